"""SPMD pipeline parallelism over the `pp` mesh axis: 1F1B and GPipe, inside the train step's shard_map.

Every device runs the same program; a device's stage is `axis_index("pp")` and its slice of the
stacked layer weights is its stage's layers. A static schedule table (jaxpar.parallel.schedule) is
fed to `lax.scan` tick by tick; each device reads its own column. Work a stage does not own in a tick
is masked, never skipped: on CPU a collective inside a per-device `lax.cond` deadlocks, and on GPUs
divergent collectives hang NCCL the same way, so every device issues the same collectives
(tp all-reduces inside the stage, the pp ppermutes) in the same order every tick.

1F1B keeps the stage input of each microbatch in flight in a ring buffer of 2p-1 slots and, at its
backward tick, re-runs the stage forward under `jax.vjp` (stage-level recomputation, as Megatron's
full recompute). Memory is O(p) microbatches whatever m is; the price is one extra stage forward per
microbatch. GPipe differentiates a forward scan over ticks, keeping every tick's residuals: O(m).

The embedding (stage 0) and the head + loss (last stage) are computed, masked, on every stage; their
weights are replicated over pp and their gradients summed over pp once at the end.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.config import ModelConfig
from jaxpar.layers.collectives import Collectives, after
from jaxpar.models import llama, vla
from jaxpar.parallel.schedule import Schedule

PP = "pp"
HEAD_KEYS = ("final_norm", "lm_head")


class Pipeline:
    """Loss and local gradients of one dp shard's batch, pipelined over pp (call inside shard_map)."""

    def __init__(self, schedule: Schedule, cfg: ModelConfig, coll: Collectives, remat_policy: Callable | None,
                 varying_axes: tuple[str, ...], prefix_len: int = 0):
        self.schedule, self.cfg, self.coll, self.policy = schedule, cfg, coll, remat_policy
        self.prefix_len = prefix_len  # VLA: image + instruction prefix attends bidirectionally
        self.p, self.m = schedule.stages, schedule.microbatches
        self.varying = varying_axes  # the manual axes activations vary over (pp, and dp when dp > 1)
        self.slots = 2 * self.p - 1  # 1F1B ring buffer: stage 0 holds 2(p-1)+1 microbatches at most
        self.send_next = [(s, s + 1) for s in range(self.p - 1)]
        self.send_prev = [(s + 1, s) for s in range(self.p - 1)]

    # --------------------------------------------------------------- pieces
    def _stage(self, layers, x_BxSxD):
        return llama.run_layers(x_BxSxD, layers, self.cfg, self.coll, self.policy, self.prefix_len)

    def _first_input(self, table, image_tokens_BxIxD, ids_BxS):
        """Stage 0's input: embedded tokens, after the projected image tokens for a VLA."""
        if image_tokens_BxIxD is None:
            return llama.embed_tokens({"embed": table}, ids_BxS, self.coll)
        return vla.llm_inputs({"embed": table}, image_tokens_BxIxD, ids_BxS, self.coll)

    def _micro_images(self, image_tokens):
        """Image tokens per microbatch, typed per stage (only stage 0 uses them; summed over pp after)."""
        if image_tokens is None:
            return None
        return self._varying(image_tokens.reshape(self.m, -1, *image_tokens.shape[1:]), (PP,))

    def _head_loss(self, head, x_BxSxD, targets_BxS, mask_BxS, token_count):
        return llama.head_loss_sum(head, x_BxSxD, targets_BxS, mask_BxS, self.cfg, self.coll) / token_count

    def _varying(self, tree, axes: tuple[str, ...] | None = None):
        """Type values as differing per device over `axes` (default: all the pipeline's manual axes)."""
        return jax.tree.map(lambda x: jax.lax.pcast(x, axes or self.varying, to="varying"), tree)

    def _stage_varying(self, params):
        """Embedding and head weights are replicated over pp; each stage accumulates its own gradients."""
        return self._varying(params["embed"], (PP,)), self._varying({k: params[k] for k in HEAD_KEYS}, (PP,))

    @staticmethod
    def _zeros_f32(tree):
        """fp32 gradient accumulators (microbatch gradients are summed in fp32 whatever the compute dtype)."""
        return jax.tree.map(lambda x: jnp.zeros_like(x, dtype=jnp.float32), tree)

    @staticmethod
    def _add(acc, grads):
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

    @staticmethod
    def _micro(batch, m):
        return jax.tree.map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)

    # --------------------------------------------------------------- 1F1B
    def one_f_one_b(self, params, batch, token_count, image_tokens=None):
        """(loss, grads, image-token cotangent): grads of this stage's layers, embed/head summed over pp."""
        stage = jax.lax.axis_index(PP)
        is_first, is_last = stage == 0, stage == self.p - 1
        micro = self._micro(batch, self.m)
        images = self._micro_images(image_tokens)
        layers = params["layers"]
        embed, head = self._stage_varying(params)
        act_shape = micro["targets"].shape[1:] + (self.cfg.d_model,)
        act_dtype = embed.dtype

        def forward(carry, mb):
            """Forward slot: run microbatch `mb` (or masked garbage) and stash its stage input."""
            valid, index = mb >= 0, jnp.maximum(mb, 0)
            image = None if images is None else images[index]
            x_in = jnp.where(is_first, self._first_input(embed, image, micro["inputs"][index]), carry["recv_fwd"])
            y = self._stage(layers, x_in)
            slot = index % self.slots
            kept = jnp.where(valid, x_in, carry["stash"][slot])
            return y, {**carry, "stash": jax.lax.dynamic_update_index_in_dim(carry["stash"], kept, slot, 0)}

        def backward(carry, mb, dy_last):
            """Backward slot: recompute the stage under vjp from the stashed input, push dx upstream."""
            valid, index = mb >= 0, jnp.maximum(mb, 0)
            x_in = carry["stash"][index % self.slots]
            cot = jnp.where(is_last, dy_last, carry["recv_bwd"]) * valid.astype(act_dtype)
            _, stage_vjp = jax.vjp(self._stage, layers, x_in)
            d_layers, dx = stage_vjp(cot)
            image = None if images is None else images[index]
            _, input_vjp = jax.vjp(lambda t, im: self._first_input(t, im, micro["inputs"][index]), embed, image)
            d_embed, d_image = input_vjp(dx * is_first.astype(act_dtype))
            grads = carry["grads"]
            grads = {**grads, "layers": self._add(grads["layers"], d_layers),
                     "embed": self._add(grads["embed"], d_embed)}
            if images is not None:  # zero unless this is stage 0 with a real microbatch
                carry = {**carry, "d_image": carry["d_image"].at[index].add(d_image.astype(jnp.float32))}
            return dx, {**carry, "grads": grads}

        def loss_slot(carry, y, mb):
            """The last stage's loss of the microbatch it just forwarded, and its cotangent."""
            index = jnp.maximum(mb, 0)
            weight = ((mb >= 0) & is_last).astype(jnp.float32)
            loss, head_vjp = jax.vjp(lambda h, x: self._head_loss(h, x, micro["targets"][index],
                                                                    micro["mask"][index], token_count), head, y)
            data_axes = tuple(a for a in self.varying if a != PP)  # weight already varies over pp
            d_head, dy = head_vjp(self._varying(weight, data_axes) if data_axes else weight)
            grads = {**carry["grads"], "head": self._add(carry["grads"]["head"], d_head)}
            return dy, {**carry, "grads": grads, "loss": carry["loss"] + weight * loss}

        def warmup_tick(carry, row):
            y, carry = forward(carry, row["F"][stage])
            return {**carry, "recv_fwd": jax.lax.ppermute(y, PP, self.send_next)}, None

        def steady_tick(carry, row):
            y, carry = forward(carry, row["F"][stage])
            dy, carry = loss_slot(carry, y, row["F"][stage])
            dx, carry = backward(carry, row["B"][stage], dy)
            # Pin one order of collectives on every device: this tick's compute (and its tp all-reduces),
            # then the forward send, then the backward send. XLA:CPU runs independent ops concurrently
            # and may start independent collectives in a different order per device, which deadlocks;
            # optimization_barrier does not survive its pipeline, a data dependency does.
            recv_fwd = jax.lax.ppermute(after(y, dx), PP, self.send_next)
            recv_bwd = jax.lax.ppermute(after(dx, recv_fwd), PP, self.send_prev)
            return {**carry, "recv_fwd": recv_fwd, "recv_bwd": recv_bwd}, None

        def cooldown_tick(carry, row):
            dx, carry = backward(carry, row["B"][stage], jnp.zeros(act_shape, act_dtype))
            return {**carry, "recv_bwd": jax.lax.ppermute(dx, PP, self.send_prev)}, None

        zeros = self._varying(jnp.zeros(act_shape, act_dtype))
        carry = {"recv_fwd": zeros, "recv_bwd": zeros,
                 "stash": self._varying(jnp.zeros((self.slots,) + act_shape, act_dtype)),
                 "grads": self._zeros_f32({"layers": layers, "embed": embed, "head": head}),
                 "loss": self._varying(jnp.zeros((), jnp.float32))}
        if images is not None:
            carry["d_image"] = self._varying(jnp.zeros(images.shape, jnp.float32))
        for (name, first, count), tick_fn in zip(self.schedule.phases, (warmup_tick, steady_tick, cooldown_tick)):
            rows = {"F": jnp.asarray(self.schedule.forward[first:first + count]),
                    "B": jnp.asarray(self.schedule.backward[first:first + count])}
            if count:
                carry, _ = jax.lax.scan(tick_fn, carry, rows)
        d_image = None if images is None else jax.lax.psum(carry["d_image"], PP).reshape(image_tokens.shape)
        return (*self._finish(carry["loss"], carry["grads"]), d_image)

    def _finish(self, loss, grads):
        """Sum the loss and the embed / head gradients over stages (each came from one stage only)."""
        out = {"layers": grads["layers"], "embed": jax.lax.psum(grads["embed"], PP)}
        out.update(jax.lax.psum(grads["head"], PP))
        return jax.lax.psum(loss, PP), out

    # --------------------------------------------------------------- GPipe and forward-only
    def _forward_ticks(self, layers, embed, head, images, micro, head_fn, sums):
        """The forward ticks of a GPipe table: the last stage adds `head_fn(head, y, microbatch)` of
        each real microbatch it finishes to the tree `sums` (masked elsewhere; summed over pp after)."""
        stage = jax.lax.axis_index(PP)
        is_first, is_last = stage == 0, stage == self.p - 1
        _, first, count = self.schedule.phases[0]
        rows = jnp.asarray(self.schedule.forward[first:first + count])

        def tick(carry, row):
            recv, sums = carry
            mb = row[stage]
            index, weight = jnp.maximum(mb, 0), ((mb >= 0) & is_last).astype(jnp.float32)
            image = None if images is None else images[index]
            x_in = jnp.where(is_first, self._first_input(embed, image, micro["inputs"][index]), recv)
            y = self._stage(layers, x_in)
            out = head_fn(head, y, jax.tree.map(lambda a: a[index], micro))
            sums = jax.tree.map(lambda s, o: s + weight * o, sums, out)
            head_done = sum(jax.tree.leaves(sums))  # the head's collectives come before the send
            return (jax.lax.ppermute(after(y, head_done), PP, self.send_next), sums), None

        recv = self._varying(jnp.zeros(micro["targets"].shape[1:] + (self.cfg.d_model,), embed.dtype))
        (_, sums), _ = jax.lax.scan(tick, (recv, sums), rows)
        return sums

    def gpipe(self, params, batch, token_count, image_tokens=None):
        """All forwards in one scan over ticks, then autodiff: every tick's residuals stay alive (O(m))."""
        micro = self._micro(batch, self.m)

        def total_loss(layers, embed, head, images):
            def head_loss(h, y, mb):
                return self._head_loss(h, y, mb["targets"], mb["mask"], token_count)
            zero = self._varying(jnp.zeros((), jnp.float32))
            return self._forward_ticks(layers, embed, head, images, micro, head_loss, zero)

        embed, head = self._stage_varying(params)
        images = self._micro_images(image_tokens)
        loss, (d_layers, d_embed, d_head, d_images) = jax.value_and_grad(total_loss, argnums=(0, 1, 2, 3))(
            params["layers"], embed, head, images)
        d_image = None if images is None else jax.lax.psum(d_images, PP).reshape(image_tokens.shape)
        return (*self._finish(loss, {"layers": d_layers, "embed": d_embed, "head": d_head}), d_image)

    def forward_sums(self, params, batch, head_fn, zero_sums, image_tokens=None):
        """Forward only (evaluation, with a GPipe table): `head_fn`'s sums over every microbatch."""
        embed, head = self._stage_varying(params)
        sums = self._forward_ticks(params["layers"], embed, head, self._micro_images(image_tokens),
                                   self._micro(batch, self.m), head_fn, self._varying(zero_sums))
        return jax.lax.psum(sums, PP)  # one variadic all-reduce for the whole tree

    def loss_and_grads(self, params, batch, token_count, image_tokens=None):
        """(loss, local gradients, cotangent of the image tokens or None) for this device."""
        run = self.one_f_one_b if self.schedule.kind == "1f1b" else self.gpipe
        batch = {k: batch[k] for k in ("inputs", "targets", "mask")}
        return run(params, batch, token_count, image_tokens)
