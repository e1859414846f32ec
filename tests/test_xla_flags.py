"""jaxpar/compiler/xla_flags.py: the GPU flag bundle is merged under the user's XLA_FLAGS, applied only for GPU
runs (decided without starting JAX), and every flag in it is one this jaxlib knows."""

import os
import subprocess
import sys

import pytest

from jaxpar.compiler import xla_flags
from jaxpar.compiler.xla_flags import GPU_BUNDLE, apply_gpu_bundle, bundle_tokens, flag_name, merge, runs_on_gpu

TINY_JAX = "import jax.numpy as jnp; print(float((jnp.arange(4.0) @ jnp.arange(4.0))))"


def test_bundle_covers_the_overlap_flags_once_each_with_a_reason():
    names = [name for name, _, _ in GPU_BUNDLE]
    assert len(names) == len(set(names))
    for wanted in ("latency_hiding_scheduler", "pipelined_all_gather", "pipelined_reduce_scatter",
                   "pipelined_all_reduce", "while_loop_double_buffering", "all_gather_combine_threshold_bytes",
                   "reduce_scatter_combine_threshold_bytes", "all_reduce_combine_threshold_bytes"):
        assert f"xla_gpu_enable_{wanted}" in names or f"xla_gpu_{wanted}" in names, wanted
    assert all(len(why) > 20 for _, _, why in GPU_BUNDLE)


def test_user_flags_win_and_the_rest_of_the_bundle_is_still_added():
    user = ("--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/d "
            "-xla_gpu_all_reduce_combine_threshold_bytes=1")
    merged, added, kept = merge(user)
    tokens = merged.split()
    names = [flag_name(t) for t in tokens]
    assert len(names) == len(set(names))  # no flag twice: XLA sees exactly one value per name
    assert "--xla_gpu_enable_pipelined_all_gather=false" in tokens and "--xla_dump_to=/tmp/d" in tokens
    assert "-xla_gpu_all_reduce_combine_threshold_bytes=1" in tokens
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in tokens
    assert set(names) == {name for name, _, _ in GPU_BUNDLE} | {"xla_dump_to"}
    assert len(added) == len(GPU_BUNDLE) - 2
    assert kept == ["--xla_gpu_enable_pipelined_all_gather=false", "-xla_gpu_all_reduce_combine_threshold_bytes=1"]
    assert merge("")[0] == " ".join(bundle_tokens())


@pytest.mark.parametrize("environ,on_gpu", [
    ({"JAX_PLATFORMS": "cpu"}, False), ({"JAX_PLATFORMS": "cuda"}, True), ({"JAX_PLATFORMS": "gpu,cpu"}, True),
    ({"JAX_PLATFORMS": "cpu,cuda"}, False), ({"JAX_PLATFORMS": "tpu"}, False),
])
def test_jax_platforms_decides_when_set(environ, on_gpu, monkeypatch):
    monkeypatch.setattr(xla_flags, "_cuda_plugin_importable", lambda: True)  # JAX_PLATFORMS overrides the probe
    assert runs_on_gpu(environ)[0] is on_gpu


def test_without_jax_platforms_a_cuda_plugin_and_a_visible_nvidia_device_are_needed(monkeypatch):
    monkeypatch.setattr(xla_flags, "_cuda_plugin_importable", lambda: False)
    assert runs_on_gpu({}) == (False, "no CUDA plugin for jaxlib is installed")
    monkeypatch.setattr(xla_flags, "_cuda_plugin_importable", lambda: True)
    monkeypatch.setattr(xla_flags.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert runs_on_gpu({})[0] and not runs_on_gpu({"CUDA_VISIBLE_DEVICES": ""})[0]
    monkeypatch.setattr(xla_flags.glob, "glob", lambda pattern: [])
    assert runs_on_gpu({})[0] is False


def test_this_cpu_only_machine_is_not_a_gpu_run():
    assert xla_flags._cuda_plugin_importable() is False  # the test venv has no CUDA plugin
    assert runs_on_gpu({k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})[0] is False


def test_apply_changes_xla_flags_only_for_gpu_runs():
    cpu = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert apply_gpu_bundle(cpu) is None and cpu["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    gpu = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    lines = []
    line = apply_gpu_bundle(gpu, announce=lines.append)
    assert lines == [line] and "\n" not in line
    assert line.startswith("jaxpar: XLA flags for GPUs") and "yours kept: --xla_gpu_enable_latency_hiding" in line
    assert gpu["XLA_FLAGS"].endswith("--xla_gpu_enable_latency_hiding_scheduler=false")
    assert "--xla_gpu_enable_while_loop_double_buffering=true" in gpu["XLA_FLAGS"]
    off = {"JAX_PLATFORMS": "cuda", "JAXPAR_XLA_BUNDLE": "0"}
    assert apply_gpu_bundle(off) is None and "XLA_FLAGS" not in off


def run_with_xla_flags(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", TINY_JAX], env=env, capture_output=True, text=True, timeout=300)


def test_every_bundle_flag_is_known_to_this_jaxlib():
    """XLA aborts on an unknown name in XLA_FLAGS (the control shows the check can fail), so a tiny
    computation with the whole bundle set proves every name exists in this jaxlib."""
    proc = run_with_xla_flags(" ".join(bundle_tokens()))
    assert proc.returncode == 0 and proc.stdout.strip() == "14.0", proc.stderr[-2000:]
    control = run_with_xla_flags(" ".join(bundle_tokens() + ["--xla_gpu_enable_pipelined_collectives=true"]))
    assert control.returncode != 0 and "Unknown flag" in control.stderr


def test_module_cli_prints_the_merged_flags_for_shell_scripts():
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_enable_pipelined_all_reduce=false"}
    out = subprocess.run([sys.executable, "-m", "jaxpar.compiler.xla_flags", "--gpu"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == merge("--xla_gpu_enable_pipelined_all_reduce=false")[0]
    assert "--xla_gpu_enable_pipelined_all_reduce=true" not in out
