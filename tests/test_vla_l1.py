"""The l1 action head (actions.head = l1, OpenVLA-OFT's continuous head, issue 49): an MLP on each action slot's
last hidden state regresses the slot's normalised value with an L1 loss. The loss is the formula written out in
numpy, the batch leaks no answer, every layout equals one device, and decoding returns the values the training
forward regresses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, validate
from jaxpar.inference import decode
from jaxpar.models import vla
from jaxpar.parallel.evaluate import Evaluator

import test_vla as base

CHUNK = 4
CONFIG = base.with_values(base.BASE, actions=dict(chunk=CHUNK, head="l1"))
SINGLE = base.with_values(base.SINGLE, actions=dict(chunk=CHUNK, head="l1"))


def _numpy_l1_loss(params, hidden_BxSxD, batch, config):
    """The loss from its definition: RMS norm, gelu MLP, readout, the slot's own dim, [-1, 1] targets, |error| summed."""
    slots, dims = vla.action_targets(config), config.actions.dims
    x = np.asarray(hidden_BxSxD, np.float64)[:, -slots:]
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.model.norm_eps) * np.asarray(params["final_norm"])
    w1, w2, w_out = (np.asarray(params["action_head"][k], np.float64) for k in ("w1", "w2", "w_out"))
    h = x @ w1
    out = (0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))) @ w2 @ w_out  # [B, slots, dims]
    dim = np.arange(slots) % dims
    pred = np.take_along_axis(out, np.broadcast_to(dim[None, :, None], out.shape[:2] + (1,)), -1)[..., 0]
    low, high = config.actions.low, config.actions.high
    target = np.clip(2 * (batch["values"][:, -slots:] - low) / (high - low) - 1, -1, 1)
    return np.sum(np.abs(pred - target) * batch["mask"][:, -slots:])


def test_the_l1_loss_is_the_mlp_regression_of_each_slots_normalised_value():
    params = base.single_device_params(SINGLE)
    assert params["action_head"]["w1"].shape == (SINGLE.model.d_model, SINGLE.model.d_model)
    batch = vla.synthetic_batch(SINGLE, 0, 4)
    other = vla.synthetic_batch(SINGLE, 0, 4)
    other["values"] = -other["values"]
    np.testing.assert_array_equal(batch["inputs"], other["inputs"])  # the answer is not in the input
    image_tokens = vla.encode_images(params, batch, SINGLE)
    x = vla.llm_inputs(params, image_tokens, batch["inputs"], vla.Collectives())
    cache = decode.init_cache(SINGLE.model, x.shape[0], x.shape[1], SINGLE.model.n_kv_heads, x.dtype)
    hidden, _ = decode.hidden_states(params, x, cache, 0, SINGLE.model, prefix_len=vla.prefix_len(SINGLE))
    loss, count = vla.loss_sum(params, batch, SINGLE)
    assert float(count) == batch["mask"].sum() > 0
    np.testing.assert_allclose(float(loss), _numpy_l1_loss(params, hidden, batch, SINGLE), rtol=1e-5)
    assert float(vla.loss_sum(params, other, SINGLE)[0]) != pytest.approx(float(loss), rel=1e-3)  # the values count


def test_normalised_values_round_trip_through_the_bins_range():
    config = base.with_values(CONFIG, actions=dict(dims=3, normalization="quantile", q01=(-2.0, 0.0, 1.5),
                                                   q99=(2.0, 10.0, 1.5)))
    dim = jnp.array([0, 1, 2, 0])
    values = jnp.array([[1.0, 2.5, 7.0, -5.0]])
    unit = vla.normalise_values(config, values, dim)
    np.testing.assert_allclose(unit, [[0.5, -0.5, 0.0, -1.0]])  # the last one clipped; a fixed dim is 0
    np.testing.assert_allclose(vla.denormalise_values(config, unit, dim), [[1.0, 2.5, 1.5, -2.0]])


@pytest.mark.parametrize("mesh,schedule,vision_tp", [
    # the head part (vocab and the MLP's hidden dim over pp x tp) on the last stage's output; slow for make test's
    # 15 minutes: the flow head's (2,2,2) 1F1B case (tests/test_vla_flow.py) runs the same MLP there
    pytest.param((2, 2, 2), "1f1b", 1, marks=pytest.mark.slow),
    pytest.param((2, 1, 4), "zero1", 2, marks=pytest.mark.slow),
    pytest.param((4, 1, 2), "zero3", 1, marks=pytest.mark.slow),  # the MLP gathered per use
    pytest.param((1, 2, 4), "zb", 2, marks=pytest.mark.slow),
])
def test_l1_vla_matches_single_device(mesh, schedule, vision_tp):
    losses, grads, state = base.run(base.on_layout(CONFIG, mesh, schedule, vision_tp), single=SINGLE)
    assert np.abs(base.reference(SINGLE)[1]["action_head"]["w_out"]).max() > 0
    base.assert_matches_reference(losses, grads, base.reference(SINGLE))
    base.assert_action_head_split_like_the_vocabulary(state, mesh)


@pytest.mark.slow
def test_l1_vla_under_context_parallelism_matches_single_device():
    ref_losses, ref_grads, _ = base.reference(SINGLE)
    config = base.with_values(CONFIG, mesh=dict(dp=2, pp=1, tp=2, cp=2, cp_strategy="ring"),
                              pipeline=dict(microbatches=1))
    losses, grads, _ = base.run(config, single=SINGLE)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e))),
                 grads, ref_grads)


def test_decoding_returns_the_values_the_training_forward_regresses():
    params = base.single_device_params(SINGLE)
    batch = vla.synthetic_batch(SINGLE, 1, 2)
    text = batch["inputs"][:, :SINGLE.actions.instruction_len]
    values, unit = decode.predict_actions(params, batch["images"], text, SINGLE)
    assert values.shape == unit.shape == (2, CHUNK * SINGLE.actions.dims)
    np.testing.assert_allclose(values, SINGLE.actions.low + (np.clip(unit, -1, 1) + 1) / 2
                               * (SINGLE.actions.high - SINGLE.actions.low), rtol=1e-6)
    # the loss of the decoded values as targets is the distance to the clipped range only: zero here
    batch["values"][:, -CHUNK * SINGLE.actions.dims:] = np.asarray(values)
    batch["mask"][:] = 0
    batch["mask"][:, -CHUNK * SINGLE.actions.dims:] = 1
    assert float(vla.loss_sum(params, batch, SINGLE)[0]) == pytest.approx(
        float(np.sum(np.maximum(np.abs(unit) - 1, 0))), abs=1e-4)


@pytest.mark.slow  # (a pipelined eval step's compile: make test's time)
def test_evaluation_scores_values_in_their_units():
    config = base.with_values(CONFIG, mesh=dict(dp=2, pp=2, tp=2), pipeline=dict(schedule="1f1b"))
    b = base.builder(config)
    state = jax.device_put(b.from_model_order(base.reference_state(SINGLE)), b.state_shardings())
    batch = vla.synthetic_batch(config, 0, config.train.global_batch_size)  # (with the values: head=l1)
    sums = jax.device_get(Evaluator(b).jit_eval_step()(state.params, jax.device_put(batch, b.batch_sharding())))
    single = base.single_device_params(SINGLE)
    x = vla.llm_inputs(single, vla.encode_images(single, batch, SINGLE), batch["inputs"], vla.Collectives())
    cache = decode.init_cache(SINGLE.model, x.shape[0], x.shape[1], SINGLE.model.n_kv_heads, x.dtype)
    hidden, _ = decode.hidden_states(single, x, cache, 0, SINGLE.model, prefix_len=vla.prefix_len(SINGLE))
    np.testing.assert_allclose(sums["loss"], _numpy_l1_loss(single, hidden, batch, SINGLE), rtol=1e-4)
    assert sums["action_tokens"] == sums["tokens"] == batch["mask"].sum()
    assert 0 < sums["action_abs_err"] and sums["action_correct"] <= sums["action_tokens"]


def test_l1_head_errors_are_one_line():
    with pytest.raises(ConfigError, match="actions.head='mse' is unknown"):
        validate(base.with_values(CONFIG, actions=dict(head="mse")))
    with pytest.raises(ConfigError, match="needs model.prefix_lm=true"):
        validate(base.with_values(CONFIG, model=dict(prefix_lm=False), actions=dict(chunk=1)))
    with pytest.raises(ConfigError, match="model.text_loss needs the LM head"):
        validate(base.with_values(CONFIG, model=dict(text_loss=True)))


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), CHUNK])  # (chunk 1: [B, dims], slow)
def test_the_rollout_policy_returns_the_decoded_values(chunk):
    from jaxpar.data.instructions import InstructionEncoder
    from jaxpar.robot import env as task
    from jaxpar.robot import rollout

    config = base.with_values(SINGLE, actions=dict(chunk=chunk))
    params = base.single_device_params(config)
    images = vla.synthetic_batch(config, 2, 2)["images"]
    actions = rollout.model_policy(config, params)(images, ["reach the red square", "go"])
    assert actions.shape == ((2, config.actions.dims) if chunk == 1 else (2, chunk, config.actions.dims))
    text, film = InstructionEncoder.for_config(config).encode_batch(["reach the red square", "go"], "test")
    values, _ = decode.predict_actions(params, images, text, config, film)
    np.testing.assert_allclose(actions.reshape(2, -1), values, rtol=1e-5, atol=1e-6)
    if chunk > 1:  # a receding horizon: the chunk's first actions.execute steps, and a call per that many steps
        receding = base.with_values(config, actions=dict(execute=2))
        policy = rollout.model_policy(receding, params)
        np.testing.assert_array_equal(policy(images, ["reach the red square", "go"]), actions[:, :2])
        shape = task.TaskShape.from_config(receding)
        result = rollout.run_rollouts(policy, task.draw_scenes(6, 0, shape), 5, shape)
        assert result["policy_calls"] == 3 and result["trajectories"].shape[0] == 6  # 2 + 2 + 1 steps
