"""Re-compute the planner columns of docs/planner.md's "Fit to the GPU compiler" table (the GPU-compiled
columns stay: re-compiling a row is its dry-run command, "Command per row" in docs/planner.md).

    .venv/bin/python scripts/planner_agreement.py [--write]

Prints the table's rows with today's planner peak and step (error against the compiled figures);
`--write` puts them into docs/planner.md. The planner is analytic: the whole table takes seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "planner.md"
HEADER = "| case | config, overrides | GPUs | GPU-compiled peak GB | planner peak GB | estimated step s | planner step s |"
# the table's shorthands for long override lists
FIT = ("model.d_model=3072 model.n_layers=8 model.n_heads=24 model.n_kv_heads=8 model.d_ff=8192 "
       "train.seq_len=4096 train.global_batch_size=8").split()
SEED = ("mesh.dp=2 mesh.pp=4 mesh.sequence_parallel=false zero.stage=1 remat.policy=full pipeline.microbatches=16 "
        "pipeline.virtual_stages=1 grad_reduce=fp32 vision.tp=2 actions.instruction_len=32").split()
GPUS = {"a100": "a100-80gb", "h100": "h100", "h200": "h200"}


def planned_row(line: str) -> str:
    case, spec, gpus, peak, _, estimate, _ = [c.strip() for c in line.strip("|").split("|")]
    config, *rest = spec.split()
    overrides = []
    for shorthand, expanded in ((["(3B", "shape)"], FIT), (["(seed", "layout)"], SEED)):
        if rest[:2] == shorthand:
            overrides, rest = overrides + expanded, rest[2:]
    overrides += rest
    args = [sys.executable, "-m", "jaxpar.plan", "--config", config, "--gpu", GPUS[gpus.split(" x ")[1]], "--json",
            *[f"--config.{o}" for o in overrides]]
    report = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    planned_peak, planned_step = report["per_device_bytes"]["peak"] / 1e9, report["step_time"]["step_s"]
    return (f"| {case} | {spec} | {gpus} | {peak} | {planned_peak:.2f} ({planned_peak / float(peak) - 1:+.0%}) | "
            f"{estimate} | {planned_step:.3f} ({planned_step / float(estimate) - 1:+.0%}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/planner.md in place")
    args = parser.parse_args()
    lines = DOC.read_text().splitlines()
    first = lines.index(HEADER) + 2
    last = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    rows = [planned_row(line) for line in lines[first:last]]
    print("\n".join(rows))
    if args.write:
        DOC.write_text("\n".join(lines[:first] + rows + lines[last:]) + "\n")


if __name__ == "__main__":
    main()
