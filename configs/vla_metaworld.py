"""A small VLA for Meta-World MT10 (issue 49): action chunks of 8 steps, trained on the scripted experts'
demonstrations and evaluated in closed loop on held-out scenes at each evaluation.

Write the data first (about 17 minutes on 2 cores; jaxpar.robot.metaworld_demos), then train:

    python -m jaxpar.robot.metaworld_demos data/metaworld --train 50 --heldout 50
    python -m jaxpar.train --config vla_metaworld.py --workdir runs/vla_metaworld

Frames are rendered at 64 pixels from `corner2` and read at 64 (8-pixel patches: 64 image tokens). The
state (hand xyz, gripper) is in the data but not yet an input (issue 49 item 2). The actions' 4 dims are
binned between the data's 1st and 99th percentiles (a LeRobot dataset's default). Each evaluation runs
20 held-out scenes, 2 per task, in closed loop (eval_success_rate and one rate per task).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=4, pp=1, tp=2)
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.pipeline = dict(microbatches=1)
    c.train = dict(steps=4000, global_batch_size=64, seed=0, lr=1e-3, warmup_steps=100, weight_decay=0.0, log_every=20)
    c.model = dict(kind="vla", vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=512,
                   prefix_lm=True, init_std=0.08)
    c.vision = dict(image_size=64, patch_size=8, channels=3, cameras=1, width=128, depth=4, n_heads=4, mlp_dim=256,
                    projector_dim=256, film=True, tp=1, zero=dict(stage=2))
    # "pick and place the puck at the goal" is 35 bytes
    c.actions = dict(dims=4, chunk=8, bins=256, instruction_len=40)
    c.data = dict(train="data/metaworld/train", eval="data/metaworld/heldout", generate=False)
    c.eval = dict(every=1000, rollouts=20)
    return c
