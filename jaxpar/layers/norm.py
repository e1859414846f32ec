"""RMSNorm (Llama): computed in fp32 whatever the compute dtype, replicated over tp."""

import jax
import jax.numpy as jnp


def rms_norm(x_BxSxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    x32 = x_BxSxD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale_D.astype(jnp.float32)).astype(x_BxSxD.dtype)


def layer_norm(x_BxSxD: jax.Array, scale_D: jax.Array, bias_D: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm (ViT), in fp32 whatever the compute dtype."""
    x32 = x_BxSxD.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale_D.astype(jnp.float32) + bias_D.astype(jnp.float32)).astype(x_BxSxD.dtype)
