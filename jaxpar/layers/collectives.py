"""The parallel hooks model math may call; every one is the identity on a single device.

Megatron's layers take a process group; jaxpar's take a `Collectives`, built by the parallel runtime
(jaxpar.parallel.step) for code running inside `jax.shard_map`. With no axes set (the default) the
same model code is the plain single-device model, which is what the equivalence tests compare to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.sharding import is_axes_leaf

ZERO3_GATHERED = "zero3_gathered"  # checkpoint name of all-gathered ZeRO-3 weights: never saved for backward


def after(x: jax.Array, dependency: jax.Array) -> jax.Array:
    """`x`, usable only once `dependency` is computed: fixes the order of two collectives.

    XLA:CPU runs independent ops concurrently and may start two independent collectives in a
    different order on different devices, which deadlocks (each waits in the other's rendezvous).
    `lax.optimization_barrier` does not survive its pipeline; this real data dependency does
    (0 x one element: XLA does not fold float multiplies by zero, for NaN's sake). Free on GPUs.
    """
    zero = 0.0 * jax.lax.stop_gradient(dependency).reshape(-1)[0].astype(jnp.float32)
    return x + zero.astype(x.dtype)


def _reduce_scatter_grad(axis: str, dim: int):
    """identity(full, shard) -> full, whose gradient w.r.t. `shard` is the gradient of `full`
    reduce-scattered over `axis`: ZeRO-2's reduce-scatter, issued per layer inside the backward."""
    @jax.custom_vjp
    def tap(full, shard):
        return full

    def forward(full, shard):
        return full, None

    def backward(_, cotangent):
        return None, jax.lax.psum_scatter(cotangent, axis, scatter_dimension=dim, tiled=True)

    tap.defvjp(forward, backward)
    return tap


@dataclasses.dataclass(frozen=True)
class Collectives:
    tp_axis: str | None = None  # tensor-parallel mesh axis (row-parallel outputs are summed over it)
    zero3_axis: str | None = None  # ZeRO-3: weights arrive sharded over this axis and are gathered per use
    zero2_axis: str | None = None  # ZeRO-2: weights arrive as (full, grad tap) pairs, see gather_weights
    zero_logical_axis: str = "embed"  # which logical dim ZeRO shards

    def tp_sum(self, x: jax.Array) -> jax.Array:
        """All-reduce over tp: the output of a row-parallel layer, or a vocab-parallel partial."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def tp_max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.tp_axis) if self.tp_axis else x

    def tp_rank(self) -> jax.Array:
        return jax.lax.axis_index(self.tp_axis) if self.tp_axis else jnp.int32(0)

    def gather_weights(self, params: Any, logical_axes: Any) -> Any:
        """The weights to compute with, right before use.

        ZeRO-3: all-gather the dp-sharded weights. ZeRO-2: each weight comes as a pair (full weight,
        dp-sharded grad tap); gradients flow to the tap reduce-scattered, layer by layer, so no device
        ever holds its whole unreduced gradient. Otherwise the identity.
        """
        if self.zero2_axis:
            def use(axes, pair):
                full, shard = pair
                return _reduce_scatter_grad(self.zero2_axis, axes.index(self.zero_logical_axis))(full, shard)
            return jax.tree.map(use, logical_axes, params, is_leaf=is_axes_leaf)
        if not self.zero3_axis:
            return params

        def gather(w, axes):
            full = jax.lax.all_gather(w, self.zero3_axis, axis=axes.index(self.zero_logical_axis), tiled=True)
            return checkpoint_name(full, ZERO3_GATHERED)

        return jax.tree.map(gather, params, logical_axes)
