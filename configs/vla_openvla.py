"""A VLA shaped like OpenVLA: SigLIP-so400m/14 at 224 px (the vision tower, 0.4B) + Llama-2-7B, on 8 GPUs.

OpenVLA (Kim et al., 2024) fuses SigLIP with DINOv2; jaxpar takes the SigLIP tower (`vision.bias`:
SigLIP's biased projections, GELU-tanh, LayerNorm 1e-6). Start it from pretrained parts with

    python -m jaxpar.train --config vla_openvla.py --config.init.llm_from_hf=/path/Llama-2-7b-hf \
        --config.init.vision_from_hf=/path/siglip-so400m-patch14-224

(vision.* and model.* then come from the two config.json files, which agree with the values below),
or compile it here:

    python -m jaxpar.train --config vla_openvla.py --dry_run --workdir runs/vla_openvla_dry

LLM: tp=4 x dp=2, ZeRO-1, full recompute. Encoder + projector: data-parallel over all 8 devices,
ZeRO-2 (the per-head biases, having no d_model dim, stay whole), selective recompute.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=1, tp=4)
    c.zero = dict(stage=1)
    c.precision = "bf16"
    c.remat = dict(policy="full")
    c.train = dict(steps=10000, global_batch_size=32, seed=0, lr=2e-5, warmup_steps=200)
    c.model = dict(kind="vla", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
                   prefix_lm=True)
    # SigLIP-so400m/14: width 1152, 27 blocks, 16 heads, MLP 4304; 224 / 14 = 16 x 16 = 256 patches
    c.vision = dict(image_size=224, patch_size=14, channels=3, cameras=1, width=1152, depth=27, n_heads=16,
                    mlp_dim=4304, projector_dim=4096, bias=True, tp=1, zero=dict(stage=2),
                    remat=dict(policy="selective"))
    c.actions = dict(dims=7, bins=256, instruction_len=32)
    return c
