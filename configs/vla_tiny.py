"""A tiny VLA (ViT + projector + Llama, 7-D discretised actions) that trains in seconds on CPU.

Default mesh (dp, pp, tp) = (2, 2, 2) with a 1F1B pipeline; the vision encoder runs data-parallel
over all 8 devices (vision.tp = 1). Try --config.vision.tp=2 for a tensor-parallel encoder.

    python -m jaxpar.train --config vla_tiny.py --workdir runs/vla_tiny
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=2, tp=2)
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.pipeline = dict(schedule="1f1b", microbatches=4)
    c.train = dict(steps=100, global_batch_size=16, seed=0, lr=1e-3, warmup_steps=10, weight_decay=0.0)
    c.model = dict(kind="vla", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256,
                   prefix_lm=True)
    c.vision = dict(image_size=16, patch_size=4, channels=3, cameras=1, width=64, depth=2, n_heads=4,
                    mlp_dim=128, projector_dim=128, tp=1, zero=dict(stage=2))
    c.actions = dict(dims=7, bins=256, instruction_len=8)
    return c
