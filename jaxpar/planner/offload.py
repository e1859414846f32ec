"""Host offload's cost: the bytes each device moves over its host link (PCIe) per step, the seconds
they take, which of them overlap compute, and the host CPU's AdamW update (offload.update=host).

Why a term of its own: offload trades device memory for host-link traffic, and that traffic is what
makes the seeds' offload rows (section 2.4) slower. Bytes per device per step (c = compute-dtype
bytes, g = grad_reduce's bytes, P = the device's optimizer-sharded parameters, memory.optimizer_params;
L = the LLM's parameters on the device / dp, its ZeRO-3 shard):
- offload.optimizer, update=device: the offloaded state (m + v, 8 B, and with master_weights the fp32
  master, 4 B) comes in for the update and goes back: 12 P each way.
- offload.optimizer, update=host: the reduced gradient shards go out (g P) and the updated
  compute-dtype shards come back (c P); none come back with offload.params, whose parameters live on
  the host already.
- offload.params: every microbatch copies each layer's shard in for the forward and again for the
  full-remat backward: 2 c L per microbatch in; with update=device the updated parameters go back to
  the host at the step's end: c L out.
- remat.policy=offload: every executed layer forward copies its offloaded activations out
  (memory.saved_per_layer's host part) and its backward copies them back in.
Seconds are bytes / hardware.Hardware.pcie_gbps (per GPU, per direction; the profiles' 64 GB/s is the
seeds' PCIe Gen5 x16: an A100 has Gen4, 32 GB/s, and DGX nodes share a switch between two GPUs, so
override it with --hardware_json for a real A100 node). What overlaps: the parameter copies run one
layer ahead beside the layers' compute (jaxpar.parallel.zero.prefetching_layer_scan) and the activation
copies beside the layer that made them (or will use them), but XLA's GPU schedule finishes most of
each copy right after it starts: HOST_COPY_HIDDEN_SHARE of their time hides (up to the layers'
compute), the rest is exposed; the optimizer's moves and the host update are at the step's end, exposed. Both
directions are added, not overlapped (the update's copies in and out are a chain): this errs slow.

The host update's seconds are a host-memory-bandwidth roofline: AdamW reads the fp32 master, m, v and
gradient (16 B) and writes master, m, v (12 B) and the compute-dtype parameter (c), per element of P,
at HOST_MEMORY_GBPS of the node shared by its GPUs' processes. That bandwidth is an ASSUMPTION, not a
measurement (no host update has run here): about 73% (a STREAM-like fraction) of the nodes' DRAM peak,
DGX A100 2 x EPYC 7742 with 16 channels of DDR4-3200 (410 GB/s), DGX H100 / H200 2 x Xeon 8480C with 16
of DDR5-4800 (614 GB/s). DeepSpeed's CPU Adam is vectorised and close to memory-bound, so this is the
optimistic end; a slower host only makes the host update rows slower.
"""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.compiler.hardware import GB, Hardware
from jaxpar.planner import kernels, memory, traffic

HOST_MEMORY_GBPS = {"a100-80gb": 300.0, "h100-80gb": 450.0, "h200": 450.0}  # per node; an assumption (docstring)
DEFAULT_HOST_MEMORY_GBPS = 300.0
ADAM_READ_BYTES = 16  # fp32 master, m, v, gradient
ADAM_WRITE_BYTES = 12  # fp32 master, m, v (+ the compute-dtype parameter: c)
# The share of the per-layer host copies (offload.params, remat=offload) XLA's GPU schedule hides behind
# compute: the GPU-compiled llama7b with remat=offload on 8 H100s hides 28% of their time (32 layers) and
# 24% (4 layers); offload.params about a quarter of its bytes at 4 layers (docs/planner.md).
HOST_COPY_HIDDEN_SHARE = 0.25


def enabled(config: Config) -> bool:
    return config.offload.optimizer or config.offload.params or config.remat.policy == "offload"


def _passes(config: Config) -> int:
    """Forward/backward passes per step (offload.params needs ZeRO-3, so no pipeline: grad_accum)."""
    return config.train.grad_accum


def activation_bytes_per_layer(config: Config, compute_capability: float = 9.0) -> float:
    """remat.policy=offload: bytes one layer forward copies to the host (and its backward back), with
    the attention kernel `auto` takes on a GPU of `compute_capability` (cuDNN's statistics go too)."""
    if config.remat.policy != "offload":
        return 0.0
    c = 2 if config.bf16_compute else 4
    blk = memory.llm_block(kernels.resolve(config, "gpu", compute_capability), "gpu")
    return memory.saved_per_layer("offload", blk, memory.microbatch(config), memory.local_seq(config), c)[1]


def link_bytes(config: Config, compute_capability: float = 9.0) -> dict[str, float]:
    """Host-link bytes per device per step, by part: `params_in` and the activations overlap the
    layers' compute, the rest is moved at the step's end. `to_device` / `from_device` sum the
    directions. The activations move once per executed layer forward (masked pipeline slots too)."""
    c = 2 if config.bf16_compute else 4
    counts = memory.local_params(config)
    p = memory.optimizer_params(config, counts)
    off = config.offload
    shard = memory.offloaded_params(config, counts, c)["host"]  # c L; 0 without offload.params
    on_host = memory.host_update(config)
    state = (8 + (4 if off.master_weights and config.bf16_compute else 0)) * p
    parts = {"params_in": 2 * shard * _passes(config),
             "state_in": state if off.optimizer and not on_host else 0.0,
             "state_out": state if off.optimizer and not on_host else 0.0,
             "grads_out": memory.grad_bytes(config) * p if on_host else 0.0,
             "updated_params_in": c * p if on_host and not off.params else 0.0,
             "updated_params_out": shard if off.params and not on_host else 0.0}
    forwards = traffic.layer_passes(config, traffic.slot_counts(config))["forward"]
    parts["activations_out"] = parts["activations_in"] = activation_bytes_per_layer(config, compute_capability) * forwards
    parts["to_device"] = parts["params_in"] + parts["state_in"] + parts["updated_params_in"] + parts["activations_in"]
    parts["from_device"] = (parts["state_out"] + parts["grads_out"] + parts["updated_params_out"]
                            + parts["activations_out"])
    parts["total"] = parts["to_device"] + parts["from_device"]
    return parts


def host_adam_s(config: Config, gpus_per_node: int, hw_name: str) -> float:
    """Seconds of the AdamW update on the host (offload.update=host; 0 otherwise): the node's host
    memory bandwidth is shared by its GPUs' processes, which all update at once."""
    if not memory.host_update(config):
        return 0.0
    c = 2 if config.bf16_compute else 4
    p = memory.optimizer_params(config, memory.local_params(config))
    per_gpu = HOST_MEMORY_GBPS.get(hw_name, DEFAULT_HOST_MEMORY_GBPS) * GB / gpus_per_node
    return (ADAM_READ_BYTES + ADAM_WRITE_BYTES + c) * p / per_gpu


def step_terms(config: Config, hw: Hardware, gpus_per_node: int, layers_compute_s: float) -> dict[str, float]:
    """Host-link seconds (all, and not overlapped) and the host update's seconds of one step."""
    moved = link_bytes(config, hw.compute_capability)
    bandwidth = hw.pcie_gbps * GB
    prefetched_s = (moved["params_in"] + moved["activations_in"] + moved["activations_out"]) / bandwidth
    hidden = min(prefetched_s * HOST_COPY_HIDDEN_SHARE, layers_compute_s)
    link_s = moved["total"] / bandwidth
    adam_s = host_adam_s(config, gpus_per_node, hw.name)
    return {"host_link_bytes": moved["total"], "host_link_s": link_s, "host_link_exposed_s": link_s - hidden,
            "host_adam_s": adam_s, "host_link_parts": moved}
