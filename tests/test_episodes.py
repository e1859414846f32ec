"""The episode format, the procedural "move to the <colour> square" task and EpisodeSource.

Oracles are written out by hand: cell offsets and gripper values, pixel positions of the squares and
the effector dot for a 16-pixel image on a 4 x 4 grid (4-pixel cells, a 2-pixel dot inset by 1), and
scenes read back from the saved images (not from the generator's own scene keys).
"""

import contextlib
import signal

import numpy as np
import pytest

from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.episodes import (COLOURS, DONE_MARKER, EFFECTOR, TABLE, EpisodeSource, expert_action, make_episode,
                                  make_scene, read_scene_keys, render, write_split, write_splits,
                                  SCENES_FILE)
from jaxpar.errors import ConfigError

NAME_OF = {rgb: name for name, rgb in COLOURS.items()}


def effector_cell(image: np.ndarray, cell: int) -> tuple[int, int]:
    """The cell of the white dot, from the pixels alone."""
    rows, cols = np.nonzero((image == EFFECTOR).all(axis=-1))
    assert rows.size, "no effector dot in the image"
    return int(rows.min()) // cell, int(cols.min()) // cell


def scene_of(path, grid: int, cell: int) -> tuple[frozenset, str]:
    """(the set of (colour, row, col) squares, the named colour) read back from a saved episode: each
    cell's bottom-right pixel, which the effector dot never covers, and the instruction's colour word."""
    with np.load(path) as data:
        image, instruction = data["images"][0, 0], str(data["instruction"])
    squares = set()
    for r in range(grid):
        for c in range(grid):
            rgb = tuple(int(x) for x in image[(r + 1) * cell - 1, (c + 1) * cell - 1])
            if rgb in NAME_OF:
                squares.add((NAME_OF[rgb], r, c))
    return frozenset(squares), instruction.split()[-2]


def write_episode(path, steps: int, size: int = 8, dims: int = 3, instruction: str = "move to the red square",
                  actions_steps: int | None = None, fill: int = 0):
    """A hand-made episode file: step t's image is filled with fill + t, its action is [fill, t, ...]."""
    images = np.stack([np.full((1, size, size, 3), fill + t, np.uint8) for t in range(steps)])
    actions = np.zeros((steps if actions_steps is None else actions_steps, dims), np.float32)
    actions[:, 0], actions[:, 1] = fill, np.arange(len(actions))
    np.savez_compressed(path, images=images, instruction=np.array(instruction), actions=actions)


@contextlib.contextmanager
def time_limit(seconds: float):
    """Turn a hang into a TimeoutError (SIGALRM; the tests run in the main thread)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------- the expert


def test_expert_action_is_the_cell_offset_over_grid_minus_one_with_the_gripper_last():
    """Worked by hand on a 4 x 4 grid: from (0, 3) to (2, 1) is (+2, -2) cells = (+2/3, -2/3)."""
    action = expert_action(np.array([0, 3]), np.array([2, 1]), grid=4, dims=7)
    assert action.dtype == np.float32
    np.testing.assert_allclose(action, [2 / 3, -2 / 3, 0, 0, 0, 0, -1], rtol=1e-6)
    np.testing.assert_allclose(expert_action(np.array([3, 0]), np.array([0, 3]), grid=4, dims=7),
                               [-1, 1, 0, 0, 0, 0, -1])  # the farthest move is exactly +-1
    np.testing.assert_array_equal(expert_action(np.array([1, 2]), np.array([1, 2]), grid=4, dims=7),
                                  [0, 0, 0, 0, 0, 0, 1])  # on the target: no move, gripper closed
    np.testing.assert_allclose(expert_action(np.array([1, 1]), np.array([1, 5]), grid=9, dims=3), [0, 0.5, -1])


@pytest.mark.parametrize("seed", range(6))
def test_expert_walks_one_cell_per_axis_onto_the_named_square_and_closes_exactly_there(seed):
    """The effector is read from the pixels: every action must point from it to the named square,
    the next frame must be one cell per axis closer, and the gripper is +1 exactly on the square."""
    grid, size, steps = 4, 16, 5
    rng = np.random.default_rng(seed)
    squares, target = make_scene(rng, grid, objects=3)
    episode = make_episode(rng, squares, target, size=size, grid=grid, steps=steps, dims=7)
    colour, row, col = squares[target]
    assert episode["instruction"] == f"move to the {colour} square"
    length = len(episode["images"])  # the episode ends with the step on the square
    assert episode["images"].shape == (length, 1, size, size, 3) and episode["images"].dtype == np.uint8
    assert episode["actions"].shape == (length, 7) and episode["actions"].dtype == np.float32
    cells = [effector_cell(episode["images"][t, 0], size // grid) for t in range(length)]
    assert length == max(abs(row - cells[0][0]), abs(col - cells[0][1])) + 1 <= steps
    for t, (r, c) in enumerate(cells):
        action = episode["actions"][t]
        np.testing.assert_allclose(action[:2] * (grid - 1), [row - r, col - c], atol=1e-5)
        assert (action[2:6] == 0).all() and (np.abs(action) <= 1).all()
        assert action[-1] == (1.0 if (r, c) == (row, col) else -1.0)
        if t + 1 < length:
            nr, nc = cells[t + 1]
            assert (nr - r, nc - c) == (int(np.sign(row - r)), int(np.sign(col - c)))
    assert cells[-1] == (row, col), "with steps >= grid the effector ends on the named square"


def test_render_draws_every_square_in_its_cell_and_a_white_dot_inset_in_the_effector_cell():
    """16 pixels, 4 x 4 grid: squares fill rows/cols 4r..4r+3; the dot is pixels 4r+1..4r+2."""
    squares = [("red", 0, 1), ("blue", 3, 3), ("cyan", 2, 0)]
    image = render(16, 4, squares, (2, 0))
    expected = np.empty((16, 16, 3), np.uint8)
    expected[:] = TABLE
    expected[0:4, 4:8] = (220, 40, 40)
    expected[12:16, 12:16] = (50, 80, 220)
    expected[8:12, 0:4] = (40, 200, 210)
    expected[9:11, 1:3] = (255, 255, 255)  # the effector on the cyan square
    np.testing.assert_array_equal(image, expected)


def test_every_frame_shows_the_named_colour_square_and_the_effector():
    rng = np.random.default_rng(11)
    squares, target = make_scene(rng, 4, objects=3)
    episode = make_episode(rng, squares, target, size=16, grid=4, steps=4, cameras=2)
    colour = episode["instruction"].split()[-2]
    assert episode["images"].shape[1:] == (2, 16, 16, 3) and 1 <= len(episode["images"]) <= 4
    for frame in episode["images"].reshape(-1, 16, 16, 3):
        assert (frame == COLOURS[colour]).all(axis=-1).sum() >= 16 - 4  # the cell, maybe under the dot
        assert (frame == EFFECTOR).all(axis=-1).sum() == 4  # a 2 x 2 dot


# ----------------------------------------------------------------------------- writing splits


def test_write_split_is_deterministic_in_its_seed(tmp_path):
    """Same seed -> identical arrays in identical files; another seed -> other scenes."""
    shape = dict(size=16, grid=4, steps=3)
    keys = write_split(tmp_path / "a", 6, seed=7, **shape)
    assert write_split(tmp_path / "b", 6, seed=7, **shape) == keys and len(keys) == 6
    write_split(tmp_path / "c", 6, seed=8, **shape)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [DONE_MARKER] + [f"episode_{i:05d}.npz" for i in range(6)] + [SCENES_FILE]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == names
    assert read_scene_keys(tmp_path / "a") == keys  # the recorded scenes are the ones written
    differs = False
    for name in names[1:-1]:
        with np.load(tmp_path / "a" / name) as a, np.load(tmp_path / "b" / name) as b, \
                np.load(tmp_path / "c" / name) as c:
            for key in ("images", "instruction", "actions"):
                np.testing.assert_array_equal(a[key], b[key])
            differs |= not np.array_equal(a["images"], c["images"])
    assert differs


def test_write_split_with_the_train_seed_but_excluding_its_scenes_shares_no_scene_with_it(tmp_path):
    """The same seed replays the train split's scenes, so only the exclusion keeps them out."""
    shape, cell = dict(size=16, grid=4, steps=2), 4
    seen = write_split(tmp_path / "train", 8, seed=3, **shape)
    again = write_split(tmp_path / "heldout", 8, seed=3, exclude=seen, **shape)
    assert len(again) == 8 and not seen & again
    train = {scene_of(p, 4, cell) for p in (tmp_path / "train").glob("*.npz")}
    heldout = {scene_of(p, 4, cell) for p in (tmp_path / "heldout").glob("*.npz")}
    assert len(train) == 8 and len(heldout) == 8 and not train & heldout


def test_write_splits_makes_both_splits_with_distinct_scenes(tmp_path):
    write_splits(tmp_path, 10, 5, seed=1, size=16, grid=4, steps=2, dims=5)
    train = {scene_of(p, 4, 4) for p in (tmp_path / "train").glob("*.npz")}
    heldout = {scene_of(p, 4, 4) for p in (tmp_path / "heldout").glob("*.npz")}
    assert len(train) == 10 and len(heldout) == 5 and not train & heldout
    assert all(len(squares) == 3 and any(s[0] == name for s in squares) for squares, name in train | heldout)
    source = EpisodeSource(tmp_path / "heldout", InstructionEncoder(32))
    lengths = [len(np.load(p)["actions"]) for p in (tmp_path / "heldout").glob("*.npz")]
    assert source.shapes == {"images": (1, 16, 16, 3), "actions": (5,)} and len(source) == sum(lengths)


def test_heldout_never_shows_a_train_scene_even_when_its_squares_were_drawn_in_another_order(tmp_path):
    """A scene is what the camera sees plus the instruction: the set of squares and the named colour.
    A small grid (2 x 2, 3 squares: 1440 scenes) makes re-drawn scenes frequent."""
    write_splits(tmp_path, 200, 50, seed=0, size=4, grid=2, steps=2)
    train = [scene_of(p, 2, 2) for p in sorted((tmp_path / "train").glob("*.npz"))]
    heldout = [scene_of(p, 2, 2) for p in sorted((tmp_path / "heldout").glob("*.npz"))]
    assert len(set(train)) == len(train), "train episodes must be distinct scenes"
    assert not set(train) & set(heldout)


@pytest.mark.parametrize("shape, match", [
    (dict(size=10, grid=4), "4x4 grid of a 10-pixel image"),
    (dict(size=16, grid=1), "1x1 grid"),
    (dict(size=4, grid=2, objects=5), "cannot draw 5 squares on a 2x2 grid"),
    (dict(size=24, grid=4, objects=7), "objects <= 6"),
])
def test_write_split_refuses_grids_it_cannot_draw(tmp_path, shape, match):
    with pytest.raises(ConfigError, match=match):
        write_split(tmp_path / "x", 1, seed=0, **shape)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dims", [1, 2])
def test_write_split_refuses_fewer_than_three_action_dims(tmp_path, dims):
    """Two move dims and a gripper need dims >= 3."""
    with pytest.raises(ConfigError, match="dims"):
        write_split(tmp_path / "x", 1, seed=0, size=16, grid=4, dims=dims)


def test_write_split_refuses_more_episodes_than_distinct_scenes(tmp_path):
    with time_limit(1.0), pytest.raises(ConfigError, match="scenes"):
        write_split(tmp_path / "x", 25, seed=0, size=4, grid=2, objects=1, steps=1)


# ----------------------------------------------------------------------------- EpisodeSource


def test_episode_source_indexes_every_step_of_every_episode_in_file_order(tmp_path):
    """Episodes of 3, 1 and 4 steps: record i is step i of the concatenation."""
    lengths = [3, 1, 4]
    for index, steps in enumerate(lengths):
        write_episode(tmp_path / f"episode_{index:05d}.npz", steps, fill=10 * index,
                      instruction=["move to the red square", "go", "é"][index])
    source = EpisodeSource(tmp_path, InstructionEncoder(24))
    assert len(source) == 8
    assert source.shapes == {"images": (1, 8, 8, 3), "actions": (3,)}
    expected = [(e, t) for e, steps in enumerate(lengths) for t in range(steps)]
    for record, (episode, step) in enumerate(expected):
        item = source[record]
        assert item["images"].shape == (1, 8, 8, 3) and item["images"].dtype == np.uint8
        assert (item["images"] == 10 * episode + step).all()
        assert item["actions"].dtype == np.float32
        np.testing.assert_array_equal(item["actions"], [10 * episode, step, 0])
    padded = np.zeros(24, np.uint8)
    padded[:22] = list(b"move to the red square")
    np.testing.assert_array_equal(source[1]["instruction"], padded)
    assert source[3]["instruction"].tolist() == [ord("g"), ord("o")] + [0] * 22
    assert source[7]["instruction"].tolist() == [0xC3, 0xA9] + [0] * 22  # UTF-8 bytes, not characters


def test_episode_source_reads_what_write_split_wrote(tmp_path):
    write_split(tmp_path, 3, seed=2, size=16, grid=4, steps=4, dims=7)
    source = EpisodeSource(tmp_path, InstructionEncoder(32))
    first = len(np.load(tmp_path / "episode_00000.npz")["actions"])  # where episode 1 starts
    with np.load(tmp_path / "episode_00001.npz") as data:
        for step in range(len(data["actions"])):
            np.testing.assert_array_equal(source[first + step]["images"], data["images"][step])
            np.testing.assert_array_equal(source[first + step]["actions"], data["actions"][step])
        text = str(data["instruction"]).encode()
        assert len(source) == first + len(data["actions"]) + len(np.load(tmp_path / "episode_00002.npz")["actions"])
    assert bytes(source[first]["instruction"][:len(text)]) == text and not source[first]["instruction"][len(text):].any()


def test_missing_or_empty_episode_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=f"no episode_.*{tmp_path / 'missing'}.*make_vla_data.py"):
        EpisodeSource(tmp_path / "missing", InstructionEncoder(32))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an episode")
    with pytest.raises(ConfigError, match=f"no episode_.*{tmp_path / 'empty'}"):
        EpisodeSource(tmp_path / "empty", InstructionEncoder(32))


def test_an_episode_with_other_per_step_shapes_is_named(tmp_path):
    write_episode(tmp_path / "episode_00000.npz", 2, size=8)
    write_episode(tmp_path / "episode_00001.npz", 2, size=8)
    write_episode(tmp_path / "episode_00002.npz", 2, size=16)
    with pytest.raises(ConfigError, match=r"episode_00002.npz: per-step images \(1, 16, 16, 3\).*do not match"):
        EpisodeSource(tmp_path, InstructionEncoder(32))
    write_episode(tmp_path / "episode_00002.npz", 2, size=8, dims=4)
    with pytest.raises(ConfigError, match=r"episode_00002.npz: .*actions \(4,\) do not match"):
        EpisodeSource(tmp_path, InstructionEncoder(32))


def test_an_episode_whose_images_and_actions_disagree_on_steps_is_named(tmp_path):
    write_episode(tmp_path / "episode_00000.npz", 2)
    write_episode(tmp_path / "episode_00001.npz", 3, actions_steps=2)
    with pytest.raises(ConfigError, match="episode_00001.npz: images .* same T"):
        EpisodeSource(tmp_path, InstructionEncoder(32))


def test_a_corrupt_or_incomplete_episode_file_is_named(tmp_path):
    write_episode(tmp_path / "episode_00000.npz", 2)
    (tmp_path / "episode_00001.npz").write_bytes(b"this is not a zip archive")
    with pytest.raises(ConfigError, match="episode_00001.npz: not a readable .npz"):
        EpisodeSource(tmp_path, InstructionEncoder(32))
    np.savez(tmp_path / "episode_00001.npz", images=np.zeros((2, 1, 8, 8, 3), np.uint8),
             actions=np.zeros((2, 3), np.float32))
    with pytest.raises(ConfigError, match="episode_00001.npz: no 'instruction' array"):
        EpisodeSource(tmp_path, InstructionEncoder(32))


def test_an_instruction_longer_than_instruction_len_is_named(tmp_path):
    write_episode(tmp_path / "episode_00000.npz", 2, instruction="go")
    write_episode(tmp_path / "episode_00001.npz", 2, instruction="move to the red square")  # 22 bytes
    source = EpisodeSource(tmp_path, InstructionEncoder(22))
    source.check_instructions()  # exactly instruction_len fits
    assert bytes(source[3]["instruction"]) == b"move to the red square"
    short = EpisodeSource(tmp_path, InstructionEncoder(21))
    with pytest.raises(ConfigError, match="episode_00001.npz: instruction 'move to the red square' is 22 bytes, "
                                          "longer than actions.instruction_len=21"):
        short.check_instructions()
    with pytest.raises(ConfigError, match="episode_00001.npz: instruction"):
        short[2]
