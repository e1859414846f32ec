"""ZeRO in one place: what each stage shards, reduces and gathers, for the LLM and the vision encoder.

ZeRO shards state over the data-parallel axes on one logical dim of every weight ("embed"; the rules
table in jaxpar.sharding says which mesh axes). Per stage (DeepSpeed's semantics):

| stage | sharded over dp                     | gradient reduction over dp                      | gathered per use      |
|-------|-------------------------------------|-------------------------------------------------|-----------------------|
| 0     | nothing                             | all-reduce per layer inside the backward        | -                     |
|       |                                     | (reduce taps); with a pipeline or accumulation  |                       |
|       |                                     | one after the backward                          |                       |
| 1     | optimizer state, fp32 master        | as stage 0; each rank updates its shard         | -                     |
| 2     | + gradients                         | reduce-scatter per layer inside the backward    | -                     |
|       |                                     | (grad taps); with a pipeline, per part once its |                       |
|       |                                     | gradient is final (jaxpar.parallel.pipeline)    |                       |
| 3     | + compute-dtype weights             | reduce-scatter per layer (the gather's          | each layer's weights, |
|       |                                     | transpose)                                      | prefetched one ahead  |

Every reduction moves gradients in `grad_reduce`'s dtype (fp32 unless the user picks bf16).

- `StateSpecs`: the PartitionSpecs of params / grads / optimizer state / master per stage.
- `ZeroPlan`: which of the mechanisms below one run uses (dp size, pipeline and remat decide).
- `reduce_gradients`: the stage 0-2 reduction after the backward (a pipeline, accumulation).
- `reduce_tap` (stages 0-1): the per-layer all-reduce inside the backward; an all-reduce moves twice
  a reduce-scatter's bytes, so ZeRO-2 (`grad_tap`) halves the gradient traffic for the same overlap.
- `grad_tap` (stage 2) and `gather_weight` (stage 3): the per-layer reduce-scatter inside the backward.
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

from jaxpar.layers.collectives import varying_of
from jaxpar.layers.order import after, after_p, chain
from jaxpar.sharding import Rules, is_axes_leaf, llm_rules, tree_specs, unused_mesh_axes, zero_dim

ZERO3_GATHERED = "zero3_gathered"  # checkpoint name of all-gathered ZeRO-3 weights: never saved for backward


class StateSpecs:
    """PartitionSpecs of params / grads / optimizer state / master weights for one ZeRO stage."""

    def __init__(self, axes_tree: Any, stage: int, mesh, rules: Rules | None = None):
        unused = unused_mesh_axes(mesh)
        rules = rules or llm_rules(mesh)
        self.axes = axes_tree
        self.stage = stage
        self.params = tree_specs(axes_tree, stage >= 3, unused, rules)
        self.grads = tree_specs(axes_tree, stage >= 2, unused, rules)
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
    def taps_grads(self) -> bool:
        """ZeRO-2 without a pipeline reduce-scatters per layer inside the backward; with a pipeline,
        gradients accumulate over microbatches and each part (head, layer chunk, embedding) is
        reduce-scattered once it is final."""
        return self.stage == 2 and self.dp > 1 and not self.pipelined

    @property
    def reduces_in_backward(self) -> bool:
        """ZeRO 0-1 without a pipeline or accumulation all-reduce each weight's gradient where the
        backward leaves it (reduce_tap): per layer inside the layer scan. With accumulation that
        would reduce every microbatch (DDP's no_sync case), so those reduce once after."""
        return self.stage <= 1 and self.dp > 1 and not self.pipelined and self.grad_accum == 1

    @property
    def reduces_after_backward(self) -> bool:
        """Gradients reduced after their backward (stages 0-1 with a pipeline or accumulation,
        pipelined stage 2): once, or with a pipeline part by part as the schedule finishes each."""
        return self.dp > 1 and not (self.gathers_weights or self.taps_grads or self.reduces_in_backward)


def reduce_gradients(grads, logical_axes, mesh_axes, scatter: bool, rules: Rules, dtype):
    """Sum gradients over `mesh_axes` (ZeRO 0/1: all-reduce) or reduce-scatter each one on its ZeRO
    dim (ZeRO 2), moving them in `dtype` (fp32 by default; bf16 with grad_reduce=bf16)."""
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
    reduce-scattered over `axis`: ZeRO-2's reduce-scatter, issued per layer inside the backward."""
    @jax.custom_vjp
    def tap(full, shard):
        return full

    def backward(_, cotangent):
        return None, _scatter(cotangent, axis, dim, reduce_dtype)

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
    the form `gather_weight` and `prefetching_layer_scan` take under offload.params."""
    return jax.tree.map(lambda h, s: (h, s) if on_host(h) else s, host, sinks)


def gradient_sinks(host: Any) -> Any:
    """Device stand-ins for host weights, typed alike (shape, dtype, varying axes); see `fetch`."""
    def sink(w):
        zeros, axes = jnp.zeros(w.shape, w.dtype), tuple(sorted(varying_of(jax.typeof(w))))
        return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
    return jax.tree.map(sink, host)


def fetched(w: Any) -> jax.Array:
    """A weight to compute with: `fetch`ed from a (host, sink) pair, copied in from the host where no
    gradient is taken (evaluation), else as it is."""
    if isinstance(w, tuple):
        return fetch(*w)
    return jax.device_put(w, jax.memory.Space.Device) if on_host(w) else w


def gather_weight(axis, dim: int, reduce_dtype):
    """ZeRO-3's all-gather of a dp-sharded weight; its transpose reduce-scatters the gradient, in
    `reduce_dtype` when one is given (fp32 sums of bf16 weights' gradients), else the weight's dtype."""
    def gather(w):
        return jax.lax.all_gather(w, axis, axis=dim, tiled=True)

    if reduce_dtype is None:
        return gather

    @jax.custom_vjp
    def gather_reducing_wide(w):
        return gather(w)

    gather_reducing_wide.defvjp(lambda w: (gather(w), None),
                                lambda _, cotangent: (_scatter(cotangent, axis, dim, reduce_dtype),))
    return gather_reducing_wide


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
                           zero_logical: str, reduce_dtype) -> jax.Array:
    """`x` through every layer, `layer_fn(x, full_weights)`, the weights ZeRO-3-sharded over `axis`.

    A software pipeline over the layer scan: the all-gather of layer i+1's weights is issued before
    layer i computes and depends only on the stacked shards, so the collective overlaps the layer
    (XLA's async collectives; on GPUs the latency-hiding scheduler places it). The backward walks the
    layers in reverse the same way: gather layer i-1 while layer i is recomputed from its saved input
    and differentiated, and reduce-scatter layer i+1's gradient (deferred one layer) meanwhile. Only
    each layer's input is kept for the backward (full remat), never a gathered weight.
    """
    dims = jax.tree.map(lambda axes: axes.index(zero_logical), layer_axes, is_leaf=is_axes_leaf)
    # offload.params: (host shards, gradient sinks) pairs (host shards alone where no gradient is taken:
    # evaluation); each layer's shard is copied in by its gather,
    # so the copy runs one layer ahead like the gather, and the gradients go to the sinks (`fetch`)
    structure = jax.tree.structure(layer_axes, is_leaf=is_axes_leaf)
    leaves = structure.flatten_up_to(stacked_shards)
    host_leaves = [leaf[0] if isinstance(leaf, tuple) else leaf if on_host(leaf) else None for leaf in leaves]
    stacked_shards = structure.unflatten([leaf[1] if isinstance(leaf, tuple) else leaf for leaf in leaves])
    n_layers = jax.tree.leaves(stacked_shards)[0].shape[0]

    # On XLA:CPU every collective below runs in one order (jaxpar.layers.order): each group of gathers
    # or scatters is chained after what came before it, and each layer's compute after both.
    def gather(shards, i, start):
        def one(shard, host):  # offloaded: the slice itself meets the device copy (one async copy on XLA:GPU)
            if host is None:
                return jax.lax.dynamic_index_in_dim(shard, i, keepdims=False)
            return jax.device_put(jax.lax.dynamic_slice_in_dim(host, i, 1), jax.memory.Space.Device)[0]
        layer = structure.unflatten([one(s, h) for s, h in zip(structure.flatten_up_to(shards), host_leaves)])
        return chain(lambda w, d: jax.lax.all_gather(w, axis, axis=d, tiled=True), layer, dims, start=start)

    def scatter(full_grads, start):
        return chain(lambda g, d: _scatter(g, axis, d, reduce_dtype), full_grads, dims, start=start)

    @jax.custom_vjp
    def scan(x, shards):
        return forward(x, shards)[0]

    def forward(x, shards):
        def body(carry, i):
            x, weights = carry
            upcoming = gather(shards, i + 1, start=(x, weights))  # issued before this layer's compute
            return (layer_fn(after(x, upcoming), weights), upcoming), x

        (x_last, weights), inputs = jax.lax.scan(body, (x, gather(shards, 0, start=x)), jnp.arange(n_layers - 1))
        return layer_fn(x_last, weights), (_stack_last(inputs, x_last), shards)

    def backward(residuals, g):
        inputs, shards = residuals

        def differentiate(i, weights, g):
            x_i = after(jax.lax.dynamic_index_in_dim(inputs, i, keepdims=False), g)  # recompute after g's deps
            _, pullback = jax.vjp(layer_fn, x_i, weights)
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


def _stack_last(inputs: jax.Array, last: jax.Array) -> jax.Array:
    return jnp.concatenate([inputs, last[None]])


@dataclasses.dataclass(frozen=True)
class LayerHooks:
    """What jaxpar.layers.collectives calls where a weight is used under ZeRO 2-3; the runtime
    (jaxpar.parallel.step) passes LAYER_HOOKS in a Collectives with the ZeRO axes."""

    grad_tap: Callable
    reduce_tap: Callable
    gather_weight: Callable
    fetch: Callable
    prefetching_layer_scan: Callable
    gathered_name: str


LAYER_HOOKS = LayerHooks(grad_tap, reduce_tap, gather_weight, fetched, prefetching_layer_scan, ZERO3_GATHERED)
