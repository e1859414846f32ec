"""The step's memory-bound kernels and kernel launches: what the planner adds to its matmul time.

Why: the GPU dry run's estimate (jaxpar.compiler.gpu_program) walks XLA's scheduled GPU program and finds that
matmuls are only part of a step. Norms, RoPE, SwiGLU, residual adds, XLA's softmax over [b, h, s, s]
scores, the optimizer update and the LM head's softmax move bytes through HBM and do few FLOPs; on
the 1B Llama with XLA attention they take as long as the matmuls (BENCHMARKS.md, "GPU-compiled dry
runs"). A planner that prices only matmuls ranks layouts by the wrong cost and was 2-3x too fast.

The model counts HBM bytes per unit of work, as fused GPU kernels move them (c = compute-dtype bytes,
t tokens, local widths d, q, kv, f of one tp rank):
- a layer's forward: two norms (read and write c t d each), two residual adds (3 c t d each), RoPE on
  q and k (2 c t (q + kv)), SwiGLU (3 c t f): LAYER_D c t d + 2 c t (q + kv) + 3 c t f; its backward
  BACKWARD_RATIO times that, a recomputed forward (full remat) once more. Every executed pipeline
  slot counts: masked slots run their kernels too.
- XLA's attention (not cuDNN's, which keeps the scores on chip): per score element of a layer's
  forward and backward, SCORE_BYTES_SAVED when the probabilities are kept (remat none / dots) and
  SCORE_BYTES_RECOMPUTED when the backward recomputes them.
- the optimizer: OPTIMIZER_BYTES per optimizer-sharded parameter (read and write the fp32 master, m,
  v and gradient, write the bf16 parameters; on a GPU the NaN guard's conditional writes the new
  state to fresh buffers and copies it back: planner/memory.py); none with offload.update=host,
  whose update runs on the host CPU (planner/offload.py).
- the LM head: HEAD_BYTES per logit of the vocabulary shard (fp32 logits, their softmax and its
  cotangent, written and read).
- a pipeline's backward slots: each adds its chunk's gradients into the fp32 accumulators,
  ACCUMULATE_BYTES per parameter of the chunk.
- the layer scans: each layer pass copies its weights out of the stacked array (read and write, 2 c
  per parameter) and each backward writes its gradients into the stacked gradient (c).
- ZeRO-3: each layer pass writes and reads the gathered weights (2 c per parameter) and the backward
  the fp32 gradient before its reduce-scatter (8 bytes per parameter).
- precision=fp8's current scaling (jaxpar.layers.fp8): every operand of a layer's FP8 GEMMs is read for
  its amax, read again and written in FP8 (FP8_QUANTIZE_BYTES = 2 c + 1 per element): per forward pass the
  linears' inputs (q / k / v share theirs, as do gate / up: t (2 d + q + f)) and their weights, per backward
  the output gradients (t (q + 2 kv + 2 d + ups f)) and the weights again (the forward's FP8 weight is not
  kept; with fp8.zero3_gather=fp8 each rank quantizes its 1/dp shard instead and the GEMMs read the
  gathered bits; a pipeline stage that gathers nothing quantizes its layers' weights once per step and
  its slots read the bits). None on a device without FP8 tensor cores (A100 refuses fp8) or in bf16.
  fp8.recipe=delayed: the inputs and output gradients are read once (c + 1 per element: the scale comes from
  the counters, so the amax and the cast are one pass); the weights keep current scaling.
- ZeRO-3 with FP8 gathers: the linears' gathered weights are written and read in one byte.
- launches: KERNELS_PER_LAYER_PASS kernels per executed layer pass at hardware.KERNEL_LAUNCH_S.
Where the constants come from: LAYER_D, BACKWARD_RATIO, WEIGHT_SLICE_BYTES and ACCUMULATE_BYTES from
counting the kernels' bytes (the last two found in the seed's vla70b program on 64 A100s); the two
score constants and KERNELS_PER_LAYER_PASS from the GPU dry runs of a 3B-shaped Llama (8 layers,
d_model 3072) on 8 H100s (docs/planner.md, "Fit to the GPU compiler"), not from the configs the
planner is checked against. The VLA's encoder is not priced here (its matmuls are; it is a few
percent of a VLA step).
"""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.planner import kernels
from jaxpar.compiler.hardware import KERNEL_LAUNCH_S, Hardware
from jaxpar.parallel.schedule import pipeline_table
from jaxpar.planner.memory import (data_ways, fp8_gathers, head_positions, linear_params, llm_block, local_params,
                                   local_seq, microbatch)

LAYER_D = 10  # c t d bytes of a layer forward's norms and residual adds
BACKWARD_RATIO = 2.5  # a layer backward's elementwise bytes / its forward's (cotangents, some fp32)
SCORE_BYTES_SAVED = 139  # per [b, h, s, s] element of a layer, forward + backward, probabilities kept
SCORE_BYTES_RECOMPUTED = 66  # likewise when the backward recomputes them (remat selective / full)
OPTIMIZER_BYTES = 48
HEAD_BYTES = 16
WEIGHT_SLICE_BYTES = 2  # x c per parameter: a layer pass copies its weights out of the stacked array
ACCUMULATE_BYTES = 10  # per parameter of a chunk, per backward slot: read fp32 sum and bf16 gradient, write the sum
KERNELS_PER_LAYER_PASS = 40
KERNELS_PER_WEIGHT_PASS = 10  # zb's W per layer: its weight-gradient matmuls and the accumulation


def slot_counts(config: Config) -> dict[str, int]:
    """Chunk slots of each kind (F, B, W) one device executes: the ticks in which the kind is active
    anywhere, since a stage without work computes masked garbage (1f1b: v m + p - 1 F and B; zb: m + p
    - 1 F and B, m W). Without a pipeline: one F and one B per pass, no idle slot."""
    table = pipeline_table(config)
    if table is None:
        return {"F": 1, "B": 1, "W": 0}
    return {k: sum(ph.count for ph in table.phases if k in ph.kinds) for k in "FBW"}


def layer_passes(config: Config, slots: dict[str, int]) -> dict[str, float]:
    """Layer forwards, backwards (zb: input-gradient B), zb weight-gradient passes (W: its matmuls
    from kept inputs, no elementwise backward) and recomputed forwards one device executes per
    step, from the executed chunk slots of each kind (slot_counts; a chunk
    slot is 1/v of the stage's layers)."""
    mesh = config.mesh
    layers = config.model.n_layers // mesh.pp
    weight = 0.0
    if mesh.pp > 1:
        per_slot = layers / config.pipeline.virtual_stages
        forward, backward, weight = slots["F"] * per_slot, slots["B"] * per_slot, slots["W"] * per_slot
    else:
        forward = backward = float(layers * config.train.grad_accum)
    again = backward if config.remat.policy == "full" else 0.0
    return {"forward": forward, "backward": backward, "recomputed": again, "weight": weight}


def memory_bound_s(config: Config, hw: Hardware, slots: dict[str, int]) -> dict[str, float]:
    """Seconds of memory-bound kernels by part, and of kernel launches, per step on one device
    (`slots`: the executed chunk slots by kind, slot_counts)."""
    config = kernels.resolve(config, "gpu", hw.compute_capability)
    m, mesh = config.model, config.mesh
    c = 2 if config.bf16_compute else 4
    b, s = microbatch(config), local_seq(config)
    blk, t = llm_block(config, "gpu"), b * s
    passes = layer_passes(config, slots)
    forward_bytes = c * t * (LAYER_D * blk.d / blk.seq_split + 2 * (blk.q + blk.kv) + 3 * blk.f)
    layers = forward_bytes * (passes["forward"] + passes["recomputed"] + BACKWARD_RATIO * passes["backward"])
    attention = 0.0
    if not blk.cudnn:
        per_score = SCORE_BYTES_SAVED if config.remat.policy in ("none", "dots") else SCORE_BYTES_RECOMPUTED
        attention = per_score * b * blk.heads * s * s * blk.context * blk.attention_share * passes["backward"]
    counts = local_params(config)
    params = counts["llm_layers"] + counts["llm_rest"]
    optimizer = OPTIMIZER_BYTES * params / (mesh.dp if config.zero.stage >= 1 else 1)
    if config.offload.optimizer and config.offload.update == "host":
        optimizer = 0.0  # the update runs on the host CPU (planner/offload.py prices it)
    sequences = config.train.global_batch_size // mesh.dp
    head = HEAD_BYTES * sequences * head_positions(config) * m.vocab_size / (mesh.tp * mesh.pp)
    per_layer = counts["llm_layers"] / (m.n_layers // mesh.pp)
    # the pass that writes the weight gradients: B, or zb's W (its B writes only the norms')
    grad_passes = passes["weight"] or passes["backward"]
    weights = c * per_layer * (WEIGHT_SLICE_BYTES * sum(passes.values()) + grad_passes)
    zero3 = 0.0
    if config.zero.stage >= 3 and mesh.dp > 1:
        gathered_bytes = c * per_layer
        if fp8_gathers(config):  # the linears' gathered weights in one byte an element
            gathered_bytes -= (c - 1) * linear_params(config) / (m.n_layers // mesh.pp)
        zero3 = 2 * gathered_bytes * sum(passes.values()) + per_layer * 8 * passes["backward"]
    # each B (zb: W) slot adds its chunk's gradients into the fp32 accumulators: per layer of it
    accumulate = ACCUMULATE_BYTES * per_layer * grad_passes if mesh.pp > 1 else 0.0
    fp8 = fp8_quantize_bytes(config, hw, blk, t, per_layer, passes)
    rate = hw.hbm_tbps * 1e12
    parts = {"layers": layers / rate, "attention": attention / rate, "optimizer": optimizer / rate,
             "head": head / rate, "zero3": zero3 / rate, "accumulate": accumulate / rate,
             "weights": weights / rate, "fp8": fp8 / rate}
    layer_passes_run = passes["forward"] + passes["backward"] + passes["recomputed"]
    launches = (KERNELS_PER_LAYER_PASS * layer_passes_run + KERNELS_PER_WEIGHT_PASS * passes["weight"]) * KERNEL_LAUNCH_S
    return {"memory_s": sum(parts.values()), "memory_parts": parts, "launch_s": launches}


def fp8_quantize_bytes(config: Config, hw: Hardware, blk, t: int, per_layer: float, passes: dict[str, float]) -> float:
    """HBM bytes per step of precision=fp8's quantization passes (module docstring): 0 unless the layers'
    GEMMs run in FP8 on this device."""
    if config.precision != "fp8" or not hw.fp8_peak_flops:
        return 0.0
    per_element = 2 * 2 + 1  # bf16 compute (fp8's): read for the amax, read to convert, write the FP8 copy
    # fp8.recipe=delayed: an input's or output gradient's scale is known before it is read, so its amax and its
    # cast are one pass (the weights keep current scaling)
    per_activation = 2 + 1 if config.fp8_delayed else per_element
    ups = 2 if blk.gated else 1
    inputs = t * (2 * blk.d + blk.q + blk.f)  # attention's (q / k / v), o's, the MLP's (gate / up), down's
    output_grads = t * (blk.q + 2 * blk.kv + 2 * blk.d + ups * blk.f)
    forwards = passes["forward"] + passes["recomputed"]
    # FP8 ZeRO-3 gathers quantize each rank's shard of the weights, and the GEMMs read the gathered bits
    weights = per_layer / data_ways(config) if fp8_gathers(config) else per_layer
    weight_passes = forwards + passes["backward"]
    gathers = config.zero.stage >= 3 and data_ways(config) > 1
    if config.mesh.pp > 1 and not gathers and not config.offload.params:  # a stage quantizes its layers once
        weight_passes = config.model.n_layers // config.mesh.pp  # per step (jaxpar.layers.fp8.quantize_stacked)
    return per_activation * (inputs * forwards + output_grads * passes["backward"]) + per_element * weights * weight_passes
