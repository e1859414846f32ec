"""DeepSpeed-Ulysses (cp_strategy=ulysses): attention with the sequence split over cp by trading sequence for
heads. Before attention one all-to-all per tensor turns each rank's [B, S / cp, N, H] queries, keys and values
into [B, S, N / cp, H]: the whole sequence for 1/cp of the heads. Attention then runs as on one device over
those heads (cuDNN's causal mask type, the whole kernel); one all-to-all brings its output back to [B, S / cp,
N, H]. Each all-to-all moves (cp - 1) / cp of a tensor, and the four of a layer move no more than
all_gather's K / V when there are few KV heads; what it cannot do is split more ways than there are heads.

The sequence arrives in blockwise.balanced_order (rank r's chunks r and 2 cp - 1 - r); gathered rank by rank it
is that order, so a static permutation (chunk slices, no gather) puts it in position order for the kernel and
back. GQA: a tp rank's K KV heads are split over cp with the query heads they serve (K divisible by cp), or,
with fewer KV heads than cp, each is repeated cp / K times first, so that every cp rank receives the KV head its
query heads read (jaxpar.config.checks refuses the rest in one line). On XLA:CPU the all-to-alls are chained
(jaxpar.layers.order): q, k, v one after another, both ways; the output's follows from the data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.layers import blockwise
from jaxpar.layers.order import chain_both_ways


def to_balanced_order(x_BxSx: jax.Array, ways: int) -> jax.Array:
    """A sequence in position order put in balanced_order(S, ways): rank r's chunks r and 2 ways - 1 - r."""
    chunk = x_BxSx.shape[1] // (2 * ways)
    ranges = [(c * chunk, (c + 1) * chunk) for r in range(ways) for c in (r, 2 * ways - 1 - r)]
    return blockwise.take_ranges(x_BxSx, ranges)


def heads_from_sequence(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis: str):
    """(q, k, v) of the whole sequence in position order for this cp rank's 1/cp of the heads (module
    docstring), from this rank's S / cp tokens of every head."""
    ways = jax.lax.axis_size(axis)
    kv_heads = k_BxSxKxH.shape[2]
    if kv_heads % ways:  # fewer KV heads than cp ranks: each repeated so every rank receives the one it reads
        repeat = lambda x: jnp.repeat(x, ways // kv_heads, axis=2)  # noqa: E731
        k_BxSxKxH, v_BxSxKxH = repeat(k_BxSxKxH), repeat(v_BxSxKxH)
    swap = lambda x: jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)  # noqa: E731
    return tuple(blockwise.in_position_order(x, ways) for x in chain_both_ways(swap, (q_BxSxNxH, k_BxSxKxH, v_BxSxKxH)))


def sequence_from_heads(o_BxSxNxH: jax.Array, axis: str) -> jax.Array:
    """The attention output of this rank's heads over the whole sequence back to its S / cp tokens of every head."""
    ways = jax.lax.axis_size(axis)
    return jax.lax.all_to_all(to_balanced_order(o_BxSxNxH, ways), axis, split_axis=1, concat_axis=2, tiled=True)
