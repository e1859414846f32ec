"""The compiled search (issue 46 item 6): the recommender's top K layouts GPU-compiled without a device and
ranked again by what the compiled programs say.

Why: the recommender ranks by the analytic model alone, whose misses are named (docs/planner.md, "Known
gaps"; e.g. vla70b's c01, planned at 42% MFU, is 14% in XLA's schedule). The GPU dry run
(`python -m jaxpar.train --dry_run --gpu NAME`, jaxpar.compiler.dry_run) reads the real step's peak and a
roofline walk of XLA's schedule; compiling the few layouts the planner likes best and ranking by those
catches the misses where it matters, at seconds to a minute a layout instead of a full search.

How:
- Each candidate's override set, `--config.KEY=VALUE` for every setting that differs from the config file's
  (`override_flags`), is what the recommender prints and exactly what the compile gets, so the winner's
  line can be pasted into `jaxpar.train`.
- One subprocess per compile, one at a time: the GPU target must be prepared before JAX starts in its
  process (jaxpar.compiler.gpu_aot.prepare_environment), a 64-device compile holds several GB, and a
  crash or refusal stays one row of the table (`error`), never a traceback.
- Ranking (`rank`): a layout that compiled and fits the usable budget (jaxpar.compiler.hardware's
  memory_budget, the one the planner and the dry run's `fits` use) before any that does not, and those
  before any that failed to compile; inside each group by the schedule estimate's step time (the same
  global batch for every candidate, so also by tokens/s and MFU), then by the compiled peak.
The figures are "GPU-compiled, no device": a model of XLA's schedule with the planner's rates, not a
measurement (jaxpar.compiler.gpu_program).
"""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Callable

from jaxpar.config import Config, differences
from jaxpar.errors import ConfigError
from jaxpar.compiler.hardware import GB, Hardware, memory_budget

COMPILE_TIMEOUT_S = 3600  # per layout: vla70b on 64 A100s, 1-3 minutes on 2 idle cores, passed 15 on 2 busy ones
MAX_COMPILE = 20  # --compile K: each layout costs a compile; more is a layout search, not a re-ranking


def override_flags(defaults: Config, config: Config) -> list[str]:
    """`--config.KEY=VALUE` for every setting of `config` that differs from `defaults` (the config file as
    written, no overrides): the candidate's full override set, the user's own overrides included."""
    return [f"--config.{key}={text}" for key, text in differences(defaults, config)]


def command(config_name: str, flags: list[str], gpu: str, gpus_per_node: int, workdir: pathlib.Path) -> list[str]:
    """The GPU dry run of one layout, as a user would type it."""
    return [sys.executable, "-m", "jaxpar.train", "--config", config_name, "--dry_run", "--gpu", gpu,
            "--gpus_per_node", str(gpus_per_node), "--workdir", str(workdir), *flags]


def failure(stderr: str, returncode: int) -> str:
    """One line for a compile that failed: jaxpar's own one-line error, else the exception's last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    mine = [line for line in lines if line.startswith("jaxpar: error:")]
    raised = [line for line in lines if ("Error" in line.split(":")[0] or "Exception" in line.split(":")[0])]
    ended = f"killed by signal {-returncode} (out of host memory?)" if returncode < 0 else f"exit code {returncode}"
    text = (mine or raised or lines or [ended])[-1]
    text = text.removeprefix("jaxpar: error: ")
    return text if len(text) <= 200 else text[:197] + "..."


def compile_one(argv: list[str], workdir: pathlib.Path, timeout_s: float) -> dict:
    """Run one GPU dry run (`argv`, writing workdir/dry_run.json); its figures, or `error` on one line."""
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as late:  # (run() has killed it) its output so far, for a look
        for name, text in (("stdout.txt", late.stdout), ("stderr.txt", late.stderr)):
            (workdir / name).write_bytes(text.encode() if isinstance(text, str) else text or b"")
        return {"error": f"compile did not finish in {timeout_s:.0f} s (--compile_timeout)"}
    wall_s = time.perf_counter() - start
    (workdir / "stdout.txt").write_text(done.stdout)
    (workdir / "stderr.txt").write_text(done.stderr)
    report_path = workdir / "dry_run.json"
    if done.returncode != 0 or not report_path.is_file():
        return {"error": failure(done.stderr, done.returncode), "wall_s": wall_s}
    report = json.loads(report_path.read_text())
    est = report["estimate"]
    return {"peak": report["per_device_bytes"]["peak"], "step_s": est["step_s"], "mfu": est["mfu"],
            "exposed_comm_s": est["exposed_comm_s"], "compute_s": est["compute_s"],
            "compile_s": report["compile_s"], "wall_s": wall_s, "target": report["target"]}


def rank(rows: list[dict]) -> list[dict]:
    """Compiled and fitting first, then compiled but over the budget, then failed; each group by the
    estimated step, then the compiled peak, then the planner's order (module docstring)."""
    def key(row):
        compiled = row.get("compiled") or {}
        group = 2 if "error" in compiled or not compiled else (0 if row["compiled_fits"] else 1)
        return group, compiled.get("step_s", float("inf")), compiled.get("peak", float("inf")), row["analytic_rank"]
    return sorted(rows, key=key)


def search(ranked: list[dict], config_name: str, hw: Hardware, gpus_per_node: int, k: int,
           timeout_s: float = COMPILE_TIMEOUT_S, keep_dir: str | None = None,
           progress: Callable[[str], None] | None = None, argv_for: Callable = command) -> list[dict]:
    """Compile the first `k` of the recommender's `ranked` (each with its `flags`) one at a time and rank
    them (`rank`). `keep_dir`: keep each compile's dry_run.json and output there (else a temporary folder);
    `argv_for`: the command of one compile (tests swap it)."""
    budget = memory_budget(hw.hbm_gb * GB, hw.usable_hbm_fraction)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxpar-compile-") as tmp:
        root = pathlib.Path(keep_dir or tmp)
        for i, result in enumerate(ranked[:k], 1):
            workdir = root / f"candidate{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            if progress:
                progress(f"compiling {i}/{min(k, len(ranked))} for {hw.name} (no device): "
                         f"{' '.join(shlex.quote(f) for f in result['flags']) or '(the config as written)'}")
            compiled = compile_one(argv_for(config_name, result["flags"], hw.name, gpus_per_node, workdir),
                                   workdir, timeout_s)
            rows.append({"analytic_rank": i, "config": result["config"], "flags": result["flags"],
                         "analytic": {"peak": result["peak"], "step_s": result["step_s"], "mfu": result["mfu"],
                                      "tokens_per_s": result["tokens_per_s"]},
                         "compiled": compiled, "budget": budget,
                         "compiled_fits": "peak" in compiled and compiled["peak"] <= budget})
    return rank(rows)


def check_request(k: int, gpu: str, hardware_json: str | None) -> None:
    """One-line errors for a --compile the GPU dry run cannot answer (checked before the search runs)."""
    from jaxpar.compiler import gpu_aot

    gpu_aot.target(gpu)  # a GPU the dry run can compile for
    if not 1 <= k <= MAX_COMPILE:
        raise ConfigError(f"--compile={k}: compile between 1 and {MAX_COMPILE} layouts (each is a GPU compile)")
    if hardware_json:
        raise ConfigError("--compile uses the stock GPU profiles (the GPU dry run takes no --hardware_json); "
                          "drop --hardware_json")
    if not (gpu_aot.LOCAL_PACKAGES.is_dir() or not gpu_aot.missing_packages()):
        raise ConfigError(f"--compile needs XLA's GPU compiler, which is not installed: {gpu_aot.INSTALL}")


def attach_flags(config_name: str, ranked: list[dict]) -> None:
    """Give each ranked layout its `flags` (override_flags against the config file as written) and check
    that they rebuild it exactly, as `jaxpar.train` will read them: what is printed is what compiles."""
    from jaxpar.config import read_config
    from jaxpar.interop.pretrained import load_run_config, with_pretrained_fields

    defaults = with_pretrained_fields(read_config(config_name))
    for result in ranked:
        result["flags"] = override_flags(defaults, result["config"])
        rebuilt = load_run_config(config_name, [f.removeprefix("--config.") for f in result["flags"]])
        if rebuilt != result["config"]:
            raise ConfigError(f"the override flags of a recommended layout do not rebuild it ({' '.join(result['flags'])}); "
                              f"a bug in jaxpar.planner.compiled.override_flags")


def to_json(rows: list[dict]) -> list[dict]:
    """The --json form of the compiled search: one entry per layout, in the compiled ranking."""
    from jaxpar.planner.recommend import describe

    return [{"layout": describe(r["config"]), "analytic_rank": r["analytic_rank"], "flags": r["flags"],
             "analytic": r["analytic"], "compiled": r["compiled"], "compiled_fits": r["compiled_fits"],
             "usable_bytes": r["budget"]} for r in rows]
