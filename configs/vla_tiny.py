"""A tiny VLA (ViT + projector + Llama, 7-D discretised actions) that learns the procedural
"move to the <colour> square" task (jaxpar.data.episodes) on a CPU in a few minutes.

Default mesh (dp, pp, tp) = (2, 2, 2) with a 1F1B pipeline; the vision encoder runs data-parallel
over all 8 devices (vision.tp = 1). Try --config.vision.tp=2 for a tensor-parallel encoder. The
encoder is FiLM-conditioned on the instruction (vision.film, as RT-1): without it the small model
reads which square is named far too slowly (docs/vla_tiny.md). The
episodes are generated into data/vla_tiny/ on first use (data.generate); instructions are UTF-8
bytes (text ids 0-255), actions the last 256 ids.

    python -m jaxpar.train --config vla_tiny.py --workdir runs/vla_tiny
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=2, tp=2)
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.pipeline = dict(schedule="1f1b", microbatches=4)
    c.train = dict(steps=3000, global_batch_size=32, seed=0, lr=1e-3, warmup_steps=50, weight_decay=0.0,
                   log_every=10)
    # init_std 0.1 ~ 1/sqrt(d_model): GPT's 0.02 is for wide models; at width 64 attention stays flat for long.
    c.model = dict(kind="vla", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=256,
                   prefix_lm=True, init_std=0.1)
    c.vision = dict(image_size=16, patch_size=4, channels=3, cameras=1, width=64, depth=2, n_heads=4,
                    mlp_dim=128, projector_dim=128, film=True, tp=1, zero=dict(stage=2))
    c.actions = dict(dims=7, bins=256, instruction_len=32)
    # jaxpar's own episode files. --config.data.demo_format=lerobot (with other data paths) writes and
    # reads the same task as a LeRobot v3.0 dataset instead; through AV1 video it learns more slowly
    # (BENCHMARKS.md, "Closed-loop evaluation").
    c.data = dict(train="data/vla_tiny/train", eval="data/vla_tiny/heldout", generate=True)
    # every evaluation also runs 200 held-out scenes in closed loop (jaxpar.robot.rollout): eval_success_rate
    c.eval = dict(every=500, rollouts=200)
    return c
