"""ZeRO in one place: what each stage shards, reduces and gathers, for the LLM and the vision encoder.

ZeRO shards state over the data-parallel axes on one logical dim of every weight ("embed"; the rules
table in jaxpar.sharding says which mesh axes). Per stage (DeepSpeed's semantics):

| stage | sharded over dp                     | gradient reduction over dp                      | gathered per use      |
|-------|-------------------------------------|-------------------------------------------------|-----------------------|
| 0     | nothing                             | all-reduce per layer inside the backward        | -                     |
|       |                                     | (reduce taps); with a pipeline or accumulation  |                       |
|       |                                     | one after the backward                          |                       |
| 1     | optimizer state, fp32 master        | reduce-scatter into the optimizer's shard (the  | -                     |
|       |                                     | distributed optimizer): per layer inside the    |                       |
|       |                                     | backward (grad taps); with accumulation once    |                       |
|       |                                     | after it; with a pipeline per part once final   |                       |
| 2     | + gradients                         | reduce-scatter per layer inside the backward    | -                     |
|       |                                     | (grad taps), every microbatch; with a pipeline, |                       |
|       |                                     | per part once its gradient is final             |                       |
| 3     | + compute-dtype weights             | reduce-scatter per layer (the gather's          | each layer's weights, |
|       |                                     | transpose)                                      | prefetched one ahead  |

ZeRO-1 is Megatron's distributed optimizer: each dp rank updates 1/dp of the weights, so it needs only
its 1/dp of the summed gradient, a reduce-scatter (half an all-reduce's bytes); the updated weights are
then all-gathered. All-reducing the whole gradient and keeping 1/dp of it moved (2g + c) / (g + c) the
bytes (g, c: bytes per element of the sums and the weights; 1.67x for fp32 sums of bf16 weights), plus
a copy of the whole fp32 sum. Stages 1 and 2 differ only with accumulation: ZeRO-1 sums
the microbatches' whole gradients (one fp32 buffer, DDP's no_sync) and reduce-scatters once; ZeRO-2 keeps
only the shard and reduce-scatters every microbatch (DeepSpeed's trade: less memory, more traffic).

Every reduction moves gradients in `grad_reduce`'s dtype (fp32 unless the user picks bf16). A
reduce-scatter into the optimizer's shard (taps, after the backward) leaves its sum in that dtype: the
fp32 update reads it as it came, with no bf16 rounding between the sum and the update.

- `StateSpecs`: the PartitionSpecs of params / grads / optimizer state / master per stage.
- `ZeroPlan`: which of the mechanisms below one run uses (dp size, pipeline and remat decide).
- `reduce_gradients`: the stage 0-2 reduction after the backward (a pipeline, accumulation).
- `reduce_tap` (stage 0): the per-layer all-reduce inside the backward; an all-reduce moves twice
  a reduce-scatter's bytes, so ZeRO 1-2 (`grad_tap`) halve the gradient traffic for the same overlap.
- `grad_tap` (stages 1-2) and `gather_weight` (stage 3): the per-layer reduce-scatter inside the backward.
- `prefetching_layer_scan` (stage 3 with full remat): the layer scan with layer i+1's all-gather
  issued before layer i computes, in the forward and in the backward, and each layer's
  reduce-scatter deferred to overlap the next layer's backward.
- `never_keep_gathered`: a remat policy never saves a gathered weight for the backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.layers import fp8
from jaxpar.layers.collectives import varying_of, zero_dim_of
from jaxpar.layers.order import after, after_p, chain
from jaxpar.sharding import Rules, is_axes_leaf, leaf_names, llm_rules, tree_specs, unused_mesh_axes, zero_dim

ZERO3_GATHERED = "zero3_gathered"  # checkpoint name of all-gathered ZeRO-3 weights: never saved for backward


class StateSpecs:
    """PartitionSpecs of params / grads / optimizer state / master weights for one ZeRO stage."""

    def __init__(self, axes_tree: Any, stage: int, mesh, rules: Rules | None = None):
        unused = unused_mesh_axes(mesh)
        rules = rules or llm_rules(mesh)
        self.axes = axes_tree
        self.stage = stage
        self.params = tree_specs(axes_tree, stage >= 3, unused, rules)
        # the reduced gradients: ZeRO 1-2 reduce-scatter them into the optimizer's shard
        self.grads = tree_specs(axes_tree, stage >= 1, unused, rules)
        self.opt = tree_specs(axes_tree, stage >= 1, unused, rules)  # also the fp32 master weights

    def merged(self, other: "StateSpecs") -> "StateSpecs":
        """One component's specs next to another's (disjoint top-level keys)."""
        out = object.__new__(StateSpecs)
        out.axes, out.stage = {**self.axes, **other.axes}, self.stage
        out.params, out.grads, out.opt = ({**a, **b} for a, b in ((self.params, other.params),
                                                                  (self.grads, other.grads), (self.opt, other.opt)))
        return out


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Which ZeRO mechanisms one run of the LLM uses."""

    stage: int
    dp: int  # data-parallel ways (1: no dp collectives at all)
    pipelined: bool
    remat: str  # the remat policy's name
    prefetch: bool = True  # zero.prefetch
    grad_accum: int = 1  # train.grad_accum (microbatches summed before one reduction)

    @property
    def gathers_weights(self) -> bool:
        """ZeRO-3 with something to gather."""
        return self.stage >= 3 and self.dp > 1

    @property
    def prefetches(self) -> bool:
        """Layer i+1's gather issued while layer i computes. Needs full remat: the backward recomputes
        each layer from its input with the weights gathered again, so no gathered weight is ever saved."""
        return self.gathers_weights and self.prefetch and self.remat == "full"

    @property
    def scatters_grads(self) -> bool:
        """ZeRO 1-2: gradients are reduce-scattered into the optimizer's shard, never all-reduced."""
        return self.stage >= 1

    @property
    def taps_grads(self) -> bool:
        """ZeRO-2 without a pipeline reduce-scatters per layer inside the backward, every microbatch;
        ZeRO-1 too when there is one microbatch (with accumulation it sums whole gradients and
        reduce-scatters once after). With a pipeline, gradients accumulate over microbatches and each
        part (head, layer chunk, embedding) is reduce-scattered once it is final."""
        return (self.stage == 2 or (self.stage == 1 and self.grad_accum == 1)) and self.dp > 1 and not self.pipelined

    @property
    def reduces_in_backward(self) -> bool:
        """ZeRO-0 without a pipeline or accumulation all-reduces each weight's gradient where the
        backward leaves it (reduce_tap): per layer inside the layer scan. With accumulation that
        would reduce every microbatch (DDP's no_sync case), so those reduce once after."""
        return self.stage == 0 and self.dp > 1 and not self.pipelined and self.grad_accum == 1

    @property
    def reduces_after_backward(self) -> bool:
        """Gradients reduced after their backward (stages 0-1 with a pipeline or accumulation,
        pipelined stage 2): once, or with a pipeline part by part as the schedule finishes each."""
        return self.dp > 1 and not (self.gathers_weights or self.taps_grads or self.reduces_in_backward)


def mesh_axes_of(entry) -> tuple:
    """A PartitionSpec entry (or a Collectives axis) as a tuple of mesh axes: None -> (), "tp" -> ("tp",)."""
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def gather_axes(source, target):
    """(dim, mesh axes) to all-gather an array laid out as PartitionSpec `source` into `target` (the optimizer's
    ZeRO 1-2 shard into the parameters' layout): the one dim where `source` splits over more axes, those axes
    last in its entry (ZeRO's); None when alike."""
    source, target = tuple(source) + (None,) * (len(target) - len(source)), tuple(target) + (None,) * (len(source) - len(target))
    differ = [d for d, (a, b) in enumerate(zip(source, target)) if mesh_axes_of(a) != mesh_axes_of(b)]
    if not differ:
        return None
    (dim,) = differ
    have, want = mesh_axes_of(source[dim]), mesh_axes_of(target[dim])
    if have[:len(want)] != want:
        raise ValueError(f"cannot gather {source} into {target}")
    return dim, have[len(want):]


def reduce_gradients(grads, logical_axes, mesh_axes, scatter: bool, rules: Rules, dtype):
    """Sum gradients over `mesh_axes` (ZeRO 0: all-reduce) or reduce-scatter each one on its ZeRO
    dim (ZeRO 1-2), moving them in `dtype` (fp32 by default; bf16 with grad_reduce=bf16), in which
    the sums stay."""
    if scatter:
        def scatter_one(g, axes):
            dim = zero_dim(axes, rules)
            if dim is None:  # an array ZeRO leaves whole (no ZeRO dim): all-reduced
                return jax.lax.psum(g.astype(dtype), mesh_axes)
            return jax.lax.psum_scatter(g.astype(dtype), mesh_axes, scatter_dimension=dim, tiled=True)
        return chain(scatter_one, grads, logical_axes, start=grads)
    return chain(lambda g: jax.lax.psum(g.astype(dtype), mesh_axes), grads, start=grads)


def _scatter(cotangent: jax.Array, axis, dim: int, reduce_dtype) -> jax.Array:
    """A full gradient reduce-scattered over `axis` on `dim`, moved in `reduce_dtype` (None: its own)."""
    summed = jax.lax.psum_scatter(cotangent.astype(reduce_dtype or cotangent.dtype), axis,
                                  scatter_dimension=dim, tiled=True)
    return summed.astype(cotangent.dtype)


def grad_tap(axis, dim: int, reduce_dtype):
    """identity(full, shard) -> full, whose gradient w.r.t. `shard` is the gradient of `full`
    reduce-scattered over `axis`: ZeRO 1-2's reduce-scatter, issued per layer inside the backward.
    The sum stays in `reduce_dtype` (None: the cotangent's), which `shard` must have: the fp32
    optimizer shard receives it with no round trip through the compute dtype."""
    @jax.custom_vjp
    def tap(full, shard):
        return full

    def backward(_, cotangent):
        wide = cotangent.astype(reduce_dtype or cotangent.dtype)
        return None, jax.lax.psum_scatter(wide, axis, scatter_dimension=dim, tiled=True)

    tap.defvjp(lambda full, shard: (full, None), backward)
    return tap


def reduce_tap(axis, reduce_dtype):
    """identity(w) -> w typed varying over `axis`, whose gradient is the use's gradient summed over
    `axis`, moved in `reduce_dtype` (None: its own): ZeRO 0-1's all-reduce issued per use inside the
    backward, as DDP's and Megatron's bucketed reductions, so a layer's reduction runs beside the
    next layer's backward instead of all of them after the last one."""
    def vary(w):
        return jax.lax.pcast(w, axis, to="varying")

    @jax.custom_vjp
    def tap(w):
        return vary(w)

    def backward(_, cotangent):
        return (jax.lax.psum(cotangent.astype(reduce_dtype or cotangent.dtype), axis).astype(cotangent.dtype),)

    tap.defvjp(lambda w: (vary(w), None), backward)
    return tap


def on_host(w) -> bool:
    return getattr(jax.typeof(w), "memory_space", None) == jax.memory.Space.Host


@jax.custom_vjp
def fetch(host: jax.Array, sink: jax.Array) -> jax.Array:
    """offload.params: a weight kept in host memory, copied to the device for its use. Its gradient
    goes to `sink`, a device array of the weight's shape and type whose value is never read (XLA drops
    it): differentiating the host weight itself would type its gradient as host memory and send it
    there, to come straight back for the update."""
    return jax.device_put(host, jax.memory.Space.Device)


fetch.defvjp(lambda host, sink: (fetch(host, sink), None), lambda _, cotangent: (None, cotangent))


def with_host_weights(host: Any, sinks: Any) -> Any:
    """(host weight, gradient sink) pairs where the weight lives in host memory (the sinks elsewhere):
    the form `fetched` takes under offload.params without ZeRO-3 (dp = 1)."""
    return jax.tree.map(lambda h, s: (h, s) if on_host(h) else s, host, sinks)


def with_sinks(shards: Any, sinks: Any) -> Any:
    """(ZeRO-3 shard, gradient sink) pairs for every weight: the form `gather_weight` and
    `prefetching_layer_scan` take when a gradient is taken. The gradient goes to the sink, typed in the
    reduction's dtype (fp32 by default), so the reduce-scatter's sum reaches the fp32 update as it came;
    differentiating the bf16 shard itself would round the sum to bf16 on the way (and, for a shard in
    host memory, send its gradient there)."""
    return jax.tree.map(lambda w, s: (w, s), shards, sinks)


def gradient_sinks(weights: Any, dtype=None) -> Any:
    """Device stand-ins for weights, typed alike (shape, varying axes) in `dtype` (None: the weight's);
    see `fetch` and `with_sinks`. Their values are never read."""
    def sink(w):
        zeros, axes = jnp.zeros(w.shape, dtype or w.dtype), tuple(sorted(varying_of(jax.typeof(w))))
        return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
    return jax.tree.map(sink, weights)


def fetched(w: Any) -> jax.Array:
    """A weight to compute with: `fetch`ed from a (host, sink) pair, copied in from the host where no
    gradient is taken (evaluation), else as it is."""
    if isinstance(w, tuple):
        return fetch(*w)
    return jax.device_put(w, jax.memory.Space.Device) if on_host(w) else w


def copied_in(w: Any) -> Any:
    """A ZeRO-3 shard for `gather_weight`: copied in from host memory (offload.params), a (shard, sink)
    pair kept a pair with its shard on the device. The shard itself is never differentiated (the sink
    is), so the copy needs no transpose."""
    if isinstance(w, tuple):
        return copied_in(w[0]), w[1]
    return jax.device_put(w, jax.memory.Space.Device) if on_host(w) else w


def gather_weight(axis, dim: int, reduce_dtype, fp8_scale=None):
    """ZeRO-3's all-gather of a dp-sharded device weight (or of a (shard, sink) pair, `with_sinks`); its
    transpose reduce-scatters the gradient, in `reduce_dtype` when one is given (fp32 sums of bf16
    weights' gradients), else the weight's dtype. A pair's gradient goes to its sink in the reduction's
    dtype, which is the sink's (StepBuilder makes its sinks so); a plain weight's comes back in its own
    dtype (no gradient is taken of one in this repo's uses). With `fp8_scale` (the whole weight's FP8
    scale, `fp8_gather_scales`) the weight travels as E4M3 and arrives as an fp8.Quantized
    (jaxpar.layers.fp8.all_gather_fp8); its gradient is reduced as any other (straight through the
    quantization, as the FP8 GEMM's own)."""
    def gather(w, scale):
        if scale is None:
            return jax.lax.all_gather(w, axis, axis=dim, tiled=True)
        return fp8.all_gather_fp8(w, scale, axis, dim)

    @jax.custom_vjp
    def gather_to_sink(shard, sink, scale):  # the sink is typed in the reduction's dtype (StepBuilder's sinks)
        return gather(shard, scale)

    def to_sink(_, cotangent):
        cotangent = _of_weight(cotangent)
        wide = cotangent.astype(reduce_dtype or cotangent.dtype)
        return None, jax.lax.psum_scatter(wide, axis, scatter_dimension=dim, tiled=True), None

    gather_to_sink.defvjp(lambda shard, sink, scale: (gather(shard, scale), None), to_sink)

    @jax.custom_vjp
    def gather_reducing_wide(w, scale):
        return gather(w, scale)

    gather_reducing_wide.defvjp(lambda w, scale: (gather(w, scale), None),
                                lambda _, cotangent: (_scatter(_of_weight(cotangent), axis, dim, reduce_dtype), None))

    def gather_any(w):  # w: a device shard, or a (shard, sink) pair (`copied_in` from the host first)
        if isinstance(w, tuple):
            return gather_to_sink(*w, fp8_scale)
        if reduce_dtype is None and fp8_scale is None:
            return gather(w, None)
        return gather_reducing_wide(w, fp8_scale)

    return gather_any


def _of_weight(cotangent):
    """The weight's cotangent of a gather's output (an fp8.Quantized's: its bits and scale have none)."""
    return cotangent.weight if isinstance(cotangent, fp8.Quantized) else cotangent


def fp8_gather_scales(shards: list, names: list[str], fp8_names: frozenset, axis, start: Any) -> tuple[list, Any]:
    """(the FP8 scale of each weight named in `fp8_names`, None for the others; what the gathers wait for).
    A weight's scale is the whole weight's (`scale_for` of the max over `axis` of its shards' amaxes), so
    that every rank quantizes its shard as the whole weight would be: one all-reduce for the weights
    typed alike (a layer's linears; K / V weights shared by some tp ranks form a second group, as a scale
    typed varying where its weight is not would make the gathered weight so); on XLA:CPU they run after
    `start`, one after another, and the gathers after them (jaxpar.layers.order). `shards`: device
    shards, or (shard, sink) pairs."""
    device = [shard[0] if isinstance(shard, tuple) else shard for shard in shards]
    groups: dict[frozenset, list[int]] = {}
    for k, name in enumerate(names):
        if name in fp8_names:
            groups.setdefault(varying_of(jax.typeof(device[k])), []).append(k)
    out = [None] * len(shards)
    for members in groups.values():
        amaxes = after(jnp.stack([fp8.amax(device[k]) for k in members]), start)
        scales = fp8.scale_for(jax.lax.pmax(amaxes, axis), fp8.FORWARD)
        for row, k in enumerate(members):
            out[k] = scales[row]
        start = (start, scales)
    return out, start


def never_keep_gathered(base: Callable | None) -> Callable:
    """`base` (a jax.checkpoint policy; None keeps everything), except that a ZeRO-3 gathered weight
    is never kept for the backward: keeping them would hold every layer's full weights at once."""
    def policy(prim, *args, **params):
        if prim is jax.lax.all_gather_p or (prim.name == "name" and params.get("name") == ZERO3_GATHERED):
            return False
        if prim is after_p or prim.name.startswith("custom_vjp_call"):
            return False  # the ordering dependencies are recomputed, so regathers keep one order (layers.order)
        return True if base is None else base(prim, *args, **params)

    return policy


def _layer(stacked: Any, i) -> Any:
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), stacked)


def _stack(first: Any, rest: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def prefetching_layer_scan(layer_fn: Callable, x: jax.Array, stacked_shards: Any, layer_axes: Any, axis,
                           zero_logical: str, reduce_dtype, fp8_names: frozenset = frozenset()) -> jax.Array:
    """`x` through every layer, `layer_fn(x, full_weights)`, the weights ZeRO-3-sharded over `axis`.

    A software pipeline over the layer scan: the all-gather of layer i+1's weights is issued before
    layer i computes and depends only on the stacked shards, so the collective overlaps the layer
    (XLA's async collectives; on GPUs the latency-hiding scheduler places it). Weights named in
    `fp8_names` travel as E4M3 (`fp8_gather_scales`). The backward walks the
    layers in reverse the same way: gather layer i-1 while layer i is recomputed from its saved input
    and differentiated, and reduce-scatter layer i+1's gradient (deferred one layer) meanwhile. Only
    each layer's input is kept for the backward (full remat), never a gathered weight.
    """
    dims = jax.tree.map(lambda axes: zero_dim_of(axes, zero_logical), layer_axes, is_leaf=is_axes_leaf)
    # When a gradient is taken the weights come as (shard, gradient sink) pairs (`with_sinks`): the values
    # are read from the shards (offload.params: in host memory, each layer's copied in by its gather, one
    # layer ahead like the gather) and the reduce-scattered gradients go to the sinks, in their dtype
    structure = jax.tree.structure(layer_axes, is_leaf=is_axes_leaf)
    leaves = structure.flatten_up_to(stacked_shards)
    sources = [leaf[0] if isinstance(leaf, tuple) else None for leaf in leaves]  # None: the shard itself
    stacked_shards = structure.unflatten([leaf[1] if isinstance(leaf, tuple) else leaf for leaf in leaves])
    grad_dtypes = structure.unflatten([w.dtype for w in structure.flatten_up_to(stacked_shards)])
    n_layers = jax.tree.leaves(stacked_shards)[0].shape[0]
    names = leaf_names(layer_axes)

    # On XLA:CPU every collective below runs in one order (jaxpar.layers.order): each group of gathers
    # or scatters is chained after what came before it, and each layer's compute after both.
    def gather(shards, i, start):
        def one(shard, source):  # offloaded: the slice itself meets the device copy (one async copy on XLA:GPU)
            source = shard if source is None else source
            if not on_host(source):
                return jax.lax.dynamic_index_in_dim(source, i, keepdims=False)
            return jax.device_put(jax.lax.dynamic_slice_in_dim(source, i, 1), jax.memory.Space.Device)[0]
        layer = [one(s, source) for s, source in zip(structure.flatten_up_to(shards), sources)]
        scales, start = fp8_gather_scales(layer, names, fp8_names, axis, start)

        def gather_one(w, d, scale):
            if scale is None:
                return jax.lax.all_gather(w, axis, axis=d, tiled=True)
            return fp8.all_gather_fp8(w, scale, axis, d).weight  # (this scan keeps no gathered weight: none to keep)
        return structure.unflatten(chain(gather_one, layer, structure.flatten_up_to(dims), scales, start=start))

    def scatter(full_grads, start):
        def one(g, d, dtype):
            summed = jax.lax.psum_scatter(g.astype(reduce_dtype or g.dtype), axis, scatter_dimension=d, tiled=True)
            return summed.astype(dtype)
        return chain(one, full_grads, dims, grad_dtypes, start=start)

    @jax.custom_vjp
    def scan(x, shards):
        return forward(x, shards)[0]

    def forward(x, shards):
        def body(carry, i):
            x, weights = carry
            upcoming = gather(shards, i + 1, start=(x, weights))  # issued before this layer's compute
            return (layer_fn(after(x, upcoming), weights), upcoming), x

        (x_last, weights), inputs = jax.lax.scan(body, (x, gather(shards, 0, start=x)), jnp.arange(n_layers - 1))
        # the last layer's input is kept apart: stacking it onto the scan's outputs would copy them all
        return layer_fn(x_last, weights), (inputs, x_last, shards)

    def backward(residuals, g):
        inputs, x_last, shards = residuals

        def differentiate(i, weights, g):
            last = isinstance(i, int) and i == n_layers - 1  # (the loop's traced i never is)
            x_i = x_last if last else jax.lax.dynamic_index_in_dim(inputs, i, keepdims=False)
            _, pullback = jax.vjp(layer_fn, after(x_i, g), weights)  # recompute after g's deps
            return pullback(g)

        weights = gather(shards, n_layers - 1, start=g)
        if n_layers == 1:
            g, d_weights = differentiate(0, weights, after(g, weights))
            done_0 = scatter(d_weights, start=(g, d_weights))
            return after(g, done_0), jax.tree.map(lambda s: s[None], done_0)
        upcoming = gather(shards, n_layers - 2, start=weights)
        g, pending = differentiate(n_layers - 1, weights, after(g, upcoming))

        def body(carry, i):  # i = n_layers - 2 .. 1
            g, weights, pending = carry
            upcoming = gather(shards, i - 1, start=(g, pending))
            done = scatter(pending, start=upcoming)  # layer i + 1's gradient, reduced while layer i is differentiated
            g, d_weights = differentiate(i, weights, after(g, done))
            return (g, upcoming, d_weights), done

        (g, weights, pending), done = jax.lax.scan(body, (g, upcoming, pending), jnp.arange(1, n_layers - 1),
                                                   reverse=True)
        done_1 = scatter(pending, start=(g, pending))
        g, d_weights_0 = differentiate(0, weights, after(g, done_1))
        done_0 = scatter(d_weights_0, start=(g, d_weights_0))
        return after(g, done_0), _stack(done_0, _stack(done_1, done))  # what follows waits for the scatters

    scan.defvjp(forward, backward)
    return scan(x, stacked_shards)


@dataclasses.dataclass(frozen=True)
class LayerHooks:
    """What jaxpar.layers.collectives calls where a weight is used under ZeRO 2-3; the runtime
    (jaxpar.parallel.step) passes LAYER_HOOKS in a Collectives with the ZeRO axes."""

    grad_tap: Callable
    reduce_tap: Callable
    gather_weight: Callable
    fetch: Callable
    copy_in: Callable
    prefetching_layer_scan: Callable
    gathered_name: str
    fp8_gather_scales: Callable


LAYER_HOOKS = LayerHooks(grad_tap, reduce_tap, gather_weight, fetched, copied_in, prefetching_layer_scan,
                         ZERO3_GATHERED, fp8_gather_scales)
