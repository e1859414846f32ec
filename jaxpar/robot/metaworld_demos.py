"""Meta-World demonstrations from the scripted experts, written as LeRobot v3.0 train and held-out splits.

    python -m jaxpar.robot.metaworld_demos data/metaworld --train 50 --heldout 50
    python -m jaxpar.robot.metaworld_demos data/mw_small --tasks reach-v3,push-v3 --train 5 --heldout 5

The data comes from jaxpar.robot.metaworld's simulator. Each episode runs one task's expert from a
seeded scene until the task succeeds. It keeps what the camera saw before each action (`frames[t]`,
then `actions[t]`), the proprioceptive state at the same moment, and the task's instruction. An
expert that has not succeeded within `max_steps` is not kept; the next seed is tried, and the attempts
are counted.

Seeds keep the splits apart. The train split of every task tries seeds `seed, seed + 1, ...`; the
held-out split tries `seed + HELDOUT_SEED_OFFSET, ...`. Scenes are drawn from continuous positions, so
no held-out scene is a train scene unless over a million attempts were made. Tasks share seeds on
purpose: reach and pick-place draw from the same reset space, so seed s puts the puck and the goal in
the same places in both, and only the instruction tells the two episodes apart. Each split also records,
outside the LeRobot format:
- `episodes.jsonl`: the task and seed of each episode, in order, so closed-loop evaluation can replay
  the held-out scenes.
- `experts.json`: each task's attempts, successes and mean steps.
Both are written in the staging directory with the format's files, and DONE_MARKER is written last.
The writer is jaxpar.data.lerobot_write's SplitWriter. Frames are rendered at the video's size, so no
upscaling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import time

import numpy as np

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.data.episodes import DONE_MARKER
from jaxpar.data.lerobot_write import (HELDOUT_SEED_OFFSET, SplitWriter, check_args, check_free, make_features,
                                       staged)
from jaxpar.errors import ConfigError
from jaxpar.robot import metaworld

EPISODES_FILE, EXPERTS_FILE = "episodes.jsonl", "experts.json"
MAX_PATH_LENGTH = 500  # Meta-World's own limit on an episode's steps
MAX_ATTEMPTS_PER_EPISODE = 5  # an expert that fails more often than this is a broken install, not bad luck


def demonstration(sim: metaworld.MetaWorldTask, seed: int, max_steps: int) -> dict | None:
    """One expert episode from scene `seed`: frames, states and actions up to the step that succeeds
    (None if the expert has not succeeded within max_steps)."""
    sim.reset(seed)
    frames, states, actions = [], [], []
    for _ in range(max_steps):
        frames.append(sim.frame())
        states.append(sim.state())
        actions.append(sim.expert_action())
        if sim.step(actions[-1]):
            return {"images": np.stack(frames)[:, None], "state": np.stack(states), "actions": np.stack(actions),
                    "instruction": sim.instruction}
    return None


def task_episodes(task: str, episodes: int, first_seed: int, max_steps: int, image_size: int, camera: str):
    """(seed, episode) for `episodes` successful expert episodes of `task`, seeds tried in order; then
    a summary dict of the attempts (the generator's return value)."""
    attempts, steps = 0, []
    with metaworld.MetaWorldTask(task, image_size, camera) as sim:
        while len(steps) < episodes:
            if attempts >= MAX_ATTEMPTS_PER_EPISODE * episodes:
                fix = (f"raise --max_steps (at most {MAX_PATH_LENGTH})" if max_steps < MAX_PATH_LENGTH else
                       "check the metaworld and mujoco versions (pyproject's metaworld extra)")
                raise ConfigError(f"the {task} expert succeeded in {len(steps)} of {attempts} episodes within "
                                  f"{max_steps} steps; {fix}")
            seed = first_seed + attempts
            attempts += 1
            episode = demonstration(sim, seed, max_steps)
            if episode is not None:
                steps.append(len(episode["actions"]))
                yield seed, episode
    return {"attempts": attempts, "successes": len(steps), "mean_steps": float(np.mean(steps))}


def check_split_args(tasks, episodes: int, seed: int, max_steps: int, image_size: int, codec: str,
                     fps: int) -> tuple:
    """One-line errors for a split that cannot be generated as asked, before anything starts."""
    tasks = metaworld.check_tasks(tasks)
    check_args(episodes, codec, fps, image_size, image_size, 1)
    if seed < 0:
        raise ConfigError(f"seed={seed}: Meta-World seeds are >= 0")
    if not 1 <= max_steps <= MAX_PATH_LENGTH:
        raise ConfigError(f"max_steps={max_steps}: a Meta-World episode has 1 to {MAX_PATH_LENGTH} steps")
    if image_size < 16:
        raise ConfigError(f"image_size={image_size}: render at least 16 pixels (64 or 128 are typical)")
    return tasks


def write_metaworld_split(directory, tasks=metaworld.MT10, episodes: int = 50, seed: int = 0, max_steps: int = 200,
                          image_size: int = 64, camera: str = "corner2", fps: int = 80, codec: str = "av1",
                          log=None) -> dict:
    """`episodes` expert episodes of each task as a LeRobot v3.0 dataset in `directory` (staged, renamed
    into place when complete); returns experts.json's content. fps 80: Meta-World's control rate
    (frame_skip 5 of a 2.5 ms MuJoCo step, as its own rendering metadata says)."""
    directory = pathlib.Path(directory)
    tasks = check_split_args(tasks, episodes, seed, max_steps, image_size, codec, fps)
    experts, records = {}, []
    with staged(directory) as staging:
        features = make_features(1, image_size, len(metaworld.ACTION_NAMES), metaworld.STATE_NAMES,
                                 metaworld.ACTION_NAMES, [f"observation.images.{camera}"])
        writer = SplitWriter(staging, features, fps, codec, image_size, metaworld.ROBOT_TYPE)
        for task in tasks:
            start = time.perf_counter()
            # closing: a failure in the writer closes the task's simulator (its GL context) at once
            with contextlib.closing(task_episodes(task, episodes, seed, max_steps, image_size, camera)) as generator:
                while True:
                    try:
                        episode_seed, episode = next(generator)
                    except StopIteration as done:  # the generator's return value: the attempts' summary
                        experts[task] = {**done.value, "seconds": round(time.perf_counter() - start, 1)}
                        break
                    writer.add(episode)
                    records.append({"task": task, "seed": episode_seed, "steps": len(episode["actions"])})
            if log is not None:
                log(f"{task}: {experts[task]}")
        writer.finish()
        with open(staging / EPISODES_FILE, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        (staging / EXPERTS_FILE).write_text(json.dumps(experts, indent=2) + "\n")
        (staging / DONE_MARKER).write_text(f"{len(records)}\n")
    return experts


def read_episode_seeds(directory) -> list[dict]:
    """episodes.jsonl of a split written here: [{"task", "seed", "steps"}, ...] in episode order."""
    path = pathlib.Path(directory) / EPISODES_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing, so {directory} was not written by jaxpar.robot.metaworld_demos; "
                          f"write it with python -m jaxpar.robot.metaworld_demos")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metaworld_splits(out, train: int, heldout: int, seed: int = 0, tasks=metaworld.MT10, max_steps: int = 200,
                           image_size: int = 64, camera: str = "corner2", fps: int = 80, codec: str = "av1",
                           log=None) -> dict:
    """`out`/train and `out`/heldout with disjoint seeds (see the module docstring); experts.json of both.
    Everything is checked before the train split starts, the held-out split's arguments too."""
    out = pathlib.Path(out)
    for flag, episodes in (("--train", train), ("--heldout", heldout)):
        if episodes < 1:
            raise ConfigError(f"{flag} {episodes}: each split needs at least 1 episode per task")
    check_split_args(tasks, 1, seed, max_steps, image_size, codec, fps)
    check_free(out / "train")
    check_free(out / "heldout")
    shared = dict(tasks=tasks, max_steps=max_steps, image_size=image_size, camera=camera, fps=fps, codec=codec, log=log)
    return {"train": write_metaworld_split(out / "train", episodes=train, seed=seed, **shared),
            "heldout": write_metaworld_split(out / "heldout", episodes=heldout, seed=seed + HELDOUT_SEED_OFFSET,
                                             **shared)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m jaxpar.robot.metaworld_demos", description=__doc__.splitlines()[0],
                                   usage_hint="OUT [--tasks a,b] [--train N] [--heldout N] [--image_size 64]")
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--tasks", default=",".join(metaworld.MT10), help="comma-separated; default MT10")
    parser.add_argument("--train", type=int, default=50, help="episodes per task")
    parser.add_argument("--heldout", type=int, default=50, help="episodes per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--camera", default="corner2", choices=metaworld.CAMERAS)
    parser.add_argument("--codec", default="av1", help="av1 or h264")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    experts = write_metaworld_splits(args.out, args.train, args.heldout, seed=args.seed,
                                     tasks=[t for t in args.tasks.split(",") if t], max_steps=args.max_steps,
                                     image_size=args.image_size, camera=args.camera, codec=args.codec, log=print)
    frames = sum(e["successes"] * e["mean_steps"] for split in experts.values() for e in split.values())
    print(f"wrote {args.out}/train and {args.out}/heldout: {frames:.0f} frames in "
          f"{time.perf_counter() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
