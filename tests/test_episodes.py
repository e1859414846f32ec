"""The episode format and the procedural VLA task (issue 7 groundwork)."""

import numpy as np
import pytest

from jaxpar.data.episodes import COLOURS, make_episode, read_episodes, write_split
from jaxpar.errors import ConfigError


def test_expert_moves_the_effector_onto_the_named_square_and_closes_the_gripper():
    episode = make_episode(np.random.default_rng(3), size=32, steps=12)
    colour = episode["instruction"].split()[-2]
    assert colour in COLOURS and episode["images"].shape == (12, 1, 32, 32, 3)
    assert episode["images"].dtype == np.uint8 and episode["actions"].shape == (12, 7)
    assert (np.abs(episode["actions"]) <= 1).all()
    moves = np.abs(episode["actions"][:, :2]).max(axis=1)
    assert moves[-1] < moves[0]  # the expert converges on its target
    assert episode["actions"][-1, -1] == 1.0 and episode["actions"][0, -1] == -1.0
    last = episode["images"][-1, 0]
    assert (last == COLOURS[colour]).all(axis=-1).any()  # the named square is in the picture


def test_splits_round_trip_and_never_share_a_scene(tmp_path):
    write_split(tmp_path / "train", 5, seed=0, size=16)
    write_split(tmp_path / "heldout", 5, seed=1, size=16)
    train, heldout = read_episodes(tmp_path / "train", 32), read_episodes(tmp_path / "heldout", 32)
    assert len(train) == 5 and train[0]["images"].shape == (8, 1, 16, 16, 3)
    first_frames = {ep["images"][0].tobytes() for ep in train}
    assert not first_frames & {ep["images"][0].tobytes() for ep in heldout}
    again = tmp_path / "again"
    write_split(again, 5, seed=0, size=16)
    assert all((a["images"] == b["images"]).all() for a, b in zip(train, read_episodes(again)))  # deterministic


def test_bad_episode_directories_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no episode_.*make_vla_data.py"):
        read_episodes(tmp_path / "missing")
    write_split(tmp_path / "mixed", 2, seed=0, size=16)
    write_split(tmp_path / "other", 1, seed=5, size=32)
    (tmp_path / "other" / "episode_00000.npz").rename(tmp_path / "mixed" / "episode_00009.npz")
    with pytest.raises(ConfigError, match="episode_00009.npz.*do not match"):
        read_episodes(tmp_path / "mixed")
    write_split(tmp_path / "long", 1, seed=5, size=16)
    with pytest.raises(ConfigError, match="episode_00000.npz: instruction .* longer than actions.instruction_len=4"):
        read_episodes(tmp_path / "long", instruction_len=4)
