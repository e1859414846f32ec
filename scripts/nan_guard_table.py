"""BENCHMARKS.md "The NaN guard on GPUs": GPU-compiled peaks and estimated steps with train.nan_guard=cond
and =select, and the planner's peak for select, per layout.

    .venv/bin/python scripts/nan_guard_table.py [--only NAME ...] [--workdir /tmp/nan_guard]

Each row is two GPU dry runs (`python -m jaxpar.train --dry_run --gpu ...`, no device; `make gpu-aot`
first), about 1-2 minutes each on a 2-core machine for the 64-GPU ones. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

SEED_16 = ["mesh.dp=1", "mesh.pp=4", "mesh.tp=4", "mesh.sequence_parallel=false", "zero.stage=1",
           "remat.policy=full", "pipeline.microbatches=16", "pipeline.virtual_stages=1", "grad_reduce=fp32",
           "vision.tp=2", "actions.instruction_len=32"]
# (name, config, gpu, overrides)
# llama7b.py's layout until 2026-12-05 (its docstring), which these rows were measured on
TP8 = ["mesh.dp=1", "mesh.pp=1", "mesh.tp=8", "zero.stage=1", "remat.policy=full"]
ROWS = [
    ("llama7b tp 8 (as shipped until 2026-12-05)", "llama7b", "h100", TP8),
    ("llama7b dp 8 ZeRO-1", "llama7b", "h100", [*TP8, "mesh.dp=8", "mesh.tp=1", "zero.stage=1"]),
    ("llama7b dp 2 tp 4 ZeRO-2 selective", "llama7b", "h100",
     [*TP8, "mesh.dp=2", "mesh.tp=4", "zero.stage=2", "remat.policy=selective", "train.global_batch_size=4"]),
    ("llama7b dp 8 ZeRO-3", "llama7b", "h100", [*TP8, "mesh.dp=8", "mesh.tp=1", "zero.stage=3"]),
    ("llama7b pp 2 tp 4 1F1B m 8", "llama7b", "h100",
     [*TP8, "mesh.pp=2", "mesh.tp=4", "pipeline.schedule=1f1b", "pipeline.microbatches=8"]),
    ("vla70b (as shipped)", "vla70b", "a100-80gb", []),
    ("vla70b, the seed's 16-GPU layout", "vla70b", "a100-80gb", SEED_16),
]


def dry_run(config: str, gpu: str, overrides: list[str], workdir: pathlib.Path) -> dict:
    args = [sys.executable, "-m", "jaxpar.train", "--config", config, "--dry_run", "--gpu", gpu,
            "--gpus_per_node", "8", "--workdir", str(workdir), *[f"--config.{o}" for o in overrides]]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"dry run failed ({' '.join(args)}):\n{done.stderr[-2000:]}")
    return json.loads((workdir / "dry_run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="row names containing any of these words")
    parser.add_argument("--workdir", default="/tmp/nan_guard")
    args = parser.parse_args()
    print("| layout | GPUs | cond: peak GB, step s | select: peak GB, step s | planner peak (select) |")
    print("|---|---|---|---|---|")
    for index, (name, config, gpu, overrides) in enumerate(ROWS):
        if args.only and not any(word in name for word in args.only):
            continue
        cells = {}
        for guard in ("cond", "select"):
            report = dry_run(config, gpu, [*overrides, f"train.nan_guard={guard}"],
                             pathlib.Path(args.workdir) / f"{index}_{guard}")
            cells[guard] = report
        peak = {g: r["per_device_bytes"]["peak"] / 1e9 for g, r in cells.items()}
        step = {g: r["estimate"]["step_s"] for g, r in cells.items()}
        planner = cells["select"]["planner"]["peak_bytes"] / 1e9
        print(f"| {name} | {cells['cond']['devices']} x {gpu} | {peak['cond']:.2f}, {step['cond']:.3f} | "
              f"{peak['select']:.2f} ({peak['select'] / peak['cond'] - 1:+.0%}), {step['select']:.3f} | "
              f"{planner:.2f} ({planner / peak['select'] - 1:+.0%}) |", flush=True)


if __name__ == "__main__":
    main()
