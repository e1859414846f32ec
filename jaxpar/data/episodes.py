"""Robot episodes on disk, and a procedural manipulation-like task to make them (issue 7 groundwork).

On-disk format: a directory of `episode_NNNNN.npz` files, one episode each, with
    images       uint8   [T, cameras, H, W, 3]   what the cameras saw at each step
    instruction  str     (0-d array)             the task in words, e.g. "move to the red square"
    actions      float32 [T, action_dims]        the expert action at each step, in [-1, 1]
All episodes of a directory share H, W, cameras and action_dims; `read_episodes` checks this and
names the offending file otherwise.

The task: a few coloured squares on a grey table and a white end-effector dot; the instruction names
one square; the expert action is the normalised (dx, dy) towards it, zeros for the other arm
dimensions, and the gripper closing (+1) once the dot is on the square. Scenes come from a seed, so a
train and a held-out split with different seeds never share a scene.
"""

from __future__ import annotations

import pathlib

import numpy as np

from jaxpar.errors import ConfigError

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40),
           "magenta": (200, 50, 200), "cyan": (40, 200, 210)}
TABLE, EFFECTOR = (110, 110, 110), (255, 255, 255)


def render(size: int, squares: list[tuple[str, int, int]], effector: np.ndarray, square: int) -> np.ndarray:
    image = np.empty((size, size, 3), np.uint8)
    image[:] = TABLE
    for colour, row, col in squares:
        image[row:row + square, col:col + square] = COLOURS[colour]
    r, c = np.clip(np.round(effector).astype(int), 0, size - 2)
    image[r:r + 2, c:c + 2] = EFFECTOR
    return image


def expert_action(effector: np.ndarray, target: np.ndarray, size: int, dims: int, reach: float) -> np.ndarray:
    """(dx, dy) towards the target in units of `reach` pixels, clipped to [-1, 1]; gripper +1 on target."""
    delta = target - effector
    action = np.zeros(dims, np.float32)
    action[:2] = np.clip(delta / reach, -1.0, 1.0)
    action[-1] = 1.0 if np.abs(delta).max() < 1.0 else -1.0
    return action


def make_episode(rng: np.random.Generator, size: int = 32, steps: int = 8, objects: int = 3, dims: int = 7,
                 cameras: int = 1) -> dict:
    square = max(size // 8, 2)
    names = rng.choice(list(COLOURS), size=objects, replace=False)
    squares = [(str(name), int(rng.integers(0, size - square)), int(rng.integers(0, size - square)))
               for name in names]
    colour, row, col = squares[int(rng.integers(objects))]
    target = np.array([row + square / 2 - 1, col + square / 2 - 1], np.float64)
    effector = rng.uniform(0, size - 2, 2)
    reach = size / 4
    images, actions = [], []
    for _ in range(steps):
        frame = render(size, squares, effector, square)
        images.append(np.stack([frame] * cameras))
        action = expert_action(effector, target, size, dims, reach)
        actions.append(action)
        effector = effector + action[:2] * reach * 0.5  # half way along the commanded move
    return {"images": np.stack(images), "instruction": f"move to the {colour} square",
            "actions": np.stack(actions)}


def write_split(directory: pathlib.Path, episodes: int, seed: int, **kwargs) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(episodes):
        episode = make_episode(rng, **kwargs)
        np.savez_compressed(directory / f"episode_{index:05d}.npz", images=episode["images"],
                            instruction=np.array(episode["instruction"]), actions=episode["actions"])


def read_episodes(directory: pathlib.Path, instruction_len: int | None = None) -> list[dict]:
    """All episodes of a directory, checked for consistent shapes and instruction length."""
    files = sorted(pathlib.Path(directory).glob("episode_*.npz"))
    if not files:
        raise ConfigError(f"no episode_*.npz files in {directory}; generate them with scripts/make_vla_data.py")
    episodes, reference = [], None
    for path in files:
        with np.load(path) as data:
            episode = {"images": data["images"], "instruction": str(data["instruction"]), "actions": data["actions"]}
        shape = (episode["images"].shape[1:], episode["actions"].shape[1:])
        reference = reference or shape
        if shape != reference or len(episode["images"]) != len(episode["actions"]):
            raise ConfigError(f"{path}: images {episode['images'].shape} / actions {episode['actions'].shape} do not "
                              f"match the directory's first episode {reference}; regenerate or remove it")
        if instruction_len is not None and len(episode["instruction"].encode()) > instruction_len:
            raise ConfigError(f"{path}: instruction '{episode['instruction']}' is longer than "
                              f"actions.instruction_len={instruction_len} bytes; raise actions.instruction_len")
        episodes.append(episode)
    return episodes
