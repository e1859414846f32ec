"""Zero-bubble's split backward: input gradients in B, weight gradients later in W, nothing run twice.

A linear y = x w has two gradients: dx = dy w^T, which the previous stage waits for (B, on the
critical path), and dw = x^T dy, which nobody waits for (W, moved into the pipeline's idle ticks).
Megatron's zero-bubble keeps (x, dy) of every linear between the two; so does jaxpar, in JAX terms:

- **B** differentiates a layer with its matrix weights held constant (`stop_gradient` where a linear
  uses them) and with a zero *probe* added to every linear's output. The probe's cotangent is that
  linear's output gradient dy, so B returns dx, every dy, and the small weights' gradients (the
  norms: elementwise, they stay in B), without a single weight-gradient matmul.
- The **forward** (F) of that same function keeps every linear's input x as an extra output (one
  copy per distinct input: q, k and v share theirs, as do gate and up), stashed beside the residuals.
- **W** is the gradient, with respect to the weights, of sum_i <x_i w_i, dy_i>: exactly the
  weight-gradient matmuls (through whatever the layer does to a weight before using it, e.g. picking
  this rank's KV head), and nothing else. It is traced from the layer's own code, and everything
  the sum does not need (the attention, the norms, the activations' collectives) is cut from it
  before it runs (`prune_jaxpr`), so W issues no activation collective.

The model takes part only by calling `Collectives.linear` for its weight matmuls (and the layer
scan, `Collectives.scan_layers`); both hand over to the `SplitBackward` the pipeline put into the
collectives. Its mode is Python state set while a function is traced: None (plain einsum, every
other use of the same model code), "shapes" (one layer traced to learn the probes' and inputs'
types), "B" or "W". Every pass computes the product with the collectives' own `matmul`, so under
precision=fp8 B's dx and W's dw are the FP8 linear's GEMMs (docs/design.md "FP8 GEMMs"). The cost:
the stash keeps the linears' inputs, and the output gradients of every linear wait in their own
buffer from B to W (docs/design.md, "Zero bubble").
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Var

from jaxpar.parallel.residuals import ResidualStash, prune_jaxpr, zeros_typed


class SplitBackward:
    """The per-trace state behind `Collectives.linear` / `scan_layers` for a zb pipeline's chunks."""

    def __init__(self):
        self.mode: str | None = None
        self.layout: dict | None = None  # from the shapes pass: probe avals, input avals, input index per linear
        self._layer_state: dict = {}  # the layer being traced: its probes / (inputs, dy) and what it recorded
        self._scan_out = None  # B: the stacked linear inputs; W: the objective
        self._probes = None  # B: every linear's probe, stacked by layer
        self._w_inputs = None  # W: (the kept linear inputs, the output gradients), stacked by layer

    # ----------------------------------------------------------------- called from Collectives
    def linear(self, equation: str, x: jax.Array, w, matmul: Callable = jnp.einsum) -> jax.Array:
        """matmul(equation, x, w) (Collectives.matmul: a plain einsum, or under fp8 an FP8 GEMM whose `w` may
        carry its quantized bits or counters), with the current mode's extra (module docstring)."""
        state = self._layer_state
        if self.mode is None:
            return matmul(equation, x, w)
        call = state["calls"]
        state["calls"] += 1
        if self.mode == "shapes":
            seen = state["inputs"]
            index = next((k for k, s in enumerate(seen) if s is x), None)
            if index is None:
                index = len(seen)
                seen.append(x)
            y = matmul(equation, x, w)
            state["probe_avals"].append(jax.typeof(y))
            state["input_index"].append(index)
            state["weights_used"].append(w)
            return y
        if self.mode == "B":  # w arrives held constant (forward): its gradient is W's
            index = self.layout["input_index"][call]
            if index == len(state["inputs"]):
                state["inputs"].append(x)
            if state["inputs"][index] is not x:
                raise AssertionError("a linear's input differs from the shapes pass: the layer is not deterministic")
            return matmul(equation, x, w) + state["probes"][call]
        # W: the same weight use on the kept input; its output's inner product with dy enters the objective
        x_kept, dy = state["inputs"][self.layout["input_index"][call]], state["dy"][call]
        y = matmul(equation, x_kept, w)
        state["terms"].append(jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)))
        return y

    def scan_layers(self, layer_fn: Callable, x: jax.Array, stacked, remat_policy: Callable | None) -> jax.Array:
        """The body's layer scan in the current mode; a chunk body has exactly one."""
        if self._scan_out is not None:
            raise AssertionError("a zb chunk body scanned its layers twice; the split expects one layer scan")
        if self.mode == "shapes":
            self._trace_one_layer(layer_fn, x, stacked)
            return x
        if self.mode == "B":
            return self._scan_b(layer_fn, x, stacked, remat_policy)
        return self._scan_w(layer_fn, x, stacked)

    @property
    def deferring(self) -> bool:
        """Whether a split trace is under way (the layer scan is then the split's)."""
        return self.mode is not None

    # ----------------------------------------------------------------- the three traces of a chunk
    def describe(self, body: Callable, params, x) -> dict:
        """Trace `body(params, x)` once in "shapes" mode: per linear call (per layer, in call order) its
        output type (the probe's) and which distinct input it reads; the distinct inputs' types."""
        self.mode, self._scan_out = "shapes", None
        try:
            jax.make_jaxpr(body)(params, x)
        finally:
            self.mode = None
        return self.layout

    def forward(self, body: Callable, params, x, probes):
        """(body(params, x), every linear's input, stacked by layer), a zero probe added to every
        linear's output: differentiated by B with the matrix weights held constant."""
        self._probes = probes
        # held constant here, at the chunk's top, not at each use: a constant made inside the layer
        # scan would be one of its residuals, a copy of the weights for every microbatch in flight
        params = jax.tree.map(lambda w, m: jax.lax.stop_gradient(w) if m else w, params, self.layout["matrix"])
        self.mode, self._scan_out = "B", None
        try:
            y = body(params, x)
        finally:
            self.mode = None
        return y, self._scan_out

    def weight_grads(self, body: Callable, params, inputs, dy, x_unused):
        """W: d/d params of sum over linears of <input w, dy>, layer by layer (the matmuls of dw only)."""
        def objective(p):
            self.mode, self._scan_out, self._w_inputs = "W", None, (inputs, dy)
            try:
                body(p, x_unused)
            finally:
                self.mode = None
            return self._scan_out
        return jax.grad(objective, allow_int=True)(params)  # (fp8: a stage's quantized bits, uint8, get float0)

    # ----------------------------------------------------------------- one layer
    def _begin_layer(self, **state) -> dict:
        self._layer_state = {"calls": 0, "inputs": [], **state}
        return self._layer_state

    def _trace_one_layer(self, layer_fn, x, stacked):
        """The layout of one layer's linears, and which weights they use ("matrix": a tree of bools
        like `stacked`, found by liveness from the weights each linear receives)."""
        first = jax.tree.map(lambda w: w[0], stacked)
        recorded = {}

        def weights_used(weights, x):
            state = self._begin_layer(probe_avals=[], input_index=[], weights_used=[])
            layer_fn(x, weights)
            recorded.update(state, input_avals=[jax.typeof(s) for s in state["inputs"]])
            return state["weights_used"]

        closed = jax.make_jaxpr(weights_used)(first, x)
        pruned = prune_jaxpr(closed.jaxpr, closed.jaxpr.outvars)
        used = {v for v in [*pruned.outvars, *(v for eqn in pruned.eqns for v in eqn.invars)] if isinstance(v, Var)}
        leaves, treedef = jax.tree.flatten(first)
        matrix = [var in used for var in closed.jaxpr.invars[:len(leaves)]]
        n_layers = jax.tree.leaves(stacked)[0].shape[0]
        stack = lambda aval: aval.update(shape=(n_layers,) + aval.shape)  # noqa: E731
        self.layout = {"probe_avals": [stack(a) for a in recorded["probe_avals"]],
                       "input_avals": [stack(a) for a in recorded["input_avals"]],
                       "input_index": list(recorded["input_index"]),
                       "matrix": jax.tree.unflatten(treedef, matrix)}

    def _scan_b(self, layer_fn, x, stacked, remat_policy):
        def layer(x, weights_and_probes):
            weights, probes = weights_and_probes
            state = self._begin_layer(probes=probes)
            y = layer_fn(x, weights)
            return y, tuple(state["inputs"])

        if remat_policy is not None:
            layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
        y, inputs = jax.lax.scan(layer, x, (stacked, tuple(self._probes)))
        self._scan_out = list(inputs)
        return y

    def _scan_w(self, layer_fn, x, stacked):
        inputs, dy = self._w_inputs

        def objective(weights, x, inputs_l, dy_l):
            state = self._begin_layer(dy=dy_l, terms=[])
            state["inputs"] = list(inputs_l)
            layer_fn(x, weights)
            return sum(state["terms"])

        at = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
        closed = jax.make_jaxpr(objective)(at(stacked), x, at(inputs), at(dy))
        jaxpr = prune_jaxpr(closed.jaxpr, closed.jaxpr.outvars)  # the sum's own work only (module docstring)

        def step(total, layer_inputs):
            weights, inputs_l, dy_l = layer_inputs
            args = jax.tree.leaves((weights, x, inputs_l, dy_l))
            return total + jax.core.eval_jaxpr(jaxpr, closed.consts, *args)[0], None

        total, _ = jax.lax.scan(step, zeros_typed(closed.out_avals[0]), (stacked, inputs, dy))
        self._scan_out = total
        return x


class SplitStash:
    """The pipeline's stash for zb (same interface as ResidualStash, plus `weight_grads`): F keeps
    B's residuals and the linears' inputs; B returns the output gradients for W to keep."""

    def __init__(self, split: SplitBackward, body: Callable, params, x):
        self.split, self.body = split, body
        layout = split.describe(body, params, x)
        self.probe_avals, self.input_avals = layout["probe_avals"], layout["input_avals"]
        # the probes go with the parameters, not the activation: zeros that, like a weight, JAX hands to
        # the pullback as themselves (a checkpointed layer keeps its inputs), so they are never stashed
        forward = lambda params_and_probes, x: split.forward(body, params_and_probes[0], x,  # noqa: E731
                                                             params_and_probes[1])
        self.inner = ResidualStash(forward, (params, self._zero_probes()), x, has_aux=True)
        self.n_residuals = len(self.inner.stash_avals())

    def _zero_probes(self) -> list:
        return [zeros_typed(a) for a in self.probe_avals]

    def forward(self, params, x):
        """(chunk output, what to stash: B's residuals, then the linears' inputs)."""
        (y, inputs), residuals = self.inner.forward((params, self._zero_probes()), x)
        return y, list(residuals) + list(inputs)

    @property
    def matrix(self):
        """Which layer weights (a tree of bools like the chunk's) the linears use: W's, not B's."""
        return self.split.layout["matrix"]

    def backward(self, params, stashed: list, cotangent):
        """(gradients of the small weights (the matrix weights' are zero here), d x, every linear's d y)."""
        (d_params, dy), dx = self.inner.backward((params, self._zero_probes()), stashed[:self.n_residuals], cotangent)
        return d_params, dx, list(dy)

    def weight_grads(self, params, stashed: list, dy: list, x_unused):
        """The matrix weights' gradients (the small weights' are zero here)."""
        return self.split.weight_grads(self.body, params, list(stashed[self.n_residuals:]), dy, x_unused)

    def stash_avals(self) -> list:
        return self.inner.stash_avals() + list(self.input_avals)

    def output_grad_avals(self) -> list:
        return list(self.probe_avals)
