"""Vocab-parallel embedding and cross-entropy (Megatron): each tp rank owns V/tp vocabulary rows.

Neither gathers the full [B, S, V] logits: the softmax normaliser and the target logit are reduced
over tp as [B, S] scalars (one max, two sums).
"""

import jax
import jax.numpy as jnp

from jaxpar.layers.collectives import Collectives, after


def _local_ids(ids: jax.Array, local_vocab: int, coll: Collectives):
    local = ids - coll.tp_rank() * local_vocab
    in_shard = (local >= 0) & (local < local_vocab)
    return jnp.where(in_shard, local, 0), in_shard


def embed(table_VxD: jax.Array, ids_BxS: jax.Array, coll: Collectives) -> jax.Array:
    """Look up this rank's rows, zero the rest, sum over tp (with sequence parallelism each rank keeps
    its sequence shard of the sum)."""
    return coll.row_parallel_sum(embed_partial(table_VxD, ids_BxS, coll))


def embed_partial(table_VxD: jax.Array, ids_BxS: jax.Array, coll: Collectives) -> jax.Array:
    """This rank's share of the embedding: its vocabulary shard's rows, zeros for the other ids (each
    id is in exactly one shard, so the sum over tp is exact)."""
    local, in_shard = _local_ids(ids_BxS, table_VxD.shape[0], coll)
    return jnp.take(table_VxD, local, axis=0) * in_shard[..., None].astype(table_VxD.dtype)


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array, coll: Collectives) -> jax.Array:
    """Per-token -log softmax(logits)[target] from vocab-sharded fp32 logits."""
    logits_BxSxV = logits_BxSxV.astype(jnp.float32)
    max_BxS = coll.tp_max(jax.lax.stop_gradient(jnp.max(logits_BxSxV, axis=-1)))
    sum_exp_BxS = coll.tp_sum(jnp.sum(jnp.exp(logits_BxSxV - max_BxS[..., None]), axis=-1))
    local, in_shard = _local_ids(targets_BxS, logits_BxSxV.shape[-1], coll)
    picked_BxS = jnp.take_along_axis(logits_BxSxV, local[..., None], axis=-1)[..., 0]
    target_logit_BxS = coll.tp_sum(after(jnp.where(in_shard, picked_BxS, 0.0), sum_exp_BxS))  # fixed order
    return jnp.log(sum_exp_BxS) + max_BxS - target_logit_BxS


def argmax(logits_BxSxV: jax.Array, coll: Collectives) -> jax.Array:
    """Global vocabulary id of the largest logit (the lowest id among ties, as jnp.argmax): each rank
    proposes its best, the max over tp picks the value, the min over tp the id."""
    local_max_BxS = jnp.max(logits_BxSxV, axis=-1)
    local_id_BxS = jnp.argmax(logits_BxSxV, axis=-1).astype(jnp.int32) + coll.tp_rank() * logits_BxSxV.shape[-1]
    best_BxS = coll.tp_max(local_max_BxS)
    candidate_BxS = jnp.where(local_max_BxS == best_BxS, local_id_BxS, jnp.iinfo(jnp.int32).max)
    return -coll.tp_max(-after(candidate_BxS, best_BxS))  # fixed order of the two collectives
