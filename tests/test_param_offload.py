"""Parameter offload (offload.params): the LLM's ZeRO-3 shards live in host memory and come to the device
one layer ahead inside the layer scan; the numbers are those of the run without it."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.config import DebugConfig, ModelConfig, OffloadConfig, RematConfig, ZeroConfig, validate
from jaxpar.compiler.dry_run import dry_run
from jaxpar.errors import ConfigError
from jaxpar.parallel.step import HOST
from test_dry_run import _fast_compile
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run
from test_eval import eval_sums, reference_text_sums, text_batch

FULL = RematConfig(policy="full")


def offloaded(config, **offload):
    return dataclasses.replace(config, remat=FULL, offload=OffloadConfig(params=True, **offload))


def test_offloaded_params_live_on_host_and_train_as_one_device():
    """dp2 x tp2 ZeRO-3: the losses and first gradients of one device; the parameters end on the host."""
    grads, losses, state = run(offloaded(make_config(dp=2, tp=2, stage=3)))
    ref_grads, ref_losses, _ = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {HOST}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)} == {"device"}


def test_offloaded_params_on_one_device_train_as_without():
    """dp = 1 (one GPU offloading its parameters): no ZeRO-3 gather copies the host weights in, so each use does
    (Collectives.fetch_host_weights); was a traceback at the embedding."""
    base = dataclasses.replace(make_config(stage=3), remat=FULL)
    _, losses, state = run(offloaded(make_config(stage=3)))
    _, want, _ = run(base)
    np.testing.assert_array_equal(losses, want)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {HOST}


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_bf16_with_the_optimizer_offloaded_too_trains_as_without_offload():
    base = dataclasses.replace(make_config(dp=4, stage=3, precision="bf16", model=dataclasses.replace(
        make_config().model, n_layers=4)), remat=FULL)
    _, ref_losses, _ = run(base)
    _, losses, state = run(offloaded(base, optimizer=True))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for tree in (state.params, state.master, state.opt_state):
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)} == {HOST}


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_dry_run_reports_the_parameters_on_the_host():
    """Every parameter byte of the LLM moves to the host; none is left on the device between steps."""
    model = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1024)
    base = dataclasses.replace(make_config(dp=4, tp=2, stage=3, precision="bf16", model=model), remat=FULL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.stages.Lowered, "compile", _fast_compile)
        without = dry_run(base, builder_for(base).mesh)["per_device_bytes"]
        config = offloaded(base)
        report = dry_run(config, builder_for(config).mesh)
    with_offload = report["per_device_bytes"]
    assert without["params_host"] == 0 and without["params"] > 0
    assert with_offload["params_host"] == without["params"] and with_offload["params"] == 0
    assert report["components"]["llm"]["params_host_bytes"] == without["params"]


@pytest.mark.parametrize("changes, message", [
    (dict(zero=ZeroConfig(stage=2)), "offload.params=true .* needs zero.stage=3, remat.policy=full"),
    (dict(zero=ZeroConfig(stage=3), remat=RematConfig(policy="selective")), "needs zero.stage=3, remat.policy=full"),
    (dict(zero=ZeroConfig(stage=3, prefetch=False)), "zero.prefetch=true"),
])
def test_params_offload_needs_zero3_with_full_remat_and_prefetch(changes, message):
    config = dataclasses.replace(make_config(dp=2), remat=FULL, offload=OffloadConfig(params=True))
    with pytest.raises(ConfigError, match=message):
        validate(dataclasses.replace(config, **changes))


def test_host_update_needs_the_optimizer_on_the_host_and_a_known_place():
    with pytest.raises(ConfigError, match="offload.update=host .* set offload.optimizer=true"):
        validate(dataclasses.replace(make_config(), offload=OffloadConfig(update="host")))
    with pytest.raises(ConfigError, match="offload.update='cpu' is unknown"):
        validate(dataclasses.replace(make_config(), offload=OffloadConfig(update="cpu")))


# ----------------------------------------------------------------------------- the update on the host


def assert_close_in_float32(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6 * np.max(np.abs(expected)))


@pytest.mark.parametrize("precision, layout", [("fp32", dict(dp=2, tp=2, stage=1)),
                                               pytest.param("bf16", dict(dp=4, stage=3), marks=pytest.mark.slow)])
def test_host_update_computes_the_device_update(precision, layout):
    """offload.update=host runs AdamW where the state lives; the same arithmetic as on the device (XLA:CPU), in
    another program, so the same losses and final parameters within float32 rounding, not bit for bit: LLVM
    rounds the two programs' fused updates apart at XLA's default optimisation as at the suite's fast codegen
    (measured, fp32: 19 and 394 of 8192 weights a few ulp apart, at most 3.7e-9). State left on the host."""
    base = dataclasses.replace(make_config(precision=precision, **layout), remat=FULL)
    on_device = dataclasses.replace(base, offload=OffloadConfig(optimizer=True))
    on_host = dataclasses.replace(base, offload=OffloadConfig(optimizer=True, update="host",
                                                              params=layout["stage"] == 3))
    _, device_losses, device_state = run(on_device)
    _, host_losses, host_state = run(on_host)
    np.testing.assert_allclose(host_losses, device_losses, rtol=1e-6)
    jax.tree.map(assert_close_in_float32, jax.device_get(host_state.params), jax.device_get(device_state.params))
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(host_state.opt_state)} == {HOST}


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_host_update_skips_a_step_whose_gradients_are_not_finite():
    config = dataclasses.replace(make_config(dp=2, stage=1), offload=OffloadConfig(optimizer=True, update="host"),
                                 debug=DebugConfig(nan_at_step=2))
    _, losses, state = run(config)
    _, ref_losses, _ = reference()
    np.testing.assert_allclose(losses[:2], ref_losses[:2], rtol=LOSS_RTOL)  # step 2's update is not applied:
    assert int(state.skipped) == 1 and not np.isclose(losses[2], ref_losses[2], rtol=1e-6)  # step 3 differs


def test_evaluation_reads_the_parameters_from_the_host(rng):
    """The eval step (no gradient: the host shards are copied in without sinks) reports the sums of the
    single-device model, the parameters still on the host."""
    config = offloaded(make_config(dp=4, tp=2, stage=3))
    batch = text_batch(config, rng)
    params, sums = eval_sums(config, batch)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(params)} == {HOST}
    expected = reference_text_sums(builder_for(make_config()).init_state(0).params, batch)
    assert sums["tokens"] == expected["tokens"] and sums["correct"] == expected["correct"]
    np.testing.assert_allclose(sums["loss"], expected["loss"], rtol=2e-6)
