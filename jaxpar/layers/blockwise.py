"""Attention over blocks of keys: the math context parallelism runs (docs/design.md, "Context
parallelism"). One block's attention with its log-sum-exp, so that blocks seen one after another (the
cp ring) merge into exactly the whole sequence's attention, and the balanced token order that makes
every block of it either causal, whole or skipped (jaxpar.layers.ring: no mask is ever built from
positions). `positions_mask` is the reference the tests check that against. Pure math: no mesh, no
collective."""

import jax
import jax.numpy as jnp
import numpy as np


def balanced_order(seq_len: int, ways: int) -> np.ndarray:
    """The token positions in the order context parallelism lays the sequence out over `ways` ranks,
    rank-major: the sequence cut into 2 ways chunks, rank i holding chunks i and 2 ways - 1 - i. Under a
    causal mask an early chunk attends to few keys and a late one to many, so each rank gets one of
    each and every rank does the same work (Megatron's and MaxText's load balancing)."""
    if seq_len % (2 * ways):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {ways} equal chunks")
    chunks = np.arange(seq_len).reshape(2 * ways, seq_len // (2 * ways))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)])


def positions_mask(q_positions: jax.Array, k_positions: jax.Array, prefix_len: int = 0) -> jax.Array:
    """[1, 1, Sq, Sk] bool for queries and keys at arbitrary sequence positions: causal (a key at or before
    the query), and with `prefix_len` the prefix sees itself whole (the prefix-LM mask). With positions
    0..S-1 on both sides it is prefix_lm_mask; context parallelism gives each rank's queries its own
    positions against the gathered keys'."""
    q, k = q_positions[:, None], k_positions[None, :]
    return ((k <= q) | (k < prefix_len))[None, None]


def _block_mask(causal: bool, queries: int, keys: int) -> jax.Array | None:
    """[1, 1, S, T] of a block: the causal triangle (query i sees keys 0..i; a diagonal block, S = T) or
    None (every key). Built from iotas inside the block's own kernel: the size of its scores."""
    if not causal:
        return None
    if queries != keys:
        raise ValueError(f"a causal block is a diagonal one: {queries} queries against {keys} keys")
    return jnp.tril(jnp.ones((queries, keys), bool))[None, None]


def block_attention(q_BxSxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                    causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """Attention of the queries over one block of keys, in fp32, normalised within the block: (output
    [B, S, N, H], log-sum-exp of the block's scores [B, N, S]). `causal`: a diagonal block (query i sees
    keys 0..i), else every key. Ring attention combines blocks with merge_blocks. Query head n uses KV
    head n // (N / K), as jax.nn.dot_product_attention does."""
    b, s, n, h = q_BxSxNxH.shape
    mask = _block_mask(causal, s, k_BxTxKxH.shape[1])
    k = k_BxTxKxH.shape[2]
    q_BxSxKxGxH = q_BxSxNxH.astype(jnp.float32).reshape(b, s, k, n // k, h)
    scores = jnp.einsum("bskgh,btkh->bkgst", q_BxSxKxGxH, k_BxTxKxH.astype(jnp.float32)) / np.sqrt(h)
    if mask is not None:
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


def block_attention_grads(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, causal, out_BxSxNxH, lse_BxNxS, d_out_BxSxNxH):
    """(dq, dk, dv) of one block's share of the whole attention, given the *merged* output and
    log-sum-exp (FlashAttention-2's backward): the block's probabilities exp(s - lse) are its part of
    the whole softmax, and D = sum(dO * O) carries the normaliser's gradient, so no gradient of the
    statistics is needed. In fp32, recomputing the block's scores (jaxpar.layers.ring)."""
    b, s, n, h = q_BxSxNxH.shape
    k = k_BxTxKxH.shape[2]
    mask = _block_mask(causal, s, k_BxTxKxH.shape[1])
    grouped = lambda x: x.astype(jnp.float32).reshape(b, s, k, n // k, h)  # noqa: E731 [B, S, K, G, H]
    q, d_out = grouped(q_BxSxNxH), grouped(d_out_BxSxNxH)
    keys, values = k_BxTxKxH.astype(jnp.float32), v_BxTxKxH.astype(jnp.float32)
    scores = jnp.einsum("bskgh,btkh->bkgst", q, keys) / np.sqrt(h)
    lse_BxKxGxS = lse_BxNxS.reshape(b, k, n // k, s)
    probs = jnp.exp(scores - lse_BxKxGxS[..., None])
    if mask is not None:
        probs = jnp.where(mask[:, :, None], probs, 0.0)
    d_values = jnp.einsum("bkgst,bskgh->btkh", probs, d_out)
    d_probs = jnp.einsum("bskgh,btkh->bkgst", d_out, values)
    row_BxKxGxS = jnp.einsum("bskgh,bskgh->bkgs", d_out, grouped(out_BxSxNxH))  # D = rowsum(dO * O)
    d_scores = probs * (d_probs - row_BxKxGxS[..., None]) / np.sqrt(h)
    d_q = jnp.einsum("bkgst,btkh->bskgh", d_scores, keys).reshape(b, s, n, h)
    d_keys = jnp.einsum("bkgst,bskgh->btkh", d_scores, q)
    return d_q, d_keys, d_values


def leading_positions(seq_len: int, ways: int, stop: int) -> list[tuple[int, int]]:
    """[(start, end)] ranges of an array in balanced_order(seq_len, ways) that, concatenated, hold the
    positions 0..stop-1 in order (the prefix-LM's keys): chunk b < ways is rank b's first half, chunk
    b >= ways rank 2 ways - 1 - b's second half. Static slices: no gather, no mask."""
    if not 0 <= stop <= seq_len:
        raise ValueError(f"positions 0..{stop - 1} are not all in a sequence of {seq_len}")
    chunk, ranges = seq_len // (2 * ways), []
    for b in range(-(-stop // chunk)):
        start = b * 2 * chunk if b < ways else (2 * ways - 1 - b) * 2 * chunk + chunk
        ranges.append((start, start + min(chunk, stop - b * chunk)))
    return ranges


def take_ranges(x_BxSx: jax.Array, ranges: list[tuple[int, int]]) -> jax.Array:
    """x's sequence slices [a, b) of `ranges`, concatenated along the sequence (static slices, no gather)."""
    return jnp.concatenate([x_BxSx[:, a:b] for a, b in ranges], axis=1)


def in_position_order(x_BxSx: jax.Array, ways: int, stop: int | None = None) -> jax.Array:
    """Positions 0..stop-1 (default: all) of a sequence held in balanced_order(S, ways), in position order."""
    seq = x_BxSx.shape[1]
    return take_ranges(x_BxSx, leading_positions(seq, ways, seq if stop is None else stop))
