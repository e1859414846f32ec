"""Every test runs on 8 emulated CPU devices (set before JAX's first backend use), with the trainer's
load-tolerant collective timeout (the suite runs in 2 workers on 2 cores), and compiles in-process
programs with XLA's backend (LLVM codegen) optimisation level 0 (see fast_codegen_in_this_process).

The GPU lane (tests marked `gpu`, `make test-gpu`, scripts/gpu_check.py) sets JAXPAR_GPU_LANE=1: its programs
compile with XLA's defaults and the flag bundle a GPU run uses, and a `gpu` test fails, not skips, without one."""

from jaxpar.parallel.mesh import emulate_cpu_devices

emulate_cpu_devices(8)

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# What every run outside this test process compiles with (XLA's defaults): the tests that compare a run's compile
# with the suite's fast one pass it explicitly (compiler options win over XLA_FLAGS).
XLA_DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
FAST_CODEGEN_FLAG = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def fast_codegen_in_this_process() -> None:
    """Compile this process's programs fast: XLA's backend optimisation level 0 (LLVM's codegen only) and
    XLA:CPU's elemental emitters instead of its MLIR fusion emitters, which take half the backend compile
    (measured: 9.6 s -> 4.8 s for three train steps; tests/test_pipeline.py's fast tests 91 s -> 69 s). The HLO
    passes that decide a layout's program (SPMD partitioning, the collectives, buffer assignment) are the same,
    so every layout and collective check sees the program a run compiles, and both sides of every numerical
    comparison are compiled alike (tests/test_collectives.py::test_optimised_hlo_does_not_depend_on_backend_opt_level).
    Memory analysis keeps a run's argument, output and alias bytes; the temp bytes move by a few hundred bytes
    in megabytes (tests/test_dry_run.py::test_fast_compile_keeps_memory_analysis), and no test pins temp bytes.
    Two different programs that compute the same arithmetic (the host's optimizer update and the device's) agree
    within float32 rounding, not bit for bit, under these flags as under a run's (tests/test_param_offload.py).

    XLA reads XLA_FLAGS once per process, at its first compile: the flags are in the environment for that
    compile and taken out again, so subprocesses (every `python -m jaxpar.train` a test starts, the GPU
    dry runs) compile with XLA's defaults as a user's run does (measured: LLVM's level 0 saved the two-process
    tests nothing; their time is startup and coordination). A level in the user's XLA_FLAGS wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_CODEGEN_FLAG}".strip()
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile()
    finally:
        os.environ["XLA_FLAGS"] = flags


def share_compiles_between_tests() -> None:
    """JAX's persistent compilation cache for this process's compiles, in one directory (JAXPAR_TEST_XLA_CACHE,
    default .pytest_cache/xla; "off" turns it off) that both xdist workers, `make test` and `make test-slow`
    share. The suite compiles the same program many times: a module's reference fixture in each worker that
    runs its tests and again in the slow session, a layout that two tests check for different things. A
    program compiled once is loaded from then on; the key is JAX's (the program without its source
    locations, the compile options, the jaxlib version), so an edited program compiles afresh.

    Loaded programs compute what compiled ones do and give the same memory analysis; only their HLO text's
    source locations are the first compile's (the file table's order and the caller's own frames).
    Set with jax.config, not the environment: the `python -m jaxpar.train` processes a test starts keep the
    CLI's own compile.cache_dir (tests/test_compile_cache.py tests it) and XLA's default optimisation."""
    where = os.environ.get("JAXPAR_TEST_XLA_CACHE") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
    if where == "off":
        return
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)  # not the many trivial jits
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)  # the whole cold suite writes ~0.2 GB; edits add keys


GPU_LANE = os.environ.get("JAXPAR_GPU_LANE") == "1"
if not GPU_LANE:  # the lane checks the program a GPU run compiles: XLA's default optimisation
    fast_codegen_in_this_process()
    share_compiles_between_tests()

from jaxpar.config import Config, MeshConfig, ModelConfig, TrainConfig, ZeroConfig, validate  # noqa: E402
from jaxpar.parallel.mesh import Layout  # noqa: E402
from jaxpar.parallel.step import StepBuilder  # noqa: E402

# Small but with every dim divisible by 8, so any (dp, tp) in the tests is a valid layout.
# llama7b.py's layout until 2026-12-05 (tp 8 in the node, ZeRO-1, full remat; its docstring): the tests written
# against it pin it, so the config's default (the compiled search's choice) can move without moving them
LLAMA7B_TP8 = ["mesh.dp=1", "mesh.pp=1", "mesh.tp=8", "zero.stage=1", "remat.policy=full"]
TINY_MODEL = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=128)


def make_config(dp=1, pp=1, tp=1, stage=0, precision="fp32", model=TINY_MODEL, **train) -> Config:
    train_cfg = dict(steps=3, global_batch_size=16, seq_len=16, lr=1e-3, warmup_steps=0, seed=0)
    train_cfg.update(train)
    config = Config(mesh=MeshConfig(dp=dp, pp=pp, tp=tp), zero=ZeroConfig(stage=stage), precision=precision,
                    train=TrainConfig(**train_cfg), model=model)
    validate(config)
    return config


def builder_for(config: Config) -> StepBuilder:
    mesh = Layout.for_config(config).make_mesh()
    return StepBuilder(config, mesh)


def tp_local_params(model, tp: int) -> int:
    """Parameters per tp rank in the Megatron layout (vocab, heads, kv heads and d_ff split over tp),
    written out by hand as the oracle for the ZeRO formulas and collective byte counts."""
    d, n, k, h, f, v = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim, model.d_ff, model.vocab_size
    per_layer = 2 * d + (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) // tp
    return 2 * v * d // tp + d + model.n_layers * per_layer


def replace(config: Config, **groups) -> Config:
    """Return `config` with whole groups replaced, e.g. replace(c, zero=ZeroConfig(stage=2))."""
    return dataclasses.replace(config, **groups)


def pytest_runtest_setup(item):
    """A `gpu` test without an NVIDIA GPU fails with one line (the lane must not pass green as skips)."""
    if item.get_closest_marker("gpu") and jax.default_backend() != "gpu":
        pytest.fail(f"needs an NVIDIA GPU (JAX's default backend here is {jax.default_backend()}): run the "
                    f"`gpu` tests with `make test-gpu` on a GPU machine", pytrace=False)


def pytest_runtest_logreport(report):
    """JAXPAR_LANE_RESULTS=FILE (scripts/gpu_check.py): one JSON line per test outcome, with what the test measured
    (record_property), for the GPU check's report."""
    path = os.environ.get("JAXPAR_LANE_RESULTS")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    lines = report.longreprtext.strip().splitlines() if report.failed else []
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]  # the assertion's own lines
    message = " / ".join(errors[:3] or lines[-1:])[:500]
    with open(path, "a") as out:
        out.write(json.dumps({"test": report.nodeid, "phase": report.when, "outcome": report.outcome,
                              "seconds": round(report.duration, 2), "message": message,
                              "measured": {k: str(v) for k, v in report.user_properties}}) + "\n")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def free_port() -> int:
    """A free loopback port for a coordinator: tests run side by side (2 xdist workers)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LAUNCH_CLUES = ("jaxpar: error", "Error", "may be stuck", "Fatal Python error", "Thread 0x", "File \"", "Traceback")


def launch_failure(run, tail: int = 1500) -> str:
    """A failed multi-process run's story for an assertion message: every line of stderr (both
    processes write to it) that names an error, a stuck collective or a Python frame (faulthandler's
    dump when a process aborts), at most 60 of them, then the tail: the tail alone is usually the
    coordination service's abort, which hides what failed first."""
    clues = [line for line in run.stderr.splitlines() if any(c in line for c in LAUNCH_CLUES)]
    return "\n".join(clues[:60]) + "\n...\n" + run.stderr[-tail:]


def lane_subprocess_env(platform: str, **extra: str) -> dict:
    """The environment of a process a GPU-lane test starts (`python -m jaxpar.train`, `-m jaxpar.generate`),
    with this checkout importable: for "cpu" pinned to XLA:CPU without the lane's GPU flags, the reference side
    of a comparison; otherwise the lane's own (its GPU, its XLA flag bundle). `extra` variables are added."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])), **extra)
    if platform == "cpu":
        env = {k: v for k, v in env.items() if k not in ("XLA_FLAGS", "JAXPAR_GPU_LANE")}
        env["JAX_PLATFORMS"] = "cpu"
    return env


def require(module: str):
    """`pytest.importorskip(module)`, except in CI (CI=true, as .ci/run runs): there a missing test
    dependency is a broken install, and the tests that need it fail instead of passing green as skips."""
    if os.environ.get("CI", "").lower() == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)
