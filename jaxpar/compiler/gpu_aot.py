"""Compile for NVIDIA GPUs on a machine without one: devices of a GPU target, for the dry run.

Why: jaxpar's GPU features (cuDNN attention, the XLA flag bundle, overlap) mean nothing to XLA:CPU,
and a GPU is rarely at hand. XLA's GPU compiler runs without a device when given a *target
config*, a text proto of the GPU's facts (stream_executor.GpuTargetConfigProto):
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` then returns
abstract GPU devices that `jit(...).lower(...).compile()` accepts, and the result is a scheduled GPU
program with its own `memory_analysis()`. What it is not: no GEMM autotuning (default tiles; cuBLAS
for GEMMs, since Triton GEMM fusions need autotuned tiles to compile at all) and no
`cost_analysis()`. Figures from it are "GPU-compiled, no device": memory is a close estimate.

Facts relied on (jaxlib 0.10.2 with jax-cuda12-plugin / -pjrt 0.10.2, nvidia-cuda-nvcc-cu12 for
ptxas and libdevice, nvidia-cudnn-cu12 for cuDNN attention):
- The packages live outside the venv (`make gpu-aot`: pip --target .gpu-aot, put on sys.path by
  `prepare_environment`), so CPU runs and tests never load the CUDA plugin.
- JAX_PLATFORMS must not start the CUDA backend (there is no device): the trainer sets it to `cpu`
  before JAX starts when `--gpu` is given.
- The target config below is written from each GPU's data (XLA keeps such files under
  xla/backends/gpu/target_config/specs/); jaxlib 0.10.2's parser rejects newer fields
  (collective_memory_granularity), so only the fields it knows are written.
- The target config carries the CUDA runtime version of the toolkit that compiles (`cuda_version`: the
  version of nvidia-cuda-nvcc-cu12, whose ptxas builds the kernels; 12.9 with `make gpu-aot` today).
  Without a `runtime_version` XLA's GPU compiler assumes a runtime too old for cuBLASLt's FP8 GEMMs and
  never rewrites an FP8 `dot_general` into `__cublas$lt$matmul$f8` (issue 47); other passes read it too.
- The topology string is "<slices>x<hosts per slice>x<devices per host>"; one slice, `nodes` hosts
  of `gpus_per_node` GPUs, process-major device order as a multi-host launch sees it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import sys

from jaxpar.errors import ConfigError
from jaxpar.compiler.hardware import ALIASES, GB, PROFILES  # the planner's profile names and memory

INSTALL = "make gpu-aot (or pip install 'jaxpar[gpu-aot]')"
# Where `make gpu-aot` puts the compiler's packages (pip --target), outside the venv: installed there, the
# CUDA plugin makes every CPU-only JAX process log "Could not find cuda drivers" and a plugin traceback.
LOCAL_PACKAGES = pathlib.Path(os.environ.get("JAXPAR_GPU_AOT_PATH",
                                             pathlib.Path(__file__).resolve().parents[2] / ".gpu-aot"))
# Without autotuning a Triton GEMM fusion may find no tile sizes ("Couldn't find output tile sizes that
# satisfy hlo"); cuBLAS GEMMs compile with their heuristics.
AOT_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU's facts, as the target config needs them (vendor data; XLA's spec files agree)."""
    name: str  # the planner's profile name (jaxpar.compiler.hardware)
    description: str  # the device name the CUDA driver reports
    compute_capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    fpus_per_core: int
    clock_ghz: float
    memory_bytes: int  # the driver's total: the planner profile's hbm_gb, one figure for both (_memory)
    memory_bandwidth: int  # bytes/s
    l2_bytes: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int


def _memory(name: str) -> int:
    """Device memory in bytes, from the planner's profile: the planner, the dry run's `fits` and the
    program XLA compiles see one figure (jaxpar.compiler.hardware.memory_budget)."""
    return round(PROFILES[name].hbm_gb * GB)


TARGETS = {t.name: t for t in (
    GpuTarget("h100-80gb", "NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, _memory("h100-80gb"), 3_352_320_000_000,
              52_428_800, 233_472, 232_448),
    GpuTarget("h200", "NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 1.98, _memory("h200"), 4_800_000_000_000,
              52_428_800, 233_472, 232_448),
    GpuTarget("a100-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, _memory("a100-80gb"), 2_039_040_000_000,
              41_943_040, 167_936, 166_912),
)}


def target(name: str) -> GpuTarget:
    """The target for `name` (a planner profile name or alias); one-line error for others."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TARGETS:
        names = sorted([*TARGETS, *ALIASES])
        raise ConfigError(f"--gpu={name}: no GPU target of that name; use one of {', '.join(names)}")
    return TARGETS[key]


def cuda_version() -> tuple[int, int]:
    """(major, minor) of the CUDA toolkit the GPU compiler uses: nvidia-cuda-nvcc-cu12's version
    ("12.9.86" -> (12, 9)); the package's third number is NVIDIA's build, not the runtime's patch."""
    from importlib import metadata

    found = next(metadata.distributions(name="nvidia-cuda-nvcc-cu12", path=[str(LOCAL_PACKAGES), *sys.path]), None)
    if found is None:
        raise ConfigError(f"--gpu needs XLA's GPU compiler, which is not installed (nvidia-cuda-nvcc-cu12): "
                          f"{INSTALL}")
    major, minor = found.version.split(".")[:2]
    return int(major), int(minor)


def target_config(gpu: GpuTarget, cuda: tuple[int, int] | None = None) -> str:
    """The GpuTargetConfigProto text for `gpu`: the device facts XLA's GPU compiler plans with, and the
    CUDA runtime it compiles for (`cuda`, default: the installed toolkit's, `cuda_version`)."""
    major, minor = gpu.compute_capability
    cuda_major, cuda_minor = cuda or cuda_version()
    extension = "ACCELERATED_FEATURES" if major >= 9 else "NONE"  # sm_90a: wgmma, TMA
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {gpu.cores}
  fpus_per_core: {gpu.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {gpu.memory_bandwidth}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
runtime_version {{ major: {cuda_major} minor: {cuda_minor} patch: 0 }}
device_description_str: "{gpu.description}"
"""


def missing_packages() -> list[str]:
    """The GPU-compile packages this environment lacks (import names)."""
    needed = ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc", "nvidia.cudnn")
    missing = []
    for name in needed:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def prepare_environment() -> None:
    """Before JAX starts: keep the CUDA backend from starting (no device here) and turn off what needs
    autotuning. One-line error naming the install when the compiler's packages are missing."""
    if LOCAL_PACKAGES.is_dir() and str(LOCAL_PACKAGES) not in sys.path:
        sys.path.insert(0, str(LOCAL_PACKAGES))  # before JAX looks for plugins
    missing = missing_packages()
    if missing:
        raise ConfigError(f"--gpu needs XLA's GPU compiler, which is not installed ({', '.join(missing)}): "
                          f"{INSTALL}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in AOT_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def gpu_devices(gpu: GpuTarget, count: int, gpus_per_node: int) -> list:
    """`count` abstract devices of `gpu`, as `count / gpus_per_node` nodes (one node if fewer)."""
    from jax.experimental import topologies

    per_node = min(gpus_per_node, count)
    if per_node < 1 or count % per_node:
        raise ConfigError(f"--gpus_per_node={gpus_per_node}: the mesh's {count} devices do not fill whole nodes "
                          f"of {gpus_per_node}")
    topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=target_config(gpu),
                                            topology=f"1x{count // per_node}x{per_node}")
    devices = sorted(topology.devices, key=lambda d: (d.process_index, d.id))
    assert len(devices) == count, (len(devices), count)
    return devices
