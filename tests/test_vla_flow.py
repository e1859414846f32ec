"""The flow head (actions.head = flow, flow matching as pi0 trains its action expert, issue 49): each action slot's
last hidden state, with the slot's noised value and the time, predicts the velocity from the value to the noise. The
loss is its formula written out in numpy, the draws do not depend on the layout, every layout equals one device, and
decoding integrates the velocity from noise as Euler's method does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError, validate
from jaxpar.inference import decode
from jaxpar.models import vla
from jaxpar.parallel.evaluate import Evaluator

import test_vla as base

CHUNK = 4
CONFIG = base.with_values(base.BASE, actions=dict(chunk=CHUNK, head="flow", flow_steps=3))
SINGLE = base.with_values(base.SINGLE, actions=dict(chunk=CHUNK, head="flow", flow_steps=3))


def _gelu(h):
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


def _numpy_velocity(params, hidden_BxSxD, xt_BxS, t_BxS, config):
    """The head from its definition on the slots: RMS norm, plus [x_t, sin / cos of pi 2^k t] @ w_cond, the gelu
    MLP, the slot's own dim."""
    slots, dims = vla.action_targets(config), config.actions.dims
    x = np.asarray(hidden_BxSxD, np.float64)[:, -slots:]
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.model.norm_eps) * np.asarray(params["final_norm"])
    head = {k: np.asarray(v, np.float64) for k, v in params["action_head"].items()}
    angles = np.asarray(t_BxS, np.float64)[..., None] * np.pi * 2.0 ** np.arange(8)
    cond = np.concatenate([np.asarray(xt_BxS, np.float64)[..., None], np.sin(angles), np.cos(angles)], -1)
    out = _gelu((x + cond @ head["w_cond"]) @ head["w1"]) @ head["w2"] @ head["w_out"]  # [B, slots, dims]
    dim = np.arange(slots) % dims
    return np.take_along_axis(out, np.broadcast_to(dim[None, :, None], out.shape[:2] + (1,)), -1)[..., 0]


def _unit_targets(batch, config):
    slots, low, high = vla.action_targets(config), config.actions.low, config.actions.high
    return np.clip(2 * (np.asarray(batch["values"])[:, -slots:] - low) / (high - low) - 1, -1, 1)


def _numpy_flow_loss(params, hidden_BxSxD, batch, config):
    slots = vla.action_targets(config)
    noise, t = (np.asarray(batch[k], np.float64)[:, -slots:] for k in ("noise", "time"))
    target = _unit_targets(batch, config)
    xt = t * noise + (1 - t) * target
    velocity = _numpy_velocity(params, hidden_BxSxD, xt, t, config)
    return np.sum((velocity - (noise - target)) ** 2 * np.asarray(batch["mask"])[:, -slots:])


def _hidden(params, batch, config):
    x = vla.llm_inputs(params, vla.encode_images(params, batch, config), batch["inputs"], vla.Collectives())
    cache = decode.init_cache(config.model, x.shape[0], x.shape[1], config.model.n_kv_heads, x.dtype)
    return decode.hidden_states(params, x, cache, 0, config.model, prefix_len=vla.prefix_len(config))[0]


def test_the_flow_loss_is_the_velocity_regression_at_each_slots_noised_value():
    params = base.single_device_params(SINGLE)
    assert params["action_head"]["w_cond"].shape == (17, SINGLE.model.d_model)
    batch = jax.device_get(vla.flow_noise(SINGLE, vla.synthetic_batch(SINGLE, 0, 4), 0))
    loss, count = vla.loss_sum(params, batch, SINGLE)
    assert float(count) == batch["mask"].sum() > 0
    np.testing.assert_allclose(float(loss), _numpy_flow_loss(params, _hidden(params, batch, SINGLE), batch, SINGLE),
                               rtol=1e-5)
    for key in ("values", "noise", "time"):  # each one counts
        other = dict(batch, **{key: 0.5 * batch[key]})
        assert float(vla.loss_sum(params, other, SINGLE)[0]) != pytest.approx(float(loss), rel=1e-3), key


def test_the_draws_are_the_same_on_every_layout_and_new_at_every_step():
    batch = {"mask": np.zeros((8, 12), np.float32)}
    first = jax.device_get(jax.jit(vla.flow_noise, static_argnums=0)(SINGLE, batch, 5))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    sharded = jax.jit(vla.flow_noise, static_argnums=0,
                      out_shardings=NamedSharding(mesh, P("dp", "tp")))(SINGLE, batch, 5)
    for key in ("noise", "time"):  # (a guarantee of threefry's: the step below relies on it)
        np.testing.assert_array_equal(np.asarray(sharded[key]), first[key])
    assert np.all(first["time"] == first["time"][:, :1]) and len(np.unique(first["time"][:, 0])) == 8  # one t per row
    assert np.all((first["time"] >= 0.001) & (first["time"] <= 1.0))
    later = jax.device_get(vla.flow_noise(SINGLE, batch, 6))
    assert not np.any(later["noise"] == first["noise"])


def test_the_times_follow_beta_1_5_1_weighted_toward_noise():
    """t = 0.001 + 0.999 Beta(1.5, 1) (openpi's): its CDF ((t - 0.001) / 0.999)^1.5, checked at a few points."""
    times = np.asarray(vla.flow_noise(SINGLE, {"mask": np.zeros((40000, 1), np.float32)}, 0)["time"])[:, 0]
    assert times.mean() == pytest.approx(0.001 + 0.999 * 0.6, abs=0.005)
    for t in (0.2, 0.5, 0.8):
        assert np.mean(times <= t) == pytest.approx(((t - 0.001) / 0.999) ** 1.5, abs=0.01), t


def test_the_exact_velocity_has_zero_loss_and_its_euler_steps_land_on_the_value(monkeypatch):
    """Independent of the head: along the straight path x_t = t noise + (1 - t) value, the field (x_t - value) / t is
    the constant noise - value, so the loss of a head that returns it is 0, and integrating it from the noise at
    t = 1 down to t = 0 in any number of Euler steps lands on the value."""
    batch = jax.device_get(vla.flow_noise(SINGLE, vla.synthetic_batch(SINGLE, 0, 4), 0))
    slots = vla.action_targets(SINGLE)
    value = jnp.asarray(_unit_targets(batch, SINGLE), jnp.float32)  # [B, slots]
    positions = jnp.arange(vla.sequence_layout(SINGLE)[2] - slots, vla.sequence_layout(SINGLE)[2])
    monkeypatch.setattr(vla, "flow_head_input", lambda *args: None)
    monkeypatch.setattr(vla, "flow_velocity", lambda _, xt, t, *rest: ((xt - value) / t, positions))
    loss = vla.flow_loss_sum({}, None, batch, SINGLE, vla.Collectives(), slots)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    for steps in (1, 3, 10):
        config = base.with_values(SINGLE, actions=dict(flow_steps=steps))
        landed, _ = vla.flow_sample({}, None, jnp.asarray(batch["noise"]), config, vla.Collectives(), slots)
        np.testing.assert_allclose(landed, value, atol=2e-5)


# (2,2,2) 1F1B: the head part (the MLP's hidden dim over pp x tp, the conditioning replicated) on the last stage's
# output; the others cover ZeRO-1 with vision tp 2, ZeRO-3's per-use gathers of the head, zb, and sequence parallelism
@pytest.mark.parametrize("mesh,schedule,vision_tp,sp", [
    ((2, 2, 2), "1f1b", 1, False),
    pytest.param((2, 1, 4), "zero1", 2, False, marks=pytest.mark.slow),
    pytest.param((4, 1, 2), "zero3", 1, False, marks=pytest.mark.slow),
    pytest.param((1, 2, 4), "zb", 2, False, marks=pytest.mark.slow),
    pytest.param((2, 1, 4), "zero1", 1, True, marks=pytest.mark.slow),
])
def test_flow_vla_matches_single_device(mesh, schedule, vision_tp, sp):
    config = base.on_layout(CONFIG, mesh, schedule, vision_tp)
    if sp:
        config = base.with_values(config, mesh=dict(sequence_parallel=True))
    losses, grads, state = base.run(config, single=SINGLE)
    assert np.abs(base.reference(SINGLE)[1]["action_head"]["w_cond"]).max() > 0
    base.assert_matches_reference(losses, grads, base.reference(SINGLE))
    base.assert_action_head_split_like_the_vocabulary(state, mesh)


@pytest.mark.slow
def test_flow_vla_under_context_parallelism_matches_single_device():
    config = base.with_values(CONFIG, mesh=dict(dp=2, pp=1, tp=2, cp=2, cp_strategy="ring"),
                              pipeline=dict(microbatches=1))
    losses, grads, _ = base.run(config, single=SINGLE)
    base.assert_matches_reference(losses, grads, base.reference(SINGLE))


def test_decoding_integrates_the_velocity_from_noise_in_flow_steps_euler_steps():
    params = base.single_device_params(SINGLE)
    batch = vla.synthetic_batch(SINGLE, 1, 2)
    text = batch["inputs"][:, :SINGLE.actions.instruction_len]
    values, unit = decode.predict_actions(params, batch["images"], text, SINGLE)
    slots = CHUNK * SINGLE.actions.dims
    assert values.shape == unit.shape == (2, slots)
    hidden = _hidden(params, batch, SINGLE)
    x = np.asarray(jax.random.normal(jax.random.key(SINGLE.train.seed), (1, slots), jnp.float32), np.float64)
    x = np.broadcast_to(x, (2, slots))  # one noise for every row: one observation, one chunk
    for k in range(3):  # t = 1, 2/3, 1/3, each step dt = 1/3 toward t = 0
        x = x - _numpy_velocity(params, hidden, x, np.full(x.shape, 1 - k / 3), SINGLE) / 3
    np.testing.assert_allclose(unit, x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(values, SINGLE.actions.low + (np.clip(unit, -1, 1) + 1) / 2
                               * (SINGLE.actions.high - SINGLE.actions.low), rtol=1e-6)


@pytest.mark.slow  # (a pipelined eval step's compile: make test's time)
def test_evaluation_scores_the_flow_loss_and_the_sampled_values():
    config = base.with_values(CONFIG, mesh=dict(dp=2, pp=2, tp=2), pipeline=dict(schedule="1f1b"))
    b = base.builder(config)
    state = jax.device_put(b.from_model_order(base.reference_state(SINGLE)), b.state_shardings())
    batch = vla.synthetic_batch(config, 0, config.train.global_batch_size)
    sums = jax.device_get(Evaluator(b).jit_eval_step()(state.params, jax.device_put(batch, b.batch_sharding())))
    single = base.single_device_params(SINGLE)
    drawn = jax.device_get(vla.flow_noise(SINGLE, batch, vla.EVAL_DRAWS))
    hidden = _hidden(single, drawn, SINGLE)
    np.testing.assert_allclose(sums["loss"], _numpy_flow_loss(single, hidden, drawn, SINGLE), rtol=1e-4)
    assert sums["action_tokens"] == sums["tokens"] == batch["mask"].sum()
    # the values sampled inside the pipeline (each step's sum over pp x tp) are one device's, from the same noise
    pred, positions = vla.flow_sample(single, hidden, drawn["noise"], SINGLE, vla.Collectives())
    want = jax.device_get(vla.continuous_eval_sums(SINGLE, pred, positions, drawn, 0.0))
    assert 0 < sums["action_abs_err"] and sums["action_correct"] <= sums["action_tokens"]
    np.testing.assert_allclose(sums["action_abs_err"], want["action_abs_err"], rtol=1e-4)
    assert sums["action_correct"] == pytest.approx(want["action_correct"], abs=1)  # (a value at a bin's edge)


def test_flow_head_errors_are_one_line():
    with pytest.raises(ConfigError, match="actions.flow_steps=0"):
        validate(base.with_values(CONFIG, actions=dict(flow_steps=0)))
    with pytest.raises(ConfigError, match="model.text_loss needs the LM head"):
        validate(base.with_values(CONFIG, model=dict(text_loss=True)))


def test_the_rollout_policy_returns_the_sampled_values():
    from jaxpar.data.instructions import InstructionEncoder
    from jaxpar.robot import rollout

    params = base.single_device_params(SINGLE)
    images = vla.synthetic_batch(SINGLE, 2, 2)["images"]
    actions = rollout.model_policy(SINGLE, params)(images, ["reach the red square", "go"])
    assert actions.shape == (2, CHUNK, SINGLE.actions.dims)
    text, film = InstructionEncoder.for_config(SINGLE).encode_batch(["reach the red square", "go"], "test")
    values, _ = decode.predict_actions(params, images, text, SINGLE, film)
    np.testing.assert_allclose(actions.reshape(2, -1), values, rtol=1e-5, atol=1e-6)
