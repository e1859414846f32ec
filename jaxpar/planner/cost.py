"""Step-time model: compute, tensor / data / pipeline communication and the pipeline bubble, apart.

FLOPs are matmul FLOPs (what `jaxpar.compiler.hlo_flops.executed_flops` counts in the compiled program; elementwise
work is not counted on either side), for the pipeline as jaxpar runs it once 1F1B keeps its vjp
residuals (issue 14):
- decoder layers: forward + backward (input and weight gradients: 2 x forward) + what `remat.policy`
  recomputes in the backward (`full`: the layer forward again, less its last projection, whose output
  the backward never needs and XLA drops; `selective` / `offload`: the QK^T scores; `none` / `dots`:
  nothing); `pipeline.stage_recompute=true` adds one whole stage forward per microbatch (the ring-
  buffer pipeline before the rewrite). With a pipeline every executed slot computes, masked or not:
  the layers cost the schedule table's executed slots (jaxpar.parallel.schedule; 1f1b: v m + p - 1 F
  and B chunk slots, x 1 / (1 - bubble_fraction); zb splits B into input-gradient B and weight-
  gradient W slots, each costed on its own).
- LM head: its vocabulary is split over pp x tp, so each device runs 1/(pp tp) of the head matmul
  (forward, input and weight gradient) for every microbatch of its dp shard; no bubble factor.
  The embedding is a gather: no matmul.
- VLA encoder + projector: data-parallel over all devices, once per step; the patch embedding is
  replicated inside a vision tp group and needs no input gradient; the projector is a column / row
  pair over it.
Compute runs at `matmul_efficiency` x peak. Communication is ring collectives at link bandwidth, not
overlapped with compute (jaxpar issues them in line; XLA may overlap some, so this errs slow). The
bubble's seconds are the idle slots' share of the layers' executed FLOPs (= the table's
bubble_fraction weighted by these slot costs), applied to the layer
compute and its tp all-reduces: masked slots compute and communicate like busy ones.
Host offload (offload.optimizer / offload.params) adds its host-link (PCIe) seconds and, with
offload.update=host, the host CPU's AdamW: planner/offload.py, which says what of it overlaps.
Placement follows jaxpar.parallel.mesh: tp fastest-varying (inside a node when tp <= GPUs per node), pp next,
dp outermost.
"""

from __future__ import annotations

from jaxpar.config import Config, patches_per_image
from jaxpar.models import vla
from jaxpar.models.flops import model_flops_per_step
from jaxpar.planner import kernels, offload, traffic
from jaxpar.planner.traffic import slot_counts
from jaxpar.compiler.hardware import GB, Hardware
from jaxpar.parallel.pipeline import activation_collectives
from jaxpar.parallel.schedule import bubble_fraction, pipeline_table
from jaxpar.planner.memory import (Block, fp8_gathers, head_positions, head_width, linear_params, llm_block, local_params,
                                   local_seq, microbatch,
                                  seq_len, vision_data_ways, vit_block)

# The parts of one layer's forward each remat policy computes again in the backward (layer_forward keys).
RECOMPUTED = {"none": (), "dots": (), "selective": ("scores",), "offload": ("scores",),
              "full": ("qkv", "scores", "values", "out", "mlp_in")}


def layer_forward(blk: Block, b: int, s: int) -> dict[str, float]:
    """Matmul FLOPs of one layer's forward on one tp rank, b sequences of s tokens, by part. The
    attention scores and values are s x s matmuls at the share of the pairs the kernel computes
    (Block.attention_share: XLA masks and computes all, cuDNN's causal kernel and context parallelism's
    blocks skip the masked half)."""
    t = b * s
    ups = 2 if blk.gated else 1
    keys = s * blk.context * blk.attention_share  # cp: this rank's s queries against the whole sequence
    parts = {"qkv": 2.0 * t * blk.d * (blk.q + 2 * blk.kv), "scores": 2.0 * b * s * keys * blk.q,
             "values": 2.0 * b * s * keys * blk.q, "out": 2.0 * t * blk.q * blk.d,
             "mlp_in": 2.0 * t * blk.d * blk.f * ups, "mlp_out": 2.0 * t * blk.f * blk.d}
    parts["total"] = sum(parts.values())
    return parts


def recompute(fwd: dict[str, float], policy: str, output_needed: bool = False, blockwise: bool = False) -> float:
    """What `policy` computes again in one layer's backward. Full remat skips the last projection,
    unless the layer's output itself feeds a gradient (the ViT's FiLM scale multiplies it). `blockwise`:
    context parallelism's attention (jaxpar.layers.ring), whose backward recomputes its blocks' scores
    whatever the policy (the one recompute selective and offload count already). Under full remat that
    is beside the rerun forward's, as a GPU runs them (cuDNN's backward kernel recomputes inside);
    XLA:CPU merges some of the two identical score matmuls (its FLOPs 3.5% under the plan at cp 2)."""
    extra = sum(fwd[k] for k in RECOMPUTED[policy])
    if blockwise and ("scores" not in RECOMPUTED[policy] or policy == "full"):
        extra += fwd["scores"]
    return extra + (fwd["mlp_out"] if policy == "full" and output_needed else 0.0)


def llm_flops(config: Config) -> dict[str, float]:
    """Executed FLOPs per device: decoder layers in every executed slot (and the busy share), LM head.

    Costs per (stage, microbatch): F = forward; B = input + weight gradients (2 forwards; zb: the input
    gradient only, 1) + the remat recompute + with stage_recompute the stage forward again (its output
    is unused: when a chunk is one layer, XLA drops that layer's down projection, or with full remat,
    which saves nothing, its whole forward; a longer layer scan runs one body for every layer and
    keeps it); zb: B = the backward less its weight-gradient matmuls, W = those matmuls alone (one per
    weight matmul of the forward, from the inputs F kept: jaxpar.parallel.split_backward). A chunk
    slot is 1/v of the stage."""
    mesh, m = config.mesh, config.model
    s, b = local_seq(config), microbatch(config)
    pipelined, policy = mesh.pp > 1, config.remat.policy
    passes = config.pipeline.microbatches if pipelined else config.train.grad_accum
    v = config.pipeline.virtual_stages if pipelined else 1
    blk = llm_block(config)
    fwd, layers = layer_forward(blk, b, s), m.n_layers // mesh.pp
    again = layers * recompute(fwd, policy, blockwise=blk.context > 1 and not blk.trades_heads)
    if pipelined and config.pipeline.stage_recompute:
        dead = fwd["total" if policy == "full" else "mlp_out"] if layers == v else 0.0
        again += layers * fwd["total"] - v * dead
    zb = pipelined and config.pipeline.schedule == "zb"
    # zb: B is the backward less the weight-gradient matmuls (one per weight matmul of the forward; the
    # attention core has no weights, so its whole backward is in B, and so is the remat recompute);
    # W is those weight-gradient matmuls and nothing else
    weights = fwd["total"] - fwd["scores"] - fwd["values"]
    backward = 2 * layers * fwd["total"] + again
    cost = {"F": layers * fwd["total"], "B": backward - layers * weights if zb else backward,
            "W": layers * weights if zb else 0.0}
    slots = slot_counts(config)
    executed = sum(slots[k] * cost[k] for k in "FBW") / v * (1 if pipelined else passes)
    head = passes * 3 * 2.0 * b * head_positions(config) * m.d_model * head_width(config) / (mesh.tp * mesh.pp)
    return {"layers": executed, "layers_busy": passes * sum(cost.values()), "head": head, "slot_costs": cost}


def vision_flops(config: Config) -> float:
    """Executed FLOPs per device of the VLA's encoder, FiLM and projector (once per step)."""
    if config.model.kind != "vla":
        return 0.0
    v, d = config.vision, config.model.d_model
    images = config.train.global_batch_size // vision_data_ways(config) * v.cameras
    n = patches_per_image(v)
    fwd = layer_forward(vit_block(config), images, n)
    blocks = v.depth * (3 * fwd["total"] + recompute(fwd, v.remat.policy, output_needed=v.film))
    patch = 2 * 2.0 * images * n * v.patch_size ** 2 * v.channels * v.width  # forward + weight gradient
    projector = 3 * 2.0 * images * n * (v.width * v.projector_dim + v.projector_dim * d) / v.tp  # column / row
    film = 0.0
    if v.film:  # the mean byte embedding (its gradient is an outer product: no matmul), the projection
        examples = config.train.global_batch_size // vision_data_ways(config)
        film = 2.0 * examples * v.width * (config.actions.instruction_len + 3 * v.depth * 2 * v.width)
    return blocks + patch + projector + film


def linear_share(fwd: dict[str, float]) -> float:
    """The share of a layer's matmul FLOPs in its weight GEMMs (the attention core's scores and values are
    not): what precision=fp8 runs as FP8 GEMMs (jaxpar.layers.fp8), in the forward and the backward alike."""
    return 1.0 - (fwd["scores"] + fwd["values"]) / fwd["total"]


def compute_flops(config: Config) -> dict:
    """Model FLOPs per step (for MFU), per device, and the FLOPs one device executes, by part."""
    model = model_flops_per_step(config, seq_len(config))
    llm = llm_flops(config)
    vision = vision_flops(config)
    shares = {"layers": linear_share(layer_forward(llm_block(config), microbatch(config), local_seq(config)))}
    if config.model.kind == "vla":
        shares["vision"] = linear_share(layer_forward(vit_block(config), 1, patches_per_image(config.vision)))
    return {"linear_shares": shares, "model_flops": model, "model_flops_per_device": model / config.mesh.size,
            "executed_flops_per_device": llm["layers"] + llm["head"] + vision,
            "executed_parts": {"layers": llm["layers"], "head": llm["head"], "vision": vision},
            "layers_busy_flops_per_device": llm["layers_busy"],
            "layers_backward_share": 1 - llm["slot_costs"]["F"] / sum(llm["slot_costs"].values()),
            "bubble_fraction": bubble_fraction(config, {k: c for k, c in llm["slot_costs"].items() if c})}


# The share of per-layer dp traffic across nodes that XLA's GPU schedule hides (_dp_comm_s), from five
# GPU-compiled programs on A100 nodes: 6, 9, 20, 20 and 23% (docs/planner.md, "dp traffic across nodes").
INTER_NODE_HIDDEN_SHARE = 0.15


def link_bandwidth(group_stride: int, group_size: int, gpus_per_node: int, hw: Hardware) -> tuple[float, str]:
    """Per-GPU one-way bandwidth (bytes/s) of a ring over a mesh axis of `group_size` devices placed
    `group_stride` apart: NVLink when the whole group sits in one node, else the node's NICs shared
    by its GPUs."""
    if group_size <= 1:
        return float("inf"), "none"
    if group_stride * group_size <= gpus_per_node:
        return hw.nvlink_gbps / 2 * GB, "NVLink"
    return hw.ib_gbps_per_node / gpus_per_node * GB, "inter-node"


def ring_allreduce_s(nbytes: float, n: int, bandwidth: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth


def _comm_s(config: Config, hw: Hardware, gpus_per_node: int) -> dict:
    """tp all-reduces of the busy slots, the dp gradient sync and the pp traffic, in seconds."""
    mesh, m = config.mesh, config.model
    c = 2 if config.bf16_compute else 4
    p = mesh.pp
    passes = config.pipeline.microbatches if p > 1 else config.train.grad_accum
    activation = c * microbatch(config) * local_seq(config) * m.d_model  # one [b, s / cp, d] in compute dtype
    # tp: 2 all-reduces per layer forward, 2 backward, 2 more per recomputed forward (full remat, stage recompute)
    forwards = 1 + rerun_forwards(config)
    tp_bw, tp_link = link_bandwidth(1, mesh.tp, gpus_per_node, hw)
    tp_s = ring_allreduce_s((2 * forwards + 2) * (m.n_layers // p) * passes * activation, mesh.tp, tp_bw)
    dp = _dp_comm_s(config, hw, gpus_per_node)
    # pp: the activation-sized sends and all-reduces the pipeline executes (counted from its table as
    # jaxpar.parallel.pipeline issues them: one send per tick with forwards and one per tick with
    # backwards; per microbatch the first input's all-reduce and its gradient's, and two for the head)
    pp_bw, pp_link = link_bandwidth(mesh.tp, p, gpus_per_node, hw)
    table = pipeline_table(config)
    pp_ops = activation_collectives(table) if table is not None else {}
    sends_s = pp_ops.get("sends", 0) * activation / pp_bw
    all_reduces = sum(n for kind, n in pp_ops.items() if kind not in ("sends", "head"))
    head_input = activation * head_positions(config) / local_seq(config)  # the VLA's head: its action positions
    pp_s = (sends_s + all_reduces * ring_allreduce_s(activation, p, pp_bw)
            + pp_ops.get("head", 0) * ring_allreduce_s(head_input, p, pp_bw))
    # what a GPU's schedule hides (XLA's latency-hiding scheduler, jaxpar.compiler.gpu_program): the backward's
    # tp all-reduces run beside its weight-gradient matmuls; the pipeline's sends beside the ticks' compute
    tp_exposed = tp_s * 2 * forwards / (2 * forwards + 2)
    cp_s, cp_link = _cp_comm_s(config, hw, gpus_per_node)
    return {"tp_comm_s": tp_s, "tp_exposed_s": tp_exposed, "pp_sends_s": sends_s, "cp_comm_s": cp_s,
            "vision_dp_s": _vision_dp_s(config, hw, gpus_per_node, c),
            "dp_comm_s": dp["total"], "dp_in_scan_s": dp["in_scan"], "dp_in_forward_s": dp["in_forward"],
            "dp_in_backward_s": dp["in_backward"],
            "dp_grad_reduce_s": dp["grad_reduce"], "pp_comm_s": pp_s,
            "links": {"tp": tp_link, "dp": dp["link"], "pp": pp_link, **({"cp": cp_link} if config.mesh.cp > 1 else {})}}


def rerun_forwards(config: Config) -> int:
    """Layer forwards a backward runs again: full remat's, and a pipeline's whole-stage recompute."""
    return int(config.remat.policy == "full") + int(config.mesh.pp > 1 and config.pipeline.stage_recompute)


def cp_bytes(config: Config) -> dict[str, float]:
    """Context parallelism's K / V collectives of one step on one device, in bytes of the full buffer by op, as
    the compiled program's collectives count them (tests/test_plan.py checks the two agree across strategies,
    remat policies, ZeRO-3 and a pipeline). A block is K and V of this rank's tokens and tp heads. Per layer
    pass (a pipeline's executed chunk slots, masked ones too: traffic.layer_passes):
    - all_gather: the forward gathers the cp blocks (cp x block); the backward reduce-scatters their
      gradients, and gathers them again unless the forward's are kept: remat none keeps them, full reruns the
      forward, and ZeRO-3's policy never keeps an all-gather's output (jaxpar.parallel.zero.never_keep_gathered).
    - ring: a block sent cp - 1 times forward; in the backward K / V go round again (cp - 1 sends) and the
      travelling dK / dV, in fp32, cp times (jaxpar.layers.ring); a rerun forward sends its own. A VLA's
      prefix-LM also gathers the prefix's keys and values, as all_gather does; a prefix that is the whole
      sequence (action chunks) runs no ring, only that gather (jaxpar.layers.collectives.context_attention).
    - ulysses: q, k, v and the output all-to-all in the forward and the backward, and again in the backward
      under every policy but none (the exchanged tensors are not kept) and full (its rerun forward's);
      a tp rank's K / V heads repeated to cp where it has fewer (jaxpar.layers.ulysses)."""
    mesh, m, c = config.mesh, config.model, (2 if config.bf16_compute else 4)
    if mesh.cp <= 1:
        return {}
    passes = traffic.layer_passes(config, slot_counts(config))
    forward, backward, policy = passes["forward"], passes["backward"], config.remat.policy
    rerun = rerun_forwards(config)
    tokens = microbatch(config) * local_seq(config)
    kv = max(m.n_kv_heads // mesh.tp, 1)
    if mesh.cp_strategy == "ulysses":
        swapped = c * tokens * m.head_dim * (2 * max(kv, mesh.cp) + 2 * (m.n_heads // mesh.tp))
        again = rerun + (policy not in ("none", "full"))
        return {"all-to-all": swapped * (forward + backward * (1 + again))}
    block = c * tokens * 2 * kv * m.head_dim
    regather = rerun + (policy != "full" and (policy != "none" or config.zero.stage >= 3))
    gathers = {"all-gather": mesh.cp * block * (forward + backward * regather),
               "reduce-scatter": mesh.cp * block * backward}
    if mesh.cp_strategy == "all_gather" or (m.kind == "vla" and vla.prefix_len(config) >= seq_len(config)):
        return gathers
    sends = (mesh.cp - 1) * block * (forward + backward * (1 + rerun)) + mesh.cp * block * 4 / c * backward
    return {"collective-permute": sends, **(gathers if m.kind == "vla" and m.prefix_lm else {})}


def _cp_comm_s(config: Config, hw: Hardware, gpus_per_node: int) -> tuple[float, str]:
    """cp_bytes in seconds at the cp group's link: a ring's sends move their whole buffer, the gathers,
    reduce-scatters and all-to-alls (cp - 1) / cp of theirs. Counted as exposed, though a GPU's schedule
    overlaps most of them (BENCHMARKS.md)."""
    mesh = config.mesh
    if mesh.cp <= 1:
        return 0.0, "none"
    bw, link = link_bandwidth(mesh.tp, mesh.cp, gpus_per_node, hw)
    share = {"collective-permute": 1.0}  # of the full buffer each device sends
    wire = sum(n * share.get(op, (mesh.cp - 1) / mesh.cp) for op, n in cp_bytes(config).items())
    return wire / bw, link


def _vision_dp_s(config: Config, hw: Hardware, gpus_per_node: int, c: int) -> float:
    """The VLA encoder's gradient sync over its data-parallel devices (all of them / vision.tp), by its
    own ZeRO stage, as the LLM's below; after the LLM's backward, so not overlapped."""
    if config.model.kind != "vla":
        return 0.0
    ways = vision_data_ways(config)
    g = 4 if config.grad_reduce == "fp32" or not config.bf16_compute else 2
    per_element = {0: 2 * g, 1: g + c, 2: g + c}.get(config.vision.zero.stage, g + 2 * c)
    bw, _ = link_bandwidth(config.vision.tp, ways, gpus_per_node, hw)
    return 0.0 if ways <= 1 else per_element * (ways - 1) / ways * local_params(config)["vision"] / bw


def dp_bytes(config: Config) -> dict[str, float]:
    """The LLM's dp collectives of one step on one device, in bytes of the full buffer by op, as the
    compiled program's collectives count them (jaxpar.compiler.hlo_collectives; tests/test_plan.py
    checks the two agree). Psi is this device's parameters (after tp and pp), g grad_reduce's bytes
    per element (fp32 by default), c the compute dtype's.

    - ZeRO-0: one all-reduce of the gradients (g Psi; after the accumulation with train.grad_accum > 1).
    - ZeRO-1 (the distributed optimizer) reduce-scatters them into the optimizer's shard once (g Psi,
      after the accumulation); ZeRO 1-2 then all-gather the updated weights (c Psi).
    - ZeRO-2 reduce-scatters the gradients (g Psi) without accumulating them whole, so without a
      pipeline once per microbatch (train.grad_accum times); a pipeline accumulates its chunks' and
      reduces once.
    - ZeRO-3 reduce-scatters once per microbatch too, and gathers every microbatch's weights: the
      layers' in the forward and again in the backward, the embedding and head once (kept for the
      backward); under fp8.zero3_gather=fp8 the layers' linear weights in one byte an element."""
    mesh, stage = config.mesh, config.zero.stage
    if mesh.dp * mesh.cp <= 1:
        return {}
    counts = local_params(config)
    psi, layers = counts["llm_layers"] + counts["llm_rest"], counts["llm_layers"]
    g = 4 if config.grad_reduce == "fp32" or not config.bf16_compute else 2
    c = 2 if config.bf16_compute else 4
    microbatches = config.train.grad_accum if mesh.pp == 1 else 1
    if stage == 0:
        return {"all-reduce": g * psi}
    if stage <= 2:
        return {"reduce-scatter": g * psi * (microbatches if stage == 2 else 1), "all-gather": c * psi}
    gathered = c * (psi + layers) - (2 * (c - 1) * linear_params(config) if fp8_gathers(config) else 0)
    return {"reduce-scatter": g * psi * microbatches, "all-gather": gathered * microbatches}


def _dp_comm_s(config: Config, hw: Hardware, gpus_per_node: int) -> dict:
    """The step's dp traffic in seconds (dp_bytes over the ring: an all-reduce moves 2 (n - 1) / n of
    its buffer, a reduce-scatter or all-gather (n - 1) / n), the part issued per layer inside the layer
    scans, and the gradients' reduction alone (what a pipeline can start before its schedule ends).
    ZeRO-3's gathers and reduce-scatters, and without a pipeline ZeRO-2's reduce-scatters and (with
    train.grad_accum = 1) ZeRO-0's all-reduces and ZeRO-1's reduce-scatters, run per layer inside the scans (jaxpar.parallel.zero's
    taps), where GPUs overlap them with the other layers' compute: inside a node. Across nodes XLA's
    GPU schedule leaves most of them exposed: its latency-hiding scheduler prices a collective
    without timing it on a device and gives each about the same short window of compute whatever
    its bytes, enough for NVLink and not for a node's NICs. Five GPU-compiled programs hide 6-23% of
    that traffic (docs/planner.md, "dp traffic across nodes"); the planner hides INTER_NODE_HIDDEN_SHARE
    of it and prices the rest as if after the scans."""
    mesh, stage = config.mesh, config.zero.stage
    ways = mesh.dp * mesh.cp  # context parallelism's ranks sum their gradients as dp's do
    if mesh.cp > 1:  # dp x cp is not one contiguous block of devices: inside a node only if all of it is
        bw, link = link_bandwidth(mesh.tp, mesh.cp * mesh.pp * mesh.dp if mesh.dp > 1 else mesh.cp, gpus_per_node, hw)
    else:
        bw, link = link_bandwidth(mesh.pp * mesh.tp, mesh.dp, gpus_per_node, hw)
    ring = 0.0 if ways <= 1 else (ways - 1) / ways / bw  # seconds per byte of buffer
    moved = dp_bytes(config)
    seconds = {op: (2 if op == "all-reduce" else 1) * ring * n for op, n in moved.items()}
    reduce = seconds.get("all-reduce", 0.0) + seconds.get("reduce-scatter", 0.0)
    total = reduce + seconds.get("all-gather", 0.0)
    per_layer = mesh.pp == 1 and (stage == 2 or config.train.grad_accum == 1)
    in_forward = 0.0
    if stage >= 3:  # the forward's gathers: Psi of the c (Psi + layers) gathered per microbatch
        counts = local_params(config)
        psi = counts["llm_layers"] + counts["llm_rest"]
        in_forward = seconds.get("all-gather", 0.0) * psi / (psi + counts["llm_layers"])
    in_backward = total - in_forward if stage >= 3 else reduce if per_layer else 0.0
    if link == "inter-node":  # the share XLA's GPU schedule hides (docstring); the rest as if after the scans
        in_forward, in_backward = in_forward * INTER_NODE_HIDDEN_SHARE, in_backward * INTER_NODE_HIDDEN_SHARE
    return {"total": total, "in_scan": in_forward + in_backward, "in_forward": in_forward,
            "in_backward": in_backward, "grad_reduce": reduce, "link": link}


def exposed_dp_s(dp_total: float, in_scans: list[tuple[float, float]], layers: int) -> float:
    """dp seconds left on the critical path when the per-layer collectives overlap the other layers'
    compute (GPUs, with xla_flags' latency-hiding scheduler and pipelined collectives). `in_scans`:
    (seconds of collectives issued inside a layer scan, seconds of that scan's compute) for the
    forward and the backward: a gradient's reduction can only run beside the backward (with its remat
    recompute), a ZeRO-3 forward gather beside the forward. In each, one layer's share is never hidden,
    nor is what exceeds the scan's compute; the rest (after the scans) is exposed."""
    hidden = sum(min(comm * (1 - 1 / max(layers, 1)), compute) for comm, compute in in_scans if comm > 0)
    return dp_total - hidden


def pipelined_dp_hidden_s(config: Config, grad_reduce_s: float, layers_executed_s: float) -> float:
    """Seconds of a pipeline's gradient reduction over dp that the rest of the schedule can hide:
    jaxpar.parallel.pipeline reduces each part once the table says it is final (the head after the
    last loss slot, chunk c of v after stage 0's last backward of it, chunk 0 and the embedding after
    the last tick). The parts share the dp link, one after another in that order, each starting when
    it is final and the link is free; what runs before the last tick ends is hidden (the ticks take
    the layers' executed time, spread evenly). Without interleaving only the head's is hidden."""
    table = pipeline_table(config)
    if table is None or table.kind == "gpipe" or grad_reduce_s <= 0:
        return 0.0
    counts, final = local_params(config), table.gradients_final()
    per_param = grad_reduce_s / (counts["llm_layers"] + counts["llm_rest"])
    tick_s, chunk_params = layers_executed_s / table.ticks, counts["llm_layers"] / table.virtual
    parts = sorted([(final["head"], counts["llm_head"])] + [(t, chunk_params) for t in final["chunks"]])
    end, link_free, hidden = table.ticks * tick_s, 0.0, 0.0
    for tick, params in parts:
        start = max(link_free, (tick + 1) * tick_s)
        link_free = start + per_param * params
        hidden += max(0.0, min(link_free, end) - start)
    return hidden


def matmul_rates(config: Config, hw: Hardware, shares: dict[str, float]) -> dict[str, float]:
    """FLOP/s of the layers', the encoder's and the head's matmuls: `matmul_efficiency` x the bf16 peak, and
    under precision=fp8 the linear share of a layer at the FP8 peak instead (the same efficiency: an
    estimate, as in jaxpar.compiler.gpu_program; the head and the attention core stay bf16)."""
    rate = hw.peak_flops * hw.matmul_efficiency
    if config.precision != "fp8" or not hw.fp8_peak_flops:
        return {"layers": rate, "vision": rate, "head": rate}
    slower = hw.peak_flops / hw.fp8_peak_flops  # an FP8 FLOP's time in bf16 FLOPs
    return {"head": rate, **{part: rate / (1 - share * (1 - slower)) for part, share in shares.items()},
            **({} if "vision" in shares else {"vision": rate})}


def step_time(config: Config, hw: Hardware, gpus_per_node: int) -> dict:
    """Seconds per step, by part, and the MFU this implies."""
    flops = compute_flops(kernels.resolve(config, "gpu", hw.compute_capability))
    rates = matmul_rates(config, hw, flops["linear_shares"])
    parts = flops["executed_parts"]
    busy_layers_s = flops["layers_busy_flops_per_device"] / rates["layers"]
    idle = 1 - flops["layers_busy_flops_per_device"] / parts["layers"]  # bubble_fraction when F:B costs 1:2
    comm = _comm_s(config, hw, gpus_per_node)
    compute_s = busy_layers_s + parts["head"] / rates["head"] + parts["vision"] / rates["vision"]
    bubble_s = idle / (1 - idle) * (busy_layers_s + comm["tp_comm_s"])
    layers = config.model.n_layers // config.mesh.pp
    backward_s = busy_layers_s * flops["layers_backward_share"]
    in_scans = [(comm["dp_in_forward_s"], busy_layers_s - backward_s), (comm["dp_in_backward_s"], backward_s)]
    comm["dp_exposed_s"] = (exposed_dp_s(comm["dp_comm_s"], in_scans, layers)
                            - pipelined_dp_hidden_s(config, comm["dp_grad_reduce_s"], busy_layers_s + bubble_s))
    hbm = traffic.memory_bound_s(config, hw, slot_counts(config))
    compute_s += hbm["memory_s"] + hbm["launch_s"]  # every executed slot's kernels: not scaled by the bubble
    without_overlap = (compute_s + bubble_s + comm["tp_comm_s"] + comm["dp_comm_s"] + comm["pp_comm_s"]
                       + comm["cp_comm_s"])
    comm["pp_exposed_s"] = comm["pp_comm_s"] - min(comm["pp_sends_s"], busy_layers_s + bubble_s)
    without_overlap += comm["vision_dp_s"]
    # host offload (planner/offload.py): the host link (parameter copies hidden behind the layers) and the host update
    host = offload.step_terms(config, hw, gpus_per_node, busy_layers_s)
    without_overlap += host["host_link_s"] + host["host_adam_s"]
    total = (without_overlap - comm["dp_comm_s"] + comm["dp_exposed_s"] - comm["tp_comm_s"] + comm["tp_exposed_s"]
             - comm["pp_comm_s"] + comm["pp_exposed_s"] - host["host_link_s"] + host["host_link_exposed_s"])
    tokens = config.train.global_batch_size * seq_len(config)
    return {"compute_s": compute_s, "matmul_s": compute_s - hbm["memory_s"] - hbm["launch_s"],
            "memory_s": hbm["memory_s"], "memory_parts": hbm["memory_parts"], "launch_s": hbm["launch_s"],
            "bubble_s": bubble_s, "step_s": total, "step_s_no_overlap": without_overlap,
            **comm, **host,
            "mfu": flops["model_flops"] / (total * config.mesh.size * hw.peak_flops),
            "tokens_per_s": tokens / total, **flops}
