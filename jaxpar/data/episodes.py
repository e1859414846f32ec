"""Robot episodes on disk, a procedural manipulation-like task to make them, and a grain source.

On-disk format: a directory of `episode_NNNNN.npz` files, one episode each, with
    images       uint8   [T, cameras, H, W, 3]   what the cameras saw at each step
    instruction  str     (0-d array)             the task in words, e.g. "move to the red square"
    actions      float32 [T, action_dims]        the expert action at each step, in [-1, 1]
All episodes of a directory share H, W, cameras and action_dims; `EpisodeSource` checks this (from the
.npy headers, without decompressing the images) and names the offending file otherwise.

The task: the table is a grid of `grid` x `grid` cells; a few coloured squares fill distinct cells,
the white end-effector dot sits in one cell, and the instruction names one square. The expert action
is the (row, column) cell offset from the effector to the named square, normalised by grid - 1 to
[-1, 1], zeros for the other arm dimensions, and the gripper (+1 closed once on the square, else -1).
The effector then moves one cell per axis towards the square, so an episode holds every distance
from the start to the goal, and ends with the step on the square (episodes differ in length). Cells the size of a ViT patch make the scene exactly readable. Scenes
come from a seed; the held-out split is generated with another seed and skips every scene (squares,
target) that the train split has.
"""

from __future__ import annotations

import json
import math
import pathlib
import zipfile

import numpy as np

from jaxpar.data import NPY_LOCK
from jaxpar.data.instructions import InstructionEncoder
from jaxpar.errors import ConfigError

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40),
           "magenta": (200, 50, 200), "cyan": (40, 200, 210)}
TABLE, EFFECTOR = (110, 110, 110), (255, 255, 255)
SCENES_FILE = "scenes.jsonl"
DONE_MARKER = "COMPLETE"  # written last by write_split: a directory without it is a partial generation
CACHE_EPISODES = 16384  # decompressed episodes kept per source (the demo task: 4000, 12 MB)


def render(size: int, grid: int, squares: list[tuple[str, int, int]], effector: tuple[int, int]) -> np.ndarray:
    cell = size // grid
    image = np.empty((size, size, 3), np.uint8)
    image[:] = TABLE
    for colour, row, col in squares:
        image[row * cell:(row + 1) * cell, col * cell:(col + 1) * cell] = COLOURS[colour]
    dot, inset = max(cell // 2, 1), cell // 4
    r, c = effector[0] * cell + inset, effector[1] * cell + inset
    image[r:r + dot, c:c + dot] = EFFECTOR
    return image


def expert_action(effector: np.ndarray, target: np.ndarray, grid: int, dims: int) -> np.ndarray:
    """Cell offset to the target / (grid - 1) in the first two dims, gripper (+1 on target) in the last."""
    action = np.zeros(dims, np.float32)
    action[:2] = (target - effector) / (grid - 1)
    action[-1] = 1.0 if np.array_equal(effector, target) else -1.0
    return action


def make_scene(rng: np.random.Generator, grid: int, objects: int) -> tuple[list[tuple[str, int, int]], int]:
    """(squares as (colour, row, col) on distinct cells, index of the named square)."""
    names = rng.choice(list(COLOURS), size=objects, replace=False)
    cells = rng.choice(grid * grid, size=objects, replace=False)
    squares = [(str(name), int(cell) // grid, int(cell) % grid) for name, cell in zip(names, cells)]
    return squares, int(rng.integers(objects))


def scene_key(squares, target: int) -> str:
    """A scene's identity whatever order its squares were drawn in: the squares and the named colour."""
    return json.dumps([sorted(map(list, squares)), squares[target][0]])


def make_episode(rng: np.random.Generator, squares, target: int, size: int = 16, grid: int = 4, steps: int = 8,
                 dims: int = 7, cameras: int = 1) -> dict:
    """One demonstration: from a random start until the step on the square (gripper closing), at
    most `steps` steps. "start" is the effector's first cell (the scene record of scenes.jsonl)."""
    colour, row, col = squares[target]
    goal = np.array([row, col])
    effector = rng.integers(0, grid, 2)
    start = [int(effector[0]), int(effector[1])]
    images, actions = [], []
    for _ in range(steps):
        frame = render(size, grid, squares, (int(effector[0]), int(effector[1])))
        images.append(np.stack([frame] * cameras))
        actions.append(expert_action(effector, goal, grid, dims))
        if np.array_equal(effector, goal):
            break
        effector = effector + np.sign(goal - effector)  # one cell per axis towards the goal
    return {"images": np.stack(images), "instruction": f"move to the {colour} square", "actions": np.stack(actions),
            "start": start}


def check_task_shape(episodes: int, exclude_count: int, objects: int, size: int, grid: int, dims: int) -> None:
    """One-line errors for a task that cannot be drawn as asked."""
    if size % grid or grid < 2 or objects > min(len(COLOURS), grid * grid):
        raise ConfigError(f"cannot draw {objects} squares on a {grid}x{grid} grid of a {size}-pixel image; the "
                          f"image size must be a multiple of the grid, grid >= 2, objects <= {len(COLOURS)}")
    if dims < 3:
        raise ConfigError(f"action dims={dims}: the task needs 2 move dims and a gripper: dims >= 3")
    available = math.comb(len(COLOURS), objects) * math.perm(grid * grid, objects) * objects
    if episodes > available - exclude_count:
        raise ConfigError(f"{episodes} episodes asked for, but a {grid}x{grid} grid with {objects} squares has only "
                          f"{available} distinct scenes ({exclude_count} excluded); use a larger grid or fewer episodes")


def iter_split(episodes: int, seed: int, exclude: set[str] = frozenset(), objects: int = 3, **shape):
    """(scene key, episode) for `episodes` distinct scenes not in `exclude`, drawn from `seed`: the
    one generator behind every on-disk format (npz here, LeRobot in jaxpar.data.lerobot_write)."""
    check_task_shape(episodes, len(exclude), objects, shape.get("size", 16), shape.get("grid", 4),
                     shape.get("dims", 7))  # now, not at the first next(): nothing is written for a bad shape
    return _draw_episodes(episodes, seed, exclude, objects, **shape)


def _draw_episodes(episodes: int, seed: int, exclude: set[str], objects: int, **shape):
    rng, written = np.random.default_rng(seed), set()
    while len(written) < episodes:
        squares, target = make_scene(rng, shape.get("grid", 4), objects)
        key = scene_key(squares, target)
        if key in exclude or key in written:
            continue
        episode = make_episode(rng, squares, target, **shape)
        episode["scene"] = {"squares": [list(s) for s in squares], "target": target, "start": episode.pop("start")}
        written.add(key)
        yield key, episode


def write_scenes(directory: pathlib.Path, scenes: list[dict]) -> None:
    """scenes.jsonl: each episode's scene (squares, target, start cell), so closed-loop evaluation
    (jaxpar.robot.rollout) can draw scenes the train split never showed."""
    with open(directory / SCENES_FILE, "w") as f:
        for scene in scenes:
            f.write(json.dumps(scene) + "\n")


def read_scene_keys(directory: pathlib.Path) -> set[str] | None:
    """The scene keys a split recorded in scenes.jsonl (None when it has none)."""
    path = pathlib.Path(directory) / SCENES_FILE
    if not path.is_file():
        return None
    scenes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {scene_key([tuple(s) for s in scene["squares"]], scene["target"]) for scene in scenes}


def write_split(directory: pathlib.Path, episodes: int, seed: int, exclude: set[str] = frozenset(),
                objects: int = 3, **shape) -> set[str]:
    """Write `episodes` episodes of distinct scenes not in `exclude`; returns the scenes written."""
    generator = iter_split(episodes, seed, exclude, objects, **shape)
    directory.mkdir(parents=True, exist_ok=True)
    written, scenes = set(), []
    for index, (key, episode) in enumerate(generator):
        np.savez_compressed(directory / f"episode_{index:05d}.npz", images=episode["images"],
                            instruction=np.array(episode["instruction"]), actions=episode["actions"])
        written.add(key)
        scenes.append(episode["scene"])
    write_scenes(directory, scenes)
    (directory / DONE_MARKER).write_text(f"{episodes}\n")
    return written


def write_splits(out: pathlib.Path, train: int, heldout: int, seed: int = 0, heldout_dir: pathlib.Path | None = None,
                 **shape) -> None:
    """A train split in `out`/train (or `out` itself when `heldout_dir` is given) and a held-out split
    in `out`/heldout (or `heldout_dir`) with another seed and no scene in common."""
    train_dir = out if heldout_dir is not None else out / "train"
    seen = write_split(train_dir, train, seed, **shape)
    write_split(heldout_dir or out / "heldout", heldout, seed + 1_000_003, exclude=seen, **shape)


# ----------------------------------------------------------------------------- reading


def _npy_shape(archive: zipfile.ZipFile, name: str, path: pathlib.Path) -> tuple[int, ...]:
    """The shape of one array of an .npz from its header alone."""
    try:
        with archive.open(f"{name}.npy") as f:
            version = np.lib.format.read_magic(f)
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return reader(f)[0]
    except KeyError:
        raise ConfigError(f"{path}: no '{name}' array; an episode holds images, instruction and actions "
                          f"(see jaxpar/data/episodes.py)") from None


def _episode_length(path: pathlib.Path, reference: dict | None) -> tuple[int, dict]:
    """Steps of one episode file and its per-step shapes, checked against the directory's first file."""
    try:
        with zipfile.ZipFile(path) as archive:
            images, actions = _npy_shape(archive, "images", path), _npy_shape(archive, "actions", path)
            _npy_shape(archive, "instruction", path)
    except zipfile.BadZipFile:
        raise ConfigError(f"{path}: not a readable .npz episode; regenerate or remove it") from None
    shapes = {"images": images[1:], "actions": actions[1:]}
    if len(images) != 5 or len(actions) != 2 or images[0] != actions[0] or images[0] == 0:
        raise ConfigError(f"{path}: images {images} / actions {actions} are not [T, cameras, H, W, 3] / "
                          f"[T, dims] with the same T >= 1; regenerate or remove it")
    if reference is not None and shapes != reference:
        raise ConfigError(f"{path}: per-step images {images[1:]} / actions {actions[1:]} do not match the "
                          f"directory's first episode {reference['images']} / {reference['actions']}; "
                          f"regenerate or remove it")
    return images[0], shapes


class EpisodeSource:
    """grain random-access source: record i is step i of the concatenated episodes, as
    {"images" uint8 [cameras, H, W, 3], "instruction" [instruction_len] (the LLM's ids:
    jaxpar.data.instructions), "actions" float32 [dims]} (+ "instruction_bytes" for FiLM beside a
    tokenizer's ids). Files are indexed from headers; episodes are read on demand (cached)."""

    def __init__(self, directory: str | pathlib.Path, encoder: InstructionEncoder):
        self.directory = pathlib.Path(directory)
        self.files = sorted(self.directory.glob("episode_*.npz"))
        if not self.files:
            raise ConfigError(f"no episode_*.npz files in {self.directory}; generate them with "
                              f"scripts/make_vla_data.py or set data.generate=true")
        self.encoder, lengths, self.shapes = encoder, [], None
        for path in self.files:
            length, self.shapes = _episode_length(path, self.shapes)
            lengths.append(length)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self._cache: dict[int, dict] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def instruction(self, index: int, data=None) -> dict:
        """The instruction of episode `index`, encoded (InstructionEncoder.encode)."""
        path = self.files[index]
        if data is None:
            with np.load(path) as data:
                return self.instruction(index, data)
        return self.encoder.encode(str(data["instruction"]), path)

    def episode(self, index: int) -> dict:
        """Episode `index`, decompressed once and kept (up to CACHE_EPISODES per source)."""
        cached = self._cache.get(index)
        if cached is None:
            with NPY_LOCK, np.load(self.files[index]) as data:
                cached = {"images": data["images"], **self.instruction(index, data),
                          "actions": data["actions"].astype(np.float32)}
            if len(self._cache) >= CACHE_EPISODES:
                self._cache.pop(next(iter(self._cache)))  # the oldest
            self._cache[index] = cached
        return cached

    def __getitem__(self, record: int) -> dict:
        index = int(np.searchsorted(self.starts, record, side="right")) - 1
        episode, step = self.episode(index), record - int(self.starts[index])
        return {**episode, "images": episode["images"][step], "actions": episode["actions"][step]}

    def episode_actions(self, record: int) -> tuple[np.ndarray, int]:
        """(the actions [T, dims] of the episode record `record` is a step of, that step): action chunks."""
        index = int(np.searchsorted(self.starts, record, side="right")) - 1
        return self.episode(index)["actions"], record - int(self.starts[index])

    def check_instructions(self) -> None:
        """Read every instruction (not the images), so a too-long one fails at start, naming its file."""
        for index in range(len(self.files)):
            self.instruction(index)
