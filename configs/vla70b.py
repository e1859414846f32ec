"""70B VLA on 64 GPUs (8 nodes x 8): the first seed article's table 6.2, as close as jaxpar runs it.

Seed layout: LLM TP=8, PP=4, DP=2, ZeRO-1; ViT (1B) TP=2, DP=32, ZeRO-2; projector DP=64, ZeRO-2.
jaxpar: the LLM exactly so (1F1B, m=16 microbatches so the bubble is 3/19 = 16%, full recompute);
the ViT and projector together run with vision.tp=1, i.e. DP=64, ZeRO-2 (the projector's layout).
Change from the seed: vision tp=2 would need a sub-axis of the tp=8 axis; jaxpar's vision encoder is
tensor-parallel on the whole tp axis or not at all. A ~1B ViT needs no tensor parallelism to fit
(its bf16 weights are ~2 GB, its ZeRO-2 optimizer state over 64 devices ~0.2 GB per GPU), so the
pure data-parallel layout trades the seed's TP=2 all-reduces for nothing but a larger per-step
gradient reduce-scatter. The dry run reports the per-device memory of each component.

    python -m jaxpar.train --config vla70b.py --dry_run --workdir runs/vla70b_dry   # 64 emulated devices
    sbatch / multi-host launch: python -m jaxpar.train --config vla70b.py           # on 64 real GPUs
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=4, tp=8)
    c.zero = dict(stage=1)
    c.precision = "bf16"
    c.remat = dict(policy="full")
    c.pipeline = dict(schedule="1f1b", microbatches=16)
    c.train = dict(steps=20000, global_batch_size=64, seed=0, lr=1e-5, warmup_steps=500)
    c.model = dict(kind="vla", vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                   prefix_lm=True)
    c.vision = dict(image_size=224, patch_size=14, channels=3, cameras=1, width=1408, depth=40, n_heads=16,
                    mlp_dim=6144, projector_dim=8192, tp=1, zero=dict(stage=2), remat=dict(policy="selective"))
    c.actions = dict(dims=7, bins=256, instruction_len=32)
    return c
