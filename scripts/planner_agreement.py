"""Re-compute docs/planner.md's "Fit to the GPU compiler" table: the planner columns always, the
GPU-compiled columns with `--compile` (each row's GPU dry run, no device: "Command per row" in
docs/planner.md; about 15 minutes for the whole table on a 2-core machine; each row's dry_run.json is
kept under --workdir).

    .venv/bin/python scripts/planner_agreement.py [--compile [--only CASE ...] [--workdir W]] [--write]

Prints the table's rows with today's planner peak and step (error against the compiled figures);
`--write` puts them into docs/planner.md. The planner alone is analytic: the table takes seconds.
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


def row_overrides(spec: str) -> tuple[str, list[str]]:
    """(config, overrides) of a row's "config, overrides" cell, its shorthands expanded."""
    config, *rest = spec.split()
    overrides = []
    for shorthand, expanded in ((["(3B", "shape)"], FIT), (["(seed", "layout)"], SEED)):
        if rest[:2] == shorthand:
            overrides, rest = overrides + expanded, rest[2:]
    return config, overrides + rest


def compiled(config: str, gpu: str, overrides: list[str], workdir: pathlib.Path) -> tuple[float, float]:
    """(peak GB, estimated step s) of the row's GPU dry run, whose report stays in `workdir`."""
    args = [sys.executable, "-m", "jaxpar.train", "--config", config, "--dry_run", "--gpu", gpu,
            "--gpus_per_node", "8", "--workdir", str(workdir), *[f"--config.{o}" for o in overrides]]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"dry run failed ({' '.join(args)}):\n{done.stderr[-2000:]}")
    report = json.loads((workdir / "dry_run.json").read_text())
    return report["per_device_bytes"]["peak"] / 1e9, report["estimate"]["step_s"]


def table_row(line: str, workdir: pathlib.Path | None) -> str:
    case, spec, gpus, peak, _, estimate, _ = [c.strip() for c in line.strip("|").split("|")]
    config, overrides = row_overrides(spec)
    gpu = GPUS[gpus.split(" x ")[1]]
    if workdir is not None:
        compiled_peak, compiled_step = compiled(config, gpu, overrides, workdir / case.split()[0])
        peak, estimate = f"{compiled_peak:.2f}", f"{compiled_step:.3f}"
    args = [sys.executable, "-m", "jaxpar.plan", "--config", config, "--gpu", gpu, "--json",
            *[f"--config.{o}" for o in overrides]]
    report = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    planned_peak, planned_step = report["per_device_bytes"]["peak"] / 1e9, report["step_time"]["step_s"]
    return (f"| {case} | {spec} | {gpus} | {peak} | {planned_peak:.2f} ({planned_peak / float(peak) - 1:+.0%}) | "
            f"{estimate} | {planned_step:.3f} ({planned_step / float(estimate) - 1:+.0%}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also re-compile each row's GPU dry run")
    parser.add_argument("--only", nargs="*", help="with --compile: only the rows of these cases")
    parser.add_argument("--workdir", default="/tmp/planner_agreement", help="with --compile: a folder per row")
    parser.add_argument("--write", action="store_true", help="update docs/planner.md in place")
    args = parser.parse_args()
    lines = DOC.read_text().splitlines()
    first = lines.index(HEADER) + 2
    last = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    rows = []
    for line in lines[first:last]:
        case = line.strip("|").split("|")[0].strip()
        compile_it = args.compile and (not args.only or case in args.only)
        rows.append(table_row(line, pathlib.Path(args.workdir) if compile_it else None))
        print(rows[-1], flush=True)
    if args.write:
        DOC.write_text("\n".join(lines[:first] + rows + lines[last:]) + "\n")


if __name__ == "__main__":
    main()
