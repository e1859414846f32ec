"""scripts/bench_gpu.py: the GPU benchmark's code path, run here as `--smoke` (tiny model, CPU, one
process per variant; GPU-only variants reported as skipped), and its variant names, peak lookup and table."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


USER_XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def run_smoke(out_dir: pathlib.Path, *flags: str) -> dict:
    """Runs the smoke benchmark with a known user XLA_FLAGS (the one conftest sets), which it must keep as is."""
    env = {**os.environ, "XLA_FLAGS": USER_XLA_FLAGS}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out_dir", str(out_dir), *flags],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out_dir / "bench_gpu.json").read_text())


def check_rows(report: dict, names: list[str], out_dir: pathlib.Path, skipped=()) -> None:
    """Every row measured (finite loss, timings), except those in `skipped`, which say why and hold no numbers."""
    assert [r["variant"] for r in report["variants"]] == names
    for row in report["variants"]:
        assert row["error"] is None, row
        if row["variant"] in skipped:
            assert row["skipped"].startswith("skipped: cuDNN flash attention needs a GPU"), row
            assert "loss" not in row and "tokens_per_s" not in row
            continue
        assert "skipped" not in row and row["attention"] == "xla"  # auto and xla both run XLA's kernel on CPU
        assert math.isfinite(row["loss"]) and row["loss_finite"]
        assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0 and row["compile_s"] > 0
        assert len(row["step_times_s"]) == report["warmup_steps"] + report["timed_steps"]
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # CPU: no peak FLOP/s, no memory_stats
    table = (out_dir / "bench_gpu.md").read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| variant |"))
    assert "tokens/s" in table[header] and "MFU" in table[header] and "peak memory (GiB)" in table[header]
    rows = [line for line in table[header + 2:] if line.startswith("|")]
    assert [line.split("|")[1].strip() for line in rows] == names
    for line in rows:
        assert ("skipped: cuDNN" in line) == (line.split("|")[1].strip() in skipped), line


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_smoke_default_variants(tmp_path):
    """The one-GPU defaults on CPU: the cudnn variants (fp8's too) are skipped (exit 0), xla-selective runs."""
    report = run_smoke(tmp_path)
    names = ["cudnn-none", "cudnn-selective", "cudnn-full", "xla-selective", "cudnn-selective-fp8",
             "cudnn-selective-fp8-delayed"]
    check_rows(report, names, tmp_path, skipped=names[:3] + names[4:])
    assert report["xla_flags"] == USER_XLA_FLAGS  # the user's flags, and no GPU bundle added on CPU
    assert report["precision"] == "bf16" and report["platform"] == "cpu" and report["device_count"] == 1
    assert report["jax_version"] and "--smoke" in report["command"]
    assert report["model"]["params"] > 0 and report["peak_tflops_per_device"] is None


@pytest.mark.slow
def test_smoke_multi_device_variants(tmp_path):
    """tp and ZeRO-1/3 (the several-GPU variants) on emulated CPU devices, ZeRO-3 in fp8 too."""
    names = ["xla-tp2", "dp2-zero1", "dp2-zero3-full", "dp2-zero3-full-fp8", "dp2-zero3-full-fp8-delayed"]
    report = run_smoke(tmp_path, "--variants", ",".join(names))
    check_rows(report, names, tmp_path)
    assert [r["global_batch"] for r in report["variants"]] == [4, 8, 8, 8, 8]  # --batch is per dp replica
    assert [r["precision"] for r in report["variants"]] == ["bf16", "bf16", "bf16", "fp8", "fp8"]
    bf16, fp8, delayed = report["variants"][2:]  # the same data and init: FP8 rounding moves the loss, a little
    assert fp8["loss"] != bf16["loss"] and fp8["loss"] == pytest.approx(bf16["loss"], rel=0.02)
    assert delayed["recipe"] == "delayed" and delayed["loss"] == pytest.approx(bf16["loss"], rel=0.02)


def test_variant_names_and_defaults():
    bench = load_bench()
    assert bench.parse_variant("selective", 1) == {"attention": "auto", "remat": "selective", "dp": 1, "tp": 1,
                                                   "zero": 0, "precision": "bf16", "recipe": "current"}
    assert bench.parse_variant("zero3", 8) == {"attention": "auto", "remat": "none", "dp": 8, "tp": 1, "zero": 3,
                                               "precision": "bf16", "recipe": "current"}
    assert bench.parse_variant("cudnn-tp2-zero1-full-fp8", 8) == {"attention": "cudnn", "remat": "full", "dp": 4,
                                                                  "tp": 2, "zero": 1, "precision": "fp8",
                                                                  "recipe": "current"}
    assert bench.parse_variant("cudnn-selective-fp8-delayed", 1)["recipe"] == "delayed"
    assert bench.parse_variant("xla-none", 1)["attention"] == "xla"
    with pytest.raises(ValueError, match="unknown part 'pp2'"):
        bench.parse_variant("pp2", 8)
    one = ["cudnn-none", "cudnn-selective", "cudnn-full", "xla-selective", "cudnn-selective-fp8",
           "cudnn-selective-fp8-delayed"]
    assert bench.default_variants(1) == one
    assert bench.default_variants(8) == one + ["cudnn-tp8", "cudnn-dp8-zero1", "cudnn-dp8-zero3", "cudnn-dp8-zero3-fp8"]
    assert [bool(bench.needs_gpu(bench.parse_variant(n, 8))) for n in bench.default_variants(8)] == \
        [True, True, True, False, True, True, True, True, True, True]
    # fp8 variants on a GPU without FP8 tensor cores are skipped, with the reason; Hopper runs them
    fp8 = bench.parse_variant("cudnn-selective-fp8", 1)
    assert bench.lacks_fp8(fp8, "NVIDIA A100-SXM4-80GB") == "precision=fp8 needs FP8 tensor cores, which a100-80gb lacks"
    assert bench.lacks_fp8(fp8, "NVIDIA H100 80GB HBM3") is None and bench.lacks_fp8(fp8, "NVIDIA H200") is None
    assert bench.lacks_fp8(bench.parse_variant("cudnn-selective", 1), "NVIDIA A100-SXM4-80GB") is None


def test_bench_model_is_about_1b_and_valid():
    bench = load_bench()
    from jaxpar.models.llama import param_count

    args = bench.parse_args([])
    assert (args.batch, args.seq, args.steps, args.warmup) == (6, 2048, 5, 2)
    for name in bench.default_variants(8):
        spec = bench.parse_variant(name, 8)
        config = bench.make_config(spec, args)  # validates the layout
        assert config.precision == spec["precision"] and config.train.seq_len == 2048
        assert config.model.attention == spec["attention"] and config.model.head_dim == 128  # cuDNN-friendly
    assert 0.8e9 < param_count(bench.MODEL_1B) < 1.2e9


def test_peak_from_planner_hardware():
    bench = load_bench()
    assert bench.peak_flops("NVIDIA H200", 0.0)[0] == 989e12
    assert bench.peak_flops("NVIDIA H100 80GB HBM3", 0.0)[0] == 989e12
    assert bench.peak_flops("NVIDIA A100-SXM4-80GB", 0.0)[0] == 312e12
    assert bench.peak_flops("cpu", 0.0)[0] is None
    assert bench.peak_flops("cpu", 100.0)[0] == 100e12


def test_failed_variant_row_in_table():
    bench = load_bench()
    report = {"model": {"params": 1e9}, "seq": 2048, "batch": 8, "device_count": 1, "device_kind": "NVIDIA H200",
              "jax_version": "0.11.2", "peak_source": "x", "timed_steps": 5, "warmup_steps": 2, "command": "c",
              "variants": [{"variant": "none", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED | out of memory"}]}
    row = bench.markdown(report).splitlines()[-1]
    assert row.startswith("| none | - | - |") and "RESOURCE_EXHAUSTED / out of memory" in row
