"""The norms' and SwiGLU's own backward rules (jaxpar.layers.norm, jaxpar.layers.mlp.swiglu).

The reference is JAX's autodiff of the plain formula, written out here as the layers computed it before
they had rules: the gradients must agree within float32 rounding (bf16 inputs: within one bf16 rounding
of the result, since the rules compute in fp32 and round once). The equivalence family cannot see a wrong
rule (both sides of every layout comparison use it), so this file is what pins the arithmetic. The rules
exist to keep less for the backward: the residuals are the inputs and per-token fp32 statistics only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.layers.mlp import swiglu
from jaxpar.layers.norm import layer_norm, rms_norm


def plain_rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def plain_layer_norm(x, scale, bias, eps=1e-6):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def plain_swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _inputs(dtype, shape=(2, 6, 32)):
    keys = jax.random.split(jax.random.key(0), 5)
    x = (3.0 * jax.random.normal(keys[0], shape) + 0.5).astype(dtype)  # a mean away from 0: LayerNorm's term shows
    scale = (1.0 + 0.3 * jax.random.normal(keys[1], shape[-1:])).astype(jnp.float32)
    bias = (0.2 * jax.random.normal(keys[2], shape[-1:])).astype(jnp.float32)
    cotangent = jax.random.normal(keys[3], shape).astype(dtype)
    other = (2.0 * jax.random.normal(keys[4], shape)).astype(dtype)
    return x, scale, bias, cotangent, other


CASES = {
    "rms_norm": (lambda x, s, b, o: rms_norm(x, s, 1e-5), lambda x, s, b, o: plain_rms_norm(x, s, 1e-5)),
    "layer_norm": (lambda x, s, b, o: layer_norm(x, s, b), lambda x, s, b, o: plain_layer_norm(x, s, b)),
    "swiglu": (lambda x, s, b, o: swiglu(x, o), lambda x, s, b, o: plain_swiglu(x, o)),
}


def _grads(fn, args, cotangent):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_rule_equals_autodiff_of_the_formula(name, dtype):
    x, scale, bias, cotangent, other = _inputs(dtype)
    rule, plain = CASES[name]
    args = (x, scale, bias, other)
    out, grads = _grads(rule, args, cotangent)
    ref_out, ref_grads = _grads(plain, args, cotangent)
    assert jnp.array_equal(out, ref_out)  # the forward is the formula's, to the bit
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        # fp32: rounding only; bf16: the reference rounds its intermediates to bf16 (jax.nn.silu's and the
        # cast's transposes), the rule once at the end, so they differ by a few bf16 ulps of the largest value
        tol = 1e-5 if dtype == jnp.float32 else 2 ** -6
        scale_of = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) + 1e-30
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol * scale_of, (name, err, scale_of)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_backward_keeps_only_the_inputs_and_per_token_statistics(name):
    """bf16 inputs: what the pullback holds is the inputs (and the fp32 parameters) plus fp32 [..., 1]
    statistics. JAX's autodiff of the formula holds fp32 [..., d] copies (or, for SwiGLU, the sigmoid
    and its products) on top."""
    x, scale, bias, _, other = _inputs(jnp.bfloat16, shape=(2, 16, 64))
    args = (x, scale, bias, other)
    rule, plain = CASES[name]
    used = {"rms_norm": (x, scale), "layer_norm": (x, scale, bias), "swiglu": (x, other)}[name]
    allowed = sum(a.nbytes for a in used) + 2 * 4 * x.shape[0] * x.shape[1]  # + fp32 mean / rstd per token
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(jax.vjp(rule, *args)[1]))
    kept_by_autodiff = sum(leaf.nbytes for leaf in jax.tree.leaves(jax.vjp(plain, *args)[1]))
    assert kept <= allowed < kept_by_autodiff, (kept, allowed, kept_by_autodiff)


def test_a_replicated_scale_on_a_sharded_sequence_gets_the_summed_gradient():
    """Sequence parallelism: x is split over the axis, the scale replicated. The rule is handed the scale
    typed as varying (jaxpar.layers.collectives.typed_like), so JAX sums its gradient over the axis
    outside the rule, as it does for the formula."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    x, scale, bias, cotangent, _ = _inputs(jnp.float32, shape=(2, 8, 32))

    def grads(norm):
        def loss(x, scale, bias):
            return jnp.sum(norm(x, scale, bias) * cotangent_local(cotangent))
        inner = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                              in_specs=(P(None, "tp"), P(), P()), out_specs=(P(None, "tp"), P(), P()))
        return jax.jit(inner)(x, scale, bias)

    def cotangent_local(full):  # each rank's slice of the cotangent, by its index on the axis
        index = jax.lax.axis_index("tp")
        return jax.lax.dynamic_slice_in_dim(full, index * (full.shape[1] // 4), full.shape[1] // 4, axis=1)

    for rule, plain in ((lambda x, s, b: rms_norm(x, s, 1e-5), lambda x, s, b: plain_rms_norm(x, s, 1e-5)),
                        (layer_norm, plain_layer_norm)):
        for got, want in zip(grads(rule), grads(plain)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
