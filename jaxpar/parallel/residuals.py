"""Keeping a function's vjp residuals between a pipeline's forward slot and its backward slot.

`jax.vjp(fn, params, x)` returns a pullback whose pytree leaves are exactly what the backward needs
(under a remat policy, only what the policy saves; the rest is recomputed inside the pullback). A
1F1B stage keeps those leaves for every microbatch in flight and calls the pullback later, so no
stage forward is run twice. The leaves are of three kinds, found once by tracing (`make_jaxpr`):

- **parameters**: JAX passes a primal input it needs (a weight) into the pullback as the very same
  value. Never stashed: the backward slot hands in the current parameters again.
- **constants**: leaves that do not depend on `x` (RoPE tables, attention masks, scalars, anything
  computed from the parameters alone). Never stashed: the backward slot recomputes them from the
  parameters with only the part of the forward that produces them (a pruned jaxpr; it multiplies
  no activation, so it is cheap, and it holds no collective of `x`).
- **activations**: leaves that depend on `x`. Only these go into the stash, one entry per
  microbatch in flight.

`InputStash` is the low-memory alternative (`pipeline.stage_recompute=true`): it keeps only the
stage input and re-runs the stage forward under `jax.vjp` in the backward slot.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Var

from jaxpar.layers.collectives import varying_of


def _classify(jaxpr, n_params: int) -> list[tuple[str, int]]:
    """Per output of `jaxpr` (inputs: params..., x...): ("param", k), ("act", 0) or ("const", 0)."""
    param_vars = list(jaxpr.invars[:n_params])
    depends = set(jaxpr.invars[n_params:])
    for eqn in jaxpr.eqns:  # forward reachability from x
        if any(isinstance(v, Var) and v in depends for v in eqn.invars):
            depends.update(eqn.outvars)
    kinds = []
    for var in jaxpr.outvars:
        if isinstance(var, Var) and var in param_vars:
            kinds.append(("param", param_vars.index(var)))
        elif isinstance(var, Var) and var in depends:
            kinds.append(("act", 0))
        else:
            kinds.append(("const", 0))
    return kinds


def prune_jaxpr(jaxpr, outvars: list, invars: list | None = None):
    """The jaxpr computing only `outvars` (backward liveness over its equations), from `invars` (default:
    all of its inputs). Unlike XLA's dead-code elimination this drops unused collectives too."""
    live = {v for v in outvars if isinstance(v, Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, Var))
    inputs = list(jaxpr.invars if invars is None else invars)
    return jaxpr.replace(invars=inputs, outvars=list(outvars), eqns=kept[::-1])


def zeros_typed(aval):
    """Zeros of `aval`'s shape and dtype, typed as varying over the same mesh axes, in the same memory
    (residuals that remat.policy=offload keeps in host memory are stashed there)."""
    zeros, axes = jnp.zeros(aval.shape, aval.dtype), tuple(sorted(varying_of(aval)))
    zeros = jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
    space = getattr(aval, "memory_space", None)
    return jax.device_put(zeros, space) if space is not None and space != jax.typeof(zeros).memory_space else zeros


def read_before_write(buffers: list, index) -> tuple[list, list]:
    """(`buffers`, the same values, and their entries at `index`) such that whatever is written into a
    returned buffer is written after its entry was read: XLA then need not copy a buffer to keep the old
    entry for a reader it scheduled after an in-place write. One optimization barrier per buffer: a
    barrier types its outputs alike, so one over all would make every entry as varying over the mesh
    axes as the most varying buffer."""
    pairs = [jax.lax.optimization_barrier((buf[index], buf)) for buf in buffers]
    return [buf for _, buf in pairs], [entry for entry, _ in pairs]


class ResidualStash:
    """Split `fn(params, x)`'s vjp into a forward that returns the activation residuals to keep and a
    backward that rebuilds the pullback from them, the current params and recomputed constants.
    With `has_aux`, fn returns (y, aux) and the forward returns ((y, aux), residuals), aux not
    differentiated (zb's linear inputs, jaxpar.parallel.split_backward)."""

    def __init__(self, fn: Callable, params, x, has_aux: bool = False):
        self.fn, self.has_aux = fn, has_aux
        captured = {}

        def residuals(p, x_in):
            pullback = jax.vjp(fn, p, x_in, has_aux=has_aux)[1]
            leaves, captured["treedef"] = jax.tree.flatten(pullback)
            return leaves

        closed = jax.make_jaxpr(residuals)(params, x)
        self.treedef = captured["treedef"]
        n_params = len(jax.tree.leaves(params))
        self.kinds = _classify(closed.jaxpr, n_params)
        const_vars = [v for v, (kind, _) in zip(closed.jaxpr.outvars, self.kinds) if kind == "const"]
        self._const_jaxpr, self._consts = prune_jaxpr(closed.jaxpr, const_vars, closed.jaxpr.invars[:n_params]), closed.consts
        self.act_avals = [aval for aval, (kind, _) in zip(closed.out_avals, self.kinds) if kind == "act"]

    def forward(self, params, x):
        """(fn(params, x), the activation residuals to stash)."""
        y, pullback, *aux = jax.vjp(self.fn, params, x, has_aux=self.has_aux)
        leaves = jax.tree.leaves(pullback)
        return (y, *aux) if self.has_aux else y, [leaf for leaf, (kind, _) in zip(leaves, self.kinds) if kind == "act"]

    def backward(self, params, acts: list, cotangent):
        """(d params, d x) of the microbatch whose activation residuals are `acts`."""
        param_leaves = jax.tree.leaves(params)
        consts = iter(jax.core.eval_jaxpr(self._const_jaxpr, self._consts, *param_leaves))
        acts = iter(acts)
        leaves = []
        for kind, index in self.kinds:
            leaves.append(param_leaves[index] if kind == "param" else next(consts) if kind == "const" else next(acts))
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)

    def stash_avals(self) -> list:
        """Abstract values (with their mesh-axis typing) of the activation residuals of one microbatch."""
        return list(self.act_avals)


class InputStash:
    """Stage-level recomputation: keep the stage input, re-run the forward under vjp in the backward."""

    def __init__(self, fn: Callable, params, x):
        self.fn, self.x_aval = fn, jax.typeof(x)

    def forward(self, params, x):
        return self.fn(params, x), [x]

    def backward(self, params, acts: list, cotangent):
        _, pullback = jax.vjp(self.fn, params, acts[0])
        return pullback(cotangent)

    def stash_avals(self) -> list:
        return [self.x_aval]

