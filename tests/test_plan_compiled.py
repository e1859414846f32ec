"""The planner against XLA's GPU compiler (no device): the compiled search (`python -m jaxpar.plan --recommend
--compile K`, issue 46 item 6) and the planner's figures bounded by the GPU-compiled ones.

The ranking and the failure path are checked without a compile (fake compiles in subprocesses); the
end-to-end search on llama_tiny and the per-layout bounds compile for real (`make gpu-aot`), so they are slow."""

import json
import os
import subprocess
import sys

import pytest

from conftest import LLAMA7B_TP8
from jaxpar.compiler import gpu_aot, hardware
from jaxpar.config import load_config, override_text, to_dict
from jaxpar.planner import compiled, recommend
from jaxpar.planner.report import format_compiled

INSTALLED = gpu_aot.LOCAL_PACKAGES.is_dir() or not gpu_aot.missing_packages()
needs_gpu_compiler = pytest.mark.skipif(not INSTALLED and os.environ.get("CI", "").lower() != "true",
                                        reason="XLA's GPU compiler is not installed (make gpu-aot)")
H100 = hardware.get("h100")
GB = 1e9


def row(rank, step_s, peak, flags, error=None):
    """One compiled-search row as compiled.search builds it (a llama_tiny config stands in)."""
    compiled_part = {"error": error} if error else {"peak": peak, "step_s": step_s, "mfu": 0.4 / step_s,
                                                     "compile_s": 10.0, "exposed_comm_s": 0.0, "compute_s": step_s}
    budget = H100.usable_bytes
    return {"analytic_rank": rank, "config": load_config("llama_tiny.py"), "flags": flags,
            "analytic": {"peak": peak, "step_s": step_s, "mfu": 0.4 / step_s, "tokens_per_s": 1.0},
            "compiled": compiled_part, "budget": budget, "compiled_fits": not error and peak <= budget}


def test_a_layout_over_the_budget_ranks_below_every_one_that_fits_whatever_its_step():
    """The fastest estimate does not win if its compiled peak is over the usable budget; a failed compile
    ranks last; among those that fit, the shorter estimated step first, the planner's order breaking ties."""
    rows = [row(1, 0.50, 90 * GB, ["--config.a=1"]),  # best estimate, does not fit
            row(2, 0.80, 60 * GB, ["--config.b=1"]),
            row(3, 0.70, 50 * GB, ["--config.c=1"]),
            row(4, 0.10, 10 * GB, ["--config.d=1"], error="RESOURCE_EXHAUSTED"),
            row(5, 0.70, 50 * GB, ["--config.e=1"])]
    assert [r["analytic_rank"] for r in compiled.rank(rows)] == [3, 5, 2, 1, 4]
    text = format_compiled(compiled.rank(rows), H100, "llama_tiny.py")
    assert text.splitlines()[-1] == "winner: python -m jaxpar.train --config llama_tiny.py --config.c=1"
    assert "FAILED" in text and "compile failed: RESOURCE_EXHAUSTED" in text
    nothing = format_compiled(compiled.rank([rows[0], rows[3]]), H100, "llama_tiny.py")
    assert "none of the 2 fits when compiled" in nothing and "winner" not in nothing


FAKE_COMPILE = """
import json, pathlib, sys
kind, workdir = sys.argv[1], pathlib.Path(sys.argv[2])
if kind == "ok":
    report = {"per_device_bytes": {"peak": int(sys.argv[3])}, "compile_s": 1.5, "target": "h100-80gb",
              "estimate": {"step_s": float(sys.argv[4]), "mfu": 0.3, "exposed_comm_s": 0.1, "compute_s": 0.2}}
    (workdir / "dry_run.json").write_text(json.dumps(report))
elif kind == "refused":
    sys.exit("jaxpar: error: mesh.tp=3 does not divide model.n_heads=8")
else:
    raise RuntimeError("XLA: out of registers")
"""


def test_search_compiles_each_layout_in_its_own_process_and_reports_failures_as_rows(tmp_path):
    """Every candidate's flags go to its compile; a refused or crashing compile is a row with one line of
    error (no traceback), and the one that fits wins although the planner ranked it last."""
    config = load_config("llama_tiny.py")
    ranked = [{"config": config, "flags": [f"--config.x={i}"], "peak": 1e6, "step_s": 0.1, "mfu": 0.1,
               "tokens_per_s": 1.0} for i in range(3)]
    plans = {"--config.x=0": ["crash"], "--config.x=1": ["refused"], "--config.x=2": ["ok", "1000", "0.25"]}
    seen = []

    def argv_for(config_name, flags, gpu, gpus_per_node, workdir):
        seen.append((config_name, flags, gpu, gpus_per_node))
        kind, *rest = plans[flags[0]]
        return [sys.executable, "-c", FAKE_COMPILE, kind, str(workdir), *rest]

    rows = compiled.search(ranked, "llama_tiny.py", H100, 8, 3, keep_dir=str(tmp_path), argv_for=argv_for)
    assert seen == [("llama_tiny.py", [f"--config.x={i}"], "h100-80gb", 8) for i in range(3)]
    assert [r["analytic_rank"] for r in rows] == [3, 1, 2]
    assert rows[0]["compiled"]["peak"] == 1000 and rows[0]["compiled"]["step_s"] == 0.25 and rows[0]["compiled_fits"]
    assert rows[1]["compiled"]["error"] == "RuntimeError: XLA: out of registers"
    assert rows[2]["compiled"]["error"] == "mesh.tp=3 does not divide model.n_heads=8"
    assert (tmp_path / "candidate3" / "dry_run.json").is_file()  # --compile_dir keeps each compile's report


def test_a_compile_past_its_timeout_is_a_row_with_its_output_kept(tmp_path):
    argv = [sys.executable, "-c", "import time; print('lowering', flush=True); time.sleep(30)"]
    assert compiled.compile_one(argv, tmp_path, timeout_s=2) == {
        "error": "compile did not finish in 2 s (--compile_timeout)"}
    assert (tmp_path / "stdout.txt").read_text() == "lowering\n"


def test_the_printed_flags_rebuild_each_recommended_layout_exactly():
    """The recommender prints, and the compile gets, every setting that differs from the config file: the
    searched ones and the user's own overrides; read back as jaxpar.train reads them they give the layout."""
    config = load_config("llama7b.py", ["train.seq_len=2048"])
    result = recommend.recommend(config, 8, 8, H100, top=5)
    compiled.attach_flags("llama7b.py", result["ranked"])  # raises if a layout is not rebuilt exactly
    for r in result["ranked"]:
        assert "--config.train.seq_len=2048" in r["flags"]
        assert load_config("llama7b.py", [f.removeprefix("--config.") for f in r["flags"]]) == r["config"]
    assert override_text(True) == "true" and override_text((0.5, 0.25)) == "0.5,0.25"
    assert override_text(0.1 + 0.2) == repr(0.1 + 0.2)  # floats read back bit for bit


@pytest.mark.parametrize("args, expect", [
    (["--compile", "2"], "--compile re-ranks the recommender's layouts: add --recommend --gpus N"),
    (["--recommend", "--gpus", "2", "--gpus_per_node", "2", "--compile", "0"], "--compile=0: compile between 1 and"),
    (["--recommend", "--gpus", "2", "--gpus_per_node", "2", "--compile", "1", "--hardware_json",
      '{"h100-80gb": {"pcie_gbps": 16}}'], "--compile uses the stock GPU profiles"),
])
def test_compile_cli_errors_are_one_line(args, expect):
    out = subprocess.run([sys.executable, "-m", "jaxpar.plan", "--config", "llama_tiny.py", "--gpu", "h100", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and expect in out.stderr, out.stderr


@needs_gpu_compiler
@pytest.mark.slow  # two GPU compiles of llama_tiny: about 60 s on 2 cores
def test_compiled_search_on_llama_tiny_compiles_the_printed_layouts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxpar.plan", "--config", "llama_tiny.py", "--recommend", "--gpus", "2",
                          "--gpus_per_node", "2", "--gpu", "h100", "--compile", "2", "--json", "--compile_dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert sorted(r["analytic_rank"] for r in rows) == [1, 2]
    planned = recommend.recommend(load_config("llama_tiny.py"), 2, 2, H100, top=2)["ranked"]
    compiled.attach_flags("llama_tiny.py", planned)
    for r in rows:
        assert r["compiled_fits"] and 0 < r["compiled"]["peak"] <= r["usable_bytes"] == H100.usable_bytes
        assert r["compiled"]["step_s"] > 0 and r["compiled"]["target"] == "h100-80gb"
        plan = planned[r["analytic_rank"] - 1]
        assert r["flags"] == plan["flags"]
        # the program compiled is the layout the recommender printed (attention resolved by the dry run)
        report = json.loads((tmp_path / f"candidate{r['analytic_rank']}" / "dry_run.json").read_text())
        expect = to_dict(plan["config"])
        for group in ("mesh", "zero", "remat", "pipeline", "offload", "train"):
            assert report["config"][group] == expect[group], group
    steps = [r["compiled"]["step_s"] for r in rows]
    assert steps == sorted(steps)


# ----------------------------------------------------------------------------- the planner's bounds
# The planner's peak and step against the GPU-compiled ones (issue 27 item 7's cases; tests/test_gpu_dry_run.py's
# test_the_planner_agrees_with_the_gpu_compiler asserted the known misses stayed misses: a better planner failed CI).
# Each case asserts |planner / compiled - 1| <= a bound, so a fix passes and a regression fails. The bounds:
# - peak 10%: the accuracy the README and docs/planner.md claim for the GPU target. None of these layouts was
#   in the set the GPU terms were fitted on (a 3B-shaped Llama on 8 H100s, docs/planner.md "Fit to the GPU
#   compiler"), so this is the claim checked out of sample.
# - step 20%: the planner adds the schedule walk's own rates (hardware.py) but its overlap is a rule
#   (cost.exposed_dp_s: all but one layer's share hidden inside a node, 15% across nodes) where the walk
#   reads XLA's schedule; the cross-node programs that rule was fitted on landed within -5..+10%, and 20%
#   is twice that spread, as the walk itself moves with others' changes to the step (issue 46 items 1-5).
# - a named miss (docs/planner.md "Known gaps") gets its miss as last compiled, rounded up to the next 5
#   points, plus 5: tight enough that it cannot grow unseen, wide enough that the other agents' changes to
#   the compiled step (ZeRO-1's reduce-scatter, the pipeline) do not fail it, and a fix passes.


def planner_case(config, gpu, overrides, memory=0.10, time=0.20, slow=True, extra=False):
    """`extra`: left out of CI for its 90 minutes (`make test-extra`): a case whose model CI checks on another
    layout (llama7b's pipeline: llama1b's interleaved one; vla70b's seed layout: its default)."""
    marks = ([pytest.mark.slow] if slow else []) + ([pytest.mark.extra] if extra else [])
    name = "-".join([config, *[o.split("=")[-1] if "." in o else o for o in overrides]])
    return pytest.param(config, gpu, overrides, memory, time, marks=marks, id=name)


SHAPE_3B = ["model.d_model=3072", "model.n_layers=8", "model.n_heads=24", "model.n_kv_heads=8", "model.d_ff=8192",
            "train.seq_len=4096", "train.global_batch_size=8"]
VLA70B_SEED_LAYOUT = ["mesh.dp=2", "mesh.pp=4", "mesh.sequence_parallel=false", "zero.stage=1", "remat.policy=full",
                      "pipeline.microbatches=16", "pipeline.virtual_stages=1", "grad_reduce=fp32", "vision.tp=2",
                      "actions.instruction_len=32"]
PLANNER_CASES = [
    planner_case("llama7b", "h100", [], slow=False),  # as shipped: dp 8 ZeRO-3, remat none (the compiled search's pick)
    planner_case("llama7b", "h100", LLAMA7B_TP8),  # the layout shipped until 2026-12-05
    # remat none: the recommender's pick for llama7b on 8 A100s (docs/planner.md "remat none on the GPU")
    planner_case("llama7b", "a100", [*LLAMA7B_TP8, "mesh.dp=4", "mesh.tp=2", "mesh.sequence_parallel=true", "zero.stage=2",
                                     "remat.policy=none"], slow=False),
    planner_case("llama1b", "h100", [*SHAPE_3B, "mesh.tp=8", "zero.stage=1", "remat.policy=none"]),
    planner_case("llama1b", "h200", ["model.attention=xla", "remat.policy=selective"]),
    planner_case("llama1b", "h200", ["model.attention=xla", "remat.policy=none"]),
    planner_case("llama1b", "h200", ["model.attention=xla", "remat.policy=full"]),
    planner_case("llama1b", "h200", []),
    # the NaN guard: the cond's update writes the whole new state to fresh buffers; auto (the select) in place
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "mesh.dp=8", "mesh.tp=1", "zero.stage=3", "train.nan_guard=cond"]),
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "mesh.dp=8", "mesh.tp=1", "zero.stage=3"]),
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "mesh.dp=2", "mesh.tp=4", "zero.stage=2", "remat.policy=selective",
                                     "train.global_batch_size=4"]),
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "mesh.pp=2", "mesh.tp=4", "pipeline.schedule=1f1b", "pipeline.microbatches=8"],
                 extra=True),
    planner_case("vla_openvla", "h100", [], extra=True),
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "mesh.dp=8", "mesh.tp=1", "zero.stage=1"]),
    # the interleaved dp = 1 pipeline, its chunks taken whole after the last tick
    planner_case("llama1b", "h100", [*SHAPE_3B, "mesh.pp=2", "mesh.tp=4", "zero.stage=0", "pipeline.microbatches=4",
                                     "pipeline.virtual_stages=4"]),
    planner_case("vla_openvla", "h100", ["mesh.dp=1", "mesh.tp=8", "remat.policy=full"]),
    planner_case("vla70b", "a100", []),
    planner_case("vla70b", "a100", VLA70B_SEED_LAYOUT, extra=True),
    # dp across nodes (64 GPUs); peak -10%: remat none with sequence parallelism under ZeRO-3 (a named miss)
    planner_case("llama7b", "a100", [*LLAMA7B_TP8, "mesh.dp=16", "mesh.tp=4", "mesh.sequence_parallel=true", "zero.stage=3",
                                     "remat.policy=none", "train.global_batch_size=64"], memory=0.20),
    planner_case("llama7b", "a100", [*LLAMA7B_TP8, "mesh.dp=8", "mesh.tp=8", "mesh.sequence_parallel=true", "zero.stage=2",
                                     "remat.policy=selective"], extra=True),
    planner_case("llama7b", "h100", [*LLAMA7B_TP8, "remat.policy=offload"]),
    # context parallelism at 131,072 tokens (issue 48's target: within 10%), cp 8 ring and cp 4 x tp 2 all_gather
    planner_case("llama7b", "h100", ["train.seq_len=131072", "train.global_batch_size=1", "mesh.dp=1", "mesh.cp=8",
                                     "mesh.tp=1", "mesh.cp_strategy=ring", "zero.stage=3", "remat.policy=full"]),
    planner_case("llama7b", "h100", ["train.seq_len=131072", "train.global_batch_size=1", "mesh.dp=1", "mesh.cp=4",
                                     "mesh.tp=2", "mesh.cp_strategy=all_gather", "zero.stage=3", "remat.policy=full"]),
    # peak -25%: ZeRO-2's accumulation buffers on a 4-layer 70B shape (a named miss)
    planner_case("llama7b", "a100", [*LLAMA7B_TP8, "model.d_model=8192", "model.n_layers=4", "model.n_heads=64", "model.n_kv_heads=8",
                                     "model.d_ff=28672", "mesh.dp=4", "mesh.tp=8", "zero.stage=2", "remat.policy=full",
                                     "train.grad_accum=2"], memory=0.35),
]


@needs_gpu_compiler
@pytest.mark.parametrize("config, gpu, overrides, memory, time", PLANNER_CASES)
def test_the_planner_is_within_its_bounds_of_the_gpu_compiler(tmp_path, config, gpu, overrides, memory, time):
    workdir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", "--dry_run", "--workdir", str(workdir), "--config",
                           config, "--gpu", gpu, *[f"--config.{o}" for o in overrides]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((workdir / "dry_run.json").read_text())
    planner = report["planner"]
    memory_error = planner["peak_bytes"] / report["per_device_bytes"]["peak"] - 1
    time_error = planner["step_s"] / report["estimate"]["step_s"] - 1
    assert abs(memory_error) <= memory, f"planner peak {memory_error:+.1%} off the GPU-compiled one (bound {memory:.0%})"
    assert abs(time_error) <= time, f"planner step {time_error:+.1%} off the schedule estimate (bound {time:.0%})"
