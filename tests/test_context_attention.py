"""The attention math context parallelism (issues 31, 48) rests on, on one device: the balanced token order
over cp ranks, RoPE at each rank's own positions, every block of it causal, whole or skipped as the
positions' mask says, the prefix-LM's prefix rows apart, and the blocks merged (and differentiated) by
log-sum-exp, which together give exactly the whole sequence's attention."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.layers.attention import core_attention, prefix_lm_mask, rope
from jaxpar.layers import blockwise, ring
from jaxpar.layers.blockwise import merge_blocks, positions_mask
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


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_every_block_is_causal_whole_or_skipped_as_the_positions_say(ways):
    """jaxpar.layers.ring's three kinds, against the mask the positions give: rank r's queries against rank
    j's keys are the causal triangle (j = r), the block's first half for every query (j < r), or the whole
    block for the late half of the queries (j > r); whatever else a block holds is masked."""
    seq, local = 16 * ways, 16
    order = balanced_order(seq, ways)
    triangle = np.tril(np.ones((local, local), bool))
    first_half = np.zeros((local, local), bool)
    first_half[:, :local // 2] = True
    late_rows = np.zeros((local, local), bool)
    late_rows[local // 2:] = True
    for r in range(ways):
        for j in range(ways):
            mask = np.asarray(positions_mask(order[r * local:(r + 1) * local], order[j * local:(j + 1) * local]))
            kind = ring.relation(j, r)
            expected = {ring.OWN: triangle, ring.EARLIER: first_half, ring.LATER: late_rows}[kind]
            np.testing.assert_array_equal(mask[0, 0], expected, err_msg=f"rank {r}, block {j}, kind {kind}")


def test_leading_positions_are_the_prefix_in_order():
    order = balanced_order(64, 4)
    for stop in (1, 8, 13, 32, 45, 64):
        picked = np.concatenate([order[a:b] for a, b in blockwise.leading_positions(64, 4, stop)])
        assert picked.tolist() == list(range(stop))


@pytest.mark.parametrize("prefix_len", [5, 11, 32])
def test_a_prefix_query_is_the_unmasked_attention_of_the_prefix(prefix_len):
    """The prefix-LM under cp (jaxpar.layers.attention.context_attention): rows inside the prefix are one
    unmasked attention against the prefix's keys, rows after it the causal attention."""
    batch, seq, heads, head_dim = 2, 32, 4, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (batch, seq, heads, head_dim)) for i in range(3))
    whole = core_attention(q, k, v, "xla", mask=prefix_lm_mask(seq, prefix_len))
    causal = core_attention(q, k, v, "xla", is_causal=True)
    prefix = core_attention(q, k[:, :prefix_len], v[:, :prefix_len], "xla")
    rows = (np.arange(seq) < prefix_len)[None, :, None, None]
    np.testing.assert_allclose(np.where(rows, prefix, causal), whole, rtol=1e-5, atol=1e-6)


def test_rope_at_a_ranks_positions_is_the_whole_sequences_rope_there():
    x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
    mine = balanced_order(32, 4)[8:16]  # rank 1 of 4: chunks 1 and 6
    np.testing.assert_allclose(rope(x[:, mine], 10000.0, positions_S=mine), rope(x, 10000.0)[:, mine], rtol=1e-6)


def rank_blocks(q, k, v, ways):
    """Per rank: (its positions, [(kind, the positions of rank j's block)] in ring order)."""
    order, local = balanced_order(q.shape[1], ways), q.shape[1] // ways
    blocks = [order[r * local:(r + 1) * local] for r in range(ways)]
    return [(blocks[r], [(ring.relation((r - s) % ways, r), blocks[(r - s) % ways]) for s in range(ways)])
            for r in range(ways)]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_blocks_merged_by_log_sum_exp_are_the_whole_attention(kv_heads):
    """Ring attention's arithmetic: the keys in cp order cut into blocks, each block's attention by its kind
    (causal own block, a half block, or the late queries only) merged in ring order is the whole attention."""
    batch, seq, heads, head_dim, ways = 2, 32, 4, 8, 4
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, head_dim)) for i in (1, 2))
    whole = core_attention(q, k, v, "xla", is_causal=True)
    blocks = ring._Blocks("xla", seq // ways)
    for mine, sources in rank_blocks(q, k, v, ways):
        out, lse = None, None
        for kind, theirs in sources:
            o, l = blocks.forward(kind, q[:, mine], k[:, theirs], v[:, theirs])
            out, lse = (o, l) if out is None else merge_blocks(out, lse, o, l)
        np.testing.assert_allclose(out, whole[:, mine], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_gradients_with_the_merged_statistics_are_the_whole_attentions(kv_heads):
    """The ring's backward (jaxpar.layers.ring): each block's (dq, dk, dv) computed from the merged
    output and log-sum-exp, summed over the blocks, is the gradient of the whole attention, with no
    gradient of the statistics (what lets cuDNN's backward run per block)."""
    batch, seq, heads, head_dim, ways = 2, 32, 4, 8, 4
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, head_dim)) for i in (1, 2))
    d_out = jax.random.normal(jax.random.key(3), q.shape)
    _, vjp = jax.vjp(lambda q, k, v: core_attention(q, k, v, "xla", is_causal=True), q, k, v)
    expected = vjp(d_out)
    blocks = ring._Blocks("xla", seq // ways)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    for mine, sources in rank_blocks(q, k, v, ways):
        out, lse = None, None
        for kind, theirs in sources:
            o, l = blocks.forward(kind, q[:, mine], k[:, theirs], v[:, theirs])
            out, lse = (o, l) if out is None else merge_blocks(out, lse, o, l)
        dq = jnp.zeros(q[:, mine].shape, jnp.float32)  # the running dq: each block adds its share
        for kind, theirs in sources:
            dq, dk, dv = blocks.backward(kind, q[:, mine], k[:, theirs], v[:, theirs], out, lse, d_out[:, mine], dq)
            grads[1][:, theirs] += dk
            grads[2][:, theirs] += dv
        grads[0][:, mine] = dq
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- on a cp mesh

def cp_attention(strategy: str, ways: int, prefix_len: int):
    """f(q, k, v) with q, k, v [B, S, ., H] in position order: each cp rank takes its balanced chunks and
    runs jaxpar.layers.attention.context_attention over a cp mesh of `ways` emulated devices; the output
    comes back in position order."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxpar.layers.attention import context_attention
    from jaxpar.layers.collectives import Collectives

    mesh = Mesh(np.array(jax.devices()[:ways]), ("cp",))
    coll = Collectives(context_axis="cp", context_strategy=strategy)

    def local(q, k, v):
        positions = coll.context_positions(q.shape[1])
        return context_attention(q, k, v, positions, coll, prefix_len, "xla")

    spec = P(None, "cp")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def attend(q, k, v):
        order = balanced_order(q.shape[1], ways)
        return sharded(q[:, order], k[:, order], v[:, order])[:, np.argsort(order)]
    return jax.jit(attend)


@pytest.mark.parametrize("strategy,ways,prefix_len,kv_heads", [
    ("ring", 4, 0, 2), ("all_gather", 4, 0, 4), ("ring", 2, 10, 4),
    ("ring", 4, 40, 2), ("all_gather", 4, 13, 2), ("all_gather", 2, 0, 1),
    ("ulysses", 4, 0, 4), ("ulysses", 2, 13, 2), ("ulysses", 4, 0, 2), ("ulysses", 4, 40, 1)])  # (KV heads repeated)
def test_context_attention_over_cp_is_the_whole_attention_and_its_gradients(strategy, ways, prefix_len, kv_heads):
    batch, seq, heads, head_dim = 2, 48, 4, 8
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim))
    k, v = (jax.random.normal(jax.random.key(i), (batch, seq, kv_heads, head_dim)) for i in (1, 2))
    d_out = jax.random.normal(jax.random.key(3), q.shape)
    mask = prefix_lm_mask(seq, prefix_len) if prefix_len else None
    whole, whole_vjp = jax.vjp(lambda q, k, v: core_attention(q, k, v, "xla", mask=mask, is_causal=mask is None),
                               q, k, v)
    out, vjp = jax.vjp(cp_attention(strategy, ways, prefix_len), q, k, v)
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)
    for got, want in zip(vjp(d_out), whole_vjp(d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_no_buffer_of_local_queries_by_the_whole_sequence(strategy):
    """No [S_local, T] mask or scores anywhere in the compiled step (forward and backward): each block is
    c x 2 c (a causal diagonal block 2 c x 2 c), never 2 c x S. Sizes chosen so no other dim is 12 or 48."""
    ways, batch, seq, heads, head_dim = 4, 2, 48, 5, 8
    local = seq // ways
    shape = (batch, seq, heads, head_dim)
    step = cp_attention(strategy, ways, 0)
    loss = jax.jit(jax.grad(lambda q, k, v: step(q, k, v).sum(), argnums=(0, 1, 2)))
    args = [jax.ShapeDtypeStruct(shape, np.float32)] * 3
    text = loss.lower(*args).compile().as_text()
    dims = [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]+)\]", text)]
    assert any(local in d for d in dims)  # the test sees the blocks' shapes
    both = [d for d in dims if local in d and seq in d]
    assert not both, f"buffers of {local} local tokens by the {seq} of the sequence: {sorted(set(both))[:5]}"
