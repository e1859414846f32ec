"""Meta-World (MT10) as jaxpar sees it: one task's simulator, its camera and its scripted expert.

Why: issue 49 asks for a benchmark someone else wrote. Meta-World's Sawyer tasks are what SmolVLA and pi0
report on (MT50: 57% and 48% mean success). This module is the simulator side; the demonstrations written
from it are jaxpar.robot.metaworld_demos's.

Facts relied on, read from the installed packages (metaworld 3.1.1, mujoco 3.3.0):
- `metaworld.env_dict.ALL_V3_ENVIRONMENTS[name]` is a task's class. The scripted experts
  (`metaworld.policies.ENV_POLICY_MAP[name]`) read the goal from the observation's last 3 values. Those are
  zeros while the env is "partially observable" (its default), so the goal is made observable, as
  `ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE` does. The VLA never reads the observation vector: only the frame
  and the proprioceptive state.
- Object and goal positions are drawn at reset from `env.np_random` when `_freeze_rand_vec` is off and
  `seeded_rand_vec` on. `reset(seed=)` ignores its seed, so a scene is `env.seed(s)` then `reset()`: the
  same seed gives the same scene (tested).
- The observation's first 4 values are the hand's xyz and the gripper's opening: the proprioceptive state
  (LeRobot's Meta-World env gives its `agent_pos` the same 4).
- Actions are 4-D in [-1, 1]: the hand's xyz move and the gripper's effort. The experts may exceed that
  range and the env clips it, so the actions kept are clipped.
- `info["success"]` is 1.0 at a step where the task is done (recomputed each step); an episode may run 500
  steps (`max_path_length`).
- The `corner*` cameras render upside down (their frame's up is the world's down), so their frames are
  turned 180 degrees.
- Rendering headless: `MUJOCO_GL=egl` (set here unless the caller chose a backend). Anti-aliasing,
  shadows and reflections are off: about 7 ms a 64 x 64 frame instead of ~100 ms (issue 49).
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from jaxpar.errors import ConfigError

MT10 = ("reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
        "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3")
# One instruction per task (Meta-World ships none). reach, push and pick-place share one scene, so there the
# instruction is what tells the tasks apart.
INSTRUCTIONS = {
    "reach-v3": "reach the goal",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick and place the puck at the goal",
    "door-open-v3": "open the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button from the top",
    "peg-insert-side-v3": "insert the peg into the hole",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}
STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper_opening"]
ACTION_NAMES = ["move_x", "move_y", "move_z", "gripper_effort"]
CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
ROBOT_TYPE = "sawyer"


def _modules():
    """metaworld and mujoco, imported on first use with a headless GL backend: only this suite needs them."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import metaworld.env_dict
        import metaworld.policies
        import mujoco
    except ImportError as err:
        raise ConfigError(f"the Meta-World suite needs metaworld and mujoco ({err}); "
                          f"pip install -e '.[metaworld]'") from None
    return metaworld, mujoco


def check_tasks(tasks) -> tuple[str, ...]:
    """The tasks asked for, each one Meta-World knows and jaxpar has an instruction for (one-line error)."""
    tasks = tuple(tasks)
    unknown = [task for task in tasks if task not in INSTRUCTIONS]
    if not tasks:
        raise ConfigError(f"no Meta-World task given; choose from {', '.join(MT10)}")
    if unknown:
        raise ConfigError(f"Meta-World tasks {unknown} are not in MT10; choose from {', '.join(MT10)}")
    return tasks


class MetaWorldTask:
    """One Meta-World task: its simulator, a renderer for one camera, and its scripted expert.

    `reset(seed)` places the objects and the goal from `seed`; `frame()` renders what the camera sees;
    `step(action)` acts and says whether the task is done; `state()` is the proprioceptive state."""

    def __init__(self, task: str, image_size: int = 64, camera: str = "corner2"):
        metaworld, mujoco = _modules()
        check_tasks([task])
        if camera not in CAMERAS:
            raise ConfigError(f"camera={camera!r} is not a Meta-World camera; choose from {', '.join(CAMERAS)}")
        self.task, self.camera, self.image_size = task, camera, image_size
        env = metaworld.env_dict.ALL_V3_ENVIRONMENTS[task]()
        env._partially_observable = False  # the expert reads the goal from the observation
        del env.sawyer_observation_space  # recomputed for the observable goal (as set_task does)
        env._freeze_rand_vec, env.seeded_rand_vec, env._set_task_called = False, True, True
        self.env, self.expert = env, metaworld.policies.ENV_POLICY_MAP[task]()
        env.model.vis.quality.offsamples = 0  # no anti-aliasing
        try:
            self.renderer = mujoco.Renderer(env.model, image_size, image_size)
        except Exception as err:  # no EGL (or no display for the backend MUJOCO_GL names)
            env.close()
            raise ConfigError(f"MuJoCo cannot render headless with MUJOCO_GL={os.environ['MUJOCO_GL']} ({err}); "
                              f"install Mesa's EGL: bash scripts/ensure_egl.sh") from None
        for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
            self.renderer.scene.flags[flag] = 0
        self.observation = None

    @property
    def instruction(self) -> str:
        return INSTRUCTIONS[self.task]

    def reset(self, seed: int) -> None:
        self.env.seed(int(seed))
        self.observation, _ = self.env.reset()

    def frame(self) -> np.ndarray:
        """uint8 [image_size, image_size, 3]: the camera's view now, upright."""
        self.renderer.update_scene(self.env.data, camera=self.camera)
        image = self.renderer.render()
        return np.ascontiguousarray(image[::-1, ::-1]) if self.camera.startswith("corner") else image

    def state(self) -> np.ndarray:
        """float32 [4]: the hand's xyz and the gripper's opening."""
        return np.asarray(self.observation[:4], np.float32)

    def expert_action(self) -> np.ndarray:
        """float32 [4]: the scripted expert's action for the current observation, clipped to [-1, 1]."""
        with warnings.catch_warnings():  # "Constant(s) may be too high": the clip below is the env's own
            warnings.simplefilter("ignore", UserWarning)
            action = self.expert.get_action(self.observation)
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    def step(self, action: np.ndarray) -> bool:
        """Act; True once the task is done."""
        self.observation, _, _, _, info = self.env.step(np.asarray(action, np.float32))
        return bool(info["success"])

    def close(self) -> None:
        """Free the GL context now: left to the garbage collector at exit, EGL reports errors."""
        self.renderer.close()
        self.env.close()

    def __enter__(self) -> "MetaWorldTask":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetaWorldEnv:
    """B Meta-World scenes stepped together, for closed-loop evaluation: `scenes` are records of a
    split's episodes.jsonl ({"task", "seed"}), so held-out scenes replay exactly. Each scene has its
    own simulator. State: `done` [B], `steps` [B] (steps to success, -1 while not done), `t` steps
    taken. A scene that succeeds is done and ignores later actions, as in jaxpar.robot.env.TaskEnv."""

    def __init__(self, scenes: list[dict], image_size: int = 64, camera: str = "corner2"):
        if not scenes:
            raise ConfigError("no Meta-World scenes to roll out; ask for at least one")
        self.scenes = [dict(scene) for scene in scenes]
        self.sims = []
        try:
            for scene in self.scenes:
                self.sims.append(MetaWorldTask(scene["task"], image_size, camera))
        except BaseException:
            self.close()
            raise
        self.reset()

    def __len__(self) -> int:
        return len(self.scenes)

    def reset(self) -> None:
        for sim, scene in zip(self.sims, self.scenes):
            sim.reset(scene["seed"])
        self.done = np.zeros(len(self), bool)
        self.steps = np.full(len(self), -1, np.int64)
        self.t = 0

    @property
    def instructions(self) -> list[str]:
        return [sim.instruction for sim in self.sims]

    def render(self) -> np.ndarray:
        """uint8 [B, 1, H, W, 3]: each scene's camera now."""
        return np.stack([sim.frame() for sim in self.sims])[:, None]

    def state(self) -> np.ndarray:
        """float32 [B, 4]: each scene's proprioceptive state now (MetaWorldTask.state, as the demos record it)."""
        return np.stack([sim.state() for sim in self.sims])

    def step(self, actions: np.ndarray) -> np.ndarray:
        """One action per scene (float [B, 4], clipped to [-1, 1] as the env does); the scenes that succeeded now."""
        actions = np.clip(np.asarray(actions, np.float32), -1.0, 1.0)
        if actions.shape != (len(self), len(ACTION_NAMES)) or not np.isfinite(actions).all():
            raise ValueError(f"a policy must return finite actions of shape {(len(self), len(ACTION_NAMES))}; "
                             f"got {actions.shape}")
        succeeded = np.zeros(len(self), bool)
        for index in np.flatnonzero(~self.done):
            succeeded[index] = self.sims[index].step(actions[index])
        self.t += 1
        self.done |= succeeded
        self.steps[succeeded] = self.t
        return succeeded

    def close(self) -> None:
        for sim in self.sims:
            sim.close()

    def __enter__(self) -> "MetaWorldEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def expert_policy(env: MetaWorldEnv):
    """The scripted experts as a policy of `env` (they read the simulator's state, not the frames)."""
    def policy(images: np.ndarray, instructions: list[str]) -> np.ndarray:
        return np.stack([sim.expert_action() for sim in env.sims])
    return policy


SCENES_AT_ONCE = 50  # simulators (each with its renderer, ~45 MB) alive at once: 500 together were killed for memory


def run_rollouts(make_policy, scenes: list[dict], max_steps: int = 200, image_size: int = 64, camera: str = "corner2",
                 frames: int = 0, at_once: int = SCENES_AT_ONCE) -> dict:
    """Closed loop on Meta-World scenes ({"task", "seed"} records): `make_policy(env)` gives the policy
    (jaxpar.robot.rollout's interface; a chunk runs open loop), in groups of `at_once` scenes stepped together.
    Returns success_rate, per_task {task: success rate}, mean_steps (over the successes), success [B], steps [B],
    policy_calls (summed over the groups), actions_per_second, seconds, and with `frames` > 0 the first `frames`
    scenes' camera frames (at most a group's)."""
    import time

    from jaxpar.robot.closed_loop import step_closed_loop

    success, steps, calls, taken_total, recorded, start = [], [], 0, 0, [], time.perf_counter()
    for first in range(0, len(scenes), at_once):
        with MetaWorldEnv(scenes[first:first + at_once], image_size, camera) as env:
            taken, group_calls = step_closed_loop(env, make_policy(env), max_steps, frames if first == 0 else 0,
                                                  recorded if first == 0 else [])
            success.append(env.done.copy())
            steps.append(env.steps.copy())
            calls, taken_total = calls + group_calls, taken_total + taken * len(env)
    seconds = time.perf_counter() - start
    success, steps = np.concatenate(success), np.concatenate(steps)
    tasks = [scene["task"] for scene in scenes]
    result = {"success_rate": float(success.mean()), "success": success, "steps": steps,
              "per_task": {task: float(success[[t == task for t in tasks]].mean()) for task in dict.fromkeys(tasks)},
              "mean_steps": float(steps[success].mean()) if success.any() else float("nan"),
              "policy_calls": calls, "actions_per_second": taken_total / seconds, "seconds": seconds}
    if frames:
        result["frames"] = np.stack(recorded)
    return result
