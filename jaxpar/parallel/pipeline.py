"""SPMD pipeline parallelism over the `pp` mesh axis, driven by a static schedule table.

Every device runs the same program inside the train step's shard_map; a device's stage is
`axis_index("pp")` and its slice of the stacked layer weights holds its chunks (with `virtual`
chunks per device, chunk c of device s is virtual stage c*p + s, Megatron's interleaving). The
table (jaxpar.parallel.schedule) is fed to `lax.scan` one phase at a time: each tick runs, in this
order, the kinds of slot the phase has: G (a sum over pp of the first input's gradient,
jaxpar.parallel.first_input), F (forward of one chunk for one microbatch), L (the loss of the
microbatch the last virtual stage just finished), B (backward of one chunk), W (zb's weight
gradients). Work a stage does not own in a tick is masked, never skipped: every device issues the
same collectives in the same order every tick (a per-device `lax.cond` around a collective
deadlocks, docs/design.md).

What makes it cheap:
- **Residuals kept, not recomputed.** A forward slot keeps its chunk's vjp residuals (under the
  remat policy: only what the policy saves) in a stash of `schedule.stash_slots` entries (+ one spare that idle slots write); the
  backward slot rebuilds the pullback from them (jaxpar.parallel.residuals). Parameters and
  constants are never stashed. `stage_recompute=True` keeps only the chunk input and re-runs the
  forward under vjp instead (the lowest-memory choice).
- **Head and first input computed once, spread over pp.** The model's first-input and head
  functions are called on every stage *for the same microbatch*: their weights are sharded over
  pp x tp (vocabulary-parallel), so each device computes its 1/(pp tp) of the embedding lookup and
  of the LM head + loss. The last stage's output is broadcast to all stages (one psum over pp) for
  the head; the head's input cotangent is summed back over pp (one psum). Nothing is replicated pp
  times and no stage computes a whole head. Where the head reads only part of the output
  (`StagePieces.head_input`: a VLA's action positions) only that part is broadcast and summed.
- **The first input once per microbatch, not once per tick** (jaxpar.parallel.first_input): m
  first inputs computed before the ticks into an [m, ...] buffer, each one's gradient summed over
  pp in the tick after stage 0's chunk-0 backward of it (so GPUs may overlap the sum with that
  tick), its backward after the ticks: m all-reduces each way where a tick-by-tick call ran
  v m + p - 1 (vla70b, v = 10: 8, not 87), at the price of two [m, ...] buffers.
- **Each gradient reduced over dp once it is final.** The scans over ticks are cut after the tick
  that makes a part's gradient final (Schedule.gradients_final): the head after the last loss slot,
  chunk c of an interleaved pipeline after stage 0's last backward of it, chunk 0 after the
  last tick, the first input after its own backward. Its reduction (a callback: ZeRO decides how)
  is issued there, so on GPUs the remaining ticks can overlap it: with v chunks, (v-1)/v of the layers' gradients.
  Without a reduction to overlap (dp = 1, or ZeRO-2/3 reducing inside the backward) nothing is cut:
  each cut copies the accumulator (a scan carry changing shape), which only the overlap pays for.
  Without interleaving the layers can only be reduced after the last tick: in lockstep every
  stage reaches that program point together, and stage 0, whose last backward is the last tick,
  is on the critical path whatever the others do (Megatron's overlap there, the bucket reductions
  inside the last microbatch's backward, is not built: it hides at most one chunk backward).

The runtime imports no model: it gets a `StagePieces` (first input, chunk body, head loss).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers.collectives import varying_of
from jaxpar.layers.order import (after, after_on_every_backend, backward_ordered, chain, cotangent_summed,
                                 ordered_both_ways, ordering_on)
from jaxpar.parallel.first_input import FirstInputs, varies_over
from jaxpar.parallel.layer_order import layer_order, reorder_layers  # noqa: F401 (their home was here)
from jaxpar.parallel.residuals import InputStash, ResidualStash, read_before_write, zeros_typed
from jaxpar.parallel.split_backward import SplitBackward, SplitStash
from jaxpar.parallel.schedule import IDLE, Schedule

PP = "pp"
# The named scopes of the slots: the compiled program's FLOPs by slot kind (measured_slot_flops reads the
# chunk slots'; the dry run reports L's, the head and loss); tests find G's sums by it
SLOT_SCOPES = {"F": "pipeline_F", "B": "pipeline_B", "W": "pipeline_W", "L": "pipeline_L", "G": "pipeline_G"}


@dataclasses.dataclass(frozen=True)
class StagePieces:
    """What a model hands the pipeline. Each is called inside shard_map on per-device shards.

    first_input(first_params, extra_mb, data_mb) -> x: the first virtual stage's input (embedding;
        for a VLA the image tokens `extra_mb` come first). Called on every stage for the same
        microbatch, so it may spread its work over pp; its result must not vary over pp.
    body(chunk_params, x) -> y: one chunk of layers (params: the chunk's slice of the stacked layers).
    head_loss(head_params, y, data_mb) -> scalar: the microbatch's loss contribution (already
        normalised); called on every stage with the same y, so it may spread its work over pp.
    head_input(y) -> y': a static slice of y, the only part head_loss reads (head_loss(head_input(y))
        == head_loss(y)), e.g. a VLA's action positions; the last stage delivers only it to the head,
        and its cotangent comes back as small. None: all of y.
    extra_at(extra, i) -> extra_mb: microbatch i's `extra` for first_input, read from the whole `extra`
        (a VLA's own images, which first_input sums over the stages itself); the cotangent of `extra`
        is then summed over the microbatches. None: `extra` is [m, ...] and extra_mb is extra[i].
    prepare_layers(layers) -> layers': the stage's stacked layers as the body reads them, made once per
        step before the ticks and sliced per chunk like the weights (precision=fp8: the linears' weights
        quantized once, not in every slot). `prepared_grads` maps the cotangent of layers' back to
        layers' (a tree like `layers`). None: the body reads the layers as they are.
    """

    first_input: Callable
    body: Callable
    head_loss: Callable
    head_input: Callable | None = None
    extra_at: Callable | None = None
    prepare_layers: Callable | None = None
    prepared_grads: Callable | None = None


def _pcast(tree, axes):
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


def _to_pp_varying(tree):
    """Leaves replicated over pp become pp-varying, so each stage accumulates its own gradient."""
    return jax.tree.map(lambda x: x if varies_over(x, PP) else jax.lax.pcast(x, (PP,), to="varying"), tree)


class Pipeline(FirstInputs):
    """Loss and gradients of one dp shard's microbatches, pipelined over pp (inside shard_map); with
    `reduce_dp`, each part's gradient is dp-reduced as soon as it is final."""

    def __init__(self, schedule: Schedule, pieces: StagePieces, varying_axes: tuple[str, ...],
                 stage_recompute: bool = False, activation_axes: tuple[str, ...] = (),
                 reduce_dp: Callable | None = None, split: SplitBackward | None = None):
        """reduce_dp(part, grads) -> grads: the gradient reduction over dp of "first", "head" or one
        chunk of "layers" (ZeRO's business, jaxpar.parallel.zero); the pipeline only decides when,
        each as soon as the schedule table says the part's gradient is final. None: no reduction.
        split: zb's split backward, the same object the body's collectives hold (`weight_grads`)."""
        self.table, self.pieces, self.varying = schedule, pieces, varying_axes
        self.reduce_dp = reduce_dp or (lambda part, grads: grads)
        self.early = reduce_dp is not None  # parts reduced over dp as they finish; else all after the last tick
        self.final_at = self._final_at()
        self.sum_ticks = self._grad_sum_ticks()  # the first input's gradient sums, in the ticks (G slots)
        self.act_varying = varying_axes + activation_axes  # sequence parallelism: activations vary over tp
        self.p, self.m, self.v = schedule.stages, schedule.microbatches, schedule.virtual
        self.data_axes = tuple(a for a in varying_axes if a != PP)
        self.stash_kind = InputStash if stage_recompute else ResidualStash
        self.split_backward = schedule.kind == "zb"  # B computes input gradients only, W the weights'
        if self.split_backward and stage_recompute:
            raise ValueError("pipeline.schedule=zb keeps residuals for its W slots; set pipeline.stage_recompute=false")
        if self.split_backward:
            if split is None:
                raise ValueError("pipeline.schedule=zb needs the split backward its body's collectives hold")
            self.stash_kind = lambda body, params, x: SplitStash(split, body, params, x)  # noqa: E731
            w_ticks = np.concatenate([np.arange(ph.first, ph.first + ph.count) for ph in schedule.phases
                                      if "W" in ph.kinds])
            if (schedule.weight[w_ticks] == IDLE).any():  # _weight_slot masks nothing
                raise AssertionError("a zb tick runs W on some stages only")
        ring = [(self.p - 1, 0)] if self.v > 1 else []  # chunk c on the last device feeds chunk c+1 on the first
        self.send_next = [(s, s + 1) for s in range(self.p - 1)] + ring
        self.send_prev = [(s + 1, s) for s in range(self.p - 1)] + [(b, a) for a, b in ring]

    # --------------------------------------------------------------- helpers
    def _chunk(self, layers, chunk):
        """Chunk `chunk` of this device's layers ([v * chunk_len, ...] stacked)."""
        if self.v == 1:
            return layers
        count = jax.tree.leaves(layers)[0].shape[0]
        if count % self.v:  # (config validation refuses it; a chunk of no layer would run silently)
            raise ValueError(f"pipeline.virtual_stages={self.v} does not divide the {count} layers per stage")
        size = count // self.v
        return jax.tree.map(lambda w: jax.lax.dynamic_slice_in_dim(w, chunk * size, size, 0), layers)

    def _unprepared(self, tree):
        """A tree like the prepared layers (a chunk's cotangent, or zb's masks of it) as the stored layers'
        (`StagePieces.prepared_grads`; the identity when nothing is prepared)."""
        return self.pieces.prepared_grads(tree) if self.pieces.prepared_grads else tree

    def _add_chunk(self, acc, grads, chunk, only=None):
        """Accumulate a chunk's gradients (fp32) into the device's layer accumulator, which holds the
        chunks whose gradients are not final yet (0, 1, ...: the top ones leave it as they finish).
        `only`: a tree of bools like `acc`, the leaves to add (zb: B's or W's)."""
        if only is not None:
            return jax.tree.map(lambda a, g, keep: self._add_chunk(a, g, chunk) if keep else a, acc, grads, only)
        if self.v == 1:
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

        def add(a, g):
            size = g.shape[0]
            part = jax.lax.dynamic_slice_in_dim(a, chunk * size, size, 0) + g.astype(jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(a, part, chunk * size, 0)
        return jax.tree.map(add, acc, grads)

    @staticmethod
    def _zeros_f32(tree):
        return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=jnp.float32), tree)

    @staticmethod
    def _add(acc, grads):
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

    def _data_typed(self, x):
        """`x` typed as varying over the data axes only (like the loss of a dp shard)."""
        return jax.lax.pcast(x, self.data_axes, to="varying") if self.data_axes else x

    def _rows(self, first: int, count: int) -> dict:
        t, s = self.table, slice(first, first + count)
        return {"F": t.forward[s], "Fc": t.forward_chunk[s], "Fs": t.stash["F"][s], "L": t.loss[s],
                "B": t.backward[s], "Bc": t.backward_chunk[s], "Bs": t.stash["B"][s],
                "W": t.weight[s], "Wc": t.weight_chunk[s], "Ws": t.stash["W"][s], "G": self.sum_ticks[s]}

    # --------------------------------------------------------------- slots of one tick
    def _stage_input(self, inputs, received, row):
        """This stage's chunk input: on stage 0's chunk 0 its microbatch's first input (`inputs`, computed
        before the ticks), else what the previous virtual stage sent."""
        stage = jax.lax.axis_index(PP)
        x0 = inputs[jnp.maximum(row["F"][0], 0)]
        return jnp.where((stage == 0) & (row["Fc"][stage] == 0), x0, received)

    def _forward_slot(self, ctx, carry, row):
        """F: run this stage's chunk for its microbatch and stash what its backward needs."""
        stage = jax.lax.axis_index(PP)
        mb, chunk, slot = row["F"][stage], row["Fc"][stage], row["Fs"][stage]
        x_in = self._stage_input(carry["inputs"], carry["recv_fwd"], row)
        y, acts = ctx["stash"].forward(self._chunk(ctx["layers"], chunk), x_in)
        slot = jnp.where(mb >= 0, slot, self.table.stash_slots)  # an idle slot writes the spare entry
        stash = [jax.lax.dynamic_update_index_in_dim(buf, a, slot, 0) for buf, a in zip(carry["stash"], acts)]
        return y, {**carry, "stash": stash}, acts

    def _entries_before_forward(self, carry, row):
        """(carry, the stash entries this tick's B slot reads, read before F writes the stash): in a tick with
        both, the last virtual stage's B reads the entry its F writes in the same tick; read after that
        in-place write, XLA copies the whole stash buffer first (vla70b: 393 MB per buffer, twice per tick).
        B then takes F's fresh entry where the slots match (`_fresh_or_stashed`)."""
        stash, entries = read_before_write(carry["stash"], jnp.maximum(row["Bs"][jax.lax.axis_index(PP)], 0))
        return {**carry, "stash": stash}, entries

    # None: on GPUs only. XLA:CPU's program grows instead (+110 MB of 283 MB temporaries in test_pipeline's
    # 1F1B memory test: it copies the buffers for the early reads); tests set True to run it there.
    read_stash_early: bool | None = None

    def _reads_stash_early(self) -> bool:
        return (not ordering_on()) if self.read_stash_early is None else self.read_stash_early

    @staticmethod
    def _fresh_or_stashed(row, fresh, stashed):
        """B's residuals: those F just computed when B reads the slot F wrote in this tick, else `stashed`."""
        stage = jax.lax.axis_index(PP)
        same = (row["Bs"][stage] == row["Fs"][stage]) & (row["F"][stage] >= 0)
        return [jnp.where(same, f, s) for f, s in zip(fresh, stashed)]

    def _loss_slot(self, ctx, carry, y, row):
        """L: loss of the microbatch the last virtual stage finished, and its cotangent on every stage."""
        mb = row["L"]
        weight = self._data_typed((mb >= 0).astype(jnp.float32))
        data_mb = ctx["data_at"](jnp.maximum(mb, 0))
        y_head, unselect = self._head_input(y)
        loss, pullback = jax.vjp(lambda h, t: self.pieces.head_loss(h, t, data_mb), ctx["head"],
                                 self._broadcast_last(y_head))
        d_head, dy_partial = pullback(after(weight, loss))  # after the loss's own collectives (XLA:CPU)
        dy = unselect(jax.lax.psum(dy_partial, PP))  # the head's input cotangent, summed over its vocab shards
        grads = {**carry["grads"], "head": self._add(carry["grads"]["head"], d_head)}
        return dy, {**carry, "grads": grads, "loss": carry["loss"] + weight * loss}

    def _backward_slot(self, ctx, carry, row, dy_last, after_forward, acts=None):
        """B: the chunk's backward from its stashed residuals; stage 0's input gradient of chunk 0 is kept
        for the first input's backward after the ticks (over that microbatch's spent first input)."""
        stage = jax.lax.axis_index(PP)
        mb, chunk, slot = row["B"][stage], row["Bc"][stage], jnp.maximum(row["Bs"][stage], 0)
        ends = (stage == self.p - 1) & (chunk == self.v - 1)
        cot = jnp.where(ends, dy_last, carry["recv_bwd"]) * (mb >= 0).astype(dy_last.dtype)
        if after_forward is not None:  # one collective order on every device (XLA:CPU)
            cot = after(cot, after_forward)
        acts = [buf[slot] for buf in carry["stash"]] if acts is None else acts
        if self.split_backward:  # zb: dx, the small weights' gradients and every linear's output gradient,
            d_chunk, dx, dy = ctx["stash"].backward(self._chunk(ctx["layers"], chunk), acts, cot)  # kept for W
            write = jnp.where(mb >= 0, slot, self.table.stash_slots)
            carry = {**carry, "dy_stash": [jax.lax.dynamic_update_index_in_dim(buf, g, write, 0)
                                           for buf, g in zip(carry["dy_stash"], dy)]}
            only = self._unprepared(jax.tree.map(lambda m: not m, ctx["stash"].matrix))  # the matrix weights' in W
        else:
            d_chunk, dx = ctx["stash"].backward(self._chunk(ctx["layers"], chunk), acts, cot)
            only = None
        d_chunk = self._unprepared(d_chunk)
        grads = {**carry["grads"], "layers": self._add_chunk(carry["grads"]["layers"], d_chunk, chunk, only)}
        dx = after(dx, d_chunk)  # the tick's sends after the chunk's weight-gradient sums (sp norms: XLA:CPU)
        first_mb = row["B"][0]
        index = jnp.maximum(first_mb, 0)
        starts = (first_mb >= 0) & (row["Bc"][0] == 0)  # the same on every stage; only stage 0's dx is used
        inputs = jax.lax.dynamic_update_index_in_dim(
            carry["inputs"], jnp.where(starts, dx, carry["inputs"][index]), index, 0)
        return dx, {**carry, "grads": grads, "inputs": inputs}

    def _weight_slot(self, ctx, carry, row, dependency):
        """W (zb): the matrix weights' gradients of a chunk whose B ran earlier, from the linears' inputs
        its F kept and the output gradients its B kept: the weight-gradient matmuls and nothing else
        (jaxpar.parallel.split_backward). zb's W ticks are busy on every stage (W(i) runs on all
        stages at tick i + 2(p - 1)), so no slot is masked: an idle one would add a stale gradient."""
        slot = row["Ws"][jax.lax.axis_index(PP)]
        chunk = row["Wc"][jax.lax.axis_index(PP)]
        dy = [after(buf[slot], dependency) for buf in carry["dy_stash"]]
        acts = [buf[slot] for buf in carry["stash"]]
        d_chunk = self._unprepared(ctx["stash"].weight_grads(self._chunk(ctx["layers"], chunk), acts, dy, ctx["x0"]))
        layers = self._add_chunk(carry["grads"]["layers"], d_chunk, chunk, only=self._unprepared(ctx["stash"].matrix))
        return {**carry, "grads": {**carry["grads"], "layers": layers}}

    def _tick(self, ctx, kinds: str):
        act_shape, act_dtype = ctx["act"]

        def tick(carry, row):
            y = dx = stashed = None
            if "G" in kinds:  # first: its psum reads only the carry, so the tick's slots can overlap it
                with jax.named_scope(SLOT_SCOPES["G"]):
                    carry = self._sum_slot(carry, row)
            if "F" in kinds and "B" in kinds and not self.split_backward and self._reads_stash_early():
                carry, stashed = self._entries_before_forward(carry, row)
            if "F" in kinds:
                with jax.named_scope(SLOT_SCOPES["F"]):
                    y, carry, fresh = self._forward_slot(ctx, carry, row)
            dy = jnp.zeros(act_shape, act_dtype)
            if "L" in kinds:
                with jax.named_scope(SLOT_SCOPES["L"]):
                    dy, carry = self._loss_slot(ctx, carry, y, row)
            if "B" in kinds:
                with jax.named_scope(SLOT_SCOPES["B"]):
                    acts = None if stashed is None else self._fresh_or_stashed(row, fresh, stashed)
                    dx, carry = self._backward_slot(ctx, carry, row, dy, y, acts)
            # Pin one order of the two sends on every device: after this tick's compute (XLA:CPU).
            if y is not None:
                carry = {**carry, "recv_fwd": jax.lax.ppermute(y if dx is None else after(y, dx), PP, self.send_next)}
            if dx is not None:
                carry = {**carry, "recv_bwd": jax.lax.ppermute(after(dx, carry["recv_fwd"]), PP, self.send_prev)}
            if "W" in kinds:  # last in the tick (XLA:CPU order): after the sends
                last = carry["recv_bwd"] if dx is not None else carry["recv_fwd"] if y is not None else dy
                with jax.named_scope(SLOT_SCOPES["W"]):
                    carry = self._weight_slot(ctx, carry, row, last)
            # XLA:CPU: the next tick's collectives wait for both sends, and a send whose buffer no later
            # tick reads stays live (XLA would drop the buffer but keep the collective, unordered)
            recv_fwd = after(carry["recv_fwd"], carry["recv_bwd"])
            carry = {**carry, "recv_fwd": recv_fwd, "loss": after(carry["loss"], recv_fwd)}
            return carry, None
        return tick

    # --------------------------------------------------------------- 1F1B family
    def _context(self, params, micro, extra):
        """What every slot reads: the weights (first / head typed pp-varying), per-microbatch getters,
        and the stage activation's zeros (typed like a received activation)."""
        first, head = _to_pp_varying(params["first"]), _to_pp_varying(params["head"])
        data_at = lambda i: jax.tree.map(lambda a: a[i], micro)  # noqa: E731
        read = self.pieces.extra_at or (lambda e, i: e[i])
        extra_at = (lambda i: None) if extra is None else (lambda i: read(extra, i))  # noqa: E731
        shape = jax.eval_shape(lambda: self.pieces.first_input(first, extra_at(0), data_at(0)))
        x_zeros = _pcast(jnp.zeros(shape.shape, shape.dtype), self.act_varying)
        layers = self.pieces.prepare_layers(params["layers"]) if self.pieces.prepare_layers else params["layers"]
        return {"first": first, "head": head, "layers": layers, "data_at": data_at,
                "extra_at": extra_at, "extra": extra, "act": (shape.shape, shape.dtype), "x0": x_zeros}

    def loss_and_grads(self, params, micro, extra=None):
        """(loss, grads {"first", "layers", "head"}, cotangent of `extra` or None).

        params: {"first", "layers", "head"} (this device's shards); micro: data with a leading
        microbatch dim [m, ...]; extra: differentiable first-stage inputs [m, ...] (VLA image tokens), or
        what pieces.extra_at reads them from (its cotangent then summed over microbatches).
        """
        if self.table.kind == "gpipe":
            return self._gpipe(params, micro, extra)
        ctx = self._context(params, micro, extra)
        ctx["stash"] = self.stash_kind(self.pieces.body, self._chunk(ctx["layers"], 0), ctx["x0"])
        slots = self.table.stash_slots + 1  # + a spare entry that idle forward slots write
        stash_zeros = [zeros_typed(a.update(shape=(slots,) + a.shape)) for a in ctx["stash"].stash_avals()]
        zeros = jnp.zeros_like(ctx["x0"])
        carry = {"recv_fwd": zeros, "recv_bwd": zeros, "stash": stash_zeros, "inputs": self._first_inputs(ctx),
                 "grads": self._zeros_f32({"layers": params["layers"], "head": ctx["head"]}),
                 "loss": self._data_typed(jnp.zeros((), jnp.float32))}
        if (self.sum_ticks != IDLE).any():
            carry["summed"] = self._summed_zeros(ctx["x0"])
        if self.split_backward:  # every linear's output gradient, from its B to its W
            carry["dy_stash"] = [zeros_typed(a.update(shape=(slots,) + a.shape))
                                 for a in ctx["stash"].output_grad_avals()]
        reduced = {}
        for kinds, first, count in self._segments():
            rows = jax.tree.map(jnp.asarray, self._rows(first, count))
            carry, _ = jax.lax.scan(self._tick(ctx, kinds), carry, rows)
            carry = self._reduce_final(params, carry, reduced, self.final_at.get(first + count - 1, []))
        d_first, d_extra = self._first_input_backward(ctx, carry.pop("inputs"), carry.pop("summed", None),
                                                      (carry, reduced[list(reduced)[-1]]))
        carry = {**carry, "grads": {**carry["grads"], "first": d_first}}
        self._reduce_final(params, carry, reduced, [("first",)])
        if ("layers", None) in reduced:
            layers = reduced[("layers", None)]
        else:
            chunks = [reduced[("layers", c)] for c in range(self.v)]
            layers = chunks[0] if self.v == 1 else jax.tree.map(lambda *c: jnp.concatenate(c), *chunks)
        grads = {"first": reduced[("first",)], "head": reduced[("head",)], "layers": layers}
        return carry["loss"], grads, d_extra

    # --------------------------------------------------------------- gradient reductions, early
    def _final_at(self) -> dict[int, list[tuple]]:
        """{tick: the gradient parts that are final after it}: ("head",), ("layers", chunk); the first
        input's, ("first",), is final after its own backward, which follows the ticks. Without a dp
        reduction every part is taken after the last tick, the layers whole as ("layers", None): cutting the accumulator chunk by chunk copies it (a scan carry that changes shape is a
        new buffer), which only an overlapped reduction pays for (on the GPU compiler, vla70b's v = 10
        at dp = 1 held ~3 more fp32 copies of the stage's gradients: docs/planner.md)."""
        final, at = self.table.gradients_final(), {}
        if not self.early:
            return {self.table.ticks - 1: [("head",), ("layers", None)]}
        # the accumulator drops its top chunk as it finishes, so chunks must finish from the top down
        assert list(final["chunks"]) == sorted(final["chunks"], reverse=True), final["chunks"]
        at.setdefault(final["head"], []).append(("head",))
        for chunk, tick in reversed(list(enumerate(final["chunks"]))):
            at.setdefault(tick, []).append(("layers", chunk))
        return at

    def _segments(self) -> list[tuple[str, int, int]]:
        """(kinds, first tick, count): the schedule's phases, cut after every tick that makes a gradient
        final, so its reduction is issued there and the ticks after it can overlap it."""
        sums = self.sum_ticks != IDLE  # and where the G slots (the first input's gradient sums) start or stop
        cuts = {t + 1 for t in self.final_at} | {t for t in range(1, len(sums)) if sums[t] != sums[t - 1]}
        out = []
        for phase in self.table.phases:
            start, end = phase.first, phase.first + phase.count
            for cut in sorted(c for c in cuts if start < c < end) + [end]:
                out.append((phase.kinds + ("G" if sums[start] else ""), start, cut - start))
                start = cut
        return out

    def _reduce_final(self, params, carry, reduced: dict, parts: list[tuple]) -> dict:
        """Reduce `parts`, whose gradients are final (into `reduced`); weights replicated
        over pp (the final norm) are summed over stages first. A finished layer chunk leaves the
        accumulator the later scans carry (it is its top chunk), so its reduction has no buffer
        beside it. On XLA:CPU the next scan starts only once every reduction is done (`after` on
        what it carries: one collective order)."""
        grads = carry["grads"]
        for part in parts:
            name, final = part[0], grads[part[0]]
            if name == "layers" and part[1] is not None:
                size = jax.tree.leaves(params["layers"])[0].shape[0] // self.v
                final = jax.tree.map(lambda a: a[part[1] * size:(part[1] + 1) * size], grads["layers"])
                grads = {**grads, "layers": jax.tree.map(lambda a: a[:part[1] * size], grads["layers"])}
            # after the tick's sends and the reduction issued before it (one collective order on XLA:CPU);
            # on every backend after the previous reduction, which XLA would otherwise merge with this one
            # into one reduction after the last tick (its all-reduce / reduce-scatter combiners)
            final = after(final, carry)
            final = after_on_every_backend(final, reduced[list(reduced)[-1]] if reduced else None)
            if name != "layers":
                final = chain(lambda g, w: g if varies_over(w, PP) else jax.lax.psum(g, PP), final, params[name],
                              start=final)
            reduced[part] = self.reduce_dp(name, final)
        carry = {**carry, "grads": grads}
        if parts:  # the ticks after it start once the reductions are done (XLA:CPU): every slot of a tick
            # reads a received buffer first (the stash and accumulators are not copied)
            received = after({k: carry[k] for k in ("recv_fwd", "recv_bwd")}, reduced[list(reduced)[-1]])
            carry = {**carry, **received}
        return carry

    # --------------------------------------------------------------- forward only: GPipe and evaluation
    def _forward_phases(self) -> list[tuple[bool, int, int]]:
        """(with loss, first tick, count): maximal runs of ticks that have forward work, split where the
        loss slot switches on or off. Evaluation and GPipe run only these."""
        t, runs = self.table, []
        for tick in range(t.ticks):
            if not (t.forward[tick] != IDLE).any():
                continue
            with_loss = bool(t.loss[tick] != IDLE)
            if runs and runs[-1][0] == with_loss and runs[-1][1] + runs[-1][2] == tick:
                runs[-1] = (with_loss, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((with_loss, tick, 1))
        return runs

    def forward_sums(self, params, micro, extra, head_fn, zero_sums, head_input=None):
        """Forward only: the sum over microbatches of `head_fn(head, y, data_mb)` (a tree), where y is
        the last virtual stage's output (`head_input(y)` if given: what head_fn reads); head_fn runs on
        every stage for the same y (spread over pp)."""
        select = head_input or (lambda y: y)
        ctx = self._context(params, micro, extra)
        inputs = self._first_inputs(ctx)

        def tick_fn(with_loss):
            def tick(carry, row):
                chunk = row["Fc"][jax.lax.axis_index(PP)]
                y = self.pieces.body(self._chunk(ctx["layers"], chunk), self._stage_input(inputs, carry["recv"], row))
                y = cotangent_summed(y) if with_loss else y  # used by the head and the send (XLA:CPU order)
                sums = carry["sums"]
                if with_loss:
                    weight = (row["L"] >= 0).astype(jnp.float32)
                    data_mb = ctx["data_at"](jnp.maximum(row["L"], 0))
                    out = head_fn(ctx["head"], self._broadcast_last(select(y)), data_mb)
                    sums = jax.tree.map(lambda s, o: s + weight * o, sums, out)
                    # the head's collectives before the send; in the backward, after the send's transpose
                    y = ordered_both_ways(y, sums)
                return {"recv": jax.lax.ppermute(y, PP, self.send_next), "sums": sums}, None
            return tick

        carry, head_ordered = {"recv": jnp.zeros_like(ctx["x0"]), "sums": zero_sums}, False
        for with_loss, first, count in self._forward_phases():
            if with_loss and not head_ordered:  # GPipe's backward (autodiff) runs the ticks before this one
                # only once the head's gradient is summed over pp: independent collectives (XLA:CPU order)
                carry, head = backward_ordered(carry, params["head"])
                ctx["head"], head_ordered = _to_pp_varying(head), True
            rows = jax.tree.map(jnp.asarray, self._rows(first, count))
            carry, _ = jax.lax.scan(tick_fn(with_loss), carry, rows)
        return carry["sums"]

    def _head_input(self, y):
        """(what the head reads of y: pieces.head_input, and the map of its cotangent back to y's shape,
        zeros elsewhere): only that part is broadcast from the last stage and its cotangent summed."""
        if self.pieces.head_input is None:
            return y, lambda dy: dy
        y_head, pullback = jax.vjp(self.pieces.head_input, y)

        def unselect(dy_head):
            missing = tuple(a for a in varying_of(jax.typeof(y_head)) if not varies_over(dy_head, a))
            return pullback(jax.lax.pcast(dy_head, missing, to="varying") if missing else dy_head)[0]
        return y_head, unselect

    def _broadcast_last(self, y):
        """The last stage's `y` on every stage (typed pp-varying, like the head weights it meets)."""
        last = jax.lax.axis_index(PP) == self.p - 1
        return jax.lax.pcast(jax.lax.psum(jnp.where(last, y, jnp.zeros_like(y)), PP), (PP,), to="varying")

    def _gpipe(self, params, micro, extra):
        """All forwards in scans over ticks, then autodiff: every tick's residuals stay alive (O(m))."""
        def total_loss(p, e):
            zero = self._data_typed(jnp.zeros((), jnp.float32))
            return self.forward_sums(p, micro, e, self.pieces.head_loss, zero, self.pieces.head_input)

        loss, (grads, d_extra) = jax.value_and_grad(total_loss, argnums=(0, 1))(params, extra)
        reduced = {}
        for part, g in grads.items():  # one after another (XLA:CPU)
            reduced[part] = self.reduce_dp(part, after(g, list(reduced.values())))
        return loss, reduced, d_extra


def activation_collectives(table: Schedule) -> dict[str, int]:
    """The activation-sized collectives over pp one training step of this runtime executes, by what
    they carry (the dry run reads the same counts from the compiled program, the planner prices
    them): `sends`, one ppermute per tick in which any stage forwards and one per tick in which any
    backs up; `first_input`, the first input's pp x tp all-reduce, and `first_input_grad`, stage 0's
    input gradient summed over pp, once per microbatch; `head`, the last stage's output broadcast and
    the head's input cotangent summed, two per tick with a loss slot. GPipe's backward, autodiff of
    its forward, issues the same: each send and sum has one transpose."""
    ticks_with = lambda kind: sum(ph.count for ph in table.phases if kind in ph.kinds)  # noqa: E731
    return {"sends": ticks_with("F") + ticks_with("B"), "first_input": table.microbatches,
            "head": 2 * ticks_with("L"), "first_input_grad": table.microbatches}


def measured_slot_flops(by_scope: dict[str, float], table: Schedule) -> dict[str, float] | None:
    """FLOPs of one executed chunk slot of each kind (F, B and for zb W) on one device, from the
    compiled step's FLOPs by slot scope (jaxpar.compiler.hlo_flops.executed_flops(text, SLOT_SCOPES
    values)): each tick whose phase has a kind runs one slot of it on every device, busy or masked.
    The schedule table weighs its slots with them (Schedule.bubble_fraction). None for GPipe (its
    backward is autodiff of the forward ticks: no slots) or when the program has no scoped FLOPs."""
    if table.kind == "gpipe":
        return None
    out = {}
    for kind in ("FBW" if table.kind == "zb" else "FB"):
        ticks = sum(ph.count for ph in table.phases if kind in ph.kinds)
        out[kind] = by_scope.get(SLOT_SCOPES[kind], 0.0) / ticks
    return out if all(out.values()) else None
