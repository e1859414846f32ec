"""Step-time model: compute, tensor / data / pipeline communication and the pipeline bubble, apart.

Compute is the FLOPs a device executes (model FLOPs / devices, plus what remat and 1F1B's stage
recompute add, plus the embedding / LM head every pipeline stage computes masked) at
`matmul_efficiency` x peak. Communication is ring collectives at link bandwidth, not overlapped
with compute (jaxpar issues them in line; XLA may overlap some, so this errs slow). The bubble is the
schedule table's idle fraction (jaxpar.parallel.schedule) of the pipeline's compute time.
Placement follows jaxpar.mesh: tp fastest-varying (inside a node when tp <= GPUs per node), pp next,
dp outermost.
"""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.metrics import model_flops_per_step
from jaxpar.models import llama
from jaxpar.parallel import schedule as schedules
from jaxpar.planner.hardware import GB, Hardware
from jaxpar.planner.memory import local_params, microbatch, seq_len

# Extra forward passes of the decoder layers per step, in units of one forward (backward = 2 forwards).
RECOMPUTE = {"none": 0.0, "dots": 0.15, "selective": 0.1, "offload": 0.1, "full": 1.0}


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


def compute_flops(config: Config) -> dict:
    """Model FLOPs per step (for MFU) and the FLOPs one device executes."""
    m, mesh = config.model, config.mesh
    s = seq_len(config)
    model = model_flops_per_step(config, s)
    tokens = config.train.global_batch_size * s
    head = 6.0 * m.d_model * m.vocab_size * tokens
    layers = model - head - (model - llama.flops_per_token(m, s) * tokens)  # the decoder layers
    extra = RECOMPUTE[config.remat.policy] * layers / 3
    if mesh.pp > 1 and config.pipeline.schedule == "1f1b":
        extra += layers / 3  # the stage forward again under vjp in the backward slot
    executed = (model + extra) / mesh.size
    if mesh.pp > 1:  # every stage computes the embedding and head, masked, in every tick
        executed += head / (mesh.dp * mesh.tp) * (1 - 1 / mesh.pp)
    return {"model_flops": model, "executed_flops_per_device": executed}


def step_time(config: Config, hw: Hardware, gpus_per_node: int) -> dict:
    """Seconds per step, by part, and the MFU this implies."""
    mesh, m = config.mesh, config.model
    c = 2 if config.precision == "bf16" else 4
    flops = compute_flops(config)
    busy = flops["executed_flops_per_device"] / (hw.peak_flops * hw.matmul_efficiency)
    p, mb = mesh.pp, config.pipeline.microbatches
    bubble = busy * schedules.ideal_bubble(p, mb) / (1 - schedules.ideal_bubble(p, mb)) if p > 1 else 0.0
    tokens_local = microbatch(config) * seq_len(config)
    passes = (config.pipeline.microbatches if p > 1 else config.train.grad_accum)
    # tp: 2 all-reduces per layer forward, 2 backward, 2 more per recomputed forward; [t, d] each
    fwd_per_step = 1 + (1 if config.remat.policy == "full" else 0) + (1 if p > 1 and config.pipeline.schedule == "1f1b" else 0)
    tp_bw, tp_link = link_bandwidth(1, mesh.tp, gpus_per_node, hw)
    tp_bytes = (2 * fwd_per_step + 2) * (m.n_layers // p) * passes * c * tokens_local * m.d_model
    tp_s = ring_allreduce_s(tp_bytes, mesh.tp, tp_bw)
    # dp: ZeRO 0-2 move 2 Psi (reduce-scatter + all-gather), ZeRO-3 3 Psi
    counts = local_params(config)
    psi = counts["llm_layers"] + counts["llm_rest"]
    dp_bw, dp_link = link_bandwidth(mesh.pp * mesh.tp, mesh.dp, gpus_per_node, hw)
    dp_s = ring_allreduce_s(c * psi, mesh.dp, dp_bw) * (1.5 if config.zero.stage == 3 else 1.0)
    # pp: per tick one activation forward and one cotangent backward, point to point
    pp_bw, pp_link = link_bandwidth(mesh.tp, mesh.pp, gpus_per_node, hw)
    ticks = mb + p - 1
    pp_s = 0.0 if p == 1 else 2 * ticks * c * tokens_local * m.d_model / pp_bw
    total = busy + bubble + tp_s + dp_s + pp_s
    mfu = flops["model_flops"] / (total * mesh.size * hw.peak_flops)
    tokens = config.train.global_batch_size * seq_len(config)
    return {"compute_s": busy, "bubble_s": bubble, "tp_comm_s": tp_s, "dp_comm_s": dp_s, "pp_comm_s": pp_s,
            "step_s": total, "mfu": mfu, "tokens_per_s": tokens / total,
            "links": {"tp": tp_link, "dp": dp_link, "pp": pp_link},
            "bubble_fraction": schedules.ideal_bubble(p, mb) if p > 1 else 0.0, **flops}
