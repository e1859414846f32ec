"""Ring attention (context parallelism's cp_strategy=ring) as one custom_vjp: K / V blocks travel the cp
ring, each block's attention is computed by a block kernel (XLA's fp32 math or cuDNN's flash attention)
and merged by log-sum-exp; the backward runs the ring again, flash-attention style.

Why a custom_vjp (docs/design.md, "Context parallelism"): differentiated by autodiff, the ring kept
every block's fp32 [B, N, S, S / cp] probabilities for the backward (9.3 GiB of temp per device for a
7B-shaped layer at sequence 8192 on 8 GPUs, BENCHMARKS.md) and could not use cuDNN, whose backward
ignores the gradient of its softmax statistics. Here the forward keeps only this rank's q, k, v, the
merged output and its log-sum-exp (named "attention_out" / "attention_stats" for the remat policies,
as cuDNN's own residuals are); the backward gives each block the *merged* output and log-sum-exp, so
each block's probabilities are its share of the whole softmax (exp(s - lse)) and each block's
gradients are exact without the statistics' gradient (FlashAttention-2's backward, the one the
Megatron / TransformerEngine ring uses).

Backward ring: at step s a rank holds the K / V block of rank (r - s) and the running dK / dV of that
same block; it adds its queries' share and passes both on. After the last step one more send takes
each dK / dV home: cp sends of dK / dV, cp - 1 of K / V. The next block's K / V send is issued before
this block's kernels (a GPU overlaps them); on XLA:CPU every send is ordered after the one before
(jaxpar.layers.order). Kernels take the mask of a block as positions (jaxpar.layers.blockwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import blockwise, cudnn
from jaxpar.layers.order import after


def _kernels(kernel: str):
    """(forward, backward) of one block for `kernel` ("xla" or "cudnn"): forward(q, k, v, mask) ->
    (output fp32, log-sum-exp [B, N, S] fp32); backward(q, k, v, mask, output, lse, d_output) -> (dq, dk,
    dv) with the merged output and log-sum-exp."""
    if kernel == "cudnn":
        return cudnn.cudnn_block_forward, cudnn.cudnn_block_backward
    return blockwise.block_attention, blockwise.block_attention_grads


class _Ring:
    """The positions and sends of one ring over `axis` (inside a shard_map), for S local tokens."""

    def __init__(self, axis: str, local: int, prefix_len: int):
        self.axis, self.local, self.prefix_len = axis, local, prefix_len
        self.ways, self.rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        self.order = jnp.asarray(blockwise.balanced_order(local * self.ways, self.ways))
        self.q_positions = self.positions_of(self.rank)
        self.pairs = [(i, (i + 1) % self.ways) for i in range(self.ways)]

    def positions_of(self, source):
        return jax.lax.dynamic_slice_in_dim(self.order, source * self.local, self.local)

    def mask(self, step: int):
        """The mask of this rank's queries against the block it holds at `step` (rank r - step's)."""
        source = (self.rank - step) % self.ways
        return blockwise.positions_mask(self.q_positions, self.positions_of(source), self.prefix_len)

    def send(self, x):
        return jax.lax.ppermute(x, self.axis, self.pairs)


def _forward(q, k, v, axis, prefix_len, kernel):
    ring, (block_forward, _) = _Ring(axis, k.shape[1], prefix_len), _kernels(kernel)
    kv, out, lse = jnp.concatenate([k, v], axis=-1), None, None
    for step in range(ring.ways):
        following = ring.send(kv) if step < ring.ways - 1 else None  # issued before this block's kernel
        k_blk, v_blk = jnp.split(kv, 2, axis=-1)
        o, l = block_forward(q, k_blk, v_blk, ring.mask(step))
        out, lse = (o, l) if out is None else blockwise.merge_blocks(out, lse, o, l)
        kv = following
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis: str, prefix_len: int, kernel: str):
    """This rank's attention output over the whole sequence held in balanced_order over `axis`, its
    queries at their own positions, causal (with the prefix-LM mask for `prefix_len` > 0)."""
    return _forward(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis, prefix_len, kernel)[0]


def _ring_fwd(q, k, v, axis, prefix_len, kernel):
    out, lse = _forward(q, k, v, axis, prefix_len, kernel)
    out = checkpoint_name(out, "attention_out")
    return out, (q, k, v, out, checkpoint_name(lse, "attention_stats"))


def _ring_bwd(axis, prefix_len, kernel, residuals, d_out):
    q, k, v, out, lse = residuals
    ring, (_, block_backward) = _Ring(axis, k.shape[1], prefix_len), _kernels(kernel)
    kv = jnp.concatenate([k, v], axis=-1)
    dq, dkv = jnp.zeros(q.shape, jnp.float32), jnp.zeros(kv.shape, jnp.float32)
    for step in range(ring.ways):
        # after the last dK / dV send (the first: after d_out, i.e. the backward's collectives before it)
        following = ring.send(after(kv, dkv, d_out)) if step < ring.ways - 1 else None
        k_blk, v_blk = jnp.split(kv, 2, axis=-1)
        dq_b, dk_b, dv_b = block_backward(q, k_blk, v_blk, ring.mask(step), out, lse, d_out)
        dq = dq + dq_b.astype(jnp.float32)
        dkv = dkv + jnp.concatenate([dk_b, dv_b], axis=-1).astype(jnp.float32)
        dkv = ring.send(dkv if following is None else after(dkv, following))  # on to the block's next rank; last: home
        kv = following
    dk, dv = jnp.split(dkv, 2, axis=-1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


ring_attention.defvjp(_ring_fwd, _ring_bwd)
