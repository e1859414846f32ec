"""The pipeline's first input (the embedding; a VLA's image tokens first) and its gradient.

Only m of the v m + p - 1 forward ticks run stage 0's chunk 0, so the first inputs of all m
microbatches are computed (with their pp x tp all-reduce) in one loop before the ticks, into an
[m, ...] buffer the F slots read: m all-reduces where a tick-by-tick call ran one per tick (vla70b,
v = 10: 8, not 87). Stage 0's B slot of chunk 0 writes its input gradient over that microbatch's spent
entry (F(i, 0) comes before B(i, 0)). That gradient is real on stage 0 only, and every stage needs it
(the embedding is split over pp x tp): one psum over pp per microbatch. The psum of microbatch i runs
in the G slot of the tick after stage 0's B(i, 0), first in the tick, so on GPUs the tick's slots may
overlap it (with v = 1 stage 0's B(i, 0) are the last m ticks, the cool-down among them) where after
the last tick nothing could; only the microbatch of the last tick is summed after the ticks. The
first input's backward (the embedding's vocabulary-shard gradient, the image tokens' cotangent) runs
after the ticks, one microbatch at a time.

What this holds, growing with m: the [m, ...] first-input buffer and, beside it, the [m, ...] summed
gradients (an all-reduced value has another type than the stage-varying buffer: JAX cannot retype a
pp-varying array as pp-invariant without the collective).

A mixin of jaxpar.parallel.pipeline.Pipeline (it reads pieces, table, m, act_varying).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers.collectives import varying_of
from jaxpar.layers.order import after
from jaxpar.parallel.schedule import IDLE

PP = "pp"


class FirstInputs:
    """The first input's forward (before the ticks), its gradient's sums (G slots) and backward (after)."""

    def _grad_sum_ticks(self) -> np.ndarray:
        """[ticks]: the microbatch whose first-input gradient each tick's G slot sums over pp, IDLE where a
        tick has none: the one whose chunk-0 backward stage 0 ran in the tick before (at most one per
        tick). The last tick's microbatch is summed after the ticks."""
        t = self.table
        out = np.full(t.ticks, IDLE)
        ends = np.nonzero((t.backward[:, 0] != IDLE) & (t.backward_chunk[:, 0] == 0))[0]
        ends = ends[ends + 1 < t.ticks]
        out[ends + 1] = t.backward[ends, 0]
        return out

    def _first_inputs(self, ctx):
        """Every microbatch's first input, [m, ...], typed like a received activation: one first_input
        (and its collectives) per microbatch, where a tick-by-tick call would run one per tick."""
        def one(i):
            x0 = self.pieces.first_input(ctx["first"], ctx["extra_at"](i), ctx["data_at"](i))
            missing = tuple(a for a in self.act_varying if not varies_over(x0, a))
            return jax.lax.pcast(x0, missing, to="varying") if missing else x0
        return jax.lax.map(one, jnp.arange(self.m))

    def _summed_zeros(self, x0):
        """The [m, ...] buffer of summed first-input gradients (typed like a psum over pp of `x0`'s type)."""
        axes = tuple(a for a in self.act_varying if a != PP)
        zeros = jnp.zeros((self.m,) + x0.shape, x0.dtype)
        return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros

    def _sum_slot(self, carry, row):
        """G: stage 0's input gradient of microbatch row["G"] summed over pp (only stage 0's is real) into
        carry["summed"]. XLA:CPU order: after the previous tick's sends, before this tick's collectives."""
        stage, i = jax.lax.axis_index(PP), row["G"]
        dx = after(carry["inputs"][i], carry["recv_fwd"])
        total = jax.lax.psum(jnp.where(stage == 0, dx, jnp.zeros_like(dx)), PP)
        received = after({k: carry[k] for k in ("recv_fwd", "recv_bwd")}, total)
        return {**carry, **received, "summed": jax.lax.dynamic_update_index_in_dim(carry["summed"], total, i, 0)}

    def _first_input_backward(self, ctx, inputs, summed, dependency):
        """(gradient of the first input's weights, cotangent of `extra` or None), after `dependency` (the
        ticks and their reductions: XLA:CPU order): each microbatch's stage-0 input gradient, summed over
        pp in a G slot (`summed`) or here (`inputs`, the last tick's), pulled back through first_input."""
        stage = jax.lax.axis_index(PP)
        inputs, summed = after((inputs, summed), dependency)
        in_ticks = np.sort(self.sum_ticks[self.sum_ticks != IDLE])
        late = np.setdiff1d(np.arange(self.m), in_ticks)

        summing = self.pieces.extra_at is not None  # the cotangent of the whole `extra`, summed
        extra, spread = ctx["extra"], ()
        if summing:  # pulled back as varying: one explicit sum after the scans (_spread_extra)
            extra, spread = self._spread_extra(ctx["extra"])

        def pull_back(acc, i, dx0):
            data_mb = jax.tree.map(lambda a: after(a, dx0), ctx["data_at"](i))
            if summing:
                read = self.pieces.extra_at
                _, pullback = jax.vjp(lambda f, e: self.pieces.first_input(f, read(e, i), data_mb),
                                      ctx["first"], extra)
            else:
                _, pullback = jax.vjp(lambda f, e: self.pieces.first_input(f, e, data_mb),
                                      ctx["first"], ctx["extra_at"](i))
            grad, d_extra = pullback(dx0)
            d_extra = None if d_extra is None else d_extra.astype(jnp.float32)
            d_first, d_sum = acc
            if summing:
                return (self._add(d_first, grad), d_sum + d_extra), None
            return (self._add(d_first, grad), d_sum), d_extra

        def summed_here(acc, i):
            dx0 = jax.lax.psum(jnp.where(stage == 0, inputs[i], jnp.zeros_like(inputs[i])), PP)
            return pull_back(acc, i, dx0)

        acc = (self._zeros_f32(ctx["first"]), self._zeros_f32(extra) if summing else None)
        if not len(in_ticks):
            (d_first, d_sum), d_extra = jax.lax.scan(summed_here, acc, jnp.arange(self.m))
            return self._summed_over(d_first, d_sum, spread, extra.dtype) if summing else (d_first, d_extra)
        acc, d_early = jax.lax.scan(lambda a, i: pull_back(a, i, summed[i]), acc, jnp.asarray(in_ticks))
        inputs = after(inputs, acc)  # the late sums after the early backward's work (XLA:CPU)
        (d_first, d_sum), d_late = jax.lax.scan(summed_here, acc, jnp.asarray(late))
        if summing:
            return self._summed_over(d_first, d_sum, spread, extra.dtype)
        if d_early is None:
            return d_first, None
        order = np.argsort(np.concatenate([in_ticks, late]))  # back to microbatch order
        return d_first, jnp.concatenate([d_early, d_late])[order]

    def _spread_extra(self, extra):
        """`extra` cast to varying over the axes its per-microbatch rows (extra_at) vary over and it does
        not (the ranks that mask their share to zeros), and those axes. Pulled back through an invariant
        `extra`, JAX sums each microbatch's cotangent over them inside the scan, and XLA moves an all-reduce
        that only feeds an accumulator out of its loop, where nothing orders it against the embedding's dp
        reduce-scatter (an XLA:CPU deadlock). Varying, the scans only accumulate: _summed_over sums once."""
        rows = self.pieces.extra_at(extra, 0)  # traced for its type only (XLA drops it)
        spread = tuple(a for a in varying_of(jax.typeof(rows)) if not varies_over(extra, a))
        return (jax.lax.pcast(extra, spread, to="varying") if spread else extra), spread

    @staticmethod
    def _summed_over(d_first, d_sum, spread, dtype):
        """The cotangent of `extra` summed over `spread` in `extra`'s dtype (each row is nonzero on one
        rank of `spread` and in one microbatch: exact), before the first part's gradient reductions."""
        d_sum = d_sum.astype(dtype)
        if spread:
            d_sum = jax.lax.psum(d_sum, spread)
        return after(d_first, d_sum), d_sum


def varies_over(x, axis: str) -> bool:
    return axis in varying_of(jax.typeof(x))
