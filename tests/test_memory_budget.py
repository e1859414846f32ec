"""One memory budget (jaxpar.compiler.hardware.memory_budget) for the planner, the GPU dry run's `fits` and
the runtime's allocator fraction; and the trainer's preflight (jaxpar.training.preflight), which stops a
step that will not fit its budget before anything is allocated, in one line with exit status 2.

"On GPUs" is simulated as tests/test_xla_flags.py does (JAX_PLATFORMS=cuda in a dict standing in for the
environment, or the probe patched); GPU devices as small fakes with a `memory_stats()['bytes_limit']`."""

import dataclasses
import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import FAST_CODEGEN_FLAG
from jaxpar.compiler import dry_run, gpu_aot, hardware
from jaxpar.compiler.hardware import USABLE_FRACTION, apply_memory_fraction, memory_budget
from jaxpar.config import ConfigError, load_config
from jaxpar.parallel.mesh import Layout
from jaxpar.planner import memory, recommend
from jaxpar.training import preflight
from jaxpar.training.loop import train

REPO = pathlib.Path(__file__).resolve().parent.parent
EMPTY_PROGRAM = "HloModule m\n\nENTRY main {\n  ROOT c = f32[] constant(0)\n}\n"  # no kernels to count
SYNTHETIC = ["--config.data.train=", "--config.data.eval=", "--config.data.generate=false",
             "--config.compile.cache_dir="]


# ----------------------------------------------------------------------------- the allocator's fraction

def test_the_fraction_is_set_on_gpus_only_and_never_over_the_users():
    gpu = {"JAX_PLATFORMS": "cuda"}
    lines = []
    line = apply_memory_fraction(gpu, announce=lines.append)
    assert lines == [line] and "\n" not in line and line.startswith("memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 ")
    assert float(gpu["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == USABLE_FRACTION
    for name in hardware.MEM_FRACTION_VARS:  # jaxlib refuses both names at once: the user's alone is kept
        user = {"JAX_PLATFORMS": "cuda", name: "0.5"}
        assert "set by user" in apply_memory_fraction(user) and user == {"JAX_PLATFORMS": "cuda", name: "0.5"}
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert apply_memory_fraction(cpu) is None and cpu == {"JAX_PLATFORMS": "cpu"}


def test_the_trainer_sets_the_fraction_before_jax_starts(tmp_path):
    """jaxpar.train's start-up path calls it before JAX is imported (jaxlib reads the fraction once, when
    the GPU client is made); the probe says "GPUs" and the run stops right after the call."""
    script = f"""
import sys
from jaxpar.compiler import hardware
real = hardware.apply_memory_fraction
def spy(*args, **kwargs):
    print("line:", real(*args, **kwargs)); print("jax imported:", "jax" in sys.modules); sys.exit(0)
hardware.runs_on_gpu = lambda environ=None: (True, "pretend")
hardware.apply_memory_fraction = spy
from jaxpar.train import main
main(["--config", "llama_tiny", "--dry_run", "--workdir", {str(tmp_path / "wd")!r}])
"""
    env = {k: v for k, v in os.environ.items() if k not in hardware.MEM_FRACTION_VARS}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "line: memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (jaxpar's budget" in proc.stdout
    assert "jax imported: False" in proc.stdout


# ----------------------------------------------------------------------------- one budget for plan and dry run

@pytest.mark.parametrize("name", sorted(gpu_aot.TARGETS))
def test_the_dry_runs_fits_and_the_planner_share_one_budget(name, monkeypatch):
    """A peak between the budget (90%) and the whole memory (the dry run's old threshold; the planner's
    was 95% of the data sheet's GB): the GPU dry run and the planner both say it does not fit, and both
    say a peak at the budget fits. The planner is driven through its own `fits` (recommend.evaluate),
    its estimate replaced by the given peak."""
    gpu, hw = gpu_aot.TARGETS[name], hardware.get(name)
    budget = memory_budget(gpu.memory_bytes)
    assert hw.usable_bytes == pytest.approx(budget, abs=1.0) and budget == USABLE_FRACTION * gpu.memory_bytes
    config = load_config("llama_tiny")
    for peak, fits in ((int(budget), True), (int(0.95 * gpu.memory_bytes), False), (gpu.memory_bytes - 1, False)):
        fields = dry_run.gpu_fields(gpu, {"peak": peak}, EMPTY_PROGRAM)
        assert fields["fits"] is fits and fields["usable_bytes"] == pytest.approx(budget, abs=1.0)
        monkeypatch.setattr(memory, "estimate", lambda *a, p=peak, **k: {"per_device_bytes": {"peak": p}})
        assert recommend.evaluate(config, hw, 8, time_unfit=False)["fits"] is fits, (name, peak)


# ----------------------------------------------------------------------------- the preflight's budget

class FakeGpu:
    """What the preflight asks of a device: platform, process, kind, and the allocator's limit."""

    platform, process_index, device_kind = "gpu", 0, "NVIDIA H100 80GB HBM3"

    def __init__(self, bytes_limit):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit}


def fake_mesh(bytes_limit, n=8):
    return types.SimpleNamespace(devices=np.array([FakeGpu(bytes_limit) for _ in range(n)]), size=n)


def fake_compiled(peak):
    analysis = types.SimpleNamespace(argument_size_in_bytes=peak, output_size_in_bytes=peak, alias_size_in_bytes=peak,
                                     temp_size_in_bytes=0)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


def test_the_budget_is_the_allocators_limit_on_gpus_memory_gb_when_set_and_none_on_cpu(monkeypatch):
    from conftest import make_config

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    config = load_config("llama_tiny")
    limit = 0.9 * 85e9
    assert preflight.budget(config, fake_mesh(limit)) == (limit,
                                                          "the allocator's limit, XLA_PYTHON_CLIENT_MEM_FRACTION=0.9")

    def forced(gb):
        return dataclasses.replace(config, hardware=dataclasses.replace(config.hardware, memory_gb=gb))

    assert preflight.budget(forced(40), fake_mesh(limit)) == (40e9, "hardware.memory_gb=40")
    assert preflight.budget(forced(100), fake_mesh(limit))[0] == limit  # never over what the allocator hands out
    cpu = Layout.for_config(make_config(dp=8)).make_mesh()
    assert preflight.budget(make_config(dp=8), cpu) is None  # no limit reported, none configured: no preflight
    assert preflight.budget(forced(0.5), cpu) == (0.5e9, "hardware.memory_gb=0.5")


def test_a_gpu_step_over_the_budget_is_one_line_with_the_layout_that_fits():
    """On (fake) H100s: a 70 GB step against 60 GB names both and the recommender's best layout of the same
    8 devices as overrides that load; a 50 GB step passes with a line saying so; at 1 kB nothing fits."""
    config = load_config("llama7b.py")
    with pytest.raises(ConfigError) as refused:
        preflight.check(config, fake_mesh(60e9), fake_compiled(70e9))
    message = str(refused.value)
    assert "\n" not in message and "needs 70 GB per device" in message and "budget is 60 GB" in message
    flags = message.split("): ")[-1].split()
    assert flags and all(flag.startswith("--config.") for flag in flags), message
    better = load_config("llama7b.py", [flag[len("--config."):] for flag in flags])
    assert recommend.evaluate(better, dataclasses.replace(hardware.get("h100-80gb"), hbm_gb=60, usable_hbm_fraction=1),
                              8)["fits"]
    said = []
    preflight.check(config, fake_mesh(60e9), fake_compiled(50e9), announce=said.append)
    assert len(said) == 1 and "fits the budget 60 GB" in said[0]
    nothing = preflight.recommendation(config, fake_mesh(1e3), 1e3)
    assert "finds no other layout of the 8 devices that fits 1e-06 GB" in nothing


def test_memory_gb_is_typed_and_checked():
    assert load_config("llama_tiny", ["hardware.memory_gb=40"]).hardware.memory_gb == 40.0
    with pytest.raises(ConfigError, match=r"hardware.memory_gb=-1.0 must be >= 0"):
        load_config("llama_tiny", ["hardware.memory_gb=-1"])


# ----------------------------------------------------------------------------- the trainer, end to end

def test_the_preflight_stops_a_step_over_the_budget_and_its_recommendation_trains(tmp_path, capsys):
    """llama_tiny (dp 2 x tp 4, 15 MB compiled peak per device) against 1 MB through the CLI: one line,
    exit 2, nothing written but config.json. Its recommendation (planned under 1 MB) then trains two steps
    against 10 MB, where the shipped layout would not fit (in this process, to keep the test short)."""
    workdir = tmp_path / "small"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_CODEGEN_FLAG}  # LLVM's level: same memory analysis
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "llama_tiny", *SYNTHETIC,
                           "--config.hardware.memory_gb=0.001", "--workdir", str(workdir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("jaxpar: error: the train step needs ") and "(compiled peak" in line
    assert "but the budget is 0.001 GB (hardware.memory_gb=0.001)" in line
    assert "the recommender's best layout of the 8 devices that fits: " in line
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]  # no checkpoint, no metrics
    flags = line.split("): ")[-1].split()
    assert flags and all(flag.startswith("--config.") for flag in flags), line

    overrides = [flag[len("--config."):] for flag in [*SYNTHETIC, *flags]]
    config = load_config("llama_tiny", [*overrides, "hardware.memory_gb=0.01", "train.steps=2", "train.log_every=1"])
    records = train(config, Layout.for_config(config).make_mesh(), tmp_path / "fits", show_progress=False)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert "fits the budget 0.01 GB (hardware.memory_gb=0.01)" in capsys.readouterr().out
