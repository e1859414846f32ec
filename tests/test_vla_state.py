"""Proprioceptive state as input (vision.state_dims, issue 49 item 2): the state becomes one prefix token after the
image patches, a linear map of the state normalised by the config's range. The token is that formula, the state
changes the loss, and every layout family equals one device with it."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.data.normalization import resolve_state_range
from jaxpar.data.pipeline import episode_batch, make_source
from jaxpar.models import vla
from jaxpar.robot.env import TaskEnv, TaskShape, draw_scenes
from jaxpar.robot.rollout import model_policy, run_rollouts

import test_vla as base

DIMS = 5
LOW, HIGH = (-2.0, 0.0, 1.0, -1.0, 3.0), (2.0, 10.0, 1.0, 1.0, 5.0)  # the third dim never varies
STATE = dict(state_dims=DIMS, state_low=LOW, state_high=HIGH)
CONFIG = base.with_values(base.BASE, vision=STATE)
SINGLE = base.with_values(base.SINGLE, vision=STATE)


def test_the_state_token_is_the_projection_of_the_normalised_state():
    params = base.single_device_params(SINGLE)
    batch = vla.synthetic_batch(SINGLE, 0, 4)
    state = batch["state"].astype(np.float64)
    tokens = np.asarray(vla.encode_images(params, batch, SINGLE))
    patches = SINGLE.vision.cameras * (SINGLE.vision.image_size // SINGLE.vision.patch_size) ** 2
    assert tokens.shape == (4, patches + 1, SINGLE.model.d_model) == (4, vla.sequence_layout(SINGLE)[0], tokens.shape[2])
    low, high = np.array(LOW), np.array(HIGH)
    unit = np.where(high > low, np.clip(2 * (state - low) / np.where(high > low, high - low, 1) - 1, -1, 1), 0)
    assert np.any(np.abs(2 * (state - low) / np.where(high > low, high - low, 1) - 1) > 1)  # some of it clipped
    proj = {k: np.asarray(params["projector"][k], np.float64) for k in ("state_proj", "state_bias")}
    np.testing.assert_allclose(tokens[:, -1], unit @ proj["state_proj"] + proj["state_bias"], rtol=1e-5, atol=1e-6)
    without = base.with_values(SINGLE, vision=dict(state_dims=0, state_low=(), state_high=()))
    image_only = vla.encode_images(params, {k: v for k, v in batch.items() if k != "state"}, without)
    np.testing.assert_array_equal(tokens[:, :-1], np.asarray(image_only))  # the image tokens are unchanged


def test_the_state_changes_the_loss_and_a_batch_without_it_is_refused():
    params = base.single_device_params(SINGLE)
    batch = vla.synthetic_batch(SINGLE, 0, 4)
    moved = {**batch, "state": batch["state"] + np.array([0.5, 1.0, 0.0, 0.1, 0.2], np.float32)}
    assert float(vla.loss_sum(params, moved, SINGLE)[0]) != pytest.approx(float(vla.loss_sum(params, batch, SINGLE)[0]),
                                                                          rel=1e-4)
    with pytest.raises(ValueError, match="state_dims=5: make_batch needs the state"):
        vla.make_batch(SINGLE, batch["images"], np.zeros((4, SINGLE.actions.instruction_len)), np.zeros((4, 7)))


def test_a_state_range_of_the_wrong_length_is_one_line():
    with pytest.raises(ConfigError, match="vision.state_low / state_high have 2 / 2 values for vision.state_dims=5"):
        validate(base.with_values(CONFIG, vision=dict(state_low=(0.0, 0.0), state_high=(1.0, 1.0))))


@pytest.mark.parametrize("mesh,schedule,vision_tp", [
    ((2, 2, 2), "1f1b", 2),  # a pipeline's first input, the encoder tp 2 (the state token replicated over it)
    pytest.param((2, 1, 4), "zero1", 1, marks=pytest.mark.slow),  # the images (and states) split over tp 4
    pytest.param((4, 1, 2), "zero3", 2, marks=pytest.mark.slow),
    pytest.param((1, 2, 4), "zb", 4, marks=pytest.mark.slow),
])
def test_a_vla_with_state_matches_single_device(mesh, schedule, vision_tp):
    losses, grads, state = base.run(base.on_layout(CONFIG, mesh, schedule, vision_tp), single=SINGLE)
    ref = base.reference(SINGLE)
    assert np.abs(ref[1]["projector"]["state_proj"]).max() > 0  # the state's weights learn
    base.assert_matches_reference(losses, grads, ref)
    proj = state.params["projector"]["state_proj"]
    assert proj.shape == (DIMS, CONFIG.model.d_model)


# ----------------------------------------------------------------------------- from the data, into the closed loop


def small_vla(*overrides: str):
    return load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false", "eval.rollouts=0",
                                    "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1",
                                    "train.global_batch_size=4", *overrides])


def test_a_lerobot_datasets_state_reaches_the_batch_normalised_by_its_stats(tmp_path):
    """observation.state as the LeRobot writer stored it (read back with pyarrow, not our reader), its range from
    meta/stats.json, and the one-line errors for a wrong state_dims and for data that records no state."""
    from jaxpar.data.lerobot_write import write_lerobot_split

    root = tmp_path / "data"
    write_lerobot_split(root, 3, 0, size=16, grid=4, steps=4, cameras=1, dims=7, video_size=16)
    config = resolve_state_range(small_vla(f"data.train={root}", "vision.state_dims=2"), tmp_path / "run")
    stats = json.loads((root / "meta" / "stats.json").read_text())["observation.state"]
    np.testing.assert_array_equal(config.vision.state_low, np.float32(stats["q01"]))  # (the reader's float32)
    np.testing.assert_array_equal(config.vision.state_high, np.float32(stats["q99"]))
    assert config.vision.state_low != config.vision.state_high  # the effector moves
    table = pa.concat_tables([pq.read_table(p) for p in sorted((root / "data").rglob("*.parquet"))])
    order = np.lexsort((table["frame_index"].to_numpy(), table["episode_index"].to_numpy()))
    stored = np.stack(table["observation.state"].to_numpy(zero_copy_only=False))[order]
    source = make_source(config, config.data.train)
    records = [source[i] for i in range(len(source))]
    np.testing.assert_array_equal(np.stack([r["state"] for r in records]), stored)
    batch = episode_batch(config, {k: np.stack([r[k] for r in records[:4]]) for k in records[0]})
    np.testing.assert_array_equal(batch["state"], stored[:4])
    with pytest.raises(ConfigError, match=r"observation.state has 2 dims, but vision.state_dims=3; set vision.state_dims=2"):
        resolve_state_range(small_vla(f"data.train={root}", "vision.state_dims=3"), tmp_path / "run")
    with pytest.raises(ConfigError, match="carry no state; write the demo as LeRobot"):
        make_source(small_vla("vision.state_dims=2"), str(tmp_path / "jaxpar_episodes"))


def test_the_closed_loop_gives_a_state_reading_policy_the_robots_state():
    """The grid task's state is the effector's cell / (grid - 1), as the LeRobot writer stores it; a VLA with
    vision.state_dims steps the scenes with it, and its actions depend on it."""
    shape = TaskShape(grid=4, size=16, dims=7)
    scenes = draw_scenes(3, 0, shape)
    seen = []

    def policy(images, instructions, state):
        seen.append(state)
        return np.tile([[0.4, 0.0, 0, 0, 0, 0, -1.0]], (len(images), 1))  # one cell down a step, never grasp

    policy.reads_state = True
    run_rollouts(policy, scenes, max_steps=2, shape=shape)
    start = np.array([s["start"] for s in scenes])
    np.testing.assert_array_equal(seen[0], (start / 3).astype(np.float32))
    np.testing.assert_array_equal(seen[1], (np.minimum(start + [1, 0], 3) / 3).astype(np.float32))
    assert not np.array_equal(seen[0], seen[1])  # the state followed the effector

    config = small_vla("vision.state_dims=2")
    weights = base.single_device_params(config)
    model = model_policy(config, weights)
    assert model.reads_state
    result = run_rollouts(model, scenes, max_steps=1, shape=shape)
    assert result["policy_calls"] == 1
    images, instructions = TaskEnv(shape, scenes).render(), [s for s in TaskEnv(shape, scenes).instructions]
    here, there = (model(images, instructions, np.full((3, 2), v, np.float32)) for v in (0.0, 1.0))
    assert not np.array_equal(here, there)
    with pytest.raises(ValueError, match="this policy reads the robot's state"):
        model(images, instructions)


@pytest.mark.slow  # a CLI run with closed-loop rollouts (make test's 15 minutes; the pieces are tested above)
def test_a_vla_trains_on_the_states_of_a_lerobot_dataset_and_rolls_out_with_them(tmp_path):
    """Through the trainer: the range resolved from the data and stored in config.json, the held-out split
    evaluated, and closed-loop rollouts that give the policy the simulator's state."""
    from jaxpar.data.lerobot_write import write_lerobot_splits

    write_lerobot_splits(tmp_path / "data", 8, 4, seed=3, size=16, grid=4, dims=7, cameras=1, video_size=16)
    run = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "vla_tiny", "--workdir", str(tmp_path / "run"),
                          "--config.mesh.dp=1", "--config.mesh.pp=2", "--config.mesh.tp=2", "--config.train.steps=4",
                          "--config.train.global_batch_size=4", f"--config.data.train={tmp_path / 'data' / 'train'}",
                          f"--config.data.eval={tmp_path / 'data' / 'heldout'}", "--config.data.generate=false",
                          "--config.eval.every=0", "--config.eval.rollouts=4", "--config.vision.state_dims=2",
                          "--config.model.n_layers=2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["vision"]
    stats = json.loads((tmp_path / "data" / "train" / "meta" / "stats.json").read_text())["observation.state"]
    np.testing.assert_array_equal(np.float32(saved["state_low"]), np.float32(stats["q01"]))
    np.testing.assert_array_equal(np.float32(saved["state_high"]), np.float32(stats["q99"]))
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= last["eval_success_rate"] <= 1.0 and "eval_action_accuracy" in last
    # the rollout CLI on the run: its policy compiled (with a state) before the clock starts, then the scenes
    rolled = subprocess.run([sys.executable, "-m", "jaxpar.rollout", "--workdir", str(tmp_path / "run"), "--scenes", "4",
                             "--json"], capture_output=True, text=True, timeout=600)
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    report = json.loads(rolled.stdout.strip().splitlines()[-1])
    assert report["scenes"] == 4 and 0.0 <= report["success_rate"] <= 1.0
