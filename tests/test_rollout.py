"""Closed-loop evaluation (jaxpar.robot.env, jaxpar.robot.rollout): the environment against the training episodes,
the expert and chance as reference policies, a VLA as a policy, and the CLI on a run directory."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest
from PIL import Image

from jaxpar.robot import env as task
from jaxpar.robot import rollout
from jaxpar.data import episodes

SHAPE = task.TaskShape()  # the demo data's: 16 pixels, 4x4 grid, 7 dims, 1 camera, 3 squares


def expert_run(shape, scenes, max_steps=None):
    return rollout.run_rollouts(task.expert_policy(shape), scenes, max_steps or 2 * shape.grid, shape)


@pytest.mark.parametrize("shape", [SHAPE, task.TaskShape(size=8, grid=8, dims=3, cameras=2, objects=6),
                                   task.TaskShape(size=24, grid=3)], ids=["demo", "1px-cells", "3x3"])
def test_the_expert_succeeds_everywhere_in_exactly_its_path_length(shape):
    """The expert reads the frames like any policy (1-pixel cells: the named square can hide under the dot)."""
    scenes = task.draw_scenes(200, 0, shape)
    result = expert_run(shape, scenes)
    assert result["success_rate"] == 1.0 and result["success"].all()
    np.testing.assert_array_equal(result["steps"], [task.expert_steps(s) for s in scenes])
    assert result["mean_steps"] == result["expert_mean_steps"]
    # with one step fewer than its path, every scene whose path is longest fails
    short = expert_run(shape, scenes, max_steps=shape.grid - 1)
    np.testing.assert_array_equal(short["success"], result["steps"] <= shape.grid - 1)


def test_the_expert_through_the_action_tokenizer_still_succeeds():
    """A model that predicts the expert's tokens exactly acts with their bin centres: those must move
    and close as the expert does, or a perfect model would fail in closed loop."""
    from jaxpar.config import load_config
    from jaxpar.models import vla

    config = load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false"])
    tokenizer = vla.ActionTokenizer(config.actions, config.model.vocab_size)
    expert = task.expert_policy(SHAPE)
    scenes = task.draw_scenes(200, 6, SHAPE)
    result = rollout.run_rollouts(lambda images, ids: tokenizer.from_bins(tokenizer.to_bins(expert(images, ids))),
                                  scenes, 8, SHAPE)
    np.testing.assert_array_equal(result["steps"], [task.expert_steps(s) for s in scenes])


def test_env_replays_the_training_episodes():
    """The expert stepped in the env from each episode's recorded start sees make_episode's frames
    and takes its actions at every step, and succeeds at the episode's last step: the env is the
    task the model was trained on, pixel for pixel."""
    shape = dataclasses.replace(SHAPE, cameras=2)
    drawn = list(episodes.iter_split(60, 5, size=shape.size, grid=shape.grid, dims=shape.dims, cameras=2))
    env = task.TaskEnv(shape, [episode["scene"] for _, episode in drawn])
    ids, expert = env.instructions, task.expert_policy(shape)
    assert env.instructions == [episode["instruction"] for _, episode in drawn]
    lengths = np.array([len(episode["actions"]) for _, episode in drawn])
    for t in range(lengths.max()):
        images = env.render()
        actions = expert(images, ids)
        for b in np.flatnonzero(lengths > t):
            np.testing.assert_array_equal(images[b], drawn[b][1]["images"][t])
            np.testing.assert_array_equal(actions[b], drawn[b][1]["actions"][t])
        env.step(actions)
    assert env.done.all()
    np.testing.assert_array_equal(env.steps, lengths)


def test_a_finished_scene_stays_done_where_it_grasped():
    scene = {"squares": [["red", 1, 2], ["blue", 0, 0]], "target": 0, "start": [1, 1]}
    env = task.TaskEnv(dataclasses.replace(SHAPE, dims=3, objects=2), [scene])
    move_right_closed, move_right_open = [0.0, 1 / 3, 1.0], [0.0, 1 / 3, -1.0]
    assert not env.step([move_right_closed]).any()  # closing off the square is no success
    assert env.effector.tolist() == [[1, 2]] and not env.done.any()
    assert env.step([move_right_closed]).all() and env.steps.tolist() == [2]
    env.step([move_right_open])
    env.step([[-1.0, -1.0, -1.0]])
    assert env.effector.tolist() == [[1, 2]] and env.done.all() and env.steps.tolist() == [2]
    env.reset()
    env.step([[0.1, -0.1, -1.0]])  # offsets round(0.3) = 0: no move (as the expert's zero offset)
    assert env.effector.tolist() == [[1, 1]]
    env.step([[1.0, 1.0, -1.0]])
    env.step([[1.0, 1.0, -1.0]])
    env.step([[1.0, 1.0, -1.0]])
    assert env.effector.tolist() == [[3, 3]]  # clipped to the grid


def random_policy_exact_rate(shape, scenes, max_steps):
    """The uniform random policy's success probability, exactly, by propagating each scene's
    distribution over effector cells: per step it closes on the square with probability 1/2, and
    each axis moves -1 / 0 / +1 with probability q / z / q, where z = P(|a| (grid - 1) < 1/2)."""
    g, n = shape.grid, len(scenes)
    z = 0.5 / (g - 1)
    q = (1 - z) / 2
    move = np.zeros((g, g))  # move[i, j]: P(an axis at i goes to j), clipped
    for i in range(g):
        for offset, p in ((-1, q), (0, z), (1, q)):
            move[i, min(max(i + offset, 0), g - 1)] += p
    goal = np.array([scene["squares"][scene["target"]][1:] for scene in scenes])
    alive, success = np.zeros((n, g, g)), np.zeros(n)
    start = np.array([scene["start"] for scene in scenes])
    alive[np.arange(n), start[:, 0], start[:, 1]] = 1.0
    for _ in range(max_steps):
        on_goal = alive[np.arange(n), goal[:, 0], goal[:, 1]]
        success += on_goal / 2
        alive[np.arange(n), goal[:, 0], goal[:, 1]] = on_goal / 2
        alive = np.einsum("ij,nik,kl->njl", move, alive, move)
    return float(success.mean())


def test_a_random_policy_succeeds_at_the_chance_rate():
    """Measured over 20000 scenes, the random policy's rate is within 4 standard errors (~1%) of
    the exact chance (about 18% in 8 steps on a 4x4 grid: it must stand on the square and close):
    a trained model must be judged against this, not against 0."""
    scenes = task.draw_scenes(20000, 1, SHAPE)
    result = rollout.run_rollouts(task.random_policy(SHAPE, 0), scenes, 8, SHAPE)
    exact = random_policy_exact_rate(SHAPE, scenes, 8)
    standard_error = np.sqrt(exact * (1 - exact) / len(scenes))
    assert abs(result["success_rate"] - exact) < 4 * standard_error, (result["success_rate"], exact)
    assert 0.1 < exact < 0.25


def test_rollouts_are_deterministic_for_a_seed():
    def trajectories(seed):
        scenes = task.draw_scenes(100, seed, SHAPE)
        return scenes, rollout.run_rollouts(task.random_policy(SHAPE, seed), scenes, 8, SHAPE)["trajectories"]

    scenes, path = trajectories(3)
    again, path_again = trajectories(3)
    other, path_other = trajectories(4)
    assert scenes == again and scenes != other
    np.testing.assert_array_equal(path, path_again)
    assert path.shape[1:] == (100, 2) and not np.array_equal(path[:2], path_other[:2])


def test_held_out_scenes_skip_the_given_keys():
    """A 2x2 grid with one square has 6 colours x 4 cells = 24 scenes: excluding 20 leaves exactly 4."""
    shape = task.TaskShape(size=8, grid=2, objects=1)
    everything = task.scene_keys(task.draw_scenes(24, 0, shape))
    assert len(everything) == 24
    seen = set(sorted(everything)[:20])
    left = task.scene_keys(task.draw_scenes(4, 1, shape, exclude=seen))
    assert left == everything - seen
    with pytest.raises(task.ConfigError, match="5 scenes asked for.*20 excluded"):
        task.draw_scenes(5, 1, shape, exclude=seen)


def test_held_out_scenes_skip_a_written_train_split(tmp_path):
    seen = episodes.write_split(tmp_path, 40, 0)
    keys = episodes.read_scene_keys(tmp_path)
    assert keys == seen
    assert not task.scene_keys(task.draw_scenes(300, 0, SHAPE, exclude=keys)) & keys
    assert task.split_task(keys, 4) == 3
    with pytest.raises(task.ConfigError, match="do not fit the config's 2x2 grid"):
        task.split_task(keys, 2)


def test_the_gif_frames_each_rollout_by_its_outcome(tmp_path):
    """Grey while running, green from the frame after the successful step, red at the end if failed."""
    drawn = task.draw_scenes(100, 0, SHAPE)
    scenes = [next(s for s in drawn if task.expert_steps(s) == n) for n in (1, 2, 4)]
    result = rollout.run_rollouts(task.expert_policy(SHAPE), scenes, 3, SHAPE, frames=3)
    rollout.write_gif(tmp_path / "expert.gif", result)
    expected = [["running", "running", "running"], ["success", "running", "running"],
                ["success", "success", "running"], ["success", "success", "failure"]]
    with Image.open(tmp_path / "expert.gif") as image:
        assert image.n_frames == 4 and image.size == (3 * 144, 144 + rollout.GIF_CAPTION)
        for t, states in enumerate(expected):
            image.seek(t)
            frame = np.asarray(image.convert("RGB"))
            assert [tuple(frame[6, 10 + 144 * j]) for j in range(3)] == [rollout.GIF_BORDER[s] for s in states]


# ----------------------------------------------------------------------------- a VLA as the policy


@pytest.fixture(scope="module")
def tiny_vla(tmp_path_factory):
    """vla_tiny with 2 LLM layers on one device, saved as a run directory as the training loop leaves
    it (config.json + a checkpoint). The state is random numpy of the abstract state's shapes:
    jitting the real init costs ~20 CPU-seconds of compilation and tests nothing here."""
    from jaxpar.parallel.checkpoint import Checkpointer
    from jaxpar.config import load_config
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    config = load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false", "mesh.dp=1", "mesh.pp=1",
                                      "mesh.tp=1", "zero.stage=0", "vision.zero.stage=0", "pipeline.microbatches=1",
                                      "model.n_layers=2"])
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    rng = np.random.default_rng(0)

    def fill(leaf):
        value = rng.normal(0, 0.1, leaf.shape) if np.issubdtype(leaf.dtype, np.floating) else np.zeros(leaf.shape)
        return jax.device_put(value.astype(leaf.dtype), leaf.sharding)

    state = jax.tree.map(fill, builder.abstract_state())
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    checkpoints = Checkpointer(run_dir, config)
    checkpoints.save(1, state)
    checkpoints.close()
    return config, builder.to_model_order(jax.device_get(state.params)), run_dir


def test_the_model_policy_is_predict_actions_then_bin_centres(tiny_vla):
    from jaxpar.data.instructions import utf8_bytes
    from jaxpar.inference import decode
    from jaxpar.models import vla

    config, weights, _ = tiny_vla
    shape = task.TaskShape.from_config(config)
    scenes = task.draw_scenes(12, 2, shape)
    env = task.TaskEnv(shape, scenes)
    images = env.render()
    policy = rollout.model_policy(config, weights)
    actions = policy(images, env.instructions)
    predict = jax.jit(decode.predict_actions, static_argnums=3)  # (compiled once: the policy's executable)
    ids = np.stack([utf8_bytes(text, config.actions.instruction_len, "test") for text in env.instructions])
    assert images.dtype == np.uint8  # what the policy sends: the encoder scales it
    tokens, _ = predict(weights, images, ids.astype(np.int32), config)
    tokenizer = vla.ActionTokenizer(config.actions, config.model.vocab_size)
    np.testing.assert_array_equal(actions, tokenizer.from_bins(tokenizer.tokens_to_bins(np.asarray(tokens))))
    assert len(np.unique(actions[:, 0])) > 1  # the batch's rows are each their own scene's
    placed = rollout.model_policy(config, jax.device_put(weights, jax.devices()[0]))  # already on a device
    np.testing.assert_array_equal(placed(images, env.instructions), actions)
    result = rollout.run_rollouts(policy, scenes, 3, shape, frames=2)
    assert result["trajectories"].shape[1:] == (12, 2) and result["frames"].shape[1:] == (2, 16, 16, 3)
    assert 0 <= result["success_rate"] <= 1


def test_rollouts_from_the_training_layout_follow_the_one_device_trajectories(tiny_vla):
    """The training loop's rollouts (eval.rollouts) start from the weights where training holds them:
    the checkpoint restored onto vla_tiny's (2, 2, 2) 1F1B layout with ZeRO-1 steps every scene along
    the same cells as the one-device policy, so the success rate is the same. On this CPU mesh they
    run without a collective: each leaf is gathered by a program of its own, in which nothing is left
    unordered, where the decoder partitioned over the layout (the GPU path) would leave hundreds of
    pairs of collectives unordered: an XLA:CPU hang (a 2-process CI run hung at its last rollout)."""
    from jaxpar.compiler.hlo_order import unordered_pairs
    from jaxpar.parallel.checkpoint import Checkpointer
    from jaxpar.config import load_config
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    single_config, weights, run_dir = tiny_vla
    config = load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false", "model.n_layers=2",
                                      "eval.rollouts=24"])
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    checkpoints = Checkpointer(run_dir, config)
    state, _, _ = checkpoints.restore(builder.abstract_state())
    checkpoints.close()
    assert len(jax.tree.leaves(state.params)[0].sharding.device_set) == 8
    rollouts = rollout.TrainingRollouts(config, builder)
    assert not rollouts.on_layout
    sharded = rollouts.rollout(state.params)
    single = rollout.run_rollouts(rollout.model_policy(single_config, weights), rollouts.scenes, rollouts.max_steps,
                                  rollouts.shape)
    np.testing.assert_array_equal(sharded["trajectories"], single["trajectories"])
    np.testing.assert_array_equal(sharded["success"], single["success"])
    assert len(np.unique(single["trajectories"][-1], axis=0)) > 3  # the scenes went their own ways
    metrics = rollouts.run(state.params)
    assert metrics["eval_success_rate"] == single["success_rate"]

    # what another process's gathers run (here every shard is addressable, so none is needed)
    for leaf in jax.tree.leaves(state.params):
        np.testing.assert_array_equal(np.asarray(rollouts.gather(leaf).addressable_data(0)), np.asarray(leaf))
        assert unordered_pairs(rollouts.gather.lower(leaf).compile().as_text()) == []
    shape = rollouts.shape
    images = jax.ShapeDtypeStruct((4, shape.cameras, shape.size, shape.size, 3), np.float32)
    text = jax.ShapeDtypeStruct((4, config.actions.instruction_len), np.int32)
    from jaxpar.inference import decode

    on_layout = jax.jit(decode.predict_actions, static_argnums=3, out_shardings=rollouts.replicated)
    lowered = on_layout.lower(builder.to_model_order(state.params), images, text, config)
    assert len(unordered_pairs(lowered.compile().as_text())) > 100


def cli(capsys, *argv):
    code = rollout.main(list(map(str, argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_reports_and_writes_a_gif(tiny_vla, tmp_path, capsys):
    _, _, run_dir = tiny_vla
    gif = tmp_path / "rollouts.gif"
    code, out, _ = cli(capsys, "--workdir", run_dir, "--scenes", 12, "--gif", gif, "--gif_scenes", 3, "--max_steps", 5)
    assert code == 0 and "step 1: success rate" in out and "not checked against the train split" in out
    assert "note: the run trained on synthetic data" in out
    with Image.open(gif) as image:
        tile = 16 * 8 + 2 * (4 + 4)  # upscaled 8x, a 4-pixel border and gap
        assert image.n_frames >= 2 and image.size == (3 * tile, tile + rollout.GIF_CAPTION)  # 3 tiles side by side
        image.seek(image.n_frames - 1)
        last = np.asarray(image.convert("RGB"))
    borders = {tuple(last[6, x]) for x in range(10, last.shape[1], last.shape[0])}  # each tile's top border
    assert borders <= {rollout.GIF_BORDER["success"], rollout.GIF_BORDER["failure"]}

    # the run's train split, with scenes.jsonl: drawn from the seed the CLI draws its scenes from, so
    # the first 40 scenes it would draw are exactly the train split's, and all must be skipped
    train = tmp_path / "train"
    seen = episodes.write_split(train, 40, rollout.SEED_SALT)
    assert task.scene_keys(task.draw_scenes(12, rollout.SEED_SALT, SHAPE)) <= seen
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "data": {**config["data"], "train": str(train)}}))
    try:
        code, out, _ = cli(capsys, "--workdir", run_dir, "--scenes", 12, "--json")
    finally:
        (run_dir / "config.json").write_text(json.dumps(config))
    result = json.loads(out)
    assert code == 0 and result["checked_against_train"] and result["excluded_train_scenes"] == 40
    assert result["max_steps"] == 8 and len(result["per_scene"]) == 12 and result["note"] is None
    assert not task.scene_keys(result["per_scene"]) & seen


def write_run(directory: pathlib.Path, config: dict) -> pathlib.Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_cli_mistakes_are_one_line_errors(tiny_vla, tmp_path, capsys):
    _, _, run_dir = tiny_vla
    config = json.loads((run_dir / "config.json").read_text())
    wide = tmp_path / "wide"
    episodes.write_split(wide, 5, 0, size=16, grid=8)  # the data of another task shape
    cases = {
        "config.json not found": ["--workdir", tmp_path / "nothing", "--scenes", 4],
        "trained a llama": ["--workdir", write_run(tmp_path / "llm", {**config, "model": {"kind": "llama"}}),
                            "--scenes", 4],
        "has no checkpoint": ["--workdir", write_run(tmp_path / "fresh", config), "--scenes", 4],
        "--checkpoint_step 7 is not among": ["--workdir", run_dir, "--scenes", 4, "--checkpoint_step", 7],
        "--execute 2: the run predicts chunks of actions.chunk=1": ["--workdir", run_dir, "--scenes", 4,
                                                                   "--execute", 2],
        "must be >= 1": ["--workdir", run_dir, "--scenes", 0],
        "unrecognized arguments": ["--workdir", run_dir, "--scenes", 4, "--bogus"],
        "data was made for another task shape": [
            "--workdir", write_run(tmp_path / "wide_run", {**config, "data": {**config["data"], "train": str(wide)}}),
            "--scenes", 4],
        "vision.channels=1": ["--workdir", write_run(tmp_path / "grey", {**config, "vision": {**config["vision"],
                                                                                          "channels": 1}}),
                              "--scenes", 4],
    }
    for expected, argv in cases.items():
        code, out, err = cli(capsys, *argv)
        assert code == 2 and err.startswith("jaxpar: error:") and expected in err, (expected, err)
        assert len(err.strip().splitlines()) == 1 and not out
