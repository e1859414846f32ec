"""The sharded train step: Megatron tensor parallel + ZeRO data parallel, one jitted program.

Design (docs/design.md has the longer story):
- Loss and gradients run inside one `jax.shard_map` over the whole mesh with hand-written
  collectives, so every byte that moves there is one we asked for. Over tp, per layer: 2 all-reduces
  forward (the attention and MLP row-parallel outputs, Megatron's g) and 2 backward (the input
  gradient of each tensor-parallel block, Megatron's f: the transpose of
  `Collectives.enter_tensor_parallel`); with remat full the backward scan also recomputes the
  attention output's all-reduce (not the MLP's: the layer's output is not needed), 2 + 1 + 2 = 5.
  Once per step: the vocab-parallel embedding, the loss's max, normaliser and target logit, and the
  head input's gradient. tests/test_tp_backward.py counts them in the compiled step (pp = 1, ZeRO 0,
  remat none and full): XLA leaves every per-layer one a separate all-reduce, combines the head
  input's gradient with the target logit into one tuple all-reduce, and its partitioner adds one
  more after the shard_map (the gradient norm's partial sums over tp). Over dp, one gradient
  reduction: all-reduce (ZeRO 0) or reduce-scatter into the optimizer's shard (ZeRO 1-2, Megatron's
  distributed optimizer); with sequence parallelism
  the tp all-reduces become reduce-scatter / all-gather pairs; ZeRO-3 gathers each layer's weights
  just before use and its transpose reduce-scatters the gradients. In bf16 the gathers move bf16;
  gradient reductions over dp move fp32 (`grad_reduce=bf16` halves their bytes).
- The optimizer runs after the shard_map on global arrays whose shardings follow the ZeRO table in
  jaxpar.sharding; XLA slices / all-gathers between the gradient, optimizer and parameter layouts.
- Mixed precision as DeepSpeed: `params` are the compute-dtype copy (bf16), `master` the fp32
  weights, both laid out per ZeRO stage; with fp32 there is no separate master.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import jax.experimental.compute_on as compute_on_api
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import Config, carries_instruction_bytes, image_tokens, nan_guard_for, sums_own_images
from jaxpar.errors import ConfigError
from jaxpar.layers import fp8
from jaxpar.layers.collectives import Collectives, varying_of
from jaxpar.layers.order import after, chain
from jaxpar.models import llama, vit, vla
from jaxpar.parallel.optim import is_fp8_counters, lr_schedule, make_optimizer
from jaxpar.parallel import fp8_counters, remat, schedule as pipeline_schedule, zero
from jaxpar.parallel.pipeline import Pipeline, StagePieces, reorder_layers
from jaxpar.parallel.split_backward import SplitBackward
from jaxpar.parallel.residuals import zeros_typed
from jaxpar.parallel.pipeline import layer_order as pipeline_layer_order
from jaxpar.parallel.vision import VisionComponent
from jaxpar.parallel.zero import StateSpecs, ZeroPlan, gather_axes, mesh_axes_of, reduce_gradients
from jaxpar.sharding import CP, DP, data_axes, kv_head_ways, kv_heads_replicated, llm_rules, tensor_axes, tp_split_of, zero_dim


HOST = "pinned_host"  # memory kind of offloaded state (optimizer state, master weights, offload.params' params)
VISION_KEYS = ("vit", "projector")  # the VLA's vision component in the parameter tree


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # compute dtype; ZeRO-3: dp-sharded
    master: Any  # fp32 master weights when precision=bf16 (ZeRO >= 1: dp-sharded); None for fp32
    opt_state: Any
    skipped: jax.Array  # steps not applied because their loss or gradients were not finite


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _check_host_memory(config: Config, mesh) -> None:
    """Offload needs a host memory space on the devices; say so at start, not in XLA."""
    wants = [key for key, on in (("offload.optimizer=true", config.offload.optimizer),
                                  ("offload.params=true", config.offload.params),
                                  ("remat.policy=offload", config.remat.policy == "offload")) if on]
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if not kinds:  # a GPU dry run's devices (GPUs have host memory, but these keep no memory kinds)
        if config.offload.optimizer:
            raise ConfigError("a GPU dry run cannot place offload.optimizer's state in host memory (its deviceless "
                              "devices keep no memory kinds); dry-run it without --gpu, or ask python -m jaxpar.plan")
        return
    if wants and HOST not in kinds:
        raise ConfigError(f"{' and '.join(wants)} needs '{HOST}' memory, which {device.platform.upper()} devices "
                          f"here do not have; turn offload off")



def _on_host(fn):
    """`fn` (a jitted function) computed on the host, its outputs in host memory: jax 0.10's `compute_on` is a
    context manager (its keyword form was `compute_on2`); from jax 0.11 `compute_on` is the keyword form, which
    names the outputs' memory space."""
    if hasattr(compute_on_api, "compute_on2"):
        return compute_on_api.compute_on("device_host")(fn)
    return compute_on_api.compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)

class StepBuilder:
    """Builds the abstract state, its shardings, the init function and the jitted train step."""

    def __init__(self, config: Config, mesh):
        self.config = config
        self.mesh = mesh
        self.stage = config.zero.stage
        self.axes = llama.param_axes(config.fp8_delayed)  # the LLM's; the vision component keeps its own
        if config.model.kind == "vla" and config.actions.continuous:  # the l1 / flow head's MLP: the LLM's too
            self.axes[vla.ACTION_HEAD] = vla.action_head_axes(config)
        ways = kv_head_ways(config.model.n_kv_heads, config.mesh.tp, tp_split_of(mesh))
        self.replicates_kv = ways == 1 and kv_heads_replicated(config.model.n_kv_heads, config.mesh.tp)
        self.specs_rules = llm_rules(mesh, config.model.n_kv_heads)
        self.specs = StateSpecs(self.axes, self.stage, mesh, self.specs_rules)
        self.vision = VisionComponent(config, mesh) if config.model.kind == "vla" else None
        if self.vision is not None:
            self.specs = self.specs.merged(self.vision.specs)
        self.seq_len = vla.sequence_layout(config)[2] if self.vision is not None else config.train.seq_len
        self.prefix_len = vla.prefix_len(config) if self.vision is not None else 0
        self.tx = make_optimizer(config.train, config.fp8.amax_history if config.fp8_delayed else None)
        # fp8.recipe=delayed: the tp axes the layers' counters are typed varying over, then summed over
        self.lives_axes = fp8_counters.tp_axes(mesh) if config.fp8_delayed else ()
        self.schedule = lr_schedule(config.train)
        self.bf16 = config.bf16_compute
        # ZeRO-3 gathers the linears' weights as E4M3 (fp8.zero3_gather; jaxpar.layers.fp8.all_gather_fp8)
        self.fp8_gathers = config.precision == "fp8" and config.fp8.zero3_gather == "fp8"
        self.compute_dtype = jnp.bfloat16 if self.bf16 else jnp.float32
        # gradients are reduced over dp in fp32 unless grad_reduce=bf16 (Megatron's default is fp32 too)
        self.grad_reduce_dtype = jnp.bfloat16 if self.bf16 and config.grad_reduce == "bf16" else jnp.float32
        self.nan_guard = nan_guard_for(config.train, mesh.devices.flat[0].platform)  # cond or select
        self.fp8_calibrating = False  # (fp8_counters.calibrate's copy of the builder)
        _check_host_memory(config, mesh)
        # the axes gradients are summed over (dp, and cp with context parallelism); None when they are
        # all of size 1: no data-parallel collectives at all
        self.data_axes = tuple(a for a in data_axes(mesh) if mesh.shape[a] > 1)
        self.dp_axis = self.data_axes or None
        self.data_ways = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.context_ways = mesh.shape.get(CP, 1)
        self.zero = ZeroPlan(self.stage, self.data_ways, mesh.shape["pp"] > 1, config.remat.policy,
                             config.zero.prefetch, config.train.grad_accum)
        # [batch, seq]: batch over dp; with cp each device takes its own tokens (context_shard)
        self.batch_spec = P(DP if mesh.shape[DP] > 1 else None, None)

    # ------------------------------------------------------------------ state layout
    def _named(self, specs, memory_kind: str | None = None):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=memory_kind), specs, is_leaf=_is_spec)

    def _opt_state_specs(self):
        abstract_opt = jax.eval_shape(self.tx.init, self._abstract_params(jnp.float32))
        masked = optax.transforms.MaskedNode  # a leaf an optax.partition branch does not update (no state)
        return optax.tree_map_params(self.tx, lambda leaf, spec: leaf if isinstance(leaf, masked) else spec,
                                     abstract_opt, self.specs.opt, transform_non_params=lambda _: P(),
                                     is_leaf=lambda x: _is_spec(x) or isinstance(x, masked))

    def _deviceless(self) -> bool:
        """A GPU dry run's devices (jax.experimental.topologies): no memories listed, no memory kinds kept."""
        return not self.mesh.devices.flat[0].addressable_memories()

    def offloaded_params(self) -> frozenset:
        """Top-level parameter keys kept in host memory (offload.params: the LLM's ZeRO-3 shards; the
        vision encoder is never ZeRO-3)."""
        if not self.config.offload.params:
            return frozenset()
        return frozenset(k for k in self._param_shapes() if k not in VISION_KEYS)

    def state_shardings(self, on_device: bool = False) -> TrainState:
        """Where the state lives between steps; `on_device` gives the layout the update runs in."""
        offload = self.config.offload
        opt_kind = HOST if offload.optimizer and not on_device else None
        master_kind = HOST if offload.optimizer and offload.master_weights and not on_device else None
        params = self._named(self.specs.params)
        host = self.offloaded_params() if not on_device else frozenset()
        params = {k: jax.tree.map(lambda s: s.with_memory_kind(HOST), v) if k in host else v for k, v in params.items()}
        return TrainState(
            step=NamedSharding(self.mesh, P()),
            params=params,
            master=self._named(self.specs.opt, master_kind) if self.bf16 else None,
            opt_state=self._named(self._opt_state_specs(), opt_kind),
            skipped=NamedSharding(self.mesh, P()),
        )

    def _param_shapes(self) -> dict:
        shapes = llama.param_shapes(self.config.model)
        if self.config.fp8_delayed:
            shapes["layers"][llama.FP8_LIVES] = llama.fp8_lives_shape(self.config.model)
        if self.vision is not None:
            shapes.update(vit.param_shapes(self.config.vision, self.config.model.d_model))
            if vla.ACTION_HEAD in self.axes:
                shapes[vla.ACTION_HEAD] = vla.action_head_shapes(self.config)
            if self.config.fp8_delayed:
                counters = vit.fp8_lives_shapes(self.config.vision)
                shapes["vit"]["blocks"].update(counters["vit"]["blocks"])
                shapes["projector"].update(counters["projector"])
        return shapes

    def _abstract_params(self, dtype):
        shapes = self._param_shapes()
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple))

    def layer_order(self):
        """Order of the stored stacked layers (None: the model's; interleaved stages reorder them)."""
        return pipeline_layer_order(self.config.model.n_layers, self.mesh.shape["pp"],
                                    self.config.pipeline.virtual_stages)

    def to_model_order(self, tree):
        return reorder_layers(tree, self.layer_order(), None)

    def from_model_order(self, tree):
        return reorder_layers(tree, None, self.layer_order())

    def _init(self, key) -> TrainState:
        return self._init_from(llama.init(self.config.model, key), key)

    def _init_from(self, llm_weights, key, vision_weights=None) -> TrainState:
        """A fresh state (step 0, new optimizer moments) from the LLM's fp32 weights in model order;
        the vision encoder (if any) from `vision_weights` ({"vit": ...}) or `key`, its projector from `key`."""
        master = self.from_model_order(llm_weights)
        if self.config.fp8_delayed and llama.FP8_LIVES not in master["layers"]:  # no bin seen yet
            master["layers"] = {**master["layers"],
                                llama.FP8_LIVES: jnp.zeros(llama.fp8_lives_shape(self.config.model), jnp.float32)}
        if self.vision is not None:
            vision = vit.init(self.config.vision, self.config.model.d_model, key)
            if vision_weights is not None:
                vision["vit"] = vision_weights["vit"]
            master.update(vit.with_fp8_lives(vision, self.config.vision) if self.config.fp8_delayed else vision)
            if vla.ACTION_HEAD in self.axes:  # (never in a Hugging Face checkpoint: starts fresh)
                master[vla.ACTION_HEAD] = vla.init_action_head(self.config, jax.random.fold_in(key, 49))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree.map(lambda w: w.astype(self.compute_dtype), master),
            master=master if self.bf16 else None,
            opt_state=self.tx.init(master),
            skipped=jnp.zeros((), jnp.int32),
        )

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: drives the dry run without allocating anything."""
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings())

    def init_state(self, seed: int) -> TrainState:
        """Initialise directly into the sharded layout: nothing is materialised unsharded."""
        init = jax.jit(self._init, out_shardings=self.state_shardings())
        return init(jax.random.key(seed))

    def llm_weight_shardings(self) -> dict:
        """Where the LLM's fp32 weights go when a run starts from given weights (the master layout)."""
        llm = {k: v for k, v in self.specs.opt.items() if k not in VISION_KEYS and k != vla.ACTION_HEAD}
        llm["layers"] = {k: v for k, v in llm["layers"].items() if k != llama.FP8_LIVES}  # (state, not weights)
        return self._named(llm)

    def init_state_from(self, llm_weights, seed: int, vision_weights=None) -> TrainState:
        """A fresh sharded state from given weights (e.g. Hugging Face checkpoints): the LLM's
        (None: random) and the vision encoder's (None: random); the rest from `seed`."""
        def build(llm, vision, key):
            return self._init_from(llama.init(self.config.model, key) if llm is None else llm, key, vision)

        init = jax.jit(build, out_shardings=self.state_shardings(), donate_argnums=0)
        return init(llm_weights, vision_weights, jax.random.key(seed))

    # ------------------------------------------------------------------ batches
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    def abstract_batch(self) -> dict:
        """Shapes of one global batch: LLM sequences of `seq_len` (+ images for a VLA)."""
        batch, seq, sharding = self.config.train.global_batch_size, self.seq_len, self.batch_sharding()
        shapes = {"inputs": ((batch, seq), jnp.int32), "targets": ((batch, seq), jnp.int32),
                  "mask": ((batch, seq), jnp.float32)}
        if self.vision is not None:
            v = self.config.vision
            n_image = image_tokens(v)
            shapes["inputs"] = ((batch, seq - n_image), jnp.int32)
            shapes["images"] = ((batch, v.cameras, v.image_size, v.image_size, v.channels), jnp.uint8)
            if carries_instruction_bytes(self.config):  # FiLM's bytes beside a tokenizer's ids
                shapes["instruction_bytes"] = ((batch, self.config.actions.instruction_len), jnp.int32)
            if self.config.actions.continuous:  # the values the l1 / flow head learns (vla.make_batch)
                shapes["values"] = ((batch, seq), jnp.float32)
            if v.state_dims:  # the proprioceptive state the encoder reads (jaxpar.models.vit, "The state token")
                shapes["state"] = ((batch, v.state_dims), jnp.float32)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, (shape, dtype) in shapes.items()}

    # ------------------------------------------------------------------ loss and gradients
    def collectives(self) -> Collectives:
        tp = tensor_axes(self.mesh) if self.config.mesh.tp > 1 else None
        return Collectives(tp_axis=tp, sequence_axis=tp if self.config.mesh.sequence_parallel else None,
                           zero3_axis=self.dp_axis if self.zero.gathers_weights else None,
                           host_weights=self.config.offload.params and not self.zero.gathers_weights,
                           zero2_axis=self.dp_axis if self.zero.taps_grads else None, zero3_prefetch=self.zero.prefetches,
                           dp_reduce_axis=self.dp_axis if self.zero.reduces_in_backward else None,
                           context_axis=CP if self.context_ways > 1 else None,
                           context_strategy=self.config.mesh.cp_strategy,
                           grad_reduce_dtype=self.grad_reduce_dtype if self.bf16 else None,
                           kv_heads_replicated=self.replicates_kv and tp is not None, zero_hooks=zero.LAYER_HOOKS,
                           collective_matmul=self.config.mesh.collective_matmul, fp8=self.config.precision == "fp8",
                           fp8_gathered=llama.LINEAR_WEIGHTS if self.fp8_gathers else frozenset(),
                           fp8_calibrating=self.fp8_calibrating)

    def remat_policy(self):
        """The per-layer jax.checkpoint policy (jaxpar.parallel.remat)."""
        return remat.layer_policy(self.config.remat.policy, regathers_weights=self.zero.gathers_weights)

    def _reduce_grads_over_dp(self, grads, axes=None):
        """The LLM's gradient reduction over dp (of `grads`, laid out as `axes`: by default all of the
        LLM's). ZeRO-3's gathers and ZeRO-2's grad taps already reduce-scattered inside the backward,
        layer by layer; a pipeline reduces each part itself, as soon as its gradient is final."""
        if not self.zero.reduces_after_backward:
            return grads
        return reduce_gradients(grads, self.axes if axes is None else axes, self.dp_axis, self.zero.scatters_grads,
                                self.specs_rules, self.grad_reduce_dtype)

    def _local_loss_and_grads(self, params, batch):
        """Per-device body of the shard_map: (vision encoder,) the LLM, then the gradient reductions."""
        token_count = self._dp_sum(jnp.sum(batch["mask"]))
        batch = after(batch, token_count)  # XLA:CPU: the count's dp sum before the model's collectives
        llm_params = {k: v for k, v in params.items() if k not in VISION_KEYS}
        image_tokens = vision_vjp = None
        if self.vision is not None:
            image_tokens, vision_vjp = self.vision.forward({k: params[k] for k in VISION_KEYS}, batch["images"],
                                                           vla.instruction_ids(batch, self.config),
                                                           gather=not self.sums_own_images,
                                                           calibrating=self.fp8_calibrating, state=batch.get("state"))
        if image_tokens is not None:  # (XLA:CPU) the LLM's collectives after the encoder's
            batch = after(batch, image_tokens)
            if self.context_ways > 1:  # each cp rank's image cotangent is its own tokens' share: summed below
                image_tokens = jax.lax.pcast(image_tokens, (CP,), to="varying")
        loss, grads, d_image = self._llm_loss_and_grads(llm_params, batch, image_tokens, token_count)
        if self.mesh.shape["pp"] == 1:  # the pipeline reduced each part already
            grads = self._reduce_grads_over_dp(grads)
        grads = fp8_counters.summed_over_tp(grads, self.lives_axes)
        if vision_vjp is not None:  # (XLA:CPU) the encoder's backward after the LLM's reductions
            d_image = after(d_image.astype(image_tokens.dtype), grads)
            if self.context_ways > 1:  # the whole sequence's cotangent of the (whole) image tokens
                d_image = jax.lax.psum(d_image, CP)
            (vision_grads,) = vision_vjp(d_image)
            grads.update(self.vision.reduce_grads(vision_grads, self.grad_reduce_dtype))
        loss = self._dp_sum(after(loss, grads))
        return loss, after(grads, loss)  # (XLA:CPU) what runs after the shard_map waits for every reduction

    def _llm_loss_and_grads(self, params, batch, image_tokens, token_count):
        """Loss, the LLM's gradients and the cotangent of the image tokens (None without images). The
        gradients are this dp rank's own, except where ZeRO-2 / 3 reduce them inside the backward.

        With ZeRO-2 grad taps, the gradient is taken w.r.t. a dp-shard-shaped tap per weight instead
        of the (replicated) weight itself, and arrives reduce-scattered layer by layer.
        """
        cfg, accum = self.config.model, self.config.train.grad_accum
        coll, policy = self.collectives(), self.remat_policy()
        params = fp8_counters.varying_over_tp(params, self.lives_axes)
        if self.zero.reduces_after_backward or self.zero.taps_grads:  # each dp rank's own gradients
            params = jax.lax.pcast(params, self.data_axes, to="varying")  # (reduced below, or by ZeRO-2's taps)
        if self.mesh.shape["pp"] > 1:
            return self._pipelined_loss_and_grads(params, batch, image_tokens, token_count, coll, policy)

        if self.zero.taps_grads:  # the taps' values are never used, only their shape and type: the optimizer
            frozen, dp = jax.lax.stop_gradient(params), self.data_ways  # shard's, in the reduction's dtype
            params = jax.tree.map(lambda w, axes: jax.lax.slice_in_dim(w, 0, w.shape[zero_dim(axes)] // dp,
                                                                       axis=zero_dim(axes)).astype(self.grad_reduce_dtype),
                                  frozen, self.axes)
            with_weights = lambda t: jax.tree.map(lambda full, tap: (full, tap), frozen, t)  # noqa: E731
        elif self.zero.gathers_weights:  # ZeRO-3: the gradients go to sinks in the reduction's dtype (zero.with_sinks)
            shards, params = params, zero.gradient_sinks(params, self.grad_reduce_dtype)
            with_weights = lambda sinks: zero.with_sinks(shards, sinks)  # noqa: E731
        elif self.config.offload.params:  # host weights, copied in per use; their gradients go to device sinks
            host, params = params, zero.gradient_sinks(params)
            with_weights = lambda sinks: zero.with_host_weights(host, sinks)  # noqa: E731
        else:
            with_weights = lambda p: p  # noqa: E731

        def objective(p, images, micro):
            if images is None:
                return llama.loss_sum(with_weights(p), micro, cfg, coll, policy)[0] / token_count
            return vla.llm_loss_sum(with_weights(p), images, micro, self.config, coll, policy) / token_count

        if image_tokens is not None:  # one microbatch (validated): the encoder ran on the whole batch
            loss, (grads, d_image) = jax.value_and_grad(objective, argnums=(0, 1))(params, image_tokens, batch)
            return loss, grads, d_image
        micro_batches = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)
        if accum == 1:  # a single microbatch keeps compute-dtype grads (2 bytes in bf16)
            loss, grads = jax.value_and_grad(objective)(params, None, jax.tree.map(lambda x: x[0], micro_batches))
            return loss, grads, None

        def accumulate(carry, micro):  # in fp32
            loss_i, grads_i = jax.value_and_grad(objective)(params, None, micro)
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry, (loss_i, grads_i)), None
        # every microbatch inside the scan, from zeros (0 + g = g): a first microbatch computed before it gave
        # the GPU program a second copy of the layer scan's saved inputs (docs/design.md)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(lambda: jax.value_and_grad(objective)(params, None, first))
        carry = jax.tree.map(lambda a: zeros_typed(a.update(dtype=jnp.float32)), shapes)
        (loss, grads), _ = jax.lax.scan(accumulate, carry, micro_batches)
        return loss, grads, None

    @property
    def sums_own_images(self) -> bool:
        """A pipelined VLA whose first input sums each rank's own images' tokens (jaxpar.config.sums_own_images)
        where an all-gather would first copy every image's tokens to every rank (vla70b: 235 MB across
        nodes per step, before the first tick)."""
        return sums_own_images(self.config)

    def head_collectives(self, coll: Collectives) -> Collectives:
        """With a pipeline the vocabulary (embedding, LM head, loss) is split over pp x tp: every stage
        computes its share of the first input and of the head for the same microbatch."""
        if self.mesh.shape["pp"] == 1:
            return coll
        tp = tensor_axes(self.mesh) if self.config.mesh.tp > 1 else ()
        return dataclasses.replace(coll, tp_axis=("pp",) + (tp if isinstance(tp, tuple) else (tp,)))

    def stage_pieces(self, coll: Collectives, policy, token_count=1.0) -> StagePieces:
        """The LLM (or the VLA's LLM) cut into the pipeline's three pieces."""
        cfg, head_coll, prefix_len = self.config.model, self.head_collectives(coll), self.prefix_len

        def first_input(first, image_tokens, data):
            if image_tokens is None:
                return llama.embed_tokens(first, data["inputs"], head_coll)
            if self.sums_own_images:  # image_tokens: this rank's share (extra_at)
                return vla.llm_inputs_summed(first, image_tokens, data["inputs"], head_coll)
            return vla.llm_inputs(first, image_tokens, data["inputs"], head_coll)

        extra_at = None
        if self.sums_own_images:  # microbatch i's rows of the dp shard, from this rank's own images
            ways, m = int(np.prod(self.vision.split_sizes)), self.config.pipeline.microbatches
            reduce_axes = mesh_axes_of(head_coll.tp_axis)

            def extra_at(own_tokens, i):
                rows = own_tokens.shape[0] * ways // m  # a microbatch's rows of the dp shard's batch
                return self.vision.owned_rows(own_tokens, i * rows + jnp.arange(rows), reduce_axes)

        def body(layers, x):
            return llama.run_layers(x, layers, cfg, coll, policy, prefix_len)

        last = vla.loss_positions(self.config) if self.vision is not None else None  # the VLA's actions

        def head_loss(head, y, data):
            if self.vision is not None:  # the VLA's action head: tokens or l1
                return vla.head_loss_sum(head, y, data, self.config, head_coll, last) / token_count
            return llama.head_loss_sum(head, y, data["targets"], data["mask"], cfg, head_coll, last) / token_count

        # precision=fp8: the stage's linear weights quantized once per step, not in every slot (unless ZeRO-3
        # gathers them per use: then its FP8 gathers quantize the shards)
        once = self.config.precision == "fp8" and not coll.zero3_axis and not coll.host_weights
        prepare = functools.partial(fp8.quantize_linears, names=llama.LINEAR_WEIGHTS) if once else None
        # the head reads only the last `last` positions of each rank's y: the pipeline delivers only those
        return StagePieces(first_input, body, head_loss, None if last is None else (lambda y: y[:, -last:]), extra_at,
                           prepare, fp8.weight_grads if once else None)

    def pipeline(self, coll: Collectives, policy, token_count=1.0, schedule: str | None = None) -> Pipeline:
        pipe = self.config.pipeline
        table = pipeline_schedule.build(schedule or pipe.schedule, self.mesh.shape["pp"], pipe.microbatches,
                                        pipe.virtual_stages)
        varying = ("pp",) + self.data_axes
        part_axes = self.pipeline_parts(self.axes)
        split = SplitBackward() if table.kind == "zb" else None  # zb: B and W split in the layers' linears
        coll = dataclasses.replace(coll, weight_grads=split)
        return Pipeline(table, self.stage_pieces(coll, policy, token_count), varying, pipe.stage_recompute,
                        activation_axes=coll.sequence_axes,  # sequence-parallel activations vary over tp too
                        reduce_dp=(lambda part, grads: self._reduce_grads_over_dp(grads, part_axes[part]))
                        if self.zero.reduces_after_backward else None,  # None: nothing to reduce early
                        split=split)

    @staticmethod
    def pipeline_parts(tree) -> dict:
        """An LLM-shaped tree (weights, their logical axes) cut into the pipeline's three parts."""
        return {"first": {"embed": tree["embed"]}, "layers": tree["layers"],
                "head": {k: tree[k] for k in (*llama.HEAD_AXES, vla.ACTION_HEAD) if k in tree}}

    def pipeline_inputs(self, params, batch, image_tokens):
        """The LLM's weights as the pipeline's pieces, and the batch (and image tokens) by microbatch."""
        m = self.config.pipeline.microbatches
        micro = {k: v.reshape(m, -1, *v.shape[1:]) for k, v in batch.items()}
        extra = image_tokens  # None, or this rank's own images' tokens (sums_own_images)
        if image_tokens is not None and not self.sums_own_images:
            extra = image_tokens.reshape(m, -1, *image_tokens.shape[1:])
        return self.pipeline_parts(params), micro, extra

    def _pipelined_loss_and_grads(self, params, batch, image_tokens, token_count, coll, policy):
        split, micro, extra = self.pipeline_inputs(params, {k: batch[k] for k in ("inputs", "targets", "mask", "values", "noise", "time")
                                                            if k in batch}, image_tokens)
        loss, grads, d_extra = self.pipeline(coll, policy, token_count).loss_and_grads(split, micro, extra)
        grads = {**grads["first"], "layers": grads["layers"], **grads["head"]}
        return loss, grads, None if d_extra is None else d_extra.reshape(image_tokens.shape)  # (own: same shape)

    def _dp_sum(self, x):
        """Sum over the data axes (dp, and cp: a loss or count of other tokens) of each device's own
        partial, also where it is typed invariant over one of them (e.g. a count of a cp chunk's action
        tokens, the same on every dp rank, which is then counted once per dp rank)."""
        if not self.dp_axis:
            return x
        def varying(leaf):
            missing = tuple(a for a in self.data_axes if a not in varying_of(jax.typeof(leaf)))
            return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf
        return jax.lax.psum(jax.tree.map(varying, x), self.dp_axis)  # one all-reduce for a tree

    def context_shard(self, batch: dict) -> dict:
        """Inside the shard_map: this cp rank's tokens of each [B, S] array of its dp shard, an early and a
        late chunk (jaxpar.layers.collectives.balanced_order); the identity without cp. Every device
        receives its sequences whole (token ids: small) and slices them, so ordering the tokens moves no
        data between devices; losses and counts are sums over tokens, which no order changes."""
        if self.context_ways == 1:
            return batch
        positions = self.collectives().context_positions(self.seq_len // self.context_ways)
        def sequence_shaped(key, value):  # (not the state [B, state_dims], whatever its dims)
            return key != "state" and value.ndim >= 2 and value.shape[1] == self.seq_len
        return {k: (jnp.take(v, positions, axis=1) if sequence_shaped(k, v) else v) for k, v in batch.items()}

    def loss_and_grads(self, params, batch):
        """Global mean token loss, gradients (laid out as ZeRO's gradient specs) and their global L2 norm."""
        def local(params, batch):
            loss, grads = self._local_loss_and_grads(params, self.context_shard(batch))
            return loss, grads, self._global_norm(grads)

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs.params, self.batch_spec),
                           out_specs=(P(), self.specs.grads, P()))
        return fn(params, batch)

    def _global_norm(self, grads):
        """The L2 norm of the whole gradient, in fp32, in one all-reduce over the mesh: each device's sum
        of squares of the shards it holds, each divided by the number of devices holding the same shard
        (a power of two, so exact). Computed here rather than by the partitioner after the shard_map,
        which issues one unordered all-reduce per group of mesh axes (jaxpar.layers.order). The gradients
        arrive in the optimizer's layout (ZeRO 1-3 reduce-scatter them into its shard), so each device
        reads only the part it updates."""
        axes = tuple(name for name, size in self.mesh.shape.items() if size > 1)
        total = None
        for (path, g), spec in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                   jax.tree.leaves(self.specs.grads, is_leaf=_is_spec)):
            if is_fp8_counters(path):  # bins seen, not a gradient (fp8.recipe=delayed)
                continue
            split = {a for entry in spec for a in mesh_axes_of(entry)}
            copies = self.mesh.size // max(1, int(np.prod([self.mesh.shape[a] for a in split])))
            part = jnp.sum(jnp.square(g.astype(jnp.float32))) / copies
            total = part if total is None else total + part
        total = after(total, grads)
        if axes:
            total = jax.lax.psum(jax.lax.pcast(total, tuple(a for a in axes if a not in varying_of(jax.typeof(total))),
                                               to="varying"), axes)
        return jnp.sqrt(total)

    # ------------------------------------------------------------------ the step
    def train_step(self, state: TrainState, batch: dict, with_grads: bool = False):
        """One optimizer step; `with_grads` also returns the gradients (for the equivalence tests)."""
        if self.config.offload.params and self._deviceless():
            # A GPU dry run's devices carry no memory kinds, so the offloaded parameters arrive typed as device
            # memory: move them to the host first. A GPU run moves the same bytes at the end of its step (the
            # updated parameters back to the host); the per-layer copies in the layer scan are the same.
            host = self.offloaded_params()
            state = state.replace(params={k: jax.device_put(v, jax.memory.Space.Host) if k in host else v
                                          for k, v in state.params.items()})
        # the flow head's noise and times for this step, drawn for the global batch (vla.flow_noise)
        batch = vla.flow_noise(self.config, batch, state.step)
        loss, grads, grad_norm = self.loss_and_grads(state.params, batch)
        # Each dp rank's gradient shard is the part it updates (the optimizer's layout); fp32 already unless
        # grad_reduce=bf16 or ZeRO-0 taps (ZeRO-3's gathers reduce-scatter in grad_reduce's dtype, and JAX keeps
        # their custom_vjp's wider cotangent: jaxpar.parallel.zero).
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if self.config.debug.nan_at_step:  # test hook for the NaN guard
            poison = jnp.where(state.step + 1 == self.config.debug.nan_at_step, jnp.nan, 0.0)
            grads = jax.tree.map(lambda g: g + poison, grads)
            grad_norm = grad_norm + poison
        offload = self.config.offload
        if offload.update == "host":
            return self._step_updating_on_host(state, loss, grads, grad_norm, with_grads)
        if offload.optimizer or (offload.params and not self.bf16):  # host -> device for the update only;
            on_device = self.state_shardings(on_device=True)      # the outputs go back to the host
            state = state.replace(opt_state=jax.device_put(state.opt_state, on_device.opt_state),
                                  master=jax.device_put(state.master, on_device.master))
            if not self.bf16:  # fp32: the parameters are the update's target
                state = state.replace(params=jax.device_put(state.params, on_device.params))
        # NaN guard: a step whose loss or gradients are not finite is not applied (the data is consumed).
        # `finite` comes from all-reduced values, so every device takes the same branch, and the
        # branches hold no collective (clipping reuses grad_norm). train.nan_guard picks how, `auto` as
        # the compiler updates in place (docs/design.md "The NaN guard"): a cond on XLA:CPU, where a
        # where(finite, new, old) kept the old and new state alive at once (+42 GB per device for llama7b
        # dp=8 ZeRO-0); on GPUs the conditional writes the whole new state to fresh buffers instead, and
        # the select, fused into each leaf's update, is the in-place one.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(target, opt_state):
            updates, opt_state = self.tx.update(grads, opt_state, target, grad_norm=grad_norm)
            target = optax.apply_updates(target, updates)
            if self.bf16:
                target = jax.lax.with_sharding_constraint(target, self._named(self.specs.opt))
            return target, opt_state

        target = state.master if self.bf16 else state.params
        if self.nan_guard == "select":
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_target, new_opt_state = update(target, state.opt_state)
            target, opt_state = jax.tree.map(keep, new_target, target), jax.tree.map(keep, new_opt_state, state.opt_state)
        else:
            target, opt_state = jax.lax.cond(finite, update, lambda t, o: (t, o), target, state.opt_state)
        if self.bf16:  # params are always the compute-dtype copy of master: a skip rebuilds the same params
            master, params = target, jax.tree.map(lambda w: w.astype(self.compute_dtype), target)
        else:
            master, params = None, target
        return self._finish_step(state, loss, grads, grad_norm, finite, params, master, opt_state, with_grads)

    def _finish_step(self, state, loss, grads, grad_norm, finite, params, master, opt_state, with_grads):
        params = self._gather_params(params)
        new_state = TrainState(step=state.step + 1, params=params, master=master, opt_state=opt_state,
                               skipped=state.skipped + (~finite).astype(state.skipped.dtype))
        metrics = {"loss": loss, "grad_norm": grad_norm,  # optax counts applied updates only: skips don't advance it
                   "learning_rate": self.schedule(state.step - state.skipped),
                   "skipped": ~finite, "skipped_total": new_state.skipped}
        if with_grads:
            metrics["grads"] = grads
        return new_state, metrics

    def _step_updating_on_host(self, state, loss, grads, grad_norm, with_grads):
        """offload.update=host: the AdamW update runs on the host, where the optimizer state and master
        weights live (DeepSpeed's CPU Adam; jax.experimental.compute_on), so the state never visits the
        device: the gradient shards go to the host and the updated compute-dtype parameters come back.
        The NaN guard selects on the host (host memory is not the scarce kind)."""
        on_host = lambda tree: jax.device_put(tree, self._named(self.specs.opt, HOST))  # noqa: E731
        scalars = NamedSharding(self.mesh, P(), memory_kind=HOST)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        target = state.master if self.bf16 else state.params

        @_on_host
        @jax.jit
        def update(grads, opt_state, target, grad_norm, finite):
            updates, new_opt_state = self.tx.update(grads, opt_state, target, grad_norm=grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_target = jax.tree.map(keep, optax.apply_updates(target, updates), target)
            return new_target, jax.tree.map(keep, new_opt_state, opt_state), jax.tree.map(
                lambda w: w.astype(self.compute_dtype), new_target)

        target, opt_state, params = update(on_host(grads), state.opt_state, on_host(target),
                                           jax.device_put(grad_norm, scalars), jax.device_put(finite, scalars))
        host = self.offloaded_params()  # offloaded parameters stay on the host; the others' gather (ZeRO 1-2) runs on the device
        params = {k: v if k in host else jax.device_put(v, self._named(self.specs.opt[k])) for k, v in params.items()}
        return self._finish_step(state, loss, grads, grad_norm, finite, params, target if self.bf16 else None,
                                 opt_state, with_grads)

    def _gather_params(self, params):
        """The updated weights from the optimizer's layout into the parameters' (ZeRO 1 and 2: an
        all-gather over dp of each weight), written out in a shard_map so that on XLA:CPU the gathers
        run one after another (jaxpar.layers.order); a weight laid out alike in both stays as it is."""
        gathers = jax.tree.map(gather_axes, self.specs.opt, self.specs.params, is_leaf=_is_spec)
        if all(g is None for g in jax.tree.leaves(gathers, is_leaf=lambda g: g is None or isinstance(g, tuple))):
            return jax.lax.with_sharding_constraint(params, self.state_shardings().params)  # (offloaded: to the host)

        def gather(w, how):
            if how is None:
                return w
            dim, axes = how
            return jax.lax.all_gather(w, axes, axis=dim, tiled=True)

        def local(tree):
            return chain(gather, tree, gathers)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs.opt,), out_specs=self.specs.params,
                             check_vma=False)(params)  # all_gather types its result dp-varying; it is not

    def jit_calibrate_fp8(self):
        """fp8.recipe=delayed: the calibration pass a fresh state's counters need (jaxpar.parallel.fp8_counters)."""
        state_sh = self.state_shardings()
        return jax.jit(functools.partial(fp8_counters.calibrate, self), in_shardings=(state_sh, self.batch_sharding()),
                       out_shardings=state_sh, donate_argnums=(0,))

    def jit_train_step(self, with_grads: bool = False):
        state_sh = self.state_shardings()
        replicated = NamedSharding(self.mesh, P())
        metrics_sh = {k: replicated for k in ("loss", "grad_norm", "learning_rate", "skipped", "skipped_total")}
        if with_grads:
            metrics_sh["grads"] = self._named(self.specs.grads)
        return jax.jit(functools.partial(self.train_step, with_grads=with_grads),
                       in_shardings=(state_sh, self.batch_sharding()),
                       out_shardings=(state_sh, metrics_sh), donate_argnums=(0,))
