"""Parameter offload (offload.params): the LLM's ZeRO-3 shards live in host memory and come to the device
one layer ahead inside the layer scan; the numbers are those of the run without it."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.config import ModelConfig, OffloadConfig, RematConfig, ZeroConfig, validate
from jaxpar.compiler.dry_run import dry_run
from jaxpar.errors import ConfigError
from jaxpar.parallel.step import HOST
from test_dry_run import _fast_compile
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

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


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_bf16_with_the_optimizer_offloaded_too_trains_as_without_offload():
    base = dataclasses.replace(make_config(dp=4, stage=3, precision="bf16", model=dataclasses.replace(
        make_config().model, n_layers=4)), remat=FULL)
    _, ref_losses, _ = run(base)
    _, losses, state = run(offloaded(base, optimizer=True))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for tree in (state.params, state.master, state.opt_state):
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)} == {HOST}


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
