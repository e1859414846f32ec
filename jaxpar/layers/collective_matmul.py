"""Collective matmul: sequence parallelism's all-gather and reduce-scatter decomposed around the GEMMs they
feed, so the tensor-parallel communication runs under them (issue 46 item 5; docs/design.md
"Tensor-parallel overlap").

Why by hand: under sequence parallelism each tensor-parallel block all-gathers its input along S before
the column-parallel linears (attention's q / k / v, the MLP's gate / up) and reduce-scatters the
row-parallel linear's output (attention's wo, the MLP's down) back to sequence shards. jaxpar writes those
collectives itself inside `jax.shard_map`, so XLA's SPMD windowed einsum (`xla_gpu_threshold_for_windowed_einsum_mib`,
`xla_gpu_multi_streamed_windowed_einsum`), which rewrites dots the partitioner places, never sees them: with
both flags the GPU-compiled llama7b tp 8 + SP step is the same program (same collectives, same schedule).
In XLA's schedule the gather must finish before the first GEMM starts and the reduce-scatter cannot start
before the last ends: 0.11 s of exposed tp communication per step on 8 x H100 (BENCHMARKS.md).

The rings (n = tp ranks, each holding sequence chunk r of length S/n; everything unrolled, n static):
- `all_gather_linears` (column linears): n steps; at step k rank r holds chunk (r + k) mod n and computes
  every linear's output for it while the chunk travels on to rank r - 1 (collective-permute j -> j - 1,
  n - 1 of them: each rank receives from the next one). The outputs land in place in whole-sequence
  buffers. The weights of one block share the ring (q, k and v read the same chunks).
- `linear_reduce_scatter` (row linear): n steps; at step k rank r computes the partial product of chunk
  (r - 1 - k) mod n, adds it to the running sum received from rank r - 1 and sends it on to rank r + 1
  (j -> j + 1); after n steps the sum that reaches rank r is its own chunk's, summed over all ranks.
Each step's GEMM depends only on the chunk already present, so each collective-permute can run under the
GEMM beside it; optimization barriers (`_together`) make XLA's latency-hiding scheduler do so (left alone it
ran the sends back to back, docs/design.md "Tensor-parallel overlap"). The backward (a custom_vjp each) is
the other ring: the column linears' input gradient is reduce-scattered by the ring accumulating as it goes
(each chunk's dX GEMMs under the previous send), the row linear's output gradient all-gathered by the ring
feeding each chunk's dX GEMM; the weight gradients are one GEMM each on the whole gathered input / output
gradient (fp32 accumulation, as one GEMM over the sequence does). Bytes moved equal the collectives'
((n - 1) / n of the buffer per ring); on XLA:CPU every permute is ordered by data (each takes the previous
one's result, or the running sum built from it), so the emulated mesh keeps one collective order. Not under
remat with `on` forced on XLA:CPU (`auto` leaves the rings off there): a ring re-run by the backward's
recompute is not ordered against the backward's own rings (dp 1 x tp 4 + SP: 27 unordered permute pairs
under full remat, 87 under selective; fp8's scalar all-reduce joins them; found 2026-12-06, not fixed, and
tests/test_collective_order.py has no such layout).

Memory: the forward never holds the row linear's whole [B, S, D] partial product (one chunk and the running
sum), and each ring keeps for its backward what the plain path would (row: its input; column: the gathered
input, `keep_gathered`). The plain path's residual depends on the layer's remat policy: without ZeRO-3 it
keeps the all-gather's output, but ZeRO-3's policy never keeps an all-gather's output
(jaxpar.parallel.zero.never_keep_gathered), so it keeps the sequence shard and gathers again in the backward.
The column ring first always kept the input it had assembled, which no policy can drop as an all-gather: on
llama7b dp 16 x tp 4 ZeRO-3, remat none, 2 x [4, 4096, 4096] per layer instead of 2 x [4, 1024, 4096], peak
39.63 -> 46.57 GiB (BENCHMARKS.md). Under ZeRO-3 (Collectives.keeps_gathered_inputs) it now keeps the shard
and all-gathers it again in the backward for the weight gradients, as the plain path does: 46.57 -> 39.33
GiB; selective 17.93 -> 15.95 against the plain path's 16.76 (on XLA:CPU the all-gather follows the
input-gradient ring, and what is downstream of that gradient follows it: order.after). Remat recomputes the
gathered input by running the ring again.
Cost: each GEMM is cut into n along S (S/n rows each: 4096 rows for llama7b's 8 x 4096 tokens over tp 8)
and each output chunk is copied into its buffer (a memory-bound update of the output's bytes).

When auto runs the rings (Collectives.matmul_rings, _ring_pays): on GPU programs, for chunks of at least
AUTO_MIN_CHUNK_TOKENS, and only where the layers run no dp collectives of their own (Collectives.taps_weights:
ZeRO-3's weight gathers and gradient scatters, ZeRO-1/2's and DDP's per-layer gradient reductions). XLA's GPU
schedule keeps one collective in flight (in both compiled llama7b dp 16 x tp 4 programs no two overlap), and
the rings hold it across most of the blocks' GEMMs (a permute in flight under 50 of the 72 GEMMs of the
compiled backward loop's body), the compute that hid ZeRO-3's per-layer dp traffic. llama7b dp 16 x tp 4 ZeRO-3
on 64 A100s (dp across nodes): the rings hide 0.044 s of tp exposure but expose 0.083 s more dp gathers /
scatters and add 0.042 s of compute (cut GEMMs, copies): 2.082 -> 2.164 s. dp 4 x tp 2 ZeRO-3 on 8 H100s (dp
inside the node): 0.477 -> 0.485 s (compute +0.014 s, exposure -0.006 s). llama7b tp 8 + SP, no dp: 0.691 ->
0.613 s. Collectives does not know which links dp crosses, so the rule is per-layer dp collectives, not nodes.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxpar.layers import fp8, order
from jaxpar.layers.fp8 import transposed_equations
from jaxpar.layers.vma import typed_like


# mesh.collective_matmul=auto runs the rings where a chunk holds at least this many tokens (batch x S / tp on
# one rank). Not fitted: it lies between the two GPU-compiled data points (BENCHMARKS.md "Tensor-parallel
# overlap"): llama7b tp 8 + SP, 4096 tokens per chunk, gains 0.078 s of a 0.691 s step; vla70b, 296 tokens
# per chunk (8 sequences of 296 over tp 8), loses 0.014 s of 1.243 (exposure -0.075 s, but GEMMs cut into
# 37-token slices and their copies and launches +0.089 s).
AUTO_MIN_CHUNK_TOKENS = 1024


def _ring(axes: tuple[str, ...]) -> tuple[int, jax.Array]:
    size = 1
    for axis in axes:
        size *= jax.lax.axis_size(axis)
    return size, jax.lax.axis_index(axes)


def _send(x: jax.Array, axes: tuple[str, ...], shift: int) -> jax.Array:
    """x to rank (r + shift) mod n of the ring over `axes`."""
    n = jax.lax.axis_size(axes)
    return jax.lax.ppermute(x, axes[0] if len(axes) == 1 else axes, [(j, (j + shift) % n) for j in range(n)])


def _together(*values):
    """`values`, each available only once all are computed: an optimization barrier (no copy, no arithmetic).
    XLA's scheduler otherwise ran a ring's sends back to back ahead of the GEMMs they should hide under
    (each one synchronous), and cuBLAS took the running sum's add into the GEMM as its C operand, so each
    GEMM waited for the send. Every output must be used: XLA drops a barrier's unused operands."""
    return jax.lax.optimization_barrier(values)


def _assemble(pieces: list[jax.Array], starts: list[jax.Array]) -> jax.Array:
    """The whole sequence (dim 1) from its chunks, each written in place at its start."""
    first = pieces[0]
    whole = jnp.zeros(first.shape[:1] + (first.shape[1] * len(pieces),) + first.shape[2:], first.dtype)
    for piece, start in zip(pieces, starts):
        whole = jax.lax.dynamic_update_slice_in_dim(whole, piece, start, axis=1)
    return whole


def _gather_ring(x: jax.Array, axes: tuple[str, ...], products) -> tuple[list, list, list]:
    """The all-gather ring: at step k this rank holds chunk (r + k) mod n, starts sending it to rank r - 1
    and computes `products(chunk)` (a list of arrays) under the send; the next send waits for them.
    Returns the chunks' starts along S, the chunks and each step's products."""
    n, rank = _ring(axes)
    starts, chunks, made = [], [], []
    current = x
    for k in range(n):
        starts.append(((rank + k) % n) * x.shape[1])
        chunks.append(current)
        if k == n - 1:
            made.append(products(current))
            break
        following = _send(current, axes, -1)
        following, step_made = _together(following, products(current))
        made.append(step_made)
        current = following
    return starts, chunks, made


def _scatter_ring(operands: list[jax.Array], partial, axes: tuple[str, ...]) -> jax.Array:
    """The reduce-scatter ring: at step k this rank computes `partial(chunks)` (`chunks`: each [B, S, ...]
    operand sliced at chunk (r - 1 - k) mod n, taken only once the running sum is computed) under the send
    of the running sum to rank r + 1, then adds it to the sum received from rank r - 1; the last sum is
    this rank's own chunk's."""
    n, rank = _ring(axes)
    size = operands[0].shape[1] // n
    total = None
    for k in range(n):
        start = ((rank + n - 1 - k) % n) * size  # (r - 1 - k) mod n, kept >= 0
        chunks = [jax.lax.dynamic_slice_in_dim(a, start, size, axis=1) for a in operands]
        if total is None:
            total = partial(chunks)
            continue
        chunks, total = _together(chunks, total)
        sent = _send(total, axes, +1)
        sent, part = _together(sent, partial(chunks))
        total = sent + part
    return total


# ----------------------------------------------------------------------------- column: gather, then GEMMs
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _column(equations: tuple[str, ...], axes: tuple[str, ...], keep_gathered: bool, x: jax.Array,
            *weights: jax.Array):
    return _column_fwd(equations, axes, keep_gathered, x, *weights)[0]


def _column_fwd(equations, axes, keep_gathered, x, *weights):
    starts, chunks, made = _gather_ring(x, axes, lambda c: [jnp.einsum(e, c, w) for e, w in zip(equations, weights)])
    outs = tuple(_assemble([m[i] for m in made], starts) for i in range(len(equations)))
    return outs, (_assemble(chunks, starts) if keep_gathered else x, weights)


def _column_bwd(equations, axes, keep_gathered, residuals, d_outs):
    """The input gradient by the reduce-scatter ring (each chunk's dX GEMMs under the previous send); the
    weight gradients as one GEMM each (fp32 accumulation) on the gathered input kept from the forward, or,
    where only the shard was kept (`keep_gathered` False), on the shard all-gathered again."""
    x_kept, weights = residuals
    grads = [transposed_equations(e) for e in equations]

    def partial(chunks):
        parts = [jnp.einsum(dx_eq, d, w) for (dx_eq, _), d, w in zip(grads, chunks, weights)]
        return functools.reduce(jnp.add, parts)

    d_x = _scatter_ring(list(d_outs), partial, axes)
    if not keep_gathered:  # gathered again, as the plain path does: one all-gather, after the ring
        x_kept, d_x = _together(order.after(x_kept, d_x), d_x)
        x_kept = jax.lax.all_gather(x_kept, axes[0] if len(axes) == 1 else axes, axis=1, tiled=True)
        d_x = order.after(d_x, x_kept)  # XLA:CPU: the collectives downstream of d_x wait for it (one order)
    d_weights = [jnp.einsum(dw_eq, x_kept, d, preferred_element_type=jnp.float32)
                 for (_, dw_eq), d in zip(grads, d_outs)]
    return (d_x, *(d.astype(w.dtype) for d, w in zip(d_weights, weights)))


_column.defvjp(_column_fwd, _column_bwd)


# ----------------------------------------------------------------------------- row: GEMMs, then scatter
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _row(equation: str, axes: tuple[str, ...], x: jax.Array, w: jax.Array) -> jax.Array:
    return _scatter_ring([x], lambda chunks: jnp.einsum(equation, chunks[0], w), axes)


def _row_fwd(equation, axes, x, w):
    return _row(equation, axes, x, w), (x, w)


def _row_bwd(equation, axes, residuals, d_out):
    """The output gradient all-gathered by the ring, each chunk's dX GEMM under the next send; the weight
    gradient as one GEMM on the gathered output gradient (fp32 accumulation)."""
    x, w = residuals
    dx_eq, dw_eq = transposed_equations(equation)
    starts, chunks, made = _gather_ring(d_out, axes, lambda c: [jnp.einsum(dx_eq, c, w)])
    d_x = _assemble([m[0] for m in made], starts)
    d_w = jnp.einsum(dw_eq, x, _assemble(chunks, starts), preferred_element_type=jnp.float32).astype(w.dtype)
    return d_x, d_w


_row.defvjp(_row_fwd, _row_bwd)


# ----------------------------------------------------------------------------- the rings under precision=fp8
# The same rings with each GEMM an FP8 one (jaxpar.layers.fp8, docs/design.md "FP8 GEMMs"), each operand scaled as
# the plain path scales it, so the rings give its FP8 values: the column ring's input by the whole gathered
# input's scale (the max of the shards' amaxes, one scalar all-reduce before the ring under current scaling;
# delayed scaling's counters need none), its output gradients by their own (each rank's are whole); the row ring's
# input by its own and its output gradient by the whole gathered gradient's. The chunks travel in bf16 and are
# cast on arrival. `weights` are (array, (bits, scale) or None, counters or None) triples (Collectives.matmul's
# fp8.Quantized and fp8.Scaled taken apart); with counters, their cotangent is the one-hot rows of what this rank's
# shards saw, which the counters' sum over tp makes the whole tensor's (jaxpar.parallel.fp8_counters).
def _ring_max(amax: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.pmax(amax, axes[0] if len(axes) == 1 else axes)


def _operand_scales(lives_rows: list, local_max, axes, dtype, calibrating: bool, whole: bool) -> list:
    """The scale of an operand whose amax on this rank is `local_max`, for each of its uses' counters rows
    (None: current scaling; calibrating: the operand's own amax): over the ring's ranks (one all-reduce) when the
    operand is the whole gathered tensor."""
    own = [lives is None or calibrating for lives in lives_rows]
    amax = _ring_max(local_max, axes) if whole and any(own) else local_max
    return [fp8.scale_for(amax, dtype) if lives is None else fp8.delayed_scale(lives, amax, dtype, calibrating)
            for lives in lives_rows]


def _lives_cotangent(lives, x_max, d_max):
    if lives is None:
        return None
    return typed_like(jnp.stack([fp8.seen(x_max, fp8.FORWARD, lives.dtype),
                                 fp8.seen(d_max, fp8.BACKWARD, lives.dtype)]), lives)


def _weight_bits(w, quantized):
    return fp8.quantize(w, fp8.FORWARD) if quantized is None else (
        jax.lax.bitcast_convert_type(quantized[0], fp8.FORWARD), quantized[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _column_fp8(equations, axes, keep_gathered, calibrating, x, weights):
    return _column_fp8_fwd(equations, axes, keep_gathered, calibrating, x, weights)[0]


def _column_fp8_fwd(equations, axes, keep_gathered, calibrating, x, weights):
    x_max = fp8.amax(x)
    scales = _operand_scales([None if lives is None else lives[0] for _, _, lives in weights], x_max, axes,
                             fp8.FORWARD, calibrating, True)
    x = order.after(x, scales)  # XLA:CPU: the ring's sends after the amaxes' all-reduce
    quantized = [_weight_bits(w, q) for w, q, _ in weights]

    def product(equation, chunk, sx, qw, sw):
        # each linear its own FP8 chunk (a barrier with its weight's scale): XLA's dot merger otherwise joins the
        # GEMMs of one operand (q, k, v) into one bf16 GEMM on the weights concatenated, which is no FP8 GEMM
        # (llama7b tp 8: 16 of each layer's 24 forward chunk GEMMs). (With the weight's bits in the barrier, each
        # chunk's GEMM transposed them again: 0.5335 s against 0.5261.)
        q_chunk, sw = _together(fp8.cast(chunk, sx, fp8.FORWARD), sw)
        return fp8.scaled_dot(equation, q_chunk, qw, sx * sw, chunk.dtype)

    def products(chunk):
        return [product(e, chunk, sx, qw, sw) for e, sx, (qw, sw) in zip(equations, scales, quantized)]

    starts, chunks, made = _gather_ring(x, axes, products)
    outs = tuple(_assemble([m[i] for m in made], starts) for i in range(len(equations)))
    return outs, (_assemble(chunks, starts) if keep_gathered else x, x_max, scales, weights)


def _column_fp8_bwd(equations, axes, keep_gathered, calibrating, residuals, d_outs):
    x_kept, x_max, scales, weights = residuals
    grads = [transposed_equations(e) for e in equations]
    quantized = [_weight_bits(w, q) for w, q, _ in weights]
    d_maxes = [fp8.amax(d) for d in d_outs]
    d_scales = [_operand_scales([None if lives is None else lives[1]], d_max, axes, fp8.BACKWARD, calibrating, False)[0]
                for (_, _, lives), d_max in zip(weights, d_maxes)]
    q_outs = [fp8.cast(d, sd, fp8.BACKWARD) for d, sd in zip(d_outs, d_scales)]

    def partial(chunks):
        parts = [fp8.scaled_dot(dx_eq, d, qw, sd * sw, x_kept.dtype)
                 for (dx_eq, _), d, (qw, sw), sd in zip(grads, chunks, quantized, d_scales)]
        return functools.reduce(jnp.add, parts)

    d_x = _scatter_ring(q_outs, partial, axes)
    if not keep_gathered:  # gathered again, as the plain path does: one all-gather, after the ring
        x_kept, d_x = _together(order.after(x_kept, d_x), d_x)
        x_kept = jax.lax.all_gather(x_kept, axes[0] if len(axes) == 1 else axes, axis=1, tiled=True)
        d_x = order.after(d_x, x_kept)
    d_weights = [fp8.scaled_dot(dw_eq, fp8.cast(x_kept, sx, fp8.FORWARD), qd, sx * sd, w.dtype)
                 for (_, dw_eq), qd, sx, sd, (w, _, _) in zip(grads, q_outs, scales, d_scales, weights)]
    cotangents = tuple((d_w, None, _lives_cotangent(lives, x_max, d_max))
                       for d_w, (_, _, lives), d_max in zip(d_weights, weights, d_maxes))
    return d_x, cotangents


_column_fp8.defvjp(_column_fp8_fwd, _column_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _row_fp8(equation, axes, calibrating, x, weight):
    return _row_fp8_fwd(equation, axes, calibrating, x, weight)[0]


def _row_fp8_fwd(equation, axes, calibrating, x, weight):
    w, q, lives = weight
    x_max = fp8.amax(x)
    (sx,) = _operand_scales([None if lives is None else lives[0]], x_max, axes, fp8.FORWARD, calibrating, False)
    qw, sw = _weight_bits(w, q)
    qx = fp8.cast(x, sx, fp8.FORWARD)
    out = _scatter_ring([qx], lambda chunks: fp8.scaled_dot(equation, chunks[0], qw, sx * sw, x.dtype), axes)
    return out, (jax.lax.bitcast_convert_type(qx, jnp.uint8), x_max, sx, weight)


def _row_fp8_bwd(equation, axes, calibrating, residuals, d_out):
    qx_bits, x_max, sx, (w, q, lives) = residuals
    qx, (qw, sw) = jax.lax.bitcast_convert_type(qx_bits, fp8.FORWARD), _weight_bits(w, q)
    dx_eq, dw_eq = transposed_equations(equation)
    d_max = fp8.amax(d_out)
    (sd,) = _operand_scales([None if lives is None else lives[1]], d_max, axes, fp8.BACKWARD, calibrating, True)
    d_out = order.after(d_out, sd)  # XLA:CPU: the ring's sends after the amaxes' all-reduce
    starts, chunks, made = _gather_ring(
        d_out, axes, lambda c: [fp8.scaled_dot(dx_eq, fp8.cast(c, sd, fp8.BACKWARD), qw, sd * sw, d_out.dtype)])
    d_x = _assemble([m[0] for m in made], starts)
    d_whole = fp8.cast(_assemble(chunks, starts), sd, fp8.BACKWARD)
    d_w = fp8.scaled_dot(dw_eq, qx, d_whole, sx * sd, w.dtype)
    return d_x, (d_w, None, _lives_cotangent(lives, x_max, d_max))


_row_fp8.defvjp(_row_fp8_fwd, _row_fp8_bwd)


def _fp8_parts(w, x: jax.Array) -> tuple:
    """(array, (bits, scale) or None, counters or None) of a weight (an array, fp8.Quantized or fp8.Scaled), each
    typed varying where x is (as the plain FP8 linear types them: Collectives.matmul)."""
    array, quantized, lives = fp8.unpacked(w)
    return typed_like(array, x), quantized, None if lives is None else typed_like(lives, x)


def all_gather_linears(x_BxSxD: jax.Array, linears: Sequence[tuple[str, jax.Array]],
                       axes: tuple[str, ...], keep_gathered: bool = True, fp8_calibrating: bool | None = None
                       ) -> list[jax.Array]:
    """[einsum(eq, all_gather(x, S), w) for eq, w in linears], each GEMM on the chunk present while the
    next one arrives (module docstring). Every equation keeps the sequence on dim 1 of x and output; the
    weights are typed here varying over every manual axis x varies over, as einsum would cast them
    implicitly, so the custom_vjp's weight gradients have the weights' types.
    `keep_gathered`: the backward's residual is the gathered input the ring assembled (as an all-gather's
    output kept for the weight gradients), or, False, only x itself, all-gathered again in the backward (as
    under a policy that never keeps an all-gather's output: module docstring, Memory). `fp8_calibrating`:
    None runs bf16 GEMMs; a bool runs FP8 ones (precision=fp8: "the rings under precision=fp8" above; the
    weights may be fp8.Quantized / fp8.Scaled, typed here), True as delayed scaling's calibration pass."""
    equations = tuple(e for e, _ in linears)
    if fp8_calibrating is not None:
        weights = tuple(_fp8_parts(w, x_BxSxD) for _, w in linears)
        return list(_column_fp8(equations, tuple(axes), bool(keep_gathered), fp8_calibrating, x_BxSxD, weights))
    return list(_column(equations, tuple(axes), bool(keep_gathered), x_BxSxD,
                        *(typed_like(w, x_BxSxD) for _, w in linears)))


def linear_reduce_scatter(equation: str, x_BxSxF: jax.Array, w: jax.Array, axes: tuple[str, ...],
                          fp8_calibrating: bool | None = None) -> jax.Array:
    """psum_scatter(einsum(equation, x, w), S): this rank's chunk of the output summed over the ring, the
    partial product of each chunk computed while the running sum of the previous one travels. `w` typed as
    in all_gather_linears; `fp8_calibrating` as there."""
    if fp8_calibrating is not None:
        return _row_fp8(equation, tuple(axes), fp8_calibrating, x_BxSxF, _fp8_parts(w, x_BxSxF))
    return _row(equation, tuple(axes), x_BxSxF, typed_like(w, x_BxSxF))
