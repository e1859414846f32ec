"""One order of collectives on every emulated device: `after`, `chain` and `ordered_both_ways`.

XLA:CPU runs each emulated device's program on its own threads and starts any instruction whose
operands are ready. Two collectives that no data path orders can therefore be entered in one order by
one device and in the other by another, each then waiting in a rendezvous the other never joins (and
every shard_map collective carries channel_id 1, XLA:CPU's rendezvous op_id, so two collectives over
one group can even be matched with each other). XLA:CPU's own collective ordering only fixes the
order in which they are launched, not that one ends before the next begins, and a program loaded from
the compilation cache loses even that. `lax.optimization_barrier` does not help: XLA:CPU's pipeline
expands barriers away before scheduling. So jaxpar orders every pair with a real data dependency:

* `after(x, *deps)` is `x`, bit for bit (NaN, inf, -0 and integers included), computed only once
  `deps` are. It is a primitive of its own (`after_p`), lowered to `x - z` where `z` is +0.0 derived
  from the first and last elements of each dependency (both ends of a concatenation) as `select(t == t, |t|, 0)` with `t = d * 0`: +0.0 for every
  value of `d` (t is +-0 or NaN), which XLA cannot fold; `x - 0` is then computed on `x`'s bits as
  unsigned integers (float arithmetic on XLA:CPU would flush subnormals), booleans or with false. As a primitive it keeps
  `x`'s type: a shard_map value stays invariant over the mesh axes it was invariant over, whatever
  the dependency varies over (arithmetic on the two would make it varying). Its JVP passes tangents
  through, so it costs nothing in the backward.
* `chain(fn, *trees)` applies a collective `fn` leaf by leaf, each leaf's input after the previous
  leaf's result: one order for a tree of gradient reductions or weight gathers.
* `ordered_both_ways(x, dep)` also orders the backward: the cotangent of `dep` waits for the
  cotangent of `x`, so the transposed collectives run in the reverse order of the forward ones;
  `chain_both_ways` chains a tree so.
* `backward_ordered(x, weights)`: x's cotangent waits for the weights' (nothing in the forward);
  `cotangent_after(y, dep)`: the backward uses `y`'s cotangent only once `dep` is (re)computed;
  `cotangent_summed(y)`: only once all of it is summed.

All three are the identity off the CPU backend: NCCL runs each device's collectives on ordered
streams, and a dependency there would only serialise communication behind compute. The one exception
is `after_on_every_backend`, for two collectives XLA's GPU combiners would otherwise merge into one, or an order
that keeps memory down (jaxpar.layers.ring). The backend is
the one the step is traced for (`jax.default_backend()`, or `ordering(True/False)` where a program is
compiled for another platform than the one running, as the GPU dry run does).
jaxpar/compiler/hlo_order.py finds the pairs left unordered in a compiled program; tests/test_collective_order.py
asserts there are none over the matrix of layouts.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("jaxpar_collective_ordering", default=None)


@contextlib.contextmanager
def ordering(on: bool):
    """Trace with collective ordering on or off whatever the default backend (a program compiled for
    GPUs from a CPU process keeps its freedom; one compiled for CPU devices is ordered)."""
    token = _FORCED.set(on)
    try:
        yield
    finally:
        _FORCED.reset(token)


def ordering_on() -> bool:
    forced = _FORCED.get()
    return forced if forced is not None else jax.default_backend() == "cpu"


# ----------------------------------------------------------------------------- the primitive
after_p = Primitive("jaxpar_after")
after_p.multiple_results = True


def _exact_zero(deps) -> jax.Array:
    """+0.0 (float32) computed from one element of each dependency, whatever their values."""
    zero = None
    for dep in deps:
        if dep.size == 0:
            continue
        flat = jnp.ravel(dep)
        # the first and the last element: XLA simplifies a slice of a concatenation to a slice of the one
        # operand it reads, so one element of [image tokens, text] would wait for the image tokens only
        # (the VLA's first layer gathers ran beside the text embedding's psum)
        ends = (0,) if dep.size == 1 else (0, dep.size - 1)
        for index in ends:
            element = jax.lax.reshape(jax.lax.slice(flat, (index,), (index + 1,)), ())
            if jnp.issubdtype(element.dtype, jnp.complexfloating):
                element = jnp.real(element)
            t = element.astype(jnp.float32) * np.float32(0.0)  # +-0, or NaN for inf / NaN
            z = jnp.where(t == t, jnp.abs(t), np.float32(0.0))  # +0 in every case
            zero = z if zero is None else zero + z
    # sqrt(+0) = +0, and an op XLA's fusion counts as expensive: it computes the zero once rather than
    # duplicating it, with its reads of the dependencies, into every fusion that uses `after`'s result
    # (each copy kept the whole dependency alive until that use: +16.8 GB for vla70b on 16 devices)
    return None if zero is None else jax.lax.sqrt(zero)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _apply(x: jax.Array, zero: jax.Array) -> jax.Array:
    """`x - 0` on its bits: floating-point arithmetic on XLA:CPU flushes subnormals to zero, integer
    arithmetic changes nothing."""
    if x.size == 0:
        return x
    if x.dtype == jnp.bool_:
        return x | zero.astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _UINT:
        unsigned = _UINT[x.dtype.itemsize]
        raw = jax.lax.bitcast_convert_type(x, unsigned) - zero.astype(unsigned)
        return jax.lax.bitcast_convert_type(raw, x.dtype)
    return x - zero.astype(x.dtype)


def _after_impl(*args, n: int):
    xs, deps = args[:n], args[n:]
    zero = _exact_zero(deps)
    return list(xs) if zero is None else [_apply(x, zero) for x in xs]


def _plain(aval):
    """The aval without shard_map's varying-axes annotation: the lowering is plain elementwise math."""
    return jax.core.ShapedArray(aval.shape, aval.dtype)


def _after_lowering(ctx, *args, n: int):
    plain = ctx.replace(avals_in=[_plain(a) for a in ctx.avals_in], avals_out=[_plain(a) for a in ctx.avals_out])
    return mlir.lower_fun(_after_impl, multiple_results=True)(plain, *args, n=n)


def _after_jvp(primals, tangents, *, n: int):
    return after_p.bind(*primals, n=n), list(tangents[:n])


def _after_batch(args, dims, *, n: int):
    return after_p.bind(*args, n=n), list(dims[:n])


after_p.def_impl(_after_impl)
after_p.def_abstract_eval(lambda *avals, n: list(avals[:n]))
mlir.register_lowering(after_p, _after_lowering)
ad.primitive_jvps[after_p] = _after_jvp
batching.primitive_batchers[after_p] = _after_batch


# ----------------------------------------------------------------------------- the helpers
def _arrays(tree) -> list:
    return [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype") and leaf.dtype != jax.dtypes.float0]


def after(x: Any, *dependencies: Any) -> Any:
    """`x` (an array or a tree), usable only once every array in `dependencies` is computed; its
    values and type unchanged. The identity where collectives keep their freedom (GPUs)."""
    if not ordering_on():
        return x
    deps = [d for d in _arrays(dependencies) if d.size]  # no stop_gradient: a remat policy would save it
    if not deps:
        return x
    leaves, treedef = jax.tree.flatten(x)
    index = [k for k, leaf in enumerate(leaves) if hasattr(leaf, "dtype") and leaf.dtype != jax.dtypes.float0]
    if not index:
        return x
    out = after_p.bind(*[jnp.asarray(leaves[k]) for k in index], *deps, n=len(index))
    for k, value in zip(index, out):
        leaves[k] = value
    return jax.tree.unflatten(treedef, leaves)


def after_on_every_backend(x: Any, *dependencies: Any) -> Any:
    """`after`, on GPUs too: for two collectives XLA must keep apart (its collective combiners merge
    independent collectives over the same devices into one, which then waits for the last of them: a
    pipeline's early gradient reductions would all run after its last tick, with nothing to overlap), or
    for memory: context parallelism's block backward waits for the previous block's gradients to be
    added, where XLA's GPU scheduler would run every block first and keep all their gradients
    (jaxpar.layers.ring)."""
    with ordering(True):
        return after(x, *dependencies)


def _chained(wait: Callable, fn: Callable, tree: Any, rest: tuple, start: Any, is_leaf) -> Any:
    """`jax.tree.map(fn, tree, *rest)`, each leaf's input made to `wait` for the previous result."""
    if not ordering_on():
        return jax.tree.map(fn, tree, *rest, is_leaf=is_leaf)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    others = [treedef.flatten_up_to(r) for r in rest]
    out, previous = [], start
    for k, leaf in enumerate(leaves):
        result = fn(wait(leaf, previous) if previous is not None else leaf, *(o[k] for o in others))
        out.append(result)
        previous = result
    return jax.tree.unflatten(treedef, out)


def chain(fn: Callable, tree: Any, *rest: Any, start: Any = None, is_leaf=None) -> Any:
    """`jax.tree.map(fn, tree, *rest)`, each call's first argument made to wait for the previous
    call's result (the first one for `start`): one order for a tree of collectives."""
    return _chained(after, fn, tree, rest, start, is_leaf)


def chain_both_ways(fn: Callable, tree: Any, *rest: Any, start: Any = None, is_leaf=None) -> Any:
    """`chain`, with the backward ordered too: each leaf's input is `ordered_both_ways` after the
    previous result, so the transposes of `fn` (e.g. ZeRO-3's reduce-scatters of its all-gathers)
    run one after another in the reverse order, and `start`'s cotangent waits for all of them."""
    return _chained(ordered_both_ways, fn, tree, rest, start, is_leaf)


def ordered_both_ways(x: Any, dependency: Any) -> Any:
    """`after(x, dependency)`, whose backward also waits: `dependency`'s cotangent is made to depend
    on `x`'s, so the transposes of the collectives that made `dependency` run after those that
    consume `x`'s cotangent (the reverse of the forward order, on every device)."""
    if not ordering_on():
        return x

    @jax.custom_vjp
    def order(x, dep):
        return after(x, dep)

    def forward(x, dep):
        return after(x, dep), dep

    def backward(dep, cotangent):
        return cotangent, jax.tree.map(lambda d: _zero_cotangent(d, cotangent), dep)

    order.defvjp(forward, backward)
    return order(x, dependency)


def backward_ordered(x: Any, weights: Any) -> tuple[Any, Any]:
    """(x, weights) unchanged, whose backward uses x's cotangent only once the weights' cotangent is
    computed: a tp sum of the gradient of a weight replicated over tp (sequence parallelism's norm
    gains) then comes before the collectives of the backward that consumes x's cotangent. Nothing is
    added to the forward (no copy of the weights, nothing for a pipeline to stash)."""
    if not ordering_on():
        return x, weights

    @jax.custom_vjp
    def pair(x, weights):
        return x, weights

    def backward(_, cotangents):
        d_x, d_weights = cotangents
        return after(d_x, d_weights), d_weights

    pair.defvjp(lambda x, weights: ((x, weights), None), backward)
    return pair(x, weights)


def cotangent_after(y: Any, dependency: Any) -> Any:
    """`y`, whose cotangent is used only once `dependency` is computed in the backward: under remat
    the backward recomputes `dependency` (e.g. a layer's weights, all-gathered again), and these
    collectives then come before the ones the layer's backward runs on its cotangent."""
    if not ordering_on():
        return y

    @jax.custom_vjp
    def wait(y, dep):
        return y

    def backward(dep, cotangent):
        return after(cotangent, dep), jax.tree.map(lambda d: None, dep)

    wait.defvjp(lambda y, dep: (y, dep), backward)
    return wait(y, dependency)


def cotangent_summed(y: Any) -> Any:
    """`y`, whose backward starts only once its whole cotangent is summed: a `y` used twice (a pipeline
    tick's output, sent on and fed to the head) otherwise lets XLA start the backward on one part of
    the cotangent, its collectives unordered with those that compute the other part."""
    if not ordering_on():
        return y

    @jax.custom_vjp
    def summed(y):
        return y

    summed.defvjp(lambda y: (y, None), lambda _, cotangent: (after(cotangent, cotangent),))
    return summed(y)


def _zero_cotangent(primal, cotangent):
    """Zeros shaped as `primal`'s cotangent, computed after `cotangent`."""
    if not jnp.issubdtype(primal.dtype, jnp.inexact):
        return np.zeros(primal.shape, jax.dtypes.float0)
    return after(jnp.zeros_like(primal), cotangent)
