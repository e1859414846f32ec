"""The VLA's vision encoder + projector as its own parallel component, on the same devices as the LLM.

Strategy (the seed's table 6.2 idea: a small encoder wants data parallelism, not the LLM's layout):
- The encoder is tensor-parallel over `vision.tp` devices: the whole tp axis, or its inner part
  ("tpv" of a split tp axis, jaxpar.parallel.mesh.Layout) when vision.tp is a proper divisor of mesh.tp.
- Its batch is split over every mesh axis its tp does not use: each dp shard's examples are divided
  further over pp (and the rest of tp), so every vision tp group encodes a distinct slice.
- The projected image tokens are then assembled back into the LLM's layout (dp-sharded, the same on
  every pp / tp rank) with one all-gather over the split axes, and enter the first pipeline stage.
- Backward: the first stage's input cotangent for the image positions comes back the same on every
  split rank; each device takes its slice and runs the encoder's vjp. Gradients are summed (ZeRO 0)
  or reduce-scattered (ZeRO 1-2) over all the encoder's data-parallel axes.
- fp8.recipe=delayed: the blocks' and the projector's counters (jaxpar.models.vit.fp8_lives_shapes) are
  replicated, typed varying over the encoder's tp axes on entry and summed over them once after the data
  reductions, as the LLM's (jaxpar.parallel.fp8_counters): each tp rank's linears see their own shards only.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpar.config import Config
from jaxpar.layers.collectives import Collectives
from jaxpar.models import vit
from jaxpar.parallel import fp8_counters, remat
from jaxpar.parallel.zero import StateSpecs, mesh_axes_of, reduce_gradients
from jaxpar.sharding import vision_rules


class VisionComponent:
    def __init__(self, config: Config, mesh):
        vcfg = config.vision
        sizes = mesh.shape
        self.config, self.cfg = config, vcfg
        self.rules = vision_rules(vcfg.tp, mesh)
        self.axes = vit.param_axes(vcfg, config.fp8_delayed)
        self.specs = StateSpecs(self.axes, vcfg.zero.stage, mesh, self.rules)
        self.split_axes = tuple(a for a in self.rules.zero_mesh if a != "dp" and sizes[a] > 1)  # within a dp shard
        self.split_sizes = tuple(sizes[a] for a in self.split_axes)
        self.data_axes = tuple(a for a in ("dp",) if sizes[a] > 1) + self.split_axes
        tensor_axis = self.rules.table["vit_heads"]  # "tp", the inner "tpv", or None
        self.coll = Collectives(tp_axis=tensor_axis if vcfg.tp > 1 else None, fp8=config.precision == "fp8")
        # fp8.recipe=delayed: the tp axes the counters are typed varying over, then summed over (docstring)
        self.lives_axes = mesh_axes_of(self.coll.tp_axis) if config.fp8_delayed else ()
        self.policy = remat.layer_policy(vcfg.remat.policy, regathers_weights=False)

    def describe(self, mesh) -> dict:
        data = math.prod(mesh.shape[a] for a in self.data_axes)
        return {"tp": self.cfg.tp, "data_parallel": data, "data_axes": list(self.data_axes),
                "zero_stage": self.cfg.zero.stage, "remat": self.cfg.remat.policy}

    def _split_index(self):
        index = jnp.int32(0)
        for axis, size in zip(self.split_axes, self.split_sizes):
            index = index * size + jax.lax.axis_index(axis)
        return index

    def forward(self, params, images, instruction, gather: bool = True, calibrating: bool = False, state=None):
        """(image tokens [B_dp, I, D] for this dp shard, the same on every pp / tp rank; their vjp).
        `instruction` [B_dp, T] (the bytes) is only read with vision.film. `gather=False`: this rank's
        own slice [B_dp / split ways, I, D] (rows split_index() * that onwards), for a first input that
        sums each rank's images into the sequence itself (`owned_rows`). `calibrating`: fp8.recipe=delayed's
        calibration pass (Collectives.fp8_calibrating). `state` [B_dp, state_dims]: with vision.state_dims, sliced
        with the images (its token is one more image token)."""
        ways = math.prod(self.split_sizes)
        chunk = images.shape[0] // ways
        start = self._split_index() * chunk
        mine = jax.lax.dynamic_slice_in_dim(images, start, chunk, axis=0)
        my_instruction = jax.lax.dynamic_slice_in_dim(instruction, start, chunk, axis=0)
        my_state = None if state is None else jax.lax.dynamic_slice_in_dim(state, start, chunk, axis=0)
        if self.data_axes:  # each device's gradient is its own share; summed in reduce_grads
            params = jax.lax.pcast(params, self.data_axes, to="varying")
        params = fp8_counters.varying_over_tp(params, self.lives_axes)
        coll = dataclasses.replace(self.coll, fp8_calibrating=calibrating)

        def encode(p):
            tokens = vit.encode(p, mine, self.cfg, coll, self.policy, my_instruction, my_state)
            if not self.split_axes or not gather:
                return tokens
            # every split rank's slice, in _split_index's order, typed the same on each rank ("invarying"):
            # an all-gather, half the bytes of summing zero-padded copies, and its transpose is the slice
            # each rank's encoder backward needs, with no collective
            return jax.lax.all_gather(tokens, self.split_axes, axis=0, tiled=True, to="invarying")

        return jax.vjp(encode, params)

    def owned_rows(self, tokens, rows, reduce_axes: tuple[str, ...]):
        """This rank's contribution to the image tokens of `rows` (indices into the dp shard's batch), from
        its own slice `tokens` (forward(gather=False)): the rows it encoded, zeros elsewhere, and zeros on
        every rank but the first along the axes of `reduce_axes` its images do not split (where the
        encoder's tokens are replicated). Summed over `reduce_axes`, each row is its encoder's tokens."""
        chunk = tokens.shape[0]
        owned = (rows // chunk == self._split_index())
        for axis in reduce_axes:
            if axis not in self.split_axes:
                owned = owned & (jax.lax.axis_index(axis) == 0)
        picked = jnp.take(tokens, rows % chunk, axis=0)
        return jnp.where(owned[:, None, None], picked, jnp.zeros_like(picked))

    def reduce_grads(self, grads, dtype):
        """Sum (ZeRO 0) or reduce-scatter into the optimizer's shard (ZeRO 1-2) the encoder's gradients
        over its data axes."""
        if self.data_axes:
            grads = reduce_gradients(grads, self.axes, self.data_axes, self.cfg.zero.stage >= 1, self.rules, dtype)
        return fp8_counters.summed_over_tp(grads, self.lives_axes)  # (after the data reductions)
