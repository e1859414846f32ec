"""RMSNorm (Llama) and LayerNorm (ViT): computed in fp32 whatever the compute dtype, replicated over tp.

Both have their own backward (`jax.custom_vjp`) that keeps only the input, in its own dtype (LayerNorm
also its fp32 per-token mean and rstd; RMSNorm recomputes its rstd, one reduction over d): what a fused
norm kernel keeps (Apex's and Transformer Engine's keep the input and the statistics). Left to JAX's
autodiff, the backward keeps the fp32 copy of the input and the fp32 normalised value, two [tokens, d]
fp32 tensors per norm, 4x the bf16 input's bytes: without remat 8.6 GB of llama7b's step at dp 4 x tp 2
(GPU-compiled, no device), memory pressure enough that XLA's GPU compiler rematerialised kernels of the
layer scan to fit its limit (docs/design.md, "Fused backward rules"). The forward is unchanged to the
bit; the backward computes the same formulas in fp32 (tests/test_fused_backward.py: against JAX's
autodiff of the plain formula).
"""

from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.layers.collectives import typed_like


def rms_norm(x_BxSxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """The scale is typed like x (in a shard_map: varying where x varies, e.g. over tp under sequence
    parallelism), so its gradient's sum over those axes stays JAX's, outside the backward rule."""
    return _rms_norm(x_BxSxD, typed_like(scale_D, x_BxSxD), eps)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return ((x32 * _rms_rstd(x32, eps)) * scale.astype(jnp.float32)).astype(x.dtype)


def _rms_rstd(x32, eps):
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _rms_fwd(x, scale, eps):
    return _rms_norm(x, scale, eps), (x, scale)


def _rms_bwd(eps, residuals, g):
    """y = n * w, n = x * rstd: dw = sum(g n), dx = rstd (dn - n mean(dn n)) with dn = g w."""
    x, scale = residuals
    x32 = x.astype(jnp.float32)
    rstd = _rms_rstd(x32, eps)
    normed = x32 * rstd
    g32 = g.astype(jnp.float32)
    d_normed = g32 * scale.astype(jnp.float32)
    d_x = rstd * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    d_scale = _sum_to(g32 * normed, scale.shape)
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


_rms_norm.defvjp(_rms_fwd, _rms_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps):
    return _ln_forward(x, scale, bias, eps)[0]


def layer_norm(x_BxSxD: jax.Array, scale_D: jax.Array, bias_D: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm (ViT), in fp32 whatever the compute dtype."""
    scale_D, bias_D = (typed_like(jnp.asarray(w), x_BxSxD) for w in (scale_D, bias_D))
    return _layer_norm(x_BxSxD, scale_D, bias_D, eps)


def _ln_forward(x, scale, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = ((x32 - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
    return out, (mean, rstd)


def _ln_fwd(x, scale, bias, eps):
    out, (mean, rstd) = _ln_forward(x, scale, bias, eps)
    return out, (x, scale, bias, mean, rstd)


def _ln_bwd(eps, residuals, g):
    """y = n * w + b, n = (x - mean) * rstd: dx = rstd (dn - mean(dn) - n mean(dn n)), dn = g w."""
    x, scale, bias, mean, rstd = residuals
    normed = (x.astype(jnp.float32) - mean) * rstd
    g32 = g.astype(jnp.float32)
    d_normed = g32 * scale.astype(jnp.float32)
    d_x = rstd * (d_normed - jnp.mean(d_normed, axis=-1, keepdims=True)
                  - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    return (d_x.astype(x.dtype), _sum_to(g32 * normed, scale.shape).astype(scale.dtype),
            _sum_to(g32, bias.shape).astype(bias.dtype))


_layer_norm.defvjp(_ln_fwd, _ln_bwd)


def _sum_to(x: jax.Array, shape: tuple) -> jax.Array:
    """The transpose of broadcasting `shape` to x.shape (numpy rules): sum the broadcast axes."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes).reshape(shape)
