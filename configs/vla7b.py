"""VLA on one 8-GPU node: Llama-2-7B + a ~300M ViT-L/14 encoder, 224px images, 7-D actions.

LLM: tp=4 inside the node x dp=2, ZeRO-1, full recompute. Vision encoder + projector: data-parallel
over all 8 GPUs (vision.tp=1), ZeRO-2, selective recompute.

    python -m jaxpar.train --config vla7b.py --dry_run --workdir runs/vla7b_dry
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
    c.vision = dict(image_size=224, patch_size=14, channels=3, cameras=1, width=1024, depth=24, n_heads=16,
                    mlp_dim=4096, projector_dim=4096, tp=1, zero=dict(stage=2), remat=dict(policy="selective"))
    c.actions = dict(dims=7, bins=256, instruction_len=32)
    return c
