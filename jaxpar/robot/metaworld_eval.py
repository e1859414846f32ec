"""Meta-World closed loop inside training (eval.rollouts with a Meta-World data.eval split, issue 49 item 3).

When data.eval is a split written by jaxpar.robot.metaworld_demos, every evaluation replays `eval.rollouts`
of its held-out scenes (episodes.jsonl), taken round-robin over the tasks so each task is scored. The scenes
are rendered as the split's videos were (its camera, its size), then brought to vision.image_size with the
LeRobot reader's own resize (jaxpar.data.video.resize), so the policy sees frames made as in training
(less the codec's loss). Each scene gets MAX_STEPS steps, Meta-World's usual budget for MT10.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.robot import metaworld
from jaxpar.robot.metaworld_demos import EPISODES_FILE, read_episode_seeds

MAX_STEPS = 200


def is_metaworld_split(directory) -> bool:
    directory = pathlib.Path(directory) if directory else None
    return bool(directory) and (directory / EPISODES_FILE).is_file() and (directory / "meta" / "info.json").is_file()


def round_robin(records: list[dict], count: int) -> list[dict]:
    """`count` records, one task after another (each task's in file order), so every task is scored."""
    if not records:
        raise ConfigError("the Meta-World split's episodes.jsonl lists no scene; write the split again with "
                          "python -m jaxpar.robot.metaworld_demos")
    by_task: dict[str, list[dict]] = {}
    for record in records:
        by_task.setdefault(record["task"], []).append(record)
    picked = [queue[i] for i in range(max(map(len, by_task.values()))) for queue in by_task.values() if i < len(queue)]
    if count > len(picked):
        raise ConfigError(f"eval.rollouts={count} but the Meta-World split has {len(picked)} held-out scenes; "
                          f"ask for fewer or write more with --heldout")
    return picked[:count]


def split_camera(directory) -> tuple[str, int]:
    """(Meta-World camera, frame size) of the split's one video feature (observation.images.<camera>)."""
    info = json.loads((pathlib.Path(directory) / "meta" / "info.json").read_text())
    videos = [(key, feature) for key, feature in info["features"].items() if feature["dtype"] == "video"]
    key, feature = videos[0]
    return key.rsplit(".", 1)[-1], int(feature["shape"][0])


class MetaWorldRollouts:
    """What TrainingRollouts runs for a Meta-World split: the scenes, and the closed loop for a policy."""

    def __init__(self, config, max_steps: int = MAX_STEPS):
        self.config, directory, self.max_steps = config, config.data.eval, max_steps
        self.scenes = round_robin(read_episode_seeds(directory), config.eval.rollouts)
        self.camera, self.render_size = split_camera(directory)

    def run(self, policy, frames: int = 0) -> dict:
        """metaworld.run_rollouts with `policy` (model_policy's interface) on frames resized as in training;
        `frames` > 0 records the first `frames` scenes' camera frames (as rendered)."""
        from PIL import Image

        from jaxpar.data.video import resize

        size, method = self.config.vision.image_size, self.config.vision.resize

        def seen(images: np.ndarray, instructions: list[str], *state) -> np.ndarray:
            frames = np.stack([[resize(Image.fromarray(frame), size, method) for frame in cams] for cams in images])
            return policy(frames, instructions, *state)
        seen.reads_state = getattr(policy, "reads_state", False)  # (the closed loop passes the state only then)
        return metaworld.run_rollouts(lambda env: seen, self.scenes, self.max_steps, self.render_size, self.camera,
                                      frames)


def evaluate_metaworld(args, config, step: int, weights, model_policy, write_gif) -> dict:
    """`python -m jaxpar.rollout` on a run trained on a Meta-World split: --scenes of its data.eval's held-out
    scenes (round-robin over the tasks, so --seed does not apply), --max_steps (default MAX_STEPS) each; --gif
    draws the first --gif_scenes of them (one per task first), captioned with their task. `model_policy` and
    `write_gif` are jaxpar.robot.rollout's (passed in: that module imports this one)."""
    from dataclasses import replace

    config = replace(config, eval=replace(config.eval, rollouts=args.scenes))
    rollouts = MetaWorldRollouts(config, args.max_steps or MAX_STEPS)
    policy, size = model_policy(config, weights), config.vision.image_size
    group = rollouts.scenes[:metaworld.SCENES_AT_ONCE]  # the batch the groups are stepped in
    state = (np.zeros((len(group), config.vision.state_dims), np.float32),) if policy.reads_state else ()
    policy(np.zeros((len(group), 1, size, size, 3), np.uint8),  # compiled before the clock starts
           [metaworld.INSTRUCTIONS[scene["task"]] for scene in group], *state)
    shown = min(args.gif_scenes, args.scenes) if args.gif else 0
    result = rollouts.run(policy, shown)
    if args.gif:
        labels = [scene["task"].removesuffix("-v3") for scene in rollouts.scenes[:shown]]
        write_gif(pathlib.Path(args.gif), {**result, "labels": labels})
    return {"workdir": str(args.workdir), "step": int(step), "data": config.data.eval, "scenes": len(rollouts.scenes),
            "max_steps": rollouts.max_steps, "execute": config.actions.steps_per_call,
            "success_rate": result["success_rate"], "per_task": result["per_task"],
            "policy_calls": result["policy_calls"], "actions_per_second": round(result["actions_per_second"], 1),
            "seconds": round(result["seconds"], 3),
            "per_scene": [{**scene, "success": bool(ok), "steps": int(n) if ok else None}
                          for scene, ok, n in zip(rollouts.scenes, result["success"], result["steps"])]}
