"""The closed loop every environment shares: a policy's actions step the scenes, and a chunk runs open loop.

Why one place: the procedural task (jaxpar.robot.env, via jaxpar.robot.rollout) and Meta-World
(jaxpar.robot.metaworld) must count steps, policy calls and recorded frames the same way, so their
success rates and actions per second compare.
"""

from __future__ import annotations

import numpy as np


def step_closed_loop(env, policy, max_steps: int, frames: int, recorded: list, after_step=None) -> tuple[int, int]:
    """Step `policy` in `env` (TaskEnv, or jaxpar.robot.metaworld.MetaWorldEnv) until every scene is done or
    `max_steps` steps; (steps taken, policy calls). A chunk [B, H, dims] runs open loop, H steps per call.
    The camera-0 frames of the first `frames` scenes go into `recorded`, one per step and the last. A policy
    with `reads_state` set (a VLA with vision.state_dims: model_policy) is also given `env.state()`."""
    instructions, taken, calls = env.instructions, 0, 0
    while taken < max_steps and not env.done.all():
        images = env.render()
        state = (env.state(),) if getattr(policy, "reads_state", False) else ()
        actions = np.asarray(policy(images, instructions, *state))
        calls += 1
        if actions.ndim == 3 and actions.shape[1] == 0:
            raise ValueError("the policy returned an empty chunk [B, 0, dims]; return at least one step")
        for index, step_actions in enumerate((actions if actions.ndim == 3 else actions[:, None]).transpose(1, 0, 2)):
            if taken == max_steps or env.done.all():  # (the chunk runs open loop)
                break
            if index and frames:  # only the recording needs the frames inside a chunk
                images = env.render()
            recorded.append(images[:frames, 0])
            env.step(step_actions)
            taken += 1
            if after_step is not None:
                after_step()
    recorded.append(env.render()[:frames, 0])
    return taken, calls
