"""Activation checkpointing policies and optimizer offload: same numbers, different memory."""

import collections
import dataclasses
import types
from unittest import mock

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.config import ModelConfig, OffloadConfig, PipelineConfig, RematConfig
from jaxpar.compiler.dry_run import dry_run
from jaxpar.errors import ConfigError
from jaxpar.parallel.remat import LINEAR_OUTPUTS, POLICIES
from jaxpar.parallel.step import HOST, _check_host_memory
from test_dry_run import _fast_compile
from test_equivalence import LOSS_RTOL, reference, run

FOUR_LAYERS = dataclasses.replace(TINY_MODEL, n_layers=4)


def pipelined(policy: str):
    config = make_config(dp=2, pp=2, tp=2, stage=1, model=FOUR_LAYERS, global_batch_size=24)
    return dataclasses.replace(config, pipeline=PipelineConfig(schedule="1f1b", microbatches=3),
                               remat=RematConfig(policy=policy))


@pytest.fixture(scope="module")
def no_remat():
    return run(pipelined("none"))


# selective and full are `slow` here: `make test` checks both on pipelines against one device
# (tests/test_pipeline.py's FAST cases and stage recompute)
@pytest.mark.parametrize("policy", [pytest.param(p, marks=[pytest.mark.slow] if p in ("selective", "full") else [])
                                    for p in POLICIES if p != "none"])
def test_policy_changes_nothing_but_memory(policy, no_remat):
    """(2,2,2) with 1F1B: every policy gives the losses and gradients of `none` (recompute is exact math)."""
    ref_grads, ref_losses, _ = no_remat
    grads, losses, _ = run(pipelined(policy))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6 * np.max(np.abs(e))),
                 grads, ref_grads)


MEMORY_MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1024)


def memory_config(policy: str):
    config = make_config(dp=2, tp=4, stage=1, model=MEMORY_MODEL, global_batch_size=8, seq_len=256)
    return dataclasses.replace(config, remat=RematConfig(policy=policy))


def temp_bytes(policy: str) -> int:
    """XLA's temp bytes of the step, compiled with the fast backend options (memory_analysis unchanged:
    test_dry_run.test_fast_compile_keeps_memory_analysis; the five policies compile in the time four did)."""
    config = memory_config(policy)
    with mock.patch.object(jax.stages.Lowered, "compile", _fast_compile):
        return dry_run(config, builder_for(config).mesh)["per_device_bytes"]["temp"]


def host_moves(jaxpr) -> collections.Counter:
    """device_put equations to host / device memory in `jaxpr` and every jaxpr inside it."""
    moves = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            moves.update(getattr(d, "name", type(d).__name__) for d in eqn.params["devices"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    moves += host_moves(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    moves += host_moves(sub)
    return moves


@pytest.mark.slow  # four compiles
def test_temp_bytes_order_none_selective_full_and_offload_keeps_selectives_tensors_on_host():
    temp = {policy: temp_bytes(policy) for policy in POLICIES}
    assert temp["none"] > 1.2 * temp["selective"], temp
    assert temp["selective"] > 1.2 * temp["full"], temp
    assert temp["dots"] > temp["selective"], temp  # dots also keeps the attention scores
    # offload keeps what selective keeps, in pinned host memory: never more device memory than selective.
    # On CPU host and device memory are one and memory_analysis counts both (dry_run's notes), so the
    # bytes are exactly selective's: more would be kept tensors saved twice, less something recomputed.
    assert temp["offload"] == temp["selective"], temp
    # ... and the step moves each kept tensor to the host after the forward and back for the backward: the
    # layer's linear outputs but the down projection's (mlp_out only feeds the residual stream: the backward
    # does not need it), once each in the layer scan's body.
    builder = builder_for(memory_config("offload"))
    moves = host_moves(builder.jit_train_step().trace(builder.abstract_state(), builder.abstract_batch()).jaxpr.jaxpr)
    assert moves == {"Host": len(LINEAR_OUTPUTS) - 1, "Device": len(LINEAR_OUTPUTS) - 1}, moves


# ----------------------------------------------------------------------------- optimizer offload


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_offloaded_optimizer_lives_on_host_and_trains_the_same(precision):
    base = make_config(dp=2, tp=4, stage=1, precision=precision)
    config = dataclasses.replace(base, offload=OffloadConfig(optimizer=True))
    _, losses, state = run(config)
    _, ref_losses, _ = reference() if precision == "fp32" else run(base)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    assert kinds == {HOST}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"device"}
    if precision == "bf16":
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.master)} == {HOST}


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_dry_run_reports_offloaded_optimizer_bytes_on_host():
    base = make_config(dp=2, tp=4, stage=1, precision="bf16", model=MEMORY_MODEL)
    on_device = dry_run(base, builder_for(base).mesh)["per_device_bytes"]
    offloaded_config = dataclasses.replace(base, offload=OffloadConfig(optimizer=True))
    offloaded = dry_run(offloaded_config, builder_for(offloaded_config).mesh)["per_device_bytes"]
    assert on_device["opt_state_host"] == 0 and on_device["opt_state"] > 0
    assert offloaded["opt_state"] == 0
    assert offloaded["opt_state_host"] == on_device["opt_state"]  # master + m + v + counters, moved
    assert offloaded["params"] == on_device["params"]


def test_offload_without_host_memory_is_a_clear_error():
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    mesh = types.SimpleNamespace(devices=np.array([device], dtype=object))
    for changes in (dict(offload=OffloadConfig(optimizer=True)), dict(remat=RematConfig(policy="offload"))):
        config = dataclasses.replace(make_config(), **changes)
        with pytest.raises(ConfigError, match="needs 'pinned_host' memory.*turn offload off"):
            _check_host_memory(config, mesh)
