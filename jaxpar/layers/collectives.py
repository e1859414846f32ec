"""The parallel hooks model math may call; every one is the identity on a single device.

Megatron's layers take a process group; jaxpar's take a `Collectives`, built by the parallel runtime
(jaxpar.parallel.step) for code running inside `jax.shard_map`. With no axes set (the default) the
same model code is the plain single-device model, which is what the equivalence tests compare to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import blockwise, collective_matmul, fp8, ring
from jaxpar.layers.blockwise import balanced_order  # noqa: F401  (re-exported)
from jaxpar.layers.order import after  # noqa: F401  (re-exported: the model code orders with it)
from jaxpar.layers.order import (backward_ordered, chain_both_ways, cotangent_after, cotangent_summed,
                                 ordered_both_ways, ordering_on)
from jaxpar.layers.vma import typed_like, varying_of  # noqa: F401  (re-exported: the parallel code types with them)
from jaxpar.sharding import FP8_BINS, is_axes_leaf, leaf_names


def _array_of(w):
    """A weight's array: itself, or an fp8.Quantized's or fp8.Scaled's weight (its shape and type)."""
    return fp8.unpacked(w)[0]


def _each_array(fn: Callable, w):
    """fn(w), or for an fp8.Quantized fn of its weight and of its bits (the per-tensor scale stays; an
    fp8.Scaled's counters stay too)."""
    if isinstance(w, fp8.Scaled):
        return dataclasses.replace(w, weight=_each_array(fn, w.weight))
    if isinstance(w, fp8.Quantized):
        return dataclasses.replace(w, weight=fn(w.weight), bits=fn(w.bits))
    return fn(w)


def zero_dim_of(axes: tuple[str, ...], zero_logical: str) -> int:
    """The dim ZeRO shards of a weight with logical `axes`: its `zero_logical` one, or for the FP8 counters
    (which have none) their bins (jaxpar.sharding.FP8_BINS)."""
    return axes.index(zero_logical if zero_logical in axes else FP8_BINS)


def _as_tuple(axes) -> tuple[str, ...]:
    return () if axes is None else (axes if isinstance(axes, tuple) else (axes,))


@dataclasses.dataclass(frozen=True)
class Collectives:
    tp_axis: str | None = None  # tensor-parallel mesh axis (row-parallel outputs are summed over it)
    zero3_axis: str | None = None  # ZeRO-3: weights arrive sharded over this axis and are gathered per use
    zero2_axis: str | None = None  # ZeRO-2: weights arrive as (full, grad tap) pairs, see gather_weights
    dp_reduce_axis: str | None = None  # ZeRO 0-1: each weight's gradient all-reduced at its use (gather_weights)
    zero_logical_axis: str = "embed"  # which logical dim ZeRO shards
    grad_reduce_dtype: Any = None  # dtype the ZeRO taps and gathers reduce gradients in (None: the weights' own)
    zero3_prefetch: bool = False  # ZeRO-3: gather layer i+1's weights while layer i computes (scan_layers)
    # offload.params with nothing to gather (dp = 1): the weights arrive as (host, gradient sink) pairs and are
    # copied in at each use (fetch_host_weights); with dp > 1 ZeRO-3's gather copies them in
    host_weights: bool = False
    # ZeRO's per-use mechanisms (grad_tap, gather_weight, prefetching_layer_scan, gathered_name), which
    # the parallel runtime hands in with the ZeRO axes: jaxpar.parallel.zero.LAYER_HOOKS. ZeRO stays in
    # that one module, and the layers import no parallel code.
    zero_hooks: Any = None
    kv_heads_replicated: bool = False  # more tp ranks than KV heads: K/V weights arrive whole (local_kv_heads)
    # Megatron sequence parallelism: outside the tensor-parallel regions the activations [B, S, D]
    # are split over these axes along S (the residual stream, norms and the layer boundaries).
    sequence_axis: str | tuple[str, ...] | None = None
    # zb: the pipeline's split of each layer's backward into input gradients (B) and weight gradients
    # (W), jaxpar.parallel.split_backward.SplitBackward; `linear` and `scan_layers` hand over to it
    weight_grads: Any = None
    # Context parallelism: the sequence is split over this axis in balanced_order; attention gathers
    # the keys and values over it (jaxpar.layers.attention, docs/design.md "Context parallelism")
    context_axis: str | None = None
    # "all_gather", "ring" (K / V blocks passed around the cp ranks) or "ulysses" (heads all-to-all over cp)
    context_strategy: str = "all_gather"
    # Sequence parallelism's gather / scatter decomposed around the block's GEMMs (column_linears, row_linear;
    # jaxpar.layers.collective_matmul): "on", "off", or "auto" = on where collectives keep their freedom (GPUs:
    # order.ordering_on() is False) and the layers run no dp collectives (matmul_rings), for chunks of
    # AUTO_MIN_CHUNK_TOKENS and more; off on XLA:CPU's emulated meshes
    collective_matmul: str = "auto"
    # precision=fp8: `linear`'s GEMMs in FP8 (jaxpar.layers.fp8). Not a parallel concern, but `linear` is the
    # one hook every linear layer calls, single-device model included (the runtime builds the Collectives)
    fp8: bool = False
    # fp8.zero3_gather=fp8: the weights of these names (the models' LINEAR_WEIGHTS) are ZeRO-3-gathered as E4M3
    fp8_gathered: frozenset = frozenset()
    # fp8.recipe=delayed's calibration pass (fp8_counters.calibrate): the counters' linears scale by their
    # operands' own amaxes and record them
    fp8_calibrating: bool = False

    def context_positions(self, local_len: int) -> jax.Array | None:
        """This rank's token positions in the whole sequence (its slice of balanced_order); None
        without context parallelism (positions 0..S-1)."""
        if not self.context_axis:
            return None
        ways = jax.lax.axis_size(self.context_axis)
        order = jnp.asarray(balanced_order(local_len * ways, ways))
        return jax.lax.dynamic_slice_in_dim(order, jax.lax.axis_index(self.context_axis) * local_len, local_len)

    def context_attention(self, q_BxSxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                          prefix_len: int, kernel: str = "xla") -> tuple[jax.Array, tuple | None]:
        """(this rank's causal attention output over the whole sequence, the prefix's keys and values or
        None): `ring` passes K / V blocks around cp, `all_gather` gathers them over cp first (the backward
        reduce-scatters their gradients); either way each block is causal, whole or skipped
        (jaxpar.layers.ring), on `kernel` ("xla" or "cudnn"). With `prefix_len` the prefix-LM's
        bidirectional prefix comes back as its keys and values in position order, for the caller's one
        unmasked attention of them (jaxpar.layers.attention): sliced from the gathered K / V, or for the
        ring gathered over cp on their own, before the ring's sends and, in the backward, after them
        (XLA:CPU's order). A prefix that is the whole sequence (a VLA's action chunks) needs no causal
        block at all: (None, the whole K / V), gathered alike by both strategies, and no ring runs."""
        axis = self.context_axis
        ways = jax.lax.axis_size(axis)
        gather = lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True)  # noqa: E731
        if prefix_len >= ways * q_BxSxNxH.shape[1]:  # every query sees every key: the causal blocks would be discarded
            gathered = chain_both_ways(gather, (k_BxSxKxH, v_BxSxKxH))
            return None, tuple(blockwise.in_position_order(x, ways) for x in gathered)
        if self.context_strategy == "ring":
            prefix = None
            if prefix_len:  # (a VLA: short sequences, whose prefix is most of them)
                gathered = chain_both_ways(gather, (k_BxSxKxH, v_BxSxKxH))  # V's after K's both ways (XLA:CPU)
                prefix = tuple(blockwise.in_position_order(x, ways, prefix_len) for x in gathered)
                q_BxSxNxH, k_BxSxKxH, v_BxSxKxH = ordered_both_ways((q_BxSxNxH, k_BxSxKxH, v_BxSxKxH), prefix)
            return ring.ring_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, axis, kernel), prefix
        # two gathers, V's after K's both ways (independent collectives could start in either order on
        # XLA:CPU: jaxpar.layers.order; one gather of K and V concatenated costs a GPU program copies of both)
        k_all, v_all = chain_both_ways(gather, (k_BxSxKxH, v_BxSxKxH))
        prefix = tuple(blockwise.in_position_order(x, ways, prefix_len) for x in (k_all, v_all)) if prefix_len else None
        return ring.gathered_attention(q_BxSxNxH, k_all, v_all, axis, kernel), prefix

    def linear(self, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """A weight matmul, einsum(equation, x, w). The model calls it for every linear so that a zb
        pipeline can compute its input gradient and its weight gradient at different times."""
        if self.weight_grads is not None:  # zb: the split backward calls `matmul` itself (B, then W)
            return self.weight_grads.linear(equation, x, w, self.matmul)
        return self.matmul(equation, x, w)

    def matmul(self, equation: str, x: jax.Array, w: Any) -> jax.Array:
        """`linear`'s product itself: under fp8 an FP8 GEMM (jaxpar.layers.fp8.einsum) of `w`, a weight, an
        fp8.Quantized (its bits quantized ahead) or an fp8.Scaled (with its delayed-scaling counters)."""
        # quantized ahead (ZeRO-3 FP8 gather, pipeline stage): the bits feed the GEMM; fp8.recipe=delayed: the
        # counters of this linear's scales
        weight, quantized, lives = fp8.unpacked(w)
        if self.fp8:  # a custom_vjp returns its inputs' types: each operand is typed as varying where the
            # other does (a tp-invariant input of a column linear, the ViT's: its gradient's tp sum is the cast's).
            # The counters arrive varying over tp (jaxpar.parallel.fp8_counters): their cast adds no collective there.
            x, weight = typed_like(x, weight), typed_like(weight, x)
            lives = None if lives is None else typed_like(typed_like(lives, x), weight)
            return fp8.einsum(equation, x, weight, quantized, lives, self.fp8_calibrating)
        return jnp.einsum(equation, x, weight)

    @property
    def matmul_rings(self) -> bool:
        """Whether the blocks' linears run as collective matmuls (`collective_matmul`): only under sequence
        parallelism over the tp axes themselves, and not in a zb pipeline's split (its `linear` defers dW).
        "auto" also leaves them off where the layers run dp collectives of their own (`taps_weights`: ZeRO-3's
        gathers and scatters, ZeRO-1/2's and DDP's per-layer gradient reductions): XLA's GPU schedule keeps
        one collective in flight, the rings hold it across the blocks' GEMMs, and the dp traffic those GEMMs
        hid is exposed instead (llama7b dp 16 x tp 4 ZeRO-3 on 64 A100s: 2.082 s off, 2.164 s on;
        collective_matmul's docstring, "When auto runs the rings")."""
        if not self.sequence_axis or self.weight_grads is not None or self.sequence_axes != _as_tuple(self.tp_axis):
            return False
        return self.collective_matmul == "on" or (self.collective_matmul == "auto" and not ordering_on()
                                                  and not self.taps_weights)

    @property
    def _ring_fp8(self) -> bool | None:
        """The rings' GEMMs: None bf16; under fp8 an FP8 one each, True in delayed scaling's calibration pass."""
        return self.fp8_calibrating if self.fp8 else None

    def _ring_pays(self, chunk_tokens: int) -> bool:
        """Under `matmul_rings`, whether a block's chunks are long enough for its rings: always with "on";
        with "auto" from collective_matmul.AUTO_MIN_CHUNK_TOKENS tokens per chunk (batch x S / tp) up."""
        return self.collective_matmul == "on" or chunk_tokens >= collective_matmul.AUTO_MIN_CHUNK_TOKENS

    @property
    def keeps_gathered_inputs(self) -> bool:
        """Whether the column rings keep the input they gathered for the weight gradients (as the plain path's
        all-gather output is kept), or only the sequence shard, all-gathered again in the backward: under
        ZeRO-3 the layer's remat policy never keeps an all-gather's output (parallel.zero.never_keep_gathered),
        so the plain path keeps the shard and gathers again, and a ring that kept its gathered input would
        hold (tp - 1) / tp of a [B, S, D] more per column block (collective_matmul's docstring, Memory)."""
        return not self.zero3_axis

    def enter_block(self, x_BxSxD: jax.Array) -> jax.Array:
        """The input of a tensor-parallel block whose column linears are `column_linears`:
        enter_tensor_parallel, or with `matmul_rings` the sequence shard itself (the linears gather it chunk
        by chunk under their GEMMs)."""
        return x_BxSxD if self.matmul_rings else self.enter_tensor_parallel(x_BxSxD)

    def column_linears(self, x_BxSxD: jax.Array, linears: list[tuple[str, jax.Array]],
                       kv: bool = False) -> list[jax.Array]:
        """The column-parallel linears of one tensor-parallel block, [einsum(eq, x, w) for eq, w in linears],
        on the block's input from `enter_block`. `kv`: the last two are the K and V projections, of this
        rank's KV heads (kv_weights). With `matmul_rings` the input is still the sequence shard and is
        gathered chunk by chunk under the GEMMs (jaxpar.layers.collective_matmul); it is gathered whole
        first for K / V heads shared over tp ranks (their gradient sums would be unordered with the ring's
        sends on XLA:CPU) and for chunks too short to pay for the ring (`_ring_pays`)."""
        weights = [w for _, w in linears]
        if self.matmul_rings:
            shares_kv = kv and (self.kv_heads_replicated or any(
                a not in varying_of(jax.typeof(_array_of(w))) for a in _as_tuple(self.tp_axis) for w in weights[-2:]))
            if not shares_kv and self._ring_pays(x_BxSxD.shape[0] * x_BxSxD.shape[1]):
                return collective_matmul.all_gather_linears(x_BxSxD, linears, self.sequence_axes,
                                                            keep_gathered=self.keeps_gathered_inputs,
                                                            fp8_calibrating=self._ring_fp8)
            x_BxSxD = self.enter_tensor_parallel(x_BxSxD)
        if kv:
            x_BxSxD, *weights[-2:] = self.kv_weights(x_BxSxD, *weights[-2:])
        return [self.linear(equation, x_BxSxD, w) for (equation, _), w in zip(linears, weights)]

    def row_linear(self, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """A row-parallel linear and its sum over tp (row_parallel_sum: a reduce-scatter along S under
        sequence parallelism); with `matmul_rings` the sum is a ring under the chunks' GEMMs (where they
        are long enough: `_ring_pays`)."""
        if self.matmul_rings and self._ring_pays(x.shape[0] * x.shape[1] // jax.lax.axis_size(self.sequence_axes)):
            return collective_matmul.linear_reduce_scatter(equation, x, w, self.sequence_axes, self._ring_fp8)
        return self.row_parallel_sum(self.linear(equation, x, w))

    def tp_sum(self, x: jax.Array) -> jax.Array:
        """All-reduce over tp: a vocab-parallel partial (or, without sequence parallelism, a
        row-parallel output)."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def row_parallel_sum(self, x_BxSxD: jax.Array) -> jax.Array:
        """The output of a row-parallel layer (or the vocab-parallel embedding), summed over tp. With
        sequence parallelism a reduce-scatter along S instead of the all-reduce: each rank keeps its
        sequence shard (its transpose, the backward's all-gather, comes from JAX)."""
        if not self.sequence_axis:
            return self.tp_sum(x_BxSxD)
        rest = tuple(a for a in _as_tuple(self.tp_axis) if a not in _as_tuple(self.sequence_axis))
        x_BxSxD = jax.lax.psum_scatter(x_BxSxD, self.sequence_axis, scatter_dimension=1, tiled=True)
        # e.g. the pipeline's (pp, tp) vocabulary split: the pp part an all-reduce of the shard, after the
        # scatter (1/tp of the bytes across nodes that the whole sequence's all-reduce moved)
        return jax.lax.psum(x_BxSxD, rest) if rest else x_BxSxD

    def enter_tensor_parallel(self, x_BxSxD: jax.Array) -> jax.Array:
        """The input of a tensor-parallel block (or of the vocab-parallel head), Megatron's `f`.

        With sequence parallelism: the whole sequence, all-gathered along S (its transpose
        reduce-scatters the input gradient). Without: `x` itself, typed as varying over tp once, so
        the block's input gradient is one all-reduce over tp in the backward. (Left implicit, JAX
        types it per use: q, k and v, or gate and up, would each get their own all-reduce.)
        """
        if self.sequence_axis:
            return jax.lax.all_gather(x_BxSxD, self.sequence_axis, axis=1, tiled=True)
        if not self.tp_axis:
            return x_BxSxD
        missing = tuple(a for a in _as_tuple(self.tp_axis) if a not in varying_of(jax.typeof(x_BxSxD)))
        return jax.lax.pcast(x_BxSxD, missing, to="varying") if missing else x_BxSxD

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """The axes the sequence is split over (empty without sequence parallelism)."""
        return _as_tuple(self.sequence_axis)

    def without_sequence_parallel(self) -> "Collectives":
        return dataclasses.replace(self, sequence_axis=None)

    def context_slice(self, x_BxSxD: jax.Array) -> jax.Array:
        """This cp rank's tokens (context_positions) of a sequence it holds whole, e.g. a VLA's
        assembled image + text sequence (no communication); the identity without context parallelism."""
        positions = self.context_positions(x_BxSxD.shape[1] // jax.lax.axis_size(self.context_axis)) \
            if self.context_axis else None
        return x_BxSxD if positions is None else jnp.take(x_BxSxD, positions, axis=1)

    def context_unshard(self, x_BxSx: jax.Array) -> jax.Array:
        """The whole sequence, in position order, of an array each cp rank holds its tokens of
        (context_positions), the same on every rank: one sum over cp of each rank's tokens in place
        (generation's prefill caches the whole prompt's K / V this way); the identity without cp."""
        if not self.context_axis:
            return x_BxSx
        local = x_BxSx.shape[1]
        whole = jnp.zeros((x_BxSx.shape[0], local * jax.lax.axis_size(self.context_axis)) + x_BxSx.shape[2:],
                          x_BxSx.dtype)
        return jax.lax.psum(whole.at[:, self.context_positions(local)].set(x_BxSx), self.context_axis)

    def sequence_shard(self, x_BxSxD: jax.Array) -> jax.Array:
        """This rank's slice along S of a sequence every tp rank holds whole (no communication)."""
        if not self.sequence_axis:
            return x_BxSxD
        axes = self.sequence_axes
        ways = 1
        for axis in axes:
            ways *= jax.lax.axis_size(axis)
        size = x_BxSxD.shape[1] // ways
        return jax.lax.dynamic_slice_in_dim(x_BxSxD, jax.lax.axis_index(axes) * size, size, axis=1)

    def local_kv_heads(self, w_DxKxH: jax.Array) -> jax.Array:
        """This rank's KV heads of a K or V projection. Split over tp: the weight is already this
        rank's. Replicated (tp > n_kv_heads): the one head this rank's query heads attend with,
        head rank // (tp / K); the weight's gradient then sums over the ranks sharing it (the
        transpose of its implicit broadcast to tp-varying)."""
        if not (self.kv_heads_replicated and self.tp_axis):
            return w_DxKxH
        ranks_per_head = jax.lax.axis_size(self.tp_axis) // _array_of(w_DxKxH).shape[1]
        return _each_array(lambda w: jax.lax.dynamic_slice_in_dim(w, self.tp_rank() // ranks_per_head, 1, axis=1),
                           w_DxKxH)

    def kv_weights(self, x_BxSxD: jax.Array, wk_DxKxH: jax.Array, wv_DxKxH: jax.Array):
        """(x, wk, wv) for the K and V projections of `x`: this rank's KV heads (local_kv_heads). A KV
        head shared by several tp ranks (the "tpv" part of a split tp axis, jaxpar.sharding.kv_head_ways)
        is typed varying over them here, so its gradient is summed over those ranks here in the backward,
        and that sum runs before x's cotangent flows on to the block's own collectives (left to JAX, the
        cast sits at the einsum and the sum is unordered with the input gradient's all-reduce: on
        XLA:CPU a possible deadlock, jaxpar.layers.order)."""
        if self.kv_heads_replicated or not self.tp_axis:
            return x_BxSxD, self.local_kv_heads(wk_DxKxH), self.local_kv_heads(wv_DxKxH)
        shared = tuple(a for a in _as_tuple(self.tp_axis) if a not in varying_of(jax.typeof(_array_of(wk_DxKxH))))
        if not shared:
            return x_BxSxD, wk_DxKxH, wv_DxKxH
        x_BxSxD, (wk_DxKxH, wv_DxKxH) = backward_ordered(x_BxSxD, (wk_DxKxH, wv_DxKxH))
        vary = lambda a: jax.lax.pcast(a, shared, to="varying")  # noqa: E731
        return x_BxSxD, *(_each_array(vary, w) for w in (wk_DxKxH, wv_DxKxH))

    def tp_max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.tp_axis) if self.tp_axis else x

    def tp_rank(self) -> jax.Array:
        return jax.lax.axis_index(self.tp_axis) if self.tp_axis else jnp.int32(0)

    @property
    def taps_weights(self) -> bool:
        """Whether a weight's use runs a ZeRO collective (a gather, or a gradient reduction in the backward)."""
        return bool(self.zero2_axis or self.zero3_axis or self.dp_reduce_axis)

    def use_weights(self, x: Any, params: Any, logical_axes: Any) -> tuple[Any, Any]:
        """(x, weights): `gather_weights` of `params` for a computation on `x`, in one collective
        order on XLA:CPU (jaxpar.layers.order): the weights' gathers after `x` is computed and before
        the computation's own collectives; in the backward the weights' gradient reductions (and
        the tp sums of gradients of weights replicated over tp) after the computation's input
        gradient, and before that gradient flows on."""
        if not self.taps_weights:  # nothing gathered: order the backward only (no copies)
            return backward_ordered(x, self.fetch_host_weights(params, logical_axes))
        weights = self.gather_weights(params, logical_axes, start=x)
        if self.zero2_axis or self.dp_reduce_axis:  # the taps' reductions wait for every weight's whole
            return ordered_both_ways(x, weights), cotangent_summed(weights)  # gradient (its tp sums too)
        return ordered_both_ways(x, weights), weights

    def fetch_host_weights(self, params: Any, logical_axes: Any) -> Any:
        """`params` to compute with where no ZeRO-3 gather copies them in: under `host_weights` each weight
        copied in from host memory (zero.fetched: its gradient goes to the pair's device sink), else as they are."""
        if not self.host_weights:
            return params
        structure = jax.tree.structure(logical_axes, is_leaf=is_axes_leaf)
        return structure.unflatten([self.zero_hooks.fetch(w) for w in structure.flatten_up_to(params)])

    def gather_weights(self, params: Any, logical_axes: Any, start: Any = None) -> Any:
        """The weights to compute with, right before use.

        ZeRO-3: all-gather the dp-sharded weights. ZeRO-2: each weight comes as a pair (full weight,
        dp-sharded grad tap); gradients flow to the tap reduce-scattered, layer by layer, so no device
        ever holds its whole unreduced gradient. ZeRO 0-1 with dp_reduce_axis: each weight's gradient
        is all-reduced here, layer by layer. Otherwise the identity.
        """
        if self.dp_reduce_axis:
            tap = self.zero_hooks.reduce_tap(self.dp_reduce_axis, self.grad_reduce_dtype)
            return chain_both_ways(lambda w, axes: tap(w), params, logical_axes, start=start)
        if self.zero2_axis:
            def use(pair, axes):
                full, shard = pair
                dim = zero_dim_of(axes, self.zero_logical_axis)
                return self.zero_hooks.grad_tap(self.zero2_axis, dim, self.grad_reduce_dtype)(full, shard)
            axes_leaves, structure = jax.tree.flatten(logical_axes, is_leaf=is_axes_leaf)
            pairs = [tuple(pair) for pair in structure.flatten_up_to(params)]
            return structure.unflatten(chain_both_ways(use, pairs, axes_leaves, start=start,
                                                      is_leaf=lambda v: isinstance(v, tuple)))
        if not self.zero3_axis:
            return params

        def gather(w, axes, scale):
            full = self.zero_hooks.gather_weight(self.zero3_axis, zero_dim_of(axes, self.zero_logical_axis),
                                                self.grad_reduce_dtype, scale)(w)
            return jax.tree.map(lambda a: checkpoint_name(a, self.zero_hooks.gathered_name), full)  # (fp8.Quantized)

        # offload.params: host shards copied in (zero.copied_in); with a gradient, (shard, gradient sink) pairs
        # (zero.with_sinks), which the gather takes whole
        axes_leaves, structure = jax.tree.flatten(logical_axes, is_leaf=is_axes_leaf)
        shards = [self.zero_hooks.copy_in(w) for w in structure.flatten_up_to(params)]
        scales, start = self.zero_hooks.fp8_gather_scales(shards, leaf_names(logical_axes), self.fp8_gathered,
                                                          self.zero3_axis, start)
        return structure.unflatten(chain_both_ways(gather, shards, axes_leaves, scales, start=start,
                                                  is_leaf=lambda v: isinstance(v, tuple)))

    def scan_layers(self, layer_fn: Callable, x: jax.Array, stacked: Any, layer_axes: Any,
                    remat_policy: Callable | None = None) -> jax.Array:
        """`x` through `layer_fn(x, weights)` for each layer of the stacked (leading "layers" dim)
        weights, each layer's weights gathered first (`gather_weights`) and `remat_policy` (a
        jax.checkpoint policy) around each layer if given. With ZeRO-3 prefetch, the next layer's
        gather runs ahead of each layer's compute (jaxpar.parallel.zero.prefetching_layer_scan). In a zb
        pipeline's split traces the scan is the split's (jaxpar.parallel.split_backward)."""
        if self.weight_grads is not None and self.weight_grads.deferring:
            if self.taps_weights:
                raise ValueError("zb's split backward runs without per-use ZeRO collectives (a pipeline has none)")
            return self.weight_grads.scan_layers(layer_fn, x, stacked, remat_policy)
        if self.zero3_axis and self.zero3_prefetch:
            return self.zero_hooks.prefetching_layer_scan(layer_fn, x, stacked, layer_axes, self.zero3_axis,
                                               self.zero_logical_axis, self.grad_reduce_dtype, self.fp8_gathered)

        def body(x, weights):
            if not self.taps_weights:  # nothing to gather, and the layer's collectives are ordered by its
                return layer_fn(x, self.fetch_host_weights(weights, layer_axes)), None  # data (zb B: no dW dots)
            x, weights = self.use_weights(x, weights, layer_axes)
            # ZeRO-3 under remat gathers the weights again in the backward: before the layer's own collectives
            return cotangent_after(layer_fn(x, weights), weights), None

        if remat_policy is not None:
            body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
        return jax.lax.scan(body, x, stacked)[0]
