"""What 1F1B keeps between a stage's forward and backward slots (jaxpar.parallel.residuals)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL
from jaxpar.layers.collectives import Collectives
from jaxpar.models import llama
from jaxpar.parallel import remat
from jaxpar.parallel.residuals import InputStash, ResidualStash

B, S = 2, 16


def stage_fn(policy_name):
    policy = remat.layer_policy(policy_name, regathers_weights=False)
    return lambda layers, x: llama.run_layers(x, layers, TINY_MODEL, Collectives(), policy)


def layers_and_input():
    layers = llama.init(TINY_MODEL, jax.random.key(0))["layers"]
    return layers, jax.random.normal(jax.random.key(1), (B, S, TINY_MODEL.d_model))


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_stash_backward_equals_vjp(policy):
    fn = stage_fn(policy)

    @jax.jit
    def three_ways(layers, x):
        y, pullback = jax.vjp(fn, layers, x)
        cot = jnp.sin(y)
        out = []
        for kind in (ResidualStash, InputStash):
            stash = kind(fn, layers, x)
            out.append(stash.backward(layers, stash.forward(layers, x)[1], cot))
        return pullback(cot), out

    expected, (kept, recomputed) = three_ways(*layers_and_input())
    for got in (kept, recomputed):
        jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6), got, expected)


def test_parameters_and_constants_are_not_stashed():
    """Every weight is passed back in by the backward slot, never kept per microbatch; with remat
    `full` the stash is exactly each layer's input, with `selective` also the linear outputs."""
    layers, x = layers_and_input()
    n_layers, d = TINY_MODEL.n_layers, TINY_MODEL.d_model
    full = ResidualStash(stage_fn("full"), layers, x)
    assert [a.shape for a in full.stash_avals()] == [(n_layers, B, S, d)]
    assert sorted(k for kind, k in full.kinds if kind == "param") == list(range(len(jax.tree.leaves(layers))))
    none = ResidualStash(stage_fn("none"), layers, x)
    weight_shapes = {w.shape for w in jax.tree.leaves(layers)}
    assert not weight_shapes & {a.shape for a in none.stash_avals()}
    constants = [kind for kind, _ in none.kinds if kind == "const"]
    assert constants, "RoPE tables and the causal mask are recomputed, not stashed"
    assert all(a.shape[0] in (n_layers, B) for a in none.stash_avals())  # per layer or per example: activations


def test_more_remat_keeps_fewer_bytes():
    layers, x = layers_and_input()
    kept = {p: sum(a.size * a.dtype.itemsize for a in ResidualStash(stage_fn(p), layers, x).stash_avals())
            for p in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"] == TINY_MODEL.n_layers * B * S * TINY_MODEL.d_model * 4
