"""Evaluation on the training layout: forward only, metric sums reduced over the mesh.

The eval step reads the train state's parameters where they are (no resharding, no second copy)
and runs the same shard_map as training: tensor parallel, ZeRO-3 gathers, and with a pipeline the
forward ticks of a GPipe table (no backward, so nothing is kept for one). The last stage turns each
microbatch into masked sums (jaxpar.models.llama.eval_sums / vla.eval_sums); the host divides them
into metrics, so batches of any mask count weigh correctly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.models import llama, vla
from jaxpar.parallel.step import VISION_KEYS

SUM_KEYS = {"llama": ("loss", "tokens", "correct"),
            "vla": ("loss", "tokens", "correct", "action_tokens", "action_correct", "action_abs_err",
                    "action_correct_by_dim")}


class Evaluator:
    def __init__(self, builder):
        self.builder, self.config, self.mesh = builder, builder.config, builder.mesh
        # the training collectives without ZeRO-2's grad taps (there is no backward here)
        self.coll = dataclasses.replace(builder.collectives(), zero2_axis=None, dp_reduce_axis=None)
        self.keys = SUM_KEYS[self.config.model.kind]

    def _head_sums(self, head, x_BxSxD, batch):
        coll = self.builder.head_collectives(self.coll)  # with a pipeline, the head is split over pp x tp
        if self.config.model.kind == "vla" and self.config.actions.head == "l1":
            return vla.l1_eval_sums(head, x_BxSxD, batch, self.config, coll)
        if self.config.model.kind == "vla" and self.config.actions.head == "flow":
            return vla.flow_eval_sums(head, x_BxSxD, batch, self.config, coll)
        token_loss, pred = llama.head_eval(head, x_BxSxD, batch["targets"], self.config.model, coll)
        if self.config.model.kind == "vla":
            return vla.eval_sums(self.config, token_loss, pred, batch, coll.context_positions(pred.shape[1]))
        return llama.eval_sums(token_loss, pred, batch)

    def _sum_shape(self, key: str) -> tuple[int, ...]:
        return (self.config.actions.dims,) if key == "action_correct_by_dim" else ()

    def _llm_input(self, params, batch, image_tokens):
        if image_tokens is None:
            return llama.embed_tokens(params, batch["inputs"], self.coll)
        return vla.llm_inputs(params, image_tokens, batch["inputs"], self.coll)

    def _local_sums(self, params, batch):
        b = self.builder
        image_tokens = None
        if b.vision is not None:
            image_tokens, _ = b.vision.forward({k: params[k] for k in VISION_KEYS}, batch["images"],
                                               vla.instruction_ids(batch, self.config),
                                               gather=not b.sums_own_images, state=batch.get("state"))
        llm = {k: v for k, v in params.items() if k not in VISION_KEYS}
        if b.dp_axis and not b.zero.gathers_weights:  # typed as in training (see StepBuilder)
            llm = jax.lax.pcast(llm, b.data_axes, to="varying")
        text = b.context_shard({k: v for k, v in batch.items() if k not in ("images", "state")})
        if self.mesh.shape["pp"] > 1:  # the forward slots of the training table (its chunk order)
            split, micro, extra = b.pipeline_inputs(llm, text, image_tokens)
            zeros = {k: jnp.zeros(self._sum_shape(k), jnp.float32) for k in self.keys}
            if b.dp_axis:
                zeros = jax.lax.pcast(zeros, b.data_axes, to="varying")
            pipe = b.pipeline(self.coll, None, schedule="1f1b")
            sums = pipe.forward_sums(split, micro, extra, self._head_sums, zeros)
        else:
            x = llama.run_layers(self._llm_input(llm, text, image_tokens), llm["layers"], self.config.model,
                                 self.coll, None, b.prefix_len)
            sums = self._head_sums(llm, x, text)
        return b._dp_sum({k: v.astype(jnp.float32) for k, v in sums.items()})  # one all-reduce for the tree

    def jit_eval_step(self):
        """(params, batch) -> replicated dict of metric sums for one global batch."""
        sums = jax.shard_map(self._local_sums, mesh=self.mesh,
                             in_specs=(self.builder.specs.params, self.builder.batch_spec),
                             out_specs={k: P() for k in self.keys})
        replicated = NamedSharding(self.mesh, P())

        def fn(params, batch):  # the flow head: the same draws for every evaluation batch (vla.EVAL_DRAWS)
            return sums(params, vla.flow_noise(self.config, batch, vla.EVAL_DRAWS))
        return jax.jit(fn, in_shardings=(self.builder.state_shardings().params, self.builder.batch_sharding()),
                       out_shardings={k: replicated for k in self.keys})


def metrics_from_sums(sums: dict, bytes_per_token: float | None = None) -> dict:
    """Host-side ratios: eval_loss, eval_accuracy, and eval_bits_per_byte (text) or the action metrics."""
    out = {"eval_loss": sums["loss"] / sums["tokens"], "eval_accuracy": sums["correct"] / sums["tokens"]}
    if "action_tokens" in sums:
        out["eval_action_accuracy"] = sums["action_correct"] / sums["action_tokens"]
        out["eval_action_l1"] = sums["action_abs_err"] / sums["action_tokens"]
        examples = sums["action_tokens"] / len(sums["action_correct_by_dim"])
        out["eval_action_accuracy_by_dim"] = [c / examples for c in sums["action_correct_by_dim"]]
    if bytes_per_token:  # nats per token -> bits per byte of the held-out text
        out["eval_bits_per_byte"] = out["eval_loss"] / math.log(2) / bytes_per_token
    return out
