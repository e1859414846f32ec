"""The attention math context parallelism (issue 31) rests on, on one device: the balanced token order
over cp ranks, RoPE at each rank's own positions, and each rank's queries against the gathered keys
under a mask built from positions, which together give exactly the whole sequence's attention."""

import jax
import numpy as np
import pytest

from jaxpar.layers.attention import core_attention, prefix_lm_mask, rope
from jaxpar.layers.blockwise import block_attention, block_attention_grads, merge_blocks, positions_mask
from jaxpar.layers.collectives import balanced_order


def test_balanced_order_gives_each_rank_an_early_and_a_late_chunk():
    assert balanced_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    order = balanced_order(64, 4)
    assert sorted(order.tolist()) == list(range(64))
    causal = positions_mask(order, np.arange(64))[0, 0]  # query (in cp order) x key (in position order)
    work = causal.reshape(4, 16, 64).sum(axis=(1, 2))  # unmasked query-key pairs per rank
    assert np.asarray(work).tolist() == [int(work[0])] * 4  # contiguous chunks: 136, 392, 648, 904


def test_balanced_order_refuses_a_sequence_it_cannot_split():
    with pytest.raises(ValueError, match="24 tokens does not split into 2 x 8 equal chunks"):
        balanced_order(24, 8)


@pytest.mark.parametrize("ways,prefix_len", [(2, 0), (4, 0), (2, 5), (4, 11)])
def test_each_rank_against_the_gathered_keys_is_the_whole_attention(ways, prefix_len):
    batch, seq, heads, head_dim = 2, 32, 4, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (batch, seq, heads, head_dim)) for i in range(3))
    if prefix_len:
        whole = core_attention(q, k, v, "xla", mask=prefix_lm_mask(seq, prefix_len))
    else:
        whole = core_attention(q, k, v, "xla", is_causal=True)
    order = balanced_order(seq, ways)
    k_all, v_all, local = k[:, order], v[:, order], seq // ways
    out = np.zeros_like(whole)
    for rank in range(ways):
        mine = order[rank * local:(rank + 1) * local]
        mask = positions_mask(mine, order, prefix_len)
        out[:, mine] = core_attention(q[:, mine], k_all, v_all, "xla", mask=mask)
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)


def test_rope_at_a_ranks_positions_is_the_whole_sequences_rope_there():
    x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
    mine = balanced_order(32, 4)[8:16]  # rank 1 of 4: chunks 1 and 6
    np.testing.assert_allclose(rope(x[:, mine], 10000.0, positions_S=mine), rope(x, 10000.0)[:, mine], rtol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_blocks_merged_by_log_sum_exp_are_the_whole_attention(kv_heads):
    """Ring attention's arithmetic: the keys in cp order cut into blocks, each block's attention (one
    wholly masked for early queries) merged in ring order (own block first) is the whole attention."""
    batch, seq, heads, head_dim, ways = 2, 32, 4, 8, 4
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, head_dim)) for i in (1, 2))
    whole = core_attention(q, k, v, "xla", is_causal=True)
    order, local = balanced_order(seq, ways), seq // ways
    blocks = [order[r * local:(r + 1) * local] for r in range(ways)]
    for rank in range(ways):
        mine, out, lse = blocks[rank], None, None
        for step in range(ways):
            theirs = blocks[(rank - step) % ways]
            o, l = block_attention(q[:, mine], k[:, theirs], v[:, theirs], positions_mask(mine, theirs))
            out, lse = (o, l) if out is None else merge_blocks(out, lse, o, l)
        np.testing.assert_allclose(out, whole[:, mine], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads,prefix_len", [(4, 0), (2, 11)])
def test_block_gradients_with_the_merged_statistics_are_the_whole_attentions(kv_heads, prefix_len):
    """The ring's backward (jaxpar.layers.ring): each block's (dq, dk, dv) computed from the merged
    output and log-sum-exp, summed over the blocks, is the gradient of the whole attention, with no
    gradient of the statistics (what lets cuDNN's backward run per block)."""
    batch, seq, heads, head_dim, ways = 2, 32, 4, 8, 4
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, head_dim)) for i in (1, 2))
    d_out = jax.random.normal(jax.random.key(3), q.shape)
    mask = prefix_lm_mask(seq, prefix_len)  # (causal at 0)
    _, vjp = jax.vjp(lambda q, k, v: core_attention(q, k, v, "xla", mask=mask), q, k, v)
    expected = vjp(d_out)
    order, local = balanced_order(seq, ways), seq // ways
    blocks = [order[r * local:(r + 1) * local] for r in range(ways)]
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    for rank in range(ways):
        mine, out, lse = blocks[rank], None, None
        for step in range(ways):
            theirs = blocks[(rank - step) % ways]
            o, l = block_attention(q[:, mine], k[:, theirs], v[:, theirs], positions_mask(mine, theirs, prefix_len))
            out, lse = (o, l) if out is None else merge_blocks(out, lse, o, l)
        for theirs in blocks:
            dq, dk, dv = block_attention_grads(q[:, mine], k[:, theirs], v[:, theirs],
                                               positions_mask(mine, theirs, prefix_len), out, lse, d_out[:, mine])
            grads[0][:, mine] += dq
            grads[1][:, theirs] += dk
            grads[2][:, theirs] += dv
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
