"""Action chunks (actions.chunk = H > 1, issue 49): H steps' action tokens decoded at once from placeholder
slots. The batch leaks no answer, episode ends are padded and masked, every layout equals one device,
decoding reads the training forward's logits, and rollouts run the chunk open loop."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.data import episodes
from jaxpar.data.chunks import ChunkedSource, action_chunk
from jaxpar.data.instructions import InstructionEncoder
from jaxpar.layers.collectives import Collectives
from jaxpar.models import llama, vit, vla
from jaxpar.robot import env as task
from jaxpar.robot import rollout

import test_vla as base

CHUNK = 4
CONFIG = base.with_values(base.BASE, actions=dict(chunk=CHUNK))
SINGLE = base.with_values(base.SINGLE, actions=dict(chunk=CHUNK))


def test_the_batch_reads_placeholders_and_scores_each_valid_step():
    act = CONFIG.actions
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 1, 16, 16, 3), np.uint8)
    text = rng.integers(1, 256, (3, act.instruction_len)).astype(np.int32)
    actions = rng.uniform(-1, 1, (3, CHUNK, act.dims))
    valid = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    batch = vla.make_batch(CONFIG, images, text, actions, valid=valid)
    other = vla.make_batch(CONFIG, images, text, -actions, valid=valid)
    n_image, prefix, seq = vla.sequence_layout(CONFIG)
    assert seq == prefix + CHUNK * act.dims and batch["targets"].shape == (3, seq)
    np.testing.assert_array_equal(batch["inputs"], other["inputs"])  # the answer is nowhere in the input
    assert (batch["inputs"][:, act.instruction_len:] == vla.PLACEHOLDER_ID).all()
    tokenizer = vla.ActionTokenizer(act, CONFIG.model.vocab_size)
    slots = batch["targets"][:, -CHUNK * act.dims:].reshape(3, CHUNK, act.dims)
    np.testing.assert_array_equal(slots, tokenizer.bins_to_tokens(tokenizer.to_bins(actions)))  # step-major
    mask = batch["mask"].reshape(3, -1)
    assert mask[:, :-CHUNK * act.dims].sum() == 0
    np.testing.assert_array_equal(mask[:, -CHUNK * act.dims:].reshape(3, CHUNK, act.dims).max(-1), valid)
    assert vla.prefix_len(CONFIG) == seq  # the slots see each other, and the prefix sees them
    assert vla.loss_positions(CONFIG) == CHUNK * act.dims
    # evaluation scores the valid steps' tokens only, each under its own dim
    batch["values"] = vla.action_values(CONFIG, actions)
    sums = vla.eval_sums(CONFIG, np.zeros(batch["targets"].shape, np.float32), batch["targets"], batch)
    assert sums["action_tokens"] == sums["action_correct"] == valid.sum() * act.dims
    np.testing.assert_array_equal(sums["action_correct_by_dim"], np.full(act.dims, valid.sum()))
    assert sums["action_abs_err"] <= valid.sum() * act.dims * (act.high - act.low) / act.bins / 2 + 1e-4


def test_chunks_stop_at_the_episode_end(tmp_path):
    actions = np.arange(12, dtype=np.float32).reshape(6, 2)
    chunk, valid = action_chunk(actions, 4, 4)
    np.testing.assert_array_equal(chunk, [[8, 9], [10, 11], [10, 11], [10, 11]])
    np.testing.assert_array_equal(valid, [1, 1, 0, 0])
    episodes.write_split(tmp_path, 5, seed=3)
    source = episodes.EpisodeSource(tmp_path, InstructionEncoder(CONFIG.actions.instruction_len))
    chunked = ChunkedSource(source, CHUNK)
    assert len(chunked) == len(source)
    for index in range(len(source.files)):
        first, last = int(source.starts[index]), int(source.starts[index + 1]) - 1
        recorded = source.episode(index)["actions"]
        record = chunked[first]
        np.testing.assert_array_equal(record["actions"][:len(recorded)], recorded[:CHUNK])
        np.testing.assert_array_equal(record["images"], source[first]["images"])
        end = chunked[last]  # the episode's last step: itself, then padding
        np.testing.assert_array_equal(end["action_valid"], [1, 0, 0, 0])
        np.testing.assert_array_equal(end["actions"], np.repeat(recorded[-1:], CHUNK, axis=0))


# The chunked model on the layout families (all slow: make test trains the same slots through (2,2,2) 1F1B with the
# l1 head, tests/test_vla_l1.py; CI runs these).
@pytest.mark.parametrize("mesh,schedule,vision_tp", [
    pytest.param((2, 2, 2), "1f1b", 1, marks=pytest.mark.slow),
    pytest.param((2, 1, 4), "zero1", 2, marks=pytest.mark.slow),
    pytest.param((1, 2, 4), "1f1b", 2, marks=pytest.mark.slow),
    pytest.param((2, 2, 2), "zb", 2, marks=pytest.mark.slow),
    pytest.param((4, 1, 2), "zero3", 1, marks=pytest.mark.slow),
])
def test_chunked_vla_matches_single_device(mesh, schedule, vision_tp):
    losses, grads, _ = base.run(base.on_layout(CONFIG, mesh, schedule, vision_tp), single=SINGLE)
    base.assert_matches_reference(losses, grads, base.reference(SINGLE))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])  # (all_gather shares the ring's prefix path)
def test_chunked_vla_under_context_parallelism_matches_single_device(strategy):
    """The whole sequence is the bidirectional prefix: under cp every query chunk sees every key block.
    (ZeRO-2, all_gather: the same code as ZeRO-1 / ZeRO-3 and the ring here, left out for CI's time.)"""
    ref_losses, ref_grads, _ = base.reference(SINGLE)
    config = base.with_values(CONFIG, mesh=dict(dp=2, pp=1, tp=2, cp=2, cp_strategy=strategy),
                              pipeline=dict(microbatches=1))
    losses, grads, _ = base.run(config, single=SINGLE)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e))),
                 grads, ref_grads)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_under_cp_a_whole_sequence_prefix_computes_no_causal_block(strategy):
    """Every query sees every key, so the rank's queries take one unmasked call against the gathered keys: no ring
    passes blocks (no collective-permute) and no other-rank block runs (its cond, jaxpar.layers.ring, is gone),
    where a partial prefix (one step's tokens) still runs them (jaxpar.layers.collectives.context_attention)."""
    def step_text(config):
        builder = base.builder(base.with_values(config, mesh=dict(dp=2, pp=1, tp=2, cp=2, cp_strategy=strategy),
                                                pipeline=dict(microbatches=1)))
        return builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch()).as_text()

    whole, partial = step_text(CONFIG), step_text(base.with_values(base.BASE, actions=dict(instruction_len=30)))
    if strategy == "ring":  # the ring's sends
        assert "collective_permute" in partial and "collective_permute" not in whole
    # every block but the own one is a cond (jaxpar.layers.ring), in the layers' scan forward and backward
    conds = whole.count("stablehlo.case"), partial.count("stablehlo.case")
    assert conds[0] + 2 <= conds[1], conds


def test_decoding_a_chunk_reads_the_training_forward():
    """predict_actions' one call gives the tokens the training forward's logits pick at the slots, so a
    model that learned the loss acts as it learned."""
    from jaxpar.inference import decode

    params = jax.device_get(base.reference_state(SINGLE).params)
    batch = vla.synthetic_batch(SINGLE, 0, 2)
    coll = Collectives()
    tokens, scores = decode.predict_actions(params, batch["images"], batch["inputs"][:, :SINGLE.actions.instruction_len],
                                            SINGLE)
    x = vla.llm_inputs(params, vit.encode(params, batch["images"], SINGLE.vision, coll, None,
                                          vla.instruction_ids(batch, SINGLE)), batch["inputs"], coll)
    x = llama.run_layers(x, params["layers"], SINGLE.model, coll, None, vla.prefix_len(SINGLE))
    first = SINGLE.model.vocab_size - SINGLE.actions.bins
    logits = np.asarray(llama.head_logits(params, x, SINGLE.model, coll))[:, -CHUNK * SINGLE.actions.dims:, first:]
    np.testing.assert_allclose(np.asarray(scores), logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())
    np.testing.assert_array_equal(np.asarray(tokens), first + logits.argmax(-1))


def expert_chunks(shape, chunk):
    """The expert's next `chunk` actions from each frame: the grid task is deterministic, so the effector
    is moved along in a copy of the scene."""
    expert = task.expert_policy(shape)

    def policy(images, instructions):
        scenes = [{"squares": s["squares"], "target": s["target"], "start": list(map(int, cell))}
                  for s, cell in zip(policy.scenes, policy.env.effector)]
        env = task.TaskEnv(shape, scenes)
        steps = []
        for _ in range(chunk):
            steps.append(expert(env.render(), instructions))
            env.step(steps[-1])
        return np.stack(steps, axis=1)
    return policy


def test_rollouts_run_a_chunk_open_loop():
    shape = task.TaskShape()
    scenes = task.draw_scenes(50, 4, shape)
    one = rollout.run_rollouts(task.expert_policy(shape), scenes, 8, shape)
    policy = expert_chunks(shape, CHUNK)
    policy.scenes, policy.env = scenes, None
    original = task.TaskEnv

    class Recording(original):  # hands the policy the env it acts in, to look ahead from its cells
        def __init__(self, *args):
            super().__init__(*args)
            if policy.env is None:
                policy.env = self
    task.TaskEnv, rollout.TaskEnv = Recording, Recording
    try:
        chunked = rollout.run_rollouts(policy, scenes, 8, shape)
    finally:
        task.TaskEnv, rollout.TaskEnv = original, original
    np.testing.assert_array_equal(chunked["steps"], one["steps"])  # the same path, fewer calls
    assert chunked["success_rate"] == 1.0
    longest = max(task.expert_steps(s) for s in scenes)
    assert one["policy_calls"] == longest and chunked["policy_calls"] == math.ceil(longest / CHUNK)
    # stopping inside a chunk: 6 steps of chunks of 4 that never close the gripper, one frame a step and the last
    still = rollout.run_rollouts(lambda images, ids: -np.ones((len(ids), CHUNK, shape.dims), np.float32), scenes, 6,
                                 shape, frames=2)
    assert still["policy_calls"] == 2 and still["frames"].shape[:2] == (7, 2) and len(still["trajectories"]) == 7


def test_chunk_mistakes_are_one_line_errors():
    for changes, expected in ((dict(actions=dict(chunk=0)), "actions.chunk=0"),
                              (dict(actions=dict(chunk=4, execute=5)), "actions.execute=5: run 1 to actions.chunk=4"),
                              (dict(actions=dict(chunk=4, execute=-1)), "actions.execute=-1"),
                              (dict(actions=dict(chunk=4), model=dict(prefix_lm=False)), "needs model.prefix_lm=true")):
        with pytest.raises(ConfigError, match=expected) as err:
            validate(base.with_values(base.BASE, **changes))
        assert "\n" not in str(err.value)


def test_the_config_key_reaches_the_data(tmp_path):
    """data.train with actions.chunk: the pipeline's records carry each step's chunk and validity."""
    from jaxpar.data.pipeline import episode_batch, make_source

    episodes.write_split(tmp_path, 3, seed=1)
    config = load_config("vla_tiny", [f"data.train={tmp_path}", "data.eval=", "data.generate=false",
                                      f"actions.chunk={CHUNK}"])
    source = make_source(config, str(tmp_path))
    records = [source[i] for i in range(len(source))]
    stacked = {key: np.stack([r[key] for r in records]) for key in ("images", "instruction", "actions", "action_valid")}
    batch = episode_batch(config, stacked, with_values=True)
    assert batch["mask"].sum() == stacked["action_valid"].sum() * config.actions.dims
    assert dataclasses.asdict(config)["actions"]["chunk"] == CHUNK


def test_a_whole_sequence_prefix_runs_unmasked_attention():
    """With chunks every position sees every other: the kernel gets no mask (a dense all-True bias would be
    handed to cuDNN), and the result is the masked call's."""
    from jaxpar.compiler.attention_choice import sites
    from jaxpar.layers import attention

    assert sites(CONFIG)[0].mask == "none" and sites(base.BASE)[0].mask == "prefix"
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 12, 4, 8)).astype(np.float32) for _ in range(3))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention.core_attention(q, k, v, "xla"))(q, k, v))
    masked = attention.core_attention(q, k, v, "xla", mask=attention.prefix_lm_mask(12, 12))
    np.testing.assert_allclose(attention.core_attention(q, k, v, "xla"), masked, rtol=1e-6, atol=1e-6)
    layer = jax.make_jaxpr(lambda x, p: attention.attention(x, p, 1e4, Collectives(), prefix_len=12))
    params = {"wq": q[0, :8], "wk": k[0, :8], "wv": v[0, :8], "wo": np.ones((4, 8, 8), np.float32)}
    assert "bool[1,1,12,12]" not in str(layer(q[:, :, 0], params)) and "bool" not in jaxpr
