"""fp8.recipe=delayed (issue 47): scales from the amaxes of the last `fp8.amax_history` steps, kept as per-exponent
counters in the train state (jaxpar/layers/fp8.py "delayed scaling").

What must hold, and why these tests can tell: the counters combine the amaxes of every tp shard, dp rank,
microbatch and pipeline tick by max, so with the weights held still (lr 0) every layout ends with one device's
counters bit for bit (a sum, or a shard's smaller amax kept alive, gives other values: see the unit tests); a
skipped step leaves them as they were; a checkpoint carries them (exact resume, resharded restore).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.config import ConfigError, DebugConfig, MeshConfig, PipelineConfig, validate
from jaxpar.layers import fp8
from jaxpar.models import llama
from test_equivalence import batches
from test_fp8 import FP8_LOSS_RTOL, rounded

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
HISTORY = 2  # short enough that three steps let the calibration's bins die


def delayed(config, history=HISTORY, **train):
    config = dataclasses.replace(config, precision="fp8", fp8=dataclasses.replace(config.fp8, recipe="delayed",
                                                                                   amax_history=history),
                                 train=dataclasses.replace(config.train, **train))
    validate(config)
    return config


def numpy_scale(amax: float, top: float) -> float:
    """2^ceil(log2(amax / top)) in float64: the power-of-two scale, written independently of fp8.scale_for."""
    return 2.0 ** np.ceil(np.log2(amax / top)) if amax > 0 else 1.0


def test_the_delayed_scale_is_the_largest_amax_of_the_last_history_steps():
    """Per step, several uses (shards, microbatches) see amaxes; the counters, updated by the one-hot sum of what
    each saw, give at every step the scale of the max over the last HISTORY steps' max amaxes. A fresh state gives
    1 (the calibration pass gives the current scale instead)."""
    top = float(jnp.finfo(fp8.FORWARD).max)
    rng = np.random.default_rng(0)
    steps = [rng.uniform(0.5, 2.0, size=3) * 2.0 ** rng.integers(-20, 20) for _ in range(12)]
    lives = jnp.zeros(fp8.BINS, jnp.float32)
    assert float(fp8.delayed_scale(lives, jnp.float32(0), fp8.FORWARD)) == 1.0
    assert float(fp8.delayed_scale(lives, jnp.float32(1000.0), fp8.FORWARD, calibrating=True)) == 4.0
    for t, amaxes in enumerate(steps):
        observed = sum(fp8.seen(jnp.float32(a), fp8.FORWARD, jnp.float32) for a in amaxes)
        lives = fp8.next_lives(lives, observed, HISTORY)
        window = max(np.max(a) for a in steps[max(0, t + 1 - HISTORY):t + 1])
        assert float(fp8.delayed_scale(lives, jnp.float32(0), fp8.FORWARD)) == numpy_scale(window, top), t
        maxima = {int(np.log2(numpy_scale(np.max(a), top))) for a in steps[max(0, t + 1 - HISTORY):t + 1]}
        assert set((np.flatnonzero(np.asarray(lives)) + fp8.EXPONENT_MIN).tolist()) == maxima, t  # each step's max only
    assert sorted(set(np.asarray(lives).tolist())) == [0.0, 1.0, 2.0]  # the older maxima counted down and out


def test_the_delayed_linear_scales_by_its_counters_and_returns_the_bins_it_saw():
    """The forward casts x with the counters' scale (saturating what lies above it), the backward dY likewise; the
    counters' cotangent is one-hot at the bins of x's and dY's own amaxes, whatever scale was used."""
    rng = np.random.default_rng(1)
    eq, x, w = "bd,df->bf", rng.normal(size=(8, 16)).astype(np.float32) * 3, rng.normal(size=(16, 4)).astype(np.float32)
    d_y = rng.normal(size=(8, 4)).astype(np.float32) * 1e-3
    x_bin, d_bin = 30, 40  # scales 2^-34 * ... : x's far below its amax (saturates), dY's far above (flushes some)
    lives = np.zeros((2, fp8.BINS), np.float32)
    lives[0, x_bin], lives[0, x_bin - 3], lives[1, d_bin] = 2, 1, 1
    sx, sd = (2.0 ** (b + fp8.EXPONENT_MIN) for b in (x_bin, d_bin))
    y, pullback = jax.vjp(lambda a, b, c: fp8.einsum(eq, a, b, None, c), jnp.asarray(x), jnp.asarray(w),
                          jnp.asarray(lives))
    top_x = float(jnp.finfo(fp8.FORWARD).max)
    qx = rounded(np.clip(x / sx, -top_x, top_x), E4M3) * sx
    sw = numpy_scale(np.max(np.abs(w)), top_x)
    qw = rounded(w / sw, E4M3) * sw
    np.testing.assert_allclose(np.asarray(y), np.einsum(eq, qx, qw), rtol=1e-6)
    assert np.sum(np.abs(x / sx) > top_x) > 0  # some of x really saturated
    d_x, d_w, d_lives = pullback(jnp.asarray(d_y))
    top_d = float(jnp.finfo(fp8.BACKWARD).max)
    qd = rounded(np.clip(d_y / sd, -top_d, top_d), E5M2) * sd
    np.testing.assert_allclose(np.asarray(d_x), np.einsum("bf,df->bd", qd, qw), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_w), np.einsum("bd,bf->df", qx, qd), rtol=1e-6)
    expected = np.zeros_like(lives)
    for row, (a, t) in enumerate(((x, top_x), (d_y, top_d))):
        expected[row, int(np.log2(numpy_scale(np.max(np.abs(a)), t))) - fp8.EXPONENT_MIN] = 1
    np.testing.assert_array_equal(np.asarray(d_lives), expected)


def run_delayed(config, calibrate=True):
    """Calibration, then the three steps of tests/test_equivalence.py's batches: (counters after calibration,
    losses, counters at the end, the final state)."""
    builder = builder_for(config)
    state = builder.init_state(config.train.seed)
    data = [jax.device_put(b, builder.batch_sharding()) for b in batches(config)]
    if calibrate:
        state = builder.jit_calibrate_fp8()(state, data[0])
    calibrated = np.asarray(builder.to_model_order(state.master)["layers"][llama.FP8_LIVES])
    step, losses = builder.jit_train_step(), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    counters = np.asarray(builder.to_model_order(state.master)["layers"][llama.FP8_LIVES])
    return calibrated, np.array(losses), counters, state


@pytest.fixture(scope="module")
def one_device():
    return {lr: run_delayed(delayed(make_config(), lr=lr)) for lr in (0.0, 1e-3)}


@pytest.mark.parametrize("layout", [
    pytest.param(dict(dp=8, stage=1), marks=pytest.mark.slow),  # make test's 15 minutes: one device's counters stay
    pytest.param(dict(dp=2, tp=4, stage=3), marks=pytest.mark.slow),  # make test's budget (dp 8 ZeRO-1 runs there)
    pytest.param(dict(tp=4, sequence_parallel=True), marks=[pytest.mark.slow, pytest.mark.extra]),  # CI: with rings
    pytest.param(dict(tp=4, sequence_parallel=True, collective_matmul="on"), marks=pytest.mark.slow),  # FP8 rings
    pytest.param(dict(dp=2, stage=2, grad_accum=2), marks=pytest.mark.slow),
    pytest.param(dict(dp=2, pp=2, tp=2, stage=1, microbatches=4), marks=[pytest.mark.slow, pytest.mark.extra]),  # CI: zb
    pytest.param(dict(pp=2, tp=2, stage=1, microbatches=4, schedule="zb"), marks=pytest.mark.slow),  # counters in W
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_layout_keeps_one_devices_counters_and_tracks_its_loss(layout, one_device):
    """lr 0 (the weights held still): the counters equal one device's bit for bit after calibration (where the
    layout splits no batch into microbatches: the calibration's current scales see each microbatch's own amax)
    and after three steps; with lr 1e-3 the losses track one device's within fp8's layout tolerance."""
    layout = dict(layout)
    microbatches, sp = layout.pop("microbatches", None), layout.pop("sequence_parallel", False)
    schedule, rings = layout.pop("schedule", "1f1b"), layout.pop("collective_matmul", "auto")
    config = make_config(**layout)
    if sp:
        config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=True,
                                                                      collective_matmul=rings))
    if microbatches:
        config = dataclasses.replace(config, pipeline=PipelineConfig(microbatches=microbatches, schedule=schedule))
    calibrated, _, counters, _ = run_delayed(delayed(config, lr=0.0))
    ref_calibrated, _, ref_counters, _ = one_device[0.0]
    if not (microbatches or layout.get("grad_accum")):
        np.testing.assert_array_equal(calibrated, ref_calibrated)
    np.testing.assert_array_equal(counters, ref_counters)
    assert np.max(counters) == HISTORY  # a max, never a sum of the shards' and microbatches' sightings
    _, losses, _, _ = run_delayed(delayed(config, lr=1e-3))
    np.testing.assert_allclose(losses, one_device[1e-3][1], rtol=FP8_LOSS_RTOL)


def test_calibration_gives_the_first_step_the_current_recipes_scales(one_device):
    """Calibrated on the first batch, the first step's scales are that batch's own amaxes' on one device (each
    linear runs once a step), so its gradients are the current recipe's bit for bit. Uncalibrated, the first step
    scales the output gradients by 1 (Transformer Engine's and Flax's start), which flushes them (~1e-5 here)
    below E5M2's subnormals: the first layer's query gradient comes out most of its norm away."""
    calibrated, _, _, _ = one_device[1e-3]
    alive = np.sum(calibrated == HISTORY, axis=-1)  # [layers, linears, operands]
    for row, name in enumerate(llama.LINEAR_ORDER):  # K, V and up read Q's and gate's input and counters
        assert np.all(alive[:, row] == ([0, 1] if name in llama.SAME_INPUT else [1, 1])), name
    assert set(np.unique(calibrated)) == {0.0, HISTORY}
    config = delayed(make_config(), lr=1e-3)
    builder = builder_for(config)
    batch = jax.device_put(batches(config)[0], builder.batch_sharding())
    fresh = builder.init_state(config.train.seed)
    grads = {"fresh": jax.device_get(jax.jit(builder.loss_and_grads)(fresh.params, batch)[1])}
    calibrated_state = builder.jit_calibrate_fp8()(fresh, batch)  # (donates the fresh state)
    grads["calibrated"] = jax.jit(builder.loss_and_grads)(calibrated_state.params, batch)[1]
    current = dataclasses.replace(config, fp8=dataclasses.replace(config.fp8, recipe="current"))
    current_builder = builder_for(current)
    expected = jax.jit(current_builder.loss_and_grads)(current_builder.init_state(config.train.seed).params, batch)[1]
    for name in llama.LINEAR_ORDER:
        np.testing.assert_array_equal(np.asarray(grads["calibrated"]["layers"][name]),
                                      np.asarray(expected["layers"][name]), err_msg=name)
    fresh_wq, wq = (np.asarray(g["layers"]["wq"][0], np.float64) for g in (grads["fresh"], expected))
    assert np.linalg.norm(fresh_wq - wq) > 0.5 * np.linalg.norm(wq)


@pytest.mark.slow  # make test's 15 minutes; it keeps the NaN guard (test_equivalence) and the delayed resume
def test_a_skipped_step_leaves_the_counters_as_they_were():
    """The NaN guard keeps the counters with the weights: a non-finite step (debug.nan_at_step) is not applied."""
    config = dataclasses.replace(delayed(make_config(dp=2, tp=2, stage=1)), debug=DebugConfig(nan_at_step=2))
    builder = builder_for(config)
    data = [jax.device_put(b, builder.batch_sharding()) for b in batches(config)]
    state = builder.jit_calibrate_fp8()(builder.init_state(config.train.seed), data[0])
    step = builder.jit_train_step()
    state, _ = step(state, data[0])
    before = jax.device_get(state.master)
    state, metrics = step(state, data[1])
    assert bool(metrics["skipped"])
    after = jax.device_get(state.master)
    jax.tree.map(np.testing.assert_array_equal, after, before)
    state, metrics = step(state, data[2])
    assert not bool(metrics["skipped"])
    assert not np.array_equal(np.asarray(state.master["layers"][llama.FP8_LIVES]),
                              before["layers"][llama.FP8_LIVES])  # the next step moves them again


def test_the_counters_are_state_the_optimizer_and_the_norm_leave_alone():
    """No AdamW moments, no weight decay, no part in the gradient norm: the partition gives the counters their own
    rule, and the step's grad_norm is the same whether the counters exist or not (bins seen are no gradient)."""
    config = delayed(make_config())
    builder = builder_for(config)
    state = builder.init_state(config.train.seed)
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if getattr(leaf, "ndim", 0) == 4
               and leaf.shape[-1] == fp8.BINS]
    assert not moments
    batch = jax.device_put(batches(config)[0], builder.batch_sharding())
    state = builder.jit_calibrate_fp8()(state, batch)
    _, grads, norm = jax.jit(builder.loss_and_grads)(state.params, batch)
    weights = {k: v for k, v in grads.items() if k != "layers"}
    weights["layers"] = {k: v for k, v in grads["layers"].items() if k != llama.FP8_LIVES}
    by_hand = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(weights)))
    np.testing.assert_allclose(float(norm), by_hand, rtol=1e-5)
    assert np.max(np.asarray(grads["layers"][llama.FP8_LIVES])) >= 1  # the counters' "gradient" is bins seen


def _train_losses(config, workdir):
    from jaxpar.training.loop import train
    return [r["loss"] for r in train(config, builder_for(config).mesh, workdir, show_progress=False)]


def _restored_counters(config, workdir, step):
    from jaxpar.parallel.checkpoint import Checkpointer
    builder = builder_for(config)
    checkpoints = Checkpointer(workdir, config)
    try:
        state, _, _ = checkpoints.restore(builder.abstract_state(), step)
    finally:
        checkpoints.close()
    return np.asarray(builder.to_model_order(jax.device_get(state.master))["layers"][llama.FP8_LIVES])


def test_a_delayed_run_resumes_bit_for_bit(tmp_path):
    """The counters are in the checkpoint: a run resumed at step 3 repeats the uninterrupted run's losses exactly
    (it is not calibrated again: calibration is for a fresh state only). Generation, rollouts and the export
    read the run's weights without them."""
    from test_checkpoint import drop_checkpoints_after, with_checkpoints
    config = with_checkpoints(delayed(make_config(dp=2, tp=2, stage=1, steps=6, lr=3e-3)), every=3)
    full = _train_losses(config, tmp_path)
    drop_checkpoints_after(tmp_path, 3)
    assert _train_losses(config, tmp_path) == full[3:]
    assert np.max(_restored_counters(config, tmp_path, 6)) == HISTORY
    import json
    from jaxpar.config import to_dict
    from jaxpar.inference.loader import restore_weights  # generation, rollouts and export read weights only
    (tmp_path / "config.json").write_text(json.dumps(to_dict(config)))  # (as python -m jaxpar.train writes it)
    _, _, weights = restore_weights(tmp_path)
    assert jax.tree.structure(weights) == jax.tree.structure(llama.param_shapes(config.model),
                                                             is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.slow  # make test's budget: three short runs
def test_delayed_counters_restore_onto_another_layout(tmp_path):
    """Written by dp 2 x tp 2 with ZeRO-1 (the counters' bins sharded over dp), restored by tp 4 x pp 2 with the
    layers in another order: the same counters, and the resumed run tracks the uninterrupted one. A checkpoint of
    the current recipe (no counters) is refused by a delayed run in one line, and the other way round."""
    from test_checkpoint import drop_checkpoints_after, with_checkpoints
    config = with_checkpoints(delayed(make_config(dp=2, tp=2, stage=1, steps=6, lr=3e-3)), every=3)
    full = _train_losses(config, tmp_path)
    drop_checkpoints_after(tmp_path, 3)
    other = with_checkpoints(delayed(make_config(pp=2, tp=4, stage=0, steps=6, lr=3e-3)), every=3)
    other = dataclasses.replace(other, pipeline=PipelineConfig(microbatches=4, virtual_stages=1))
    np.testing.assert_array_equal(_restored_counters(other, tmp_path, 3), _restored_counters(config, tmp_path, 3))
    np.testing.assert_allclose(_train_losses(other, tmp_path), full[3:], rtol=FP8_LOSS_RTOL)
    current = dataclasses.replace(config, fp8=dataclasses.replace(config.fp8, recipe="current"))
    with pytest.raises(ConfigError, match=r"^checkpoint .* was written for a different state .*fp8_counters"):
        _restored_counters(current, tmp_path, 6)


def test_the_recipe_is_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^fp8.amax_history=0 must be >= 1"):
        delayed(make_config(), history=0)
    with pytest.raises(ConfigError, match=r"^fp8.recipe='late' is unknown; use current or delayed$"):
        validate(dataclasses.replace(make_config(precision="fp8"), fp8=dataclasses.replace(make_config().fp8,
                                                                                             recipe="late")))
    model = dataclasses.replace(make_config().model, d_model=96, n_heads=6, n_kv_heads=2)
    with pytest.raises(ConfigError, match=r"^fp8.recipe=delayed keeps 128 exponent bins per operand, which "
                                          r"zero.stage=1 shards over dp=3; use a dp that divides 128"):
        delayed(make_config(dp=3, stage=1, model=model, global_batch_size=12))
    delayed(make_config(dp=3, stage=0, model=model, global_batch_size=12))  # nothing sharded: fine


def vla_counters(config, same_image: bool):
    """A VLA's counters after calibration on the first of three synthetic batches (model order; "vit" and
    "projector": the encoder's blocks' and the projector's, "layers": the LLM's), then after the three steps.
    `same_image`: every example shows the first one's image."""
    from jaxpar.models import vla

    b = builder_for(config)
    state, data = b.init_state(0), []
    for i in range(3):
        batch = vla.synthetic_batch(config, i, config.train.global_batch_size)
        if same_image:
            batch["images"] = np.broadcast_to(batch["images"][:1], batch["images"].shape).copy()
        data.append(jax.device_put(batch, b.batch_sharding()))
    state = b.jit_calibrate_fp8()(state, data[0])

    def of(master):
        master = b.to_model_order(jax.device_get(master))
        return {"layers": np.asarray(master["layers"][llama.FP8_LIVES]),
                "vit": np.asarray(master["vit"]["blocks"][llama.FP8_LIVES]),
                "projector": np.asarray(master["projector"][llama.FP8_LIVES])}

    calibrated, step = of(state.master), b.jit_train_step()
    for batch in data:
        state, _ = step(state, batch)
    return calibrated, of(state.master)


def vla_delayed(config, **groups):
    import test_vla
    return test_vla.with_values(dataclasses.replace(config, precision="fp8"), train=dict(lr=0.0),
                                fp8=dict(recipe="delayed", amax_history=HISTORY), **groups)


def top_bins(lives: np.ndarray) -> np.ndarray:
    """Each row's highest living bin (-1: none): the exponent of its scale."""
    return np.max(np.where(lives > 0, np.arange(fp8.BINS), -1), axis=-1)


@pytest.mark.slow  # make test's 15 minutes; it keeps the LLM's calibration on one device
def test_the_vlas_encoder_and_projector_calibrate_their_counters():
    """The encoder's and the projector's linears keep counters too (fp8.recipe=delayed scales every FP8 linear's
    input and output gradient from its history): calibration fills one bin of each row, K's and V's input rows
    excepted (they read Q's), and three steps keep them alive at the history."""
    import test_vla
    from jaxpar.models import vit

    calibrated, counters = vla_counters(vla_delayed(test_vla.SINGLE), same_image=False)
    alive = {key: np.sum(calibrated[key] == HISTORY, axis=-1) for key in ("vit", "projector")}
    for row, name in enumerate(vit.BLOCK_LINEARS):
        assert np.all(alive["vit"][:, row] == ([0, 1] if name in vit.SAME_INPUT else [1, 1])), name
    assert np.all(alive["projector"] == 1)
    assert all(np.max(counters[key]) == HISTORY for key in ("vit", "projector"))


@pytest.mark.slow  # make test's budget: a pipelined VLA and its single device, twice
@pytest.mark.extra  # CI's budget: CI checks the VLA's counters on one device, test_every_layout the LLM's
def test_the_vlas_counters_are_one_devices_in_a_layout():
    """The VLA under pp 2 x tp 4 with the vision encoder over its own tp 2 (its images split over dp x pp and
    the rest of tp), lr 0, after calibration and three steps.
    - The encoder's and the projector's input counters are one device's bit for bit, each example with its own
      image; their output gradients' scales within one bin.
    - The LLM's input counters are one device's bit for bit when every example shows the same image; its output
      gradients' scales within one bin. With each example's own image a few LLM input rows move by one bin
      (measured; not isolated further: the encoder's tp-split sums round its tokens apart from one device's, and
      with more distinct tokens more amaxes sit near a bin's edge).
    Why not exact: the layout's bf16 sums round the gradients apart, and an amax near a power of two moves to
    the neighbouring bin (measured: 4 of the LLM's 56 output-gradient rows, each by one bin)."""
    import test_vla

    layout = dict(mesh=dict(dp=1, pp=2, tp=4), vision=dict(tp=2), zero=dict(stage=1))
    for same_image, keys in ((False, ("vit", "projector")), (True, ("layers",))):
        _, expected = vla_counters(vla_delayed(test_vla.SINGLE), same_image)
        _, got = vla_counters(vla_delayed(test_vla.BASE, **layout), same_image)
        for key in keys:
            assert np.max(expected[key]) == HISTORY, key
            np.testing.assert_array_equal(got[key][..., 0, :], expected[key][..., 0, :], err_msg=key)
            assert np.all(np.abs(top_bins(got[key][..., 1, :]) - top_bins(expected[key][..., 1, :])) <= 1), key
