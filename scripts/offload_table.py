"""The first seed's section 2.4 offload table (70B model, 32 x A100) redone from the planner.

    .venv/bin/python scripts/offload_table.py [--gpu a100-80gb] [--pcie_gbps 64] [--seq_len 4096]

Prints a markdown table: per layout the planner's step time and its throughput relative to the ZeRO-2
baseline that fits, the device peak per GPU and the pinned host memory per GPU, next to the seed's
figures (1.0x 38 GB; 0.45x 12 GB; 0.20x 4 GB). The model is Llama-2-70B's shape (configs/vla70b.py's
LLM: d_model 8192, 80 layers, 64 heads, 8 kv heads, d_ff 28672, vocab 32000), bf16, full remat (offload
only on top of checkpointing, and offload.params needs it), 32 GPUs in 4 nodes of 8, a global batch
of 32 sequences (one per GPU per microbatch). Planner figures only: a dry run of a 32-device 70B
program is too slow for this host (compile one with jaxpar.train --dry_run where that matters).
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxpar.compiler import hardware
from jaxpar.compiler.hardware import GB
from jaxpar.config import load_config, validate
from jaxpar.planner import cost, memory, offload

MODEL_70B = ["model.vocab_size=32000", "model.d_model=8192", "model.n_layers=80", "model.n_heads=64",
             "model.n_kv_heads=8", "model.d_ff=28672"]
GPUS, GPUS_PER_NODE, BATCH = 32, 8, 32
SEED = {"ZeRO-2": "1.0x, 38 GB", "ZeRO-2 + CPU offload": "0.45x, 12 GB", "ZeRO-3 + NVMe offload": "0.20x, 4 GB"}

# (label, seed row, overrides); the first row that fits is the baseline
ROWS = [
    ("ZeRO-2, dp=32 tp=1 (the seed's layout)", "ZeRO-2", ["mesh.dp=32", "mesh.tp=1", "zero.stage=2"]),
    ("ZeRO-2, dp=4 tp=8 (baseline)", "ZeRO-2", ["mesh.dp=4", "mesh.tp=8", "zero.stage=2"]),
    ("ZeRO-2 + offload.optimizer (update=device), dp=4 tp=8", "ZeRO-2 + CPU offload",
     ["mesh.dp=4", "mesh.tp=8", "zero.stage=2", "offload.optimizer=true"]),
    ("ZeRO-2 + offload.optimizer (update=host), dp=4 tp=8", "ZeRO-2 + CPU offload",
     ["mesh.dp=4", "mesh.tp=8", "zero.stage=2", "offload.optimizer=true", "offload.update=host"]),
    ("ZeRO-2 + offload.optimizer (update=host), dp=32 tp=1", "ZeRO-2 + CPU offload",
     ["mesh.dp=32", "mesh.tp=1", "zero.stage=2", "offload.optimizer=true", "offload.update=host"]),
    ("ZeRO-3, dp=32 tp=1 (no offload)", "", ["mesh.dp=32", "mesh.tp=1", "zero.stage=3"]),
    ("ZeRO-3 + offload.params + offload.optimizer (update=host), dp=32 tp=1", "ZeRO-3 + NVMe offload",
     ["mesh.dp=32", "mesh.tp=1", "zero.stage=3", "offload.params=true", "offload.optimizer=true",
      "offload.update=host"]),
    ("ZeRO-3 + offload.params + offload.optimizer (update=host), dp=4 tp=8", "ZeRO-3 + NVMe offload",
     ["mesh.dp=4", "mesh.tp=8", "zero.stage=3", "offload.params=true", "offload.optimizer=true",
      "offload.update=host"]),
]


def config_for(overrides: list[str], seq_len: int):
    """The 70B config of one row: a global batch of 32, split by grad_accum to one sequence per device."""
    dp = int(next(o for o in overrides if o.startswith("mesh.dp=")).split("=")[1])
    base = ["mesh.pp=1", "precision=bf16", "remat.policy=full", f"train.seq_len={seq_len}",
            f"train.global_batch_size={BATCH}", f"train.grad_accum={BATCH // dp}", *MODEL_70B]
    config = load_config("llama7b.py", base + overrides)
    validate(config)
    return config


def row(label: str, seed_row: str, overrides: list[str], hw, seq_len: int) -> dict:
    config = config_for(overrides, seq_len)
    mem = memory.estimate(config, "gpu", hw.compute_capability)["per_device_bytes"]
    time = cost.step_time(config, hw, GPUS_PER_NODE)
    return {"label": label, "seed": SEED.get(seed_row, ""), "step_s": time["step_s"], "peak": mem["peak"],
            "state": mem["state"], "host": mem["host_total"], "fits": mem["peak"] <= hw.usable_bytes,
            "link_gb": time["host_link_bytes"] / GB, "link_exposed_s": time["host_link_exposed_s"],
            "adam_s": time["host_adam_s"], "mfu": time["mfu"]}


def table(hw, seq_len: int) -> str:
    rows = [row(*r, hw, seq_len) for r in ROWS]
    base = next(r for r in rows if r["fits"])
    out = [f"70B (Llama-2 shape), {GPUS} x {hw.name} ({GPUS // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}), "
           f"global batch {BATCH} x {seq_len} tokens, bf16, remat full, PCIe {hw.pcie_gbps:.0f} GB/s, "
           f"host memory {offload.HOST_MEMORY_GBPS.get(hw.name, offload.DEFAULT_HOST_MEMORY_GBPS):.0f} GB/s "
           f"per node (assumed); baseline: {base['label']}", "",
           "| layout | seed (throughput, memory/card) | planner throughput | step (s) | MFU | device peak (GB) | "
           "device state (GB) | host memory / GPU (GB) | host link / step (GB) | link exposed (s) | host AdamW (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if r["fits"] else "does not fit"
        out.append(f"| {r['label']} | {r['seed']} | {ratio} | {r['step_s']:.2f} | {r['mfu']:.1%} | "
                   f"{r['peak'] / GB:.1f}{'' if r['fits'] else ' (> ' + format(hw.usable_bytes / GB, '.0f') + ')'} | "
                   f"{r['state'] / GB:.1f} | {r['host'] / GB:.1f} | {r['link_gb']:.1f} | {r['link_exposed_s']:.2f} | "
                   f"{r['adam_s']:.2f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--pcie_gbps", type=float, default=None, help="override the profile's host link (GB/s)")
    parser.add_argument("--seq_len", type=int, default=4096)
    args = parser.parse_args()
    hw = hardware.get(args.gpu)
    if args.pcie_gbps:
        hw = dataclasses.replace(hw, pcie_gbps=args.pcie_gbps)
    print(table(hw, args.seq_len))


if __name__ == "__main__":
    main()
