"""The Meta-World suite's simulator and its demonstrations as LeRobot v3.0 splits (issue 49 item 3).

The splits are read back with jaxpar's LeRobot reader and pyarrow, and checked against the simulator:
each episode's recorded seed replays to the same actions and states, and its frames decode to what the
camera rendered."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.lerobot import LeRobotSource
from jaxpar.errors import ConfigError
from jaxpar.robot import metaworld
from jaxpar.robot.metaworld_demos import (HELDOUT_SEED_OFFSET, demonstration, read_episode_seeds,
                                          write_metaworld_split, write_metaworld_splits)

TASKS = ("reach-v3", "push-v3")
SIZE = 32


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    out = tmp_path_factory.mktemp("metaworld")
    experts = write_metaworld_splits(out, train=2, heldout=1, tasks=TASKS, image_size=SIZE, max_steps=150)
    return out, experts


def test_a_seed_is_a_scene():
    with metaworld.MetaWorldTask("push-v3", SIZE) as sim:
        sim.reset(3)
        first = (sim.observation.copy(), sim.frame())
        sim.reset(4)
        other = sim.observation.copy()
        sim.reset(3)
        np.testing.assert_array_equal(sim.observation, first[0])
        np.testing.assert_array_equal(sim.frame(), first[1])
    assert not np.allclose(other[4:7], first[0][4:7])  # the puck moved with the seed
    assert first[1].shape == (SIZE, SIZE, 3) and first[1].dtype == np.uint8


def test_splits_hold_the_experts_episodes(splits):
    out, experts = splits
    for split, per_task, first_seed in (("train", 2, 0), ("heldout", 1, HELDOUT_SEED_OFFSET)):
        records = read_episode_seeds(out / split)
        assert [r["task"] for r in records] == [t for t in TASKS for _ in range(per_task)]
        assert set(experts[split]) == set(TASKS)
        for task, expert in experts[split].items():  # the seeds tried, in order, from the split's first
            assert expert["successes"] == per_task
            seeds = [r["seed"] for r in records if r["task"] == task]
            assert seeds == sorted(seeds) and set(seeds) <= set(range(first_seed, first_seed + expert["attempts"]))
        info = json.loads((out / split / "meta" / "info.json").read_text())
        assert info["total_episodes"] == len(records)
        assert info["total_frames"] == sum(r["steps"] for r in records)
        assert info["robot_type"] == "sawyer"
        assert info["features"]["observation.state"]["names"] == metaworld.STATE_NAMES
        assert info["features"]["action"]["names"] == metaworld.ACTION_NAMES
        assert "observation.state" in json.loads((out / split / "meta" / "stats.json").read_text())
    train_seeds = {(r["task"], r["seed"]) for r in read_episode_seeds(out / "train")}
    assert not train_seeds & {(r["task"], r["seed"]) for r in read_episode_seeds(out / "heldout")}


def test_episodes_replay_from_their_seeds(splits):
    """The stored actions and states are what the expert does from the recorded seed, and the episode
    ends on the step that succeeds."""
    out, _ = splits
    records = read_episode_seeds(out / "train")
    table = pq.read_table(next((out / "train" / "data").rglob("*.parquet"))).to_pydict()
    episode_of = np.asarray(table["episode_index"])
    for index, record in enumerate(records):
        with metaworld.MetaWorldTask(record["task"], SIZE) as sim:
            replay = demonstration(sim, record["seed"], max_steps=150)
            assert demonstration(sim, record["seed"], max_steps=record["steps"] - 1) is None  # not sooner
        rows = episode_of == index
        stored = np.asarray(table["action"])[rows]
        np.testing.assert_array_equal(stored, replay["actions"])
        with metaworld.MetaWorldTask(record["task"], SIZE) as sim:  # the stored actions, open loop, succeed
            sim.reset(record["seed"])
            assert [sim.step(action) for action in stored][-2:] == [False, True]
        np.testing.assert_array_equal(np.asarray(table["observation.state"])[rows], replay["state"])
        assert len(replay["actions"]) == record["steps"]


def test_the_reader_gets_frames_instructions_and_actions(splits):
    out, _ = splits
    source = LeRobotSource(out / "train", InstructionEncoder(48), SIZE)
    records = read_episode_seeds(out / "train")
    assert len(source) == sum(r["steps"] for r in records)
    with metaworld.MetaWorldTask(records[-1]["task"], SIZE) as sim:
        replay = demonstration(sim, records[-1]["seed"], max_steps=150)
    last = len(source) - records[-1]["steps"]
    for step in (0, records[-1]["steps"] - 1):
        record = source[last + step]
        decoded = record["images"][0].astype(np.int32)
        error = np.abs(decoded - replay["images"][step, 0]).mean()
        assert error < 8, f"frame {step} decodes {error:.1f} levels from the render"  # AV1 at crf 30
        np.testing.assert_array_equal(record["actions"], replay["actions"][step])
    text = bytes(source[last]["instruction"]).rstrip(b"\0").decode()
    assert text == metaworld.INSTRUCTIONS[records[-1]["task"]]


def test_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not in MT10"):
        write_metaworld_split(tmp_path / "a", tasks=["reach-v2"])
    with pytest.raises(ConfigError, match="max_steps"):
        write_metaworld_split(tmp_path / "b", tasks=["reach-v3"], max_steps=501)
    with pytest.raises(ConfigError, match="succeeded in 0 of 5 episodes within 3 steps"):
        write_metaworld_split(tmp_path / "c", tasks=["reach-v3"], episodes=1, max_steps=3, image_size=16)
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob("c.partial-*"))  # nothing half-written
    with pytest.raises(ConfigError, match="--heldout 0"):  # before the train split is written
        write_metaworld_splits(tmp_path / "e", train=1, heldout=0, tasks=["reach-v3"])
    assert not (tmp_path / "e").exists()
    result = subprocess.run([sys.executable, "-m", "jaxpar.robot.metaworld_demos", str(tmp_path / "d"),
                             "--tasks", "shelf-place-v3"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "not in MT10" in result.stderr


def test_closed_loop_replays_held_out_scenes_and_the_expert_succeeds(splits):
    """The batched env replays a split's scenes: the expert in closed loop succeeds on each in exactly
    its recorded steps; a chunk of the recorded actions, run open loop, succeeds too, in fewer calls."""
    out, _ = splits
    scenes = read_episode_seeds(out / "heldout")
    result = metaworld.run_rollouts(metaworld.expert_policy, scenes, max_steps=150, image_size=SIZE, frames=1)
    assert result["success_rate"] == 1.0 and set(result["per_task"]) == set(TASKS)
    np.testing.assert_array_equal(result["steps"], [s["steps"] for s in scenes])
    assert result["policy_calls"] == max(s["steps"] for s in scenes)
    assert result["frames"].shape == (result["policy_calls"] + 1, 1, SIZE, SIZE, 3)
    one_by_one = metaworld.run_rollouts(metaworld.expert_policy, scenes, max_steps=150, image_size=SIZE, at_once=1)
    np.testing.assert_array_equal(one_by_one["steps"], result["steps"])  # groups of scenes (memory): the same
    assert one_by_one["policy_calls"] == sum(s["steps"] for s in scenes)  # a call per step of each group
    recorded = pq.read_table(next((out / "heldout" / "data").rglob("*.parquet"))).to_pydict()
    episode_of, stored = np.asarray(recorded["episode_index"]), np.asarray(recorded["action"])
    longest = max(s["steps"] for s in scenes)
    plans = np.stack([np.concatenate([stored[episode_of == i], np.zeros((longest - s["steps"], 4))])
                      for i, s in enumerate(scenes)])  # [B, longest, 4]: each scene's recorded actions

    def replay(env):
        def policy(images, instructions):  # the next 8 recorded actions of every scene
            return plans[:, env.t:env.t + 8]
        return policy
    chunked = metaworld.run_rollouts(replay, scenes, max_steps=150, image_size=SIZE)
    np.testing.assert_array_equal(chunked["steps"], [s["steps"] for s in scenes])
    assert chunked["policy_calls"] == -(-longest // 8)


def test_the_evaluation_hands_a_state_reading_policy_the_robots_state(splits):
    """The trainer's Meta-World evaluation wraps the policy to resize the frames; the wrapper must still pass
    the state to a VLA that reads it (vision.state_dims). It did not once, and a 30-minute run died at its first
    evaluation."""
    from jaxpar.config import load_config
    from jaxpar.robot.metaworld_eval import MetaWorldRollouts

    out, _ = splits
    config = load_config("vla_metaworld", [f"data.eval={out / 'heldout'}", "eval.rollouts=2",
                                           "vision.image_size=16"])
    states = []

    def policy(images, instructions, state):
        assert images.shape[2:4] == (16, 16)  # resized as in training
        states.append(state)
        return np.zeros((len(instructions), 2, 4), np.float32)  # a chunk of 2 steps that stand still
    policy.reads_state = True
    MetaWorldRollouts(config, max_steps=4).run(policy)
    assert len(states) == 2 and all(s.shape == (2, 4) for s in states)
    np.testing.assert_allclose(states[0], states[1], atol=0.01)  # the hand stood (but for settling)...
    assert np.abs(states[0][:, :3]).max() > 0.05  # ...and is somewhere over the table


@pytest.mark.slow  # a minute: the trainer's compile and 200 closed-loop steps
def test_training_evaluates_meta_world_in_closed_loop(splits, tmp_path, capsys):
    """configs/vla_metaworld.py's path at toy size: a chunked VLA that reads the robot's state trains on a
    Meta-World split, and its evaluation replays held-out scenes round-robin over the tasks and logs a success rate
    per task; the rollout CLI then does the same on the run."""
    from jaxpar.config import load_config
    from jaxpar.parallel.mesh import Layout
    from jaxpar.robot.metaworld_eval import round_robin
    from jaxpar.training.loop import train

    out, _ = splits
    config = load_config("vla_metaworld", [f"data.train={out / 'train'}", f"data.eval={out / 'heldout'}",
                                           "train.steps=2", "train.global_batch_size=8", "eval.rollouts=2",
                                           "eval.batches=1", "mesh.dp=2", "mesh.tp=1", "model.d_model=32",
                                           "model.n_layers=1", "model.d_ff=64", "vision.width=32", "vision.depth=1",
                                           "vision.mlp_dim=64", "vision.projector_dim=32", "vision.image_size=16",
                                           "vision.patch_size=4", "actions.chunk=4", "vision.state_dims=4"])
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(config)))  # as jaxpar.train writes it
    train(config, Layout.for_config(config).make_mesh(), tmp_path, show_progress=False)
    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert set(last) >= {"eval_success_rate", "eval_policy_calls", *(f"eval_success_rate/{t}" for t in TASKS)}
    assert last["eval_policy_calls"] == -(-200 // 4) or last["eval_success_rate"] > 0  # 200 steps, 4 a call
    records = read_episode_seeds(out / "heldout")
    assert [r["task"] for r in round_robin(records, 2)] == list(TASKS)
    with pytest.raises(ConfigError, match="eval.rollouts=3 but the Meta-World split has 2"):
        round_robin(records, 3)
    # the rollout CLI on the run: its held-out Meta-World scenes, chunks open loop
    from jaxpar.robot import rollout

    gif = tmp_path / "rollouts.gif"
    assert rollout.main(["--workdir", str(tmp_path), "--scenes", "2", "--max_steps", "8", "--json", "--gif", str(gif),
                         "--gif_scenes", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["scenes"] == 2 and set(report["per_task"]) == set(TASKS) and report["max_steps"] == 8
    assert report["policy_calls"] == 2 or report["success_rate"] > 0  # 8 steps in chunks of 4
    from PIL import Image

    with Image.open(gif) as image:  # both scenes side by side, a frame per step until the last one stops
        assert image.n_frames == max(s["steps"] or 8 for s in report["per_scene"]) + 1 and image.width > 2 * SIZE
