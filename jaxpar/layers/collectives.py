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

ZERO3_GATHERED = "zero3_gathered"  # checkpoint name of all-gathered ZeRO-3 weights: never saved for backward


@dataclasses.dataclass(frozen=True)
class Collectives:
    tp_axis: str | None = None  # tensor-parallel mesh axis (row-parallel outputs are summed over it)
    zero3_axis: str | None = None  # ZeRO-3: weights arrive sharded over this axis and are gathered per use
    zero_logical_axis: str = "embed"  # which logical dim ZeRO-3 sharded

    def tp_sum(self, x: jax.Array) -> jax.Array:
        """All-reduce over tp: the output of a row-parallel layer, or a vocab-parallel partial."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def tp_max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.tp_axis) if self.tp_axis else x

    def tp_rank(self) -> jax.Array:
        return jax.lax.axis_index(self.tp_axis) if self.tp_axis else jnp.int32(0)

    def gather_weights(self, params: Any, logical_axes: Any) -> Any:
        """ZeRO-3: all-gather the dp-sharded weights right before use (identity otherwise)."""
        if not self.zero3_axis:
            return params

        def gather(w, axes):
            full = jax.lax.all_gather(w, self.zero3_axis, axis=axes.index(self.zero_logical_axis), tiled=True)
            return checkpoint_name(full, ZERO3_GATHERED)

        return jax.tree.map(gather, params, logical_axes)
