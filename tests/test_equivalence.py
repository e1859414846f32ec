"""The heart of the suite: every parallel layout gives the single-device loss and gradients.

Layouts (dp, tp) in {(8,1), (4,2), (2,4), (1,8)} x ZeRO {0,1,2,3}, fp32, three optimizer steps on the
same data. Each test also asserts the arrays really are sharded as the layout claims. `make test` runs
a Latin square of the matrix (each layout once, each ZeRO stage once, ZeRO-3 over the widest dp); the
other 12 cases are `slow` (CI runs them).
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.config import DebugConfig
from jaxpar.data.synthetic import synthetic_batch

STEPS = 3
LOSS_RTOL = 1e-5


def batches(config):
    t = config.train
    return [synthetic_batch(t.seed, step, t.global_batch_size, t.seq_len, config.model.vocab_size)
            for step in range(STEPS)]


@functools.lru_cache(maxsize=None)
def initial_state_on_host(model=TINY_MODEL):
    """The single-device initial state; layouts start from it (test_sharded_init checks the sharded init)."""
    config = make_config(model=model)
    return jax.device_get(builder_for(config).init_state(config.train.seed))


def run(config):
    """STEPS train steps; returns (gradients of the first step, losses, final state)."""
    builder = builder_for(config)
    if config.precision == "fp32":
        state = jax.device_put(builder.from_model_order(initial_state_on_host(config.model)), builder.state_shardings())
    else:  # bf16 state has a different structure (bf16 params + fp32 master)
        state = builder.init_state(config.train.seed)
    data = [jax.device_put(b, builder.batch_sharding()) for b in batches(config)]
    step = builder.jit_train_step(with_grads=True)
    losses, grads0 = [], None
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads0 = builder.to_model_order(jax.device_get(metrics["grads"])) if grads0 is None else grads0
    return grads0, np.array(losses), state


@functools.lru_cache(maxsize=None)
def reference(**kwargs):
    return run(make_config(**kwargs))


def assert_grads_close(actual, expected):
    def check(path, a, e):
        scale = np.max(np.abs(e))
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, actual, expected)


def local_shape(array):
    shapes = {shard.data.shape for shard in array.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


def assert_sharded_as_claimed(state, dp, tp, stage):
    """wq is [layers, embed, heads, head_dim]: heads over tp, embed over dp when ZeRO shards it."""
    wq = state.params["layers"]["wq"]
    assert len(wq.sharding.device_set) == 8
    layers, embed, heads, head_dim = wq.shape
    expect_params = (layers, embed // (dp if stage >= 3 else 1), heads // tp, head_dim)
    assert local_shape(wq) == expect_params
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")["layers"]["wq"]
    assert local_shape(mu) == (layers, embed // (dp if stage >= 1 else 1), heads // tp, head_dim)
    embed_table = state.params["embed"]  # vocab-parallel
    assert local_shape(embed_table)[0] == embed_table.shape[0] // tp


LAYOUTS = [(8, 1), (4, 2), (2, 4), (1, 8)]
FAST = {(8, 1, 3), (4, 2, 2), (2, 4, 1), (1, 8, 0)}  # (1, 8): dp = 1 leaves ZeRO nothing to shard


@pytest.mark.parametrize("dp,tp,stage", [pytest.param(dp, tp, stage, marks=[] if (dp, tp, stage) in FAST else
                                                      [pytest.mark.slow])
                                         for dp, tp in LAYOUTS for stage in (0, 1, 2, 3)])
def test_layout_matches_single_device(dp, tp, stage):
    ref_grads, ref_losses, _ = reference()
    grads, losses, state = run(make_config(dp=dp, tp=tp, stage=stage))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert_sharded_as_claimed(state, dp, tp, stage)
    assert not np.allclose(ref_losses[0], ref_losses[-1], rtol=1e-4), "training must move the loss"


# ZeRO-1 sums the microbatches' whole gradients and reduce-scatters once; ZeRO-2 reduce-scatters each microbatch
@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_matches_one_big_batch(stage):
    ref_grads, ref_losses, _ = reference()
    grads, losses, _ = run(make_config(dp=2, tp=4, stage=stage, grad_accum=4))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_bf16_layout_tracks_fp32_single_device(stage):
    """bf16 compute cannot match fp32 to rounding; its losses and gradients must stay close (bf16 has
    8 mantissa bits) and the master weights must stay fp32."""
    ref_grads, ref_losses, _ = reference()
    grads, losses, state = run(make_config(dp=2, tp=4, stage=stage, precision="bf16"))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)

    def close(path, g, e):  # a wrong reduction (missing, doubled, wrong sign) is off by far more than this
        np.testing.assert_allclose(g, e, rtol=0, atol=0.03 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(close, grads, ref_grads)
    assert state.params["layers"]["wq"].dtype == np.dtype("bfloat16")
    assert jax.tree.leaves(state.master)[0].dtype == np.float32


def test_sharded_init_matches_single_device():
    """Initialising straight into a ZeRO-3 x tp layout gives the single-device values."""
    config = make_config(dp=4, tp=2, stage=3)
    state = builder_for(config).init_state(config.train.seed)
    assert_sharded_as_claimed(state, 4, 2, 3)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), initial_state_on_host().params)


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_the_select_nan_guard_gives_the_conds_bits(stage):
    """train.nan_guard=select (in place on GPUs, docs/design.md "The NaN guard") is the cond's arithmetic
    with another control flow: the same losses and the same state to the bit, the non-finite step skipped."""
    cond = dataclasses.replace(make_config(dp=2, tp=2, stage=stage, precision="bf16"), debug=DebugConfig(nan_at_step=2))
    select = dataclasses.replace(cond, train=dataclasses.replace(cond.train, nan_guard="select"))
    _, cond_losses, cond_state = run(cond)
    _, select_losses, select_state = run(select)
    assert int(cond_state.skipped) == int(select_state.skipped) == 1
    np.testing.assert_array_equal(select_losses, cond_losses)
    for part in ("params", "master", "opt_state"):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     jax.device_get(getattr(select_state, part)), jax.device_get(getattr(cond_state, part)))
