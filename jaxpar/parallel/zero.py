"""ZeRO's gradient reduction over data-parallel mesh axes, shared by the LLM and the vision encoder."""

from __future__ import annotations

import jax

from jaxpar.sharding import Rules, zero_dim


def reduce_gradients(grads, logical_axes, mesh_axes, scatter: bool, rules: Rules, dtype):
    """Sum gradients over `mesh_axes` (ZeRO 0/1: all-reduce) or reduce-scatter each one on its ZeRO
    dim (ZeRO 2), moving them in `dtype` (fp32 by default; bf16 with grad_reduce=bf16)."""
    if scatter:
        def scatter_one(g, axes):
            return jax.lax.psum_scatter(g.astype(dtype), mesh_axes, scatter_dimension=zero_dim(axes, rules),
                                        tiled=True)
        return jax.tree.map(scatter_one, grads, logical_axes)
    return jax.tree.map(lambda g: jax.lax.psum(g.astype(dtype), mesh_axes), grads)
