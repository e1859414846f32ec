"""Attention over blocks of keys at arbitrary sequence positions: the math context parallelism runs
(docs/design.md, "Context parallelism"). A mask from positions instead of a causal triangle, and one
block's attention with its log-sum-exp, so that blocks seen one after another (the cp ring) merge into
exactly the whole sequence's attention. Pure math: no mesh, no collective."""

import jax
import jax.numpy as jnp
import numpy as np


def positions_mask(q_positions: jax.Array, k_positions: jax.Array, prefix_len: int = 0) -> jax.Array:
    """[1, 1, Sq, Sk] bool for queries and keys at arbitrary sequence positions: causal (a key at or before
    the query), and with `prefix_len` the prefix sees itself whole (the prefix-LM mask). With positions
    0..S-1 on both sides it is prefix_lm_mask; context parallelism gives each rank's queries its own
    positions against the gathered keys'."""
    q, k = q_positions[:, None], k_positions[None, :]
    return ((k <= q) | (k < prefix_len))[None, None]


def block_attention(q_BxSxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                    mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention of the queries over one block of keys, in fp32, normalised within the block: (output
    [B, S, N, H], log-sum-exp of the block's scores [B, N, S]). Ring attention combines blocks with
    merge_blocks. Query head n uses KV head n // (N / K), as jax.nn.dot_product_attention does. A query
    that sees no key of the block gets a log-sum-exp near -1e30, so the merge gives the block no weight."""
    b, s, n, h = q_BxSxNxH.shape
    k = k_BxTxKxH.shape[2]
    q_BxSxKxGxH = q_BxSxNxH.astype(jnp.float32).reshape(b, s, k, n // k, h)
    scores = jnp.einsum("bskgh,btkh->bkgst", q_BxSxKxGxH, k_BxTxKxH.astype(jnp.float32)) / np.sqrt(h)
    scores = jnp.where(mask[:, :, None], scores, -1e30)
    lse_BxKxGxS = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.exp(scores - lse_BxKxGxS[..., None])
    o_BxSxKxGxH = jnp.einsum("bkgst,btkh->bskgh", probs, v_BxTxKxH.astype(jnp.float32))
    return o_BxSxKxGxH.reshape(b, s, n, h), lse_BxKxGxS.reshape(b, n, s)


def merge_blocks(o_a, lse_a, o_b, lse_b):
    """Two blocks' (output, log-sum-exp) as one: each output weighted by its share of the total."""
    lse = jnp.logaddexp(lse_a, lse_b)
    weight = lambda block_lse: jnp.exp(block_lse - lse).transpose(0, 2, 1)[..., None]  # noqa: E731 [B, S, N, 1]
    return o_a * weight(lse_a) + o_b * weight(lse_b), lse
