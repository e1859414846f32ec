"""Context parallelism's attention, both strategies, as custom_vjps over the blocks of the balanced order:
`ring_attention` (cp_strategy=ring: K / V blocks travel the cp ring) and `gathered_attention`
(cp_strategy=all_gather: K / V gathered once, the same blocks sliced from them). Each block's attention is
computed by a block kernel (XLA's fp32 math or cuDNN's flash attention) and merged by log-sum-exp; the
backward runs over the blocks again, flash-attention style.

No mask, and no masked work (issue 48). The sequence lies in blockwise.balanced_order: of 2 w chunks of
c tokens, rank r holds chunk r (its early one, E) and chunk 2 w - 1 - r (its late one, L), ascending.
Against the block of rank j (chunks j and 2 w - 1 - j) its 2 c queries see:
- j = r, its own block: the causal triangle on the 2 c local tokens ([E, L] against [E, L], both in
  position order): one causal kernel;
- j < r: chunk j precedes E and L, chunk 2 w - 1 - j follows both: all 2 c queries against the first half
  of the block, no mask;
- j > r: both chunks lie between E and L: only L sees them, wholly: the last c queries against the whole
  block, no mask.
So a kernel gets cuDNN's causal mask type or none, never a bias and never an [S_local, T] buffer, and
every block costs c x 2 c query-key pairs (the diagonal at half of 2 c x 2 c): half the unmasked
attention's FLOPs, the causal ideal, on every rank alike (Megatron's / Transformer Engine's split of the
ring). Which of the two non-own cases a step is depends on the rank: a `lax.cond` with no collective
inside (safe on XLA:CPU too), whose branches cost the same. Both strategies visit the blocks in the
ring's order (own block first), so a GPU program holds 1 + 2 (cp - 1) forward kernel calls per layer
(each cond's two branches) of which cp run.

Why custom_vjps (docs/design.md, "Context parallelism"): differentiated by autodiff, the ring kept every
block's fp32 probabilities for the backward (9.3 GiB of temp per device for a 7B-shaped layer at
sequence 8192 on 8 GPUs, BENCHMARKS.md) and could not use cuDNN, whose backward ignores the gradient of
its softmax statistics. Here the forward keeps only q, k, v (for all_gather: the gathered ones, which a
remat policy may drop and gather again), the merged output and its log-sum-exp (named "attention_out" /
"attention_stats" for the remat policies, as cuDNN's own residuals are); the backward gives each block
the *merged* output and log-sum-exp, so each block's probabilities are its share of the whole softmax
and its gradients are exact without the statistics' gradient (FlashAttention-2's backward).

Backward ring: at step s a rank holds the K / V block of rank (r - s) and the running dK / dV of that same
block; it adds its queries' share and passes both on. After the last step one more send takes each
dK / dV home: cp sends of dK / dV, cp - 1 of K / V. The next block's K / V send is issued before this
block's kernels (a GPU overlaps them); on XLA:CPU every send is ordered after the one before
(jaxpar.layers.order). On every backend each block's backward kernel waits for the previous block's
gradients to be added (the running dq inside the kernel's branch; dK / dV through a dependency on the
small log-sum-exp), one step behind the sends: left free, XLA's GPU scheduler ran all of a layer's block
kernels first and kept every block's fp32 dq and dK until the adds at the end (llama7b at 131,072 tokens,
cp 8: 1.6 GiB of the ring's peak, 2.7 GiB of all_gather's; BENCHMARKS.md). The prefix-LM's bidirectional
prefix is not a block kind: jaxpar.layers.attention adds it beside these (the prefix's keys, no mask).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import blockwise, cudnn
from jaxpar.layers.order import after, after_on_every_backend, chain

OWN, EARLIER, LATER = 0, 1, 2  # a block's relation to this rank's (module docstring)
_NOTHING_SEEN = -1e30  # the log-sum-exp of a query that sees no key of a block: no weight in the merge


def _kernels(kernel: str):
    """(forward, backward) of one block for `kernel` ("xla" or "cudnn"): forward(q, k, v, causal) ->
    (output fp32, log-sum-exp [B, N, S] fp32); backward(q, k, v, causal, output, lse, d_output) -> (dq, dk,
    dv) with the merged output and log-sum-exp."""
    if kernel == "cudnn":
        return cudnn.cudnn_block_forward, cudnn.cudnn_block_backward
    return blockwise.block_attention, blockwise.block_attention_grads


def _pad(x, rows: int, axis: int, before: bool, fill=0.0):
    """x with `rows` rows of `fill` added before (or after) it along `axis`."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (rows, 0) if before else (0, rows)
    return jnp.pad(x, widths, constant_values=fill)


def relation(source, rank):
    """OWN, EARLIER or LATER: the block of rank `source` as seen from rank `rank` (traced if either is)."""
    if isinstance(source, int) and isinstance(rank, int):
        return OWN if source == rank else EARLIER if source < rank else LATER
    return jnp.where(source == rank, OWN, jnp.where(source < rank, EARLIER, LATER))


class _Blocks:
    """One rank's three kinds of block (module docstring) on one kernel, for `local` = 2 c tokens."""

    def __init__(self, kernel: str, local: int):
        if local % 2:
            raise ValueError(f"a context-parallel rank holds two equal chunks, not {local} tokens")
        self.forward_kernel, self.backward_kernel = _kernels(kernel)
        self.half = local // 2

    def forward(self, kind, q, k, v):
        """(output fp32 [B, 2c, N, H], log-sum-exp fp32 [B, N, 2c]) of this rank's queries against one block.
        `kind`: a relation(); traced, it is EARLIER or LATER (the own block is step 0's, static), a cond
        between the two, whose branches cost alike."""
        h = self.half

        def own(q, k, v):
            o, lse = self.forward_kernel(q, k, v, True)
            return o.astype(jnp.float32), lse

        def earlier(q, k, v):
            o, lse = self.forward_kernel(q, k[:, :h], v[:, :h], False)
            return o.astype(jnp.float32), lse

        def later(q, k, v):
            o, lse = self.forward_kernel(q[:, h:], k, v, False)
            return _pad(o.astype(jnp.float32), h, 1, True), _pad(lse, h, 2, True, _NOTHING_SEEN)

        if isinstance(kind, int):
            return (own, earlier, later)[kind](q, k, v)
        return jax.lax.cond(kind == EARLIER, earlier, later, q, k, v)

    def backward(self, kind, q, k, v, out, lse, d_out, dq):
        """(dq plus this block's share of it, dk, dv), fp32: the gradients of this rank's queries against one
        block, given the merged out and lse. The running dq is added inside the branch, so each block's dq
        is dead after its step (module docstring); the callers order dK / dV through `lse`."""
        h, grads = self.half, self.backward_kernel
        f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731

        def own(q, k, v, out, lse, d_out, dq):
            dq_b, dk, dv = f32(*grads(q, k, v, True, out, lse, d_out))
            return dq + dq_b, dk, dv

        def earlier(q, k, v, out, lse, d_out, dq):
            dq_b, dk, dv = f32(*grads(q, k[:, :h], v[:, :h], False, out, lse, d_out))
            return dq + dq_b, _pad(dk, h, 1, False), _pad(dv, h, 1, False)

        def later(q, k, v, out, lse, d_out, dq):
            dq_b, dk, dv = f32(*grads(q[:, h:], k, v, False, out[:, h:], lse[:, :, h:], d_out[:, h:]))
            return dq + _pad(dq_b, h, 1, True), dk, dv

        if isinstance(kind, int):
            return (own, earlier, later)[kind](q, k, v, out, lse, d_out, dq)
        return jax.lax.cond(kind == EARLIER, earlier, later, q, k, v, out, lse, d_out, dq)


def _merge(acc, block):
    return block if acc is None else blockwise.merge_blocks(*acc, *block)


# ----------------------------------------------------------------------------- ring

class _Ring:
    """The sends of one ring over `axis` (inside a shard_map)."""

    def __init__(self, axis: str):
        self.axis = axis
        self.ways, self.rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        self.pairs = [(i, (i + 1) % self.ways) for i in range(self.ways)]
        self.last = None  # the latest send's result: the next send waits for it (XLA:CPU)

    def kind(self, step: int):
        """The relation of the block held at `step`, rank (r - step)'s: OWN (static) at step 0."""
        return OWN if step == 0 else relation((self.rank - step) % self.ways, self.rank)

    def send(self, x):
        """x (an array or a tuple: K and V) to the next rank. jax sends a tuple leaf by leaf; on XLA:CPU each
        send waits for the one before, across steps too (jaxpar.layers.order.chain); on GPUs, where that is the
        identity, XLA's combiner makes the pair one collective-permute of two buffers."""
        out = chain(lambda a: jax.lax.ppermute(a, self.axis, self.pairs), x, start=self.last)
        self.last = jax.tree.leaves(out)[-1]
        return out


def _ring_forward(q, k, v, axis, kernel):
    ring, blocks = _Ring(axis), _Blocks(kernel, q.shape[1])
    # K and V travel as a pair (one collective-permute of two buffers on GPUs): as one array the GPU program
    # copied both out of every block it received (slices feed no kernel in place), all blocks' at once
    kv, merged = (k, v), None
    for step in range(ring.ways):
        following = ring.send(kv) if step < ring.ways - 1 else None  # issued before this block's kernel
        merged = _merge(merged, blocks.forward(ring.kind(step), q, *kv))
        kv = following
    out, lse = merged
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ring_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis: str, kernel: str):
    """This rank's causal attention output over the whole sequence held in balanced_order over `axis`,
    its queries at their own positions; K / V blocks passed around the ring."""
    return _ring_forward(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis, kernel)[0]


def _named_residuals(out, lse, q, k, v):
    """(out, the residuals of either strategy's backward): q, k, v, and the merged output and log-sum-exp,
    named for the remat policies as cuDNN's own residuals are."""
    out = checkpoint_name(out, "attention_out")
    return out, (q, k, v, out, checkpoint_name(lse, "attention_stats"))


def _ring_fwd(q, k, v, axis, kernel):
    return _named_residuals(*_ring_forward(q, k, v, axis, kernel), q, k, v)


def _ring_bwd(axis, kernel, residuals, d_out):
    q, k, v, out, lse = residuals
    ring, blocks = _Ring(axis), _Blocks(kernel, q.shape[1])
    kv = (k, v)
    dq, dkv = jnp.zeros(q.shape, jnp.float32), tuple(jnp.zeros(x.shape, jnp.float32) for x in kv)
    summed = None  # the previous block's dK / dV added to the travelling ones (before their send)
    for step in range(ring.ways):
        # after the last dK / dV send (the first: after d_out, i.e. the backward's collectives before it)
        following = ring.send(after(kv, dkv, d_out)) if step < ring.ways - 1 else None
        # after the previous block's dK / dV are added, one step behind the sends (module docstring)
        stats = lse if summed is None else after_on_every_backend(lse, summed)
        dq, dk_b, dv_b = blocks.backward(ring.kind(step), q, *kv, out, stats, d_out, dq)
        summed = (dkv[0] + dk_b, dkv[1] + dv_b)
        dkv = ring.send(summed if following is None else after(summed, following))  # on to the next rank; last: home
        kv = following
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- gathered K / V

def _block_of(x_all, ring: _Ring, step: int, local: int):
    """Rank (r - step)'s block of gathered K or V (rank-major): the block the ring holds at `step`."""
    return jax.lax.dynamic_slice_in_dim(x_all, ((ring.rank - step) % ring.ways) * local, local, axis=1)


def _gathered_forward(q, k_all, v_all, axis, kernel):
    ring, local = _Ring(axis), q.shape[1]
    blocks, merged = _Blocks(kernel, local), None
    for step in range(ring.ways):  # in the ring's order: the own block first, kinds as the ring's
        k, v = (_block_of(x, ring, step, local) for x in (k_all, v_all))
        merged = _merge(merged, blocks.forward(ring.kind(step), q, k, v))
    out, lse = merged
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gathered_attention(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, axis: str, kernel: str):
    """This rank's causal attention output over the whole sequence, its K / V gathered over `axis` (in
    balanced_order, rank-major), one block per rank in the order and kinds the ring sees them."""
    return _gathered_forward(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, axis, kernel)[0]


def _gathered_fwd(q, k_all, v_all, axis, kernel):
    return _named_residuals(*_gathered_forward(q, k_all, v_all, axis, kernel), q, k_all, v_all)


def _gathered_bwd(axis, kernel, residuals, d_out):
    q, k_all, v_all, out, lse = residuals
    ring, local = _Ring(axis), q.shape[1]
    blocks, dq = _Blocks(kernel, local), jnp.zeros(q.shape, jnp.float32)
    dk_all, dv_all = jnp.zeros_like(k_all), jnp.zeros_like(v_all)
    for step in range(ring.ways):  # each block once: its gradient written in place
        k, v = (_block_of(x, ring, step, local) for x in (k_all, v_all))
        stats = lse if step == 0 else after_on_every_backend(lse, (dk_all, dv_all))  # as the ring's (_ring_bwd)
        dq, dk, dv = blocks.backward(ring.kind(step), q, k, v, out, stats, d_out, dq)
        at = ((ring.rank - step) % ring.ways) * local
        dk_all = jax.lax.dynamic_update_slice_in_dim(dk_all, dk.astype(k_all.dtype), at, axis=1)
        dv_all = jax.lax.dynamic_update_slice_in_dim(dv_all, dv.astype(v_all.dtype), at, axis=1)
    return dq.astype(q.dtype), dk_all, dv_all


gathered_attention.defvjp(_gathered_fwd, _gathered_bwd)
