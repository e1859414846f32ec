"""A small VLA for Meta-World MT10 (issue 49): action chunks of 8 steps regressed by the l1 head (OpenVLA-OFT's
continuous head), trained on the scripted experts' demonstrations and evaluated in closed loop on held-out scenes
at each evaluation.

Write the data first (about 17 minutes on 2 cores; jaxpar.robot.metaworld_demos), then train:

    python -m jaxpar.robot.metaworld_demos data/metaworld --train 50 --heldout 50 --camera corner3
    python -m jaxpar.train --config vla_metaworld.py --workdir runs/vla_metaworld

Frames are rendered at 64 pixels from `corner3` (the table fills more of the frame than from `corner2`) and
read at 64 (8-pixel patches: 64 image tokens). The state (hand xyz, gripper) is in the data but not yet an input
(issue 49 item 2). The actions' 4 dims are normalised to [-1, 1] by the data's 1st and 99th percentiles (a LeRobot
dataset's default), which the config stores for the rollout. Each evaluation runs 20 held-out scenes, 2 per task,
in closed loop (eval_success_rate and one rate per task).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.mesh = dict(dp=2, pp=1, tp=1)  # 2 devices on 2 cores: 1.8 s a step here, against 2.1-2.3 s as dp 4 x tp 2
    c.zero = dict(stage=1)
    c.precision = "fp32"
    c.pipeline = dict(microbatches=1)
    # 1700 steps (~110k examples, 3 epochs) and 2 evaluations fit the 60 minutes on this machine's 2 cores
    c.train = dict(steps=1700, global_batch_size=64, seed=0, lr=1e-3, warmup_steps=100, weight_decay=0.0, log_every=20)
    c.model = dict(kind="vla", vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=512,
                   prefix_lm=True, init_std=0.08)
    c.vision = dict(image_size=64, patch_size=8, channels=3, cameras=1, width=128, depth=4, n_heads=4, mlp_dim=256,
                    projector_dim=256, film=True, tp=1, zero=dict(stage=2))
    # "pick and place the puck at the goal" is 35 bytes
    c.actions = dict(dims=4, chunk=8, head="l1", bins=256, instruction_len=40)
    # every decoded frame of the train split stays cached (37,600 frames of 64 x 64 x 3: 460 MB)
    c.data = dict(train="data/metaworld/train", eval="data/metaworld/heldout", generate=False, frame_cache_mb=1024)
    c.eval = dict(every=850, rollouts=20)
    return c
