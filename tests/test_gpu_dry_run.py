"""The GPU dry run (issue 27): jaxpar's real train step compiled by XLA's GPU compiler, no GPU needed.

Each test runs `python -m jaxpar.train --dry_run --gpu NAME` in a subprocess (the compiler's packages
come from `make gpu-aot`, put on sys.path by jaxpar.gpu_aot before JAX starts) and reads what the
GPU program says: cuDNN attention calls, async collectives, the flag bundle accepted, the fit."""

import json
import os
import subprocess
import sys
import time

import pytest

from jaxpar import gpu_aot
from jaxpar.xla_flags import GPU_BUNDLE

INSTALLED = gpu_aot.LOCAL_PACKAGES.is_dir() or not gpu_aot.missing_packages()
if not INSTALLED and os.environ.get("CI", "").lower() != "true":  # CI must have it: `make test` installs it
    pytest.skip("XLA's GPU compiler is not installed (make gpu-aot)", allow_module_level=True)

TINY = ["--config", "llama_tiny", "--config.precision=bf16"]  # dp 2 x tp 4, 2 layers


def dry_run(tmp_path, *args, env=None):
    """(completed process, dry_run.json or None) of a GPU dry run."""
    workdir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", "--dry_run", "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    report = workdir / "dry_run.json"
    return done, (json.loads(report.read_text()) if report.exists() else None)


def test_cudnn_attention_under_auto_none_with_xla_and_every_bundle_flag_accepted(tmp_path):
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100")
    assert done.returncode == 0, done.stderr[-2000:]
    layers = report["config"]["model"]["n_layers"]
    assert report["target"] == "h100-80gb" and report["platform"] == "gpu" and report["devices"] == 8
    assert report["kernels"]["attention"] == "cudnn"
    assert report["kernels"]["cudnn_attention_calls"] == 2 * layers  # one forward and one backward per layer
    assert report["hbm_bytes"] == gpu_aot.TARGETS["h100-80gb"].memory_bytes and report["fits"] is True
    assert all(e["async"] == e["count"] for e in report["collectives"])  # a GPU program's collectives are async
    # XLA aborts on a flag it does not know, so a finished compile accepted every one the bundle set
    bundle_line = next(line for line in done.stdout.splitlines() if "XLA flags for GPUs" in line)
    assert all(f"--{name}=" in bundle_line for name, _, _ in GPU_BUNDLE)

    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.model.attention=xla")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["kernels"] == {"attention": "xla", "cudnn_attention_calls": 0,
                                 "gemm_calls": report["kernels"]["gemm_calls"]}
    assert report["kernels"]["gemm_calls"] > 0


def test_sequence_parallelism_reduce_scatters_and_all_gathers_over_tp(tmp_path):
    done, report = dry_run(tmp_path, *TINY, "--gpu", "a100-80gb", "--config.mesh.sequence_parallel=true")
    assert done.returncode == 0, done.stderr[-2000:]
    ops = {(e["op"], e["axis"]) for e in report["collectives"]}
    assert {("reduce-scatter", "tp"), ("all-gather", "tp")} <= ops
    assert report["target"] == "a100-80gb"


@pytest.mark.parametrize("args, message", [
    (["--gpu", "v100"], "--gpu=v100: no GPU target of that name; use one of"),
    (["--gpu", "h100", "--gpus_per_node", "3"], "--gpus_per_node=3: the mesh's 8 devices do not fill whole nodes"),
])
def test_mistakes_are_one_line(tmp_path, args, message):
    done, report = dry_run(tmp_path, *TINY, *args)
    assert done.returncode != 0 and report is None
    assert done.stderr.strip().splitlines()[-1].startswith(f"jaxpar: error: {message}"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_gpu_without_dry_run_and_missing_compiler_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", *TINY, "--gpu", "h100", "--workdir",
                           str(tmp_path / "w")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("jaxpar: error: --gpu=h100 compiles for GPUs this machine does "
                                                    "not have: add --dry_run")
    assert not (tmp_path / "w" / "config.json").exists()
    if not gpu_aot.LOCAL_PACKAGES.is_dir():
        return  # the packages are in this environment itself: nothing can hide them
    done, _ = dry_run(tmp_path, *TINY, "--gpu", "h100", env={"JAXPAR_GPU_AOT_PATH": str(tmp_path / "none")})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--gpu needs XLA's GPU compiler, which is not installed" in done.stderr.strip().splitlines()[-1]
    assert "make gpu-aot" in done.stderr


@pytest.mark.slow
def test_vla70b_on_64_a100s_compiles_in_under_3_minutes(tmp_path):
    start = time.perf_counter()
    done, report = dry_run(tmp_path, "--config", "vla70b", "--gpu", "a100-80gb")
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["devices"] == 64 and report["target"] == "a100-80gb" and report["kernels"]["attention"] == "cudnn"
    assert seconds < 180, seconds
