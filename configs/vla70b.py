"""70B VLA on 64 GPUs (8 nodes x 8): the first seed article's table 6.2.

LLM (Llama-2-70B shapes): TP=8, PP=4 (1F1B, m=16 microbatches: bubble 3/19 = 16%), DP=2, ZeRO-1,
full recompute. ViT (~1B) + projector: TP=2, DP=32, ZeRO-2, selective recompute. The vision TP=2
group is the inner half of each LLM TP=8 group (jaxpar.mesh.Layout splits tp into tp=4 x tpv=2);
the encoder's batch is split over dp x pp x the outer tp. One difference from the seed: its
projector runs data-parallel over 64 GPUs, jaxpar's rides with the encoder (replicated inside each
vision TP pair, so DP=32); the projector is ~20M parameters, so this costs nothing that shows.
Compiled peak on XLA:CPU from the dry run: 43.9 GB per device (BENCHMARKS.md); no GPU has measured
it. Sequence parallelism needs the sequence (256 image + 32 instruction + 6 action tokens = 294) to
divide tp: with `actions.instruction_len=34` and `mesh.sequence_parallel=true` it compiles to 40.3 GB.

    python -m jaxpar.train --config vla70b.py --dry_run --workdir runs/vla70b_dry   # 64 emulated devices
    python -m jaxpar.train --config vla70b.py                                       # on 64 real GPUs
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
                    mlp_dim=6144, projector_dim=8192, tp=2, zero=dict(stage=2), remat=dict(policy="selective"))
    c.actions = dict(dims=7, bins=256, instruction_len=32)
    return c
