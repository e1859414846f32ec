"""The procedural "move to the <colour> square" task (jaxpar.data.episodes) as a batched environment,
for closed-loop evaluation (jaxpar.robot.rollout): a trained VLA's actions move the effector, and success
is reaching the named square, not matching the recorded expert step by step.

A scene is the record of scenes.jsonl: {"squares": [[colour, row, col], ...], "target": index of the
named square, "start": [row, col] of the effector}. `TaskEnv` holds B scenes as numpy arrays and
renders and steps them all at once. The dynamics are exactly those behind the training episodes
(episodes.make_episode): per move axis, the action's cell offset round(a * (grid - 1)) moves the
effector one cell in its direction (clipped to the grid); the gripper is closed when the last dim
is > 0. A scene succeeds at the step whose action closes the gripper while the effector is on the
named square (the cell its frame shows: in the training episodes the closing action comes with the
frame on the square); it is then done, stays there and ignores later actions. So the expert
(episodes.expert_action) succeeds in exactly its episode length, one step per cell of Chebyshev
distance and then the close, and no policy can do better: steps to success compare directly with
the expert's. (Closing after the move would let a policy that moves and closes at once beat the
expert by a step.)
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from jaxpar.data import episodes
from jaxpar.errors import ConfigError

COLOUR_NAMES = list(episodes.COLOURS)
PALETTE = np.array([episodes.COLOURS[name] for name in COLOUR_NAMES] + [episodes.TABLE], np.uint8)
TABLE_INDEX = len(COLOUR_NAMES)  # the table's entry in PALETTE


@dataclasses.dataclass(frozen=True)
class TaskShape:
    """What the task's frames and actions look like; a run's config fixes all but `objects`."""

    size: int = 16  # image height = width in pixels
    grid: int = 4  # cells per side; size // grid pixels per cell (the demo data: one ViT patch)
    dims: int = 7  # action dims: 2 move dims first, the gripper last
    cameras: int = 1  # every camera sees the same frame (as make_episode stacks them)
    objects: int = 3  # coloured squares per scene

    @classmethod
    def from_config(cls, config, objects: int = 3) -> "TaskShape":
        """The shape a VLA config was trained on, as jaxpar.data.demo generates its episodes."""
        v = config.vision
        if v.channels != 3:
            raise ConfigError(f"vision.channels={v.channels}: the procedural task renders RGB frames (3 channels)")
        shape = cls(size=v.image_size, grid=v.image_size // v.patch_size, dims=config.actions.dims,
                    cameras=v.cameras, objects=objects)
        shape.check()
        return shape

    def check(self, scenes: int = 0, excluded: int = 0) -> None:
        """One-line errors for a shape the task cannot draw, or too few distinct scenes left."""
        episodes.check_task_shape(0, 0, self.objects, self.size, self.grid, self.dims)
        available = math.comb(len(COLOUR_NAMES), self.objects) * math.perm(self.grid ** 2, self.objects) * self.objects
        if scenes > available - excluded:
            raise ConfigError(f"{scenes} scenes asked for, but a {self.grid}x{self.grid} grid with {self.objects} "
                              f"squares has only {available} distinct scenes ({excluded} excluded as seen in "
                              f"training); ask for fewer")


def instruction(colour: str) -> str:
    """The instruction of a scene, word for word as make_episode writes it."""
    return f"move to the {colour} square"


class TaskEnv:
    """B scenes of the task, stepped together. State: `effector` [B, 2] cells, `gripper` [B] closed,
    `done` [B], `steps` [B] (steps to success, -1 while not done), `t` steps taken."""

    def __init__(self, shape: TaskShape, scenes: list[dict]):
        if not scenes:
            raise ConfigError("no scenes to roll out; ask for at least one")
        self.shape, self.scenes = shape, [dict(s) for s in scenes]
        colours = np.array([[COLOUR_NAMES.index(c) for c, _, _ in s["squares"]] for s in scenes])
        cells = np.array([[(r, c) for _, r, c in s["squares"]] for s in scenes])  # [B, objects, 2]
        if cells.min() < 0 or cells.max() >= shape.grid:
            raise ConfigError(f"a scene has a square outside the {shape.grid}x{shape.grid} grid; the scenes were "
                              f"drawn for another task shape")
        batch = np.arange(len(scenes))
        targets = np.array([s["target"] for s in scenes])
        self.goal = cells[batch, targets]  # [B, 2]
        self.colours = [COLOUR_NAMES[i] for i in colours[batch, targets]]
        board = np.full((len(scenes), shape.grid, shape.grid), TABLE_INDEX)
        board[batch[:, None], cells[..., 0], cells[..., 1]] = colours
        cell = shape.size // shape.grid
        self.background = PALETTE[board].repeat(cell, axis=1).repeat(cell, axis=2)  # [B, H, W, 3]
        self.reset()

    def __len__(self) -> int:
        return len(self.scenes)

    def reset(self) -> None:
        """Every scene back to its start cell, gripper open, not done."""
        self.effector = np.array([s["start"] for s in self.scenes], np.int64).reshape(len(self), 2)
        self.gripper = np.zeros(len(self), bool)
        self.done = np.zeros(len(self), bool)
        self.steps = np.full(len(self), -1, np.int64)
        self.t = 0

    @property
    def instructions(self) -> list[str]:
        return [instruction(colour) for colour in self.colours]

    def state(self) -> np.ndarray:
        """float32 [B, 2]: the proprioceptive state, the effector's cell / (grid - 1), as the LeRobot writer
        stores observation.state (jaxpar.data.lerobot_write)."""
        return (self.effector / (self.shape.grid - 1)).astype(np.float32)

    def render(self) -> np.ndarray:
        """uint8 [B, cameras, H, W, 3]: pixel for pixel what episodes.render draws for each scene."""
        cell = self.shape.size // self.shape.grid
        dot, inset = max(cell // 2, 1), cell // 4
        pixels = np.arange(self.shape.size)
        top, left = (self.effector * cell + inset).T
        rows = (pixels >= top[:, None]) & (pixels < top[:, None] + dot)  # [B, H]
        cols = (pixels >= left[:, None]) & (pixels < left[:, None] + dot)  # [B, W]
        on_dot = rows[:, :, None, None] & cols[:, None, :, None]
        frames = np.where(on_dot, np.array(episodes.EFFECTOR, np.uint8), self.background)
        return np.repeat(frames[:, None], self.shape.cameras, axis=1)

    def step(self, actions: np.ndarray) -> np.ndarray:
        """Apply one action per scene (float [B, dims]); returns the scenes that succeeded at this step."""
        actions = np.asarray(actions, np.float32)
        if actions.shape != (len(self), self.shape.dims) or not np.isfinite(actions).all():
            raise ValueError(f"a policy must return finite float actions of shape {(len(self), self.shape.dims)}; "
                             f"got {actions.shape}")
        live = ~self.done
        self.gripper = np.where(live, actions[:, -1] > 0, self.gripper)
        succeeded = live & self.gripper & (self.effector == self.goal).all(axis=1)  # closed where it stands
        self.done |= succeeded
        offsets = np.round(actions[:, :2] * (self.shape.grid - 1))
        moved = np.clip(self.effector + np.sign(offsets).astype(np.int64), 0, self.shape.grid - 1)
        self.effector = np.where(self.done[:, None], self.effector, moved)  # a grasp ends the scene in place
        self.t += 1
        self.steps[succeeded] = self.t
        return succeeded


# ----------------------------------------------------------------------------- policies


def expert_policy(shape: TaskShape):
    """The scripted expert as a policy over what the cameras see: it finds the effector dot and the
    named square in camera 0 and returns episodes.expert_action. Reading the frames (not the env's
    state) keeps it a policy like any other and shows the frames hold everything the task needs."""
    cell = shape.size // shape.grid

    def policy(images: np.ndarray, instructions: list[str]) -> np.ndarray:
        actions = []
        for frame, text in zip(images[:, 0], instructions):
            effector = _first_cell(frame, episodes.EFFECTOR, cell)
            colour = _colour_named(text)
            target = _first_cell(frame, episodes.COLOURS[colour], cell)
            target = effector if target is None else target  # hidden under the dot (1-pixel cells)
            actions.append(episodes.expert_action(effector, target, shape.grid, shape.dims))
        return np.stack(actions)

    return policy


def _first_cell(frame: np.ndarray, colour, cell: int) -> np.ndarray | None:
    hits = np.flatnonzero((frame == np.array(colour, np.uint8)).all(axis=-1))
    if not len(hits):
        return None
    return np.array(divmod(int(hits[0]), frame.shape[1])) // cell


def _colour_named(text: str) -> str:
    for colour in COLOUR_NAMES:
        if text == instruction(colour):
            return colour
    raise ValueError(f"'{text}' is not an instruction of the task")


def random_policy(shape: TaskShape, seed: int = 0):
    """Uniform actions in [-1, 1]: the chance level a trained policy must beat."""
    rng = np.random.default_rng(seed)

    def policy(images: np.ndarray, instructions: list[str]) -> np.ndarray:
        return rng.uniform(-1.0, 1.0, (len(images), shape.dims)).astype(np.float32)

    return policy


# ----------------------------------------------------------------------------- held-out scenes


def draw_scenes(count: int, seed: int, shape: TaskShape, exclude: set[str] = frozenset()) -> list[dict]:
    """`count` distinct scenes (squares + named square, as scene_key) from `seed`, none in `exclude`
    (e.g. the train split's read_scene_keys), each with a random effector start cell."""
    shape.check(count, len(exclude))
    rng, drawn, scenes = np.random.default_rng(seed), set(exclude), []
    while len(scenes) < count:
        squares, target = episodes.make_scene(rng, shape.grid, shape.objects)
        start = rng.integers(0, shape.grid, 2)
        key = episodes.scene_key(squares, target)
        if key in drawn:
            continue
        drawn.add(key)
        scenes.append({"squares": [list(s) for s in squares], "target": target,
                       "start": [int(start[0]), int(start[1])]})
    return scenes


def scene_keys(scenes: list[dict]) -> set[str]:
    return {episodes.scene_key([tuple(s) for s in scene["squares"]], scene["target"]) for scene in scenes}


def expert_steps(scene: dict) -> int:
    """The expert's steps to success: one per cell of Chebyshev distance, then the close."""
    _, row, col = scene["squares"][scene["target"]]
    return max(abs(row - scene["start"][0]), abs(col - scene["start"][1])) + 1


def split_task(keys: set[str], grid: int) -> int:
    """The number of squares per scene of a split's scene keys, checked against `grid`."""
    counts, cells = set(), {0}
    for key in keys:
        squares = json.loads(key)[0]
        counts.add(len(squares))
        cells.update(v for _, row, col in squares for v in (row, col))
    if len(counts) > 1 or max(cells) >= grid:
        raise ConfigError(f"the train split's scenes ({sorted(counts)} squares, cells up to {max(cells)}) do not "
                          f"fit the config's {grid}x{grid} grid: the data was made for another task shape")
    return counts.pop() if counts else TaskShape.objects
