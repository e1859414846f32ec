"""Hardware profiles for the planner: peak bf16 FLOP/s, HBM, and link bandwidths; and the one memory budget.

Everything here is editable: `--hardware_json FILE` (or a JSON string) overrides any field of any
profile or adds a new one, e.g. `{"a100-80gb": {"ib_gbps_per_node": 200}}`.

Sources. Peak dense bf16 and HBM bandwidth are the vendors' data sheets (A100-80GB SXM 312 TFLOP/s,
2.0 TB/s; H100-80GB SXM 989 TFLOP/s, 3.35 TB/s; H200 989 TFLOP/s, 4.8 TB/s). `hbm_gb` is the memory the
CUDA driver reports as the device's total, which is what the allocator's fraction multiplies
(memory_budget): the data sheets' "80GB" and "141 GB" are binary gigabytes. H200: 150.11 GB, measured
(jax's `bytes_limit` at XLA_PYTHON_CLIENT_MEM_FRACTION=1.0 on one H200, 2026-12-04); A100 / H100: XLA's
GPU spec files (xla/backends/gpu/target_config/specs/), 85.1 / 84.9 GB, not measured (XLA's H200 file
says 151.40 GB, 0.9% more than that H200's driver). NVLink is the
per-GPU bidirectional figure (A100 600 GB/s, the seed's table 6.3; H100/H200 900 GB/s). The
inter-node figures are the seed's (table 6.3 and section 8.1): InfiniBand 200 Gbps = 25 GB/s per
NIC, 4 NICs per node ("4 x IB 200Gbps, recommended"); RoCE v2 100 Gbps = 12.5 GB/s per NIC, 8 NICs
per node ("8 x RoCE 100Gbps, acceptable"); PCIe Gen5 64 GB/s for host offload.

FP8: the dense FP8 tensor-core peak, NVIDIA's data sheets (H100 / H200 SXM 1,979 TFLOP/s, twice bf16's;
A100 has none). An FP8 GEMM is priced at it times the same `matmul_efficiency`, the bf16 calibration
carried over, not measured: an estimate until a GPU measures an FP8 step (issue 47).

`matmul_efficiency` is the fraction of peak the matmuls reach, fitted to the one GPU measurement
(the 1B Llama on an H200, BENCHMARKS.md): 0.55 puts the GPU dry run's estimate (jaxpar.compiler.gpu_program)
within 5% of the three measured step times. The planner and that estimate share it; recalibrate
whenever a GPU measurement lands. Large models' GEMMs likely run faster than the 1B model's.

The memory budget (`memory_budget`, USABLE_FRACTION; docs/design.md "The memory budget") is the one
definition of the device memory a run may plan for: the planner's fit, the GPU dry run's `fits` and
the runtime's allocator (`apply_memory_fraction`: XLA_PYTHON_CLIENT_MEM_FRACTION, set before JAX starts
on GPUs) all use it, and the trainer's preflight (jaxpar.training.preflight) checks the compiled step
against the allocator's resulting limit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from jaxpar.compiler.xla_flags import runs_on_gpu
from jaxpar.errors import ConfigError

GB = 1e9
# The share of each GPU's memory given to XLA's allocator and every plan is held to: memory_budget says why.
USABLE_FRACTION = 0.90
# The allocator's fraction, as jaxlib reads it: the new name and the deprecated one (setting both is an
# error in jaxlib's generate_pjrt_gpu_plugin_options, so a user's value under either name wins alone).
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MATMUL_EFFICIENCY = 0.55  # the H200 calibration (module docstring); Hardware's default
KERNEL_LAUNCH_S = 3e-6  # per GPU kernel: launch and tail of a small grid (an assumption; gpu_program, planner)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense bf16
    hbm_gb: float  # per GPU, 1e9 bytes
    hbm_tbps: float
    nvlink_gbps: float  # per GPU, bidirectional (GB/s); a ring all-reduce moves half of it each way
    ib_gbps_per_node: float  # inter-node bandwidth of one node, all NICs together (GB/s, one direction)
    pcie_gbps: float = 64.0
    matmul_efficiency: float = MATMUL_EFFICIENCY  # fitted (see module docstring)
    usable_hbm_fraction: float = USABLE_FRACTION  # memory_budget's; --hardware_json may plan another
    compute_capability: float = 9.0  # 8.0 Ampere, 9.0 Hopper: what cuDNN attention may run (planner/kernels.py)
    fp8_peak_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores (precision=fp8 refused)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def fp8_peak_flops(self) -> float:
        return self.fp8_peak_tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return memory_budget(self.hbm_gb * GB, self.usable_hbm_fraction)


def memory_budget(device_bytes: float, fraction: float = USABLE_FRACTION) -> float:
    """The bytes of a device's memory a run may use: `fraction` of its total (the CUDA driver's figure).

    The one definition of usable memory: the planner plans against it (Hardware.usable_bytes), the GPU
    dry run's `fits` compares the compiled peak with it, and on GPUs jaxpar.train gives XLA's allocator
    exactly this share (apply_memory_fraction), so what was planned is what the allocator hands out
    (and what XLA:GPU compiles against: it schedules and rematerialises for the allocator's limit).

    Why 0.90, not JAX's default 0.75 (64 GB of an 80 GB card: the plans of 66-71 GB ran out of memory at
    start) nor the 0.95 the planner and the launch scripts used: the rest of the memory holds what lives
    outside XLA's pool. On one H200 training llama_tiny in bf16 (cuDNN attention, cuBLAS GEMMs) that was
    0.67 GB: the CUDA context and the kernels loaded (nvidia-smi's peak minus the pool, 2026-12-04). A node
    of 8 GPUs running a 3D layout adds NCCL: every group a device joins (tp, dp, pp, cp) is a communicator
    with its own buffers from cudaMalloc, NCCL_BUFFSIZE (4 MiB) per channel, peer and protocol, hundreds
    of MB each with the many channels of NVLink, more with NVLink SHARP on NVSwitch systems; and the CUDA
    graphs of XLA's command buffers take driver memory (the CUDA plugin's out-of-memory message for them
    says to lower this fraction). 0.95 leaves 4.3 GB of an 80 GB card for all of that, 0.90 leaves 8.5 GB
    (15 GB on an H200): a margin that multi-GPU runs, not yet measured, are unlikely to outgrow, for 5%
    of the memory. Inside the pool fragmentation needs no margin of its own: a step's temporaries are
    one buffer XLA allocates whole, and the donated state is updated in place, so each step allocates
    what the last one freed. On 80 GB cards the planner's budget hardly moved: 0.90 x 85.1 GB = 76.6 GB,
    where it was 0.95 x 80 GB = 76.0 GB."""
    return device_bytes * fraction


def user_memory_fraction(environ=os.environ) -> tuple[str, str] | None:
    """(variable, value) of an allocator fraction the user set (MEM_FRACTION_VARS), else None."""
    for name in MEM_FRACTION_VARS:
        if environ.get(name, "").strip():
            return name, environ[name]
    return None


def apply_memory_fraction(environ=os.environ, announce=None) -> str | None:
    """On GPUs, set XLA_PYTHON_CLIENT_MEM_FRACTION to USABLE_FRACTION unless the user set a fraction
    (either name); returns the line that says which fraction the run has (also passed to `announce`),
    or None off GPUs. Call before JAX starts: jaxlib reads it once, when the GPU client is made. "On
    GPUs" is decided as for the XLA flag bundle (jaxpar.compiler.xla_flags.runs_on_gpu)."""
    if not runs_on_gpu(environ)[0]:
        return None
    user = user_memory_fraction(environ)
    if user is not None:
        line = f"memory: {user[0]}={user[1]} (set by user; jaxpar's budget would be {USABLE_FRACTION:g})"
    else:
        environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{USABLE_FRACTION:g}"
        line = (f"memory: XLA_PYTHON_CLIENT_MEM_FRACTION={USABLE_FRACTION:g} (jaxpar's budget, "
                f"jaxpar/compiler/hardware.py: the rest is for the CUDA context, NCCL and cuBLAS)")
    if announce is not None:
        announce(line)
    return line


# The seed's table 6.3 / section 8.1 network: 4 x IB 200 Gbps per node (25 GB/s each).
IB_4X200 = 4 * 25.0
ROCE_8X100 = 8 * 12.5

PROFILES: dict[str, Hardware] = {  # hbm_gb: the driver's total, the bytes jaxpar.compiler.gpu_aot compiles for
    "a100-80gb": Hardware("a100-80gb", 312.0, 85.100068864, 2.0, 600.0, IB_4X200, compute_capability=8.0),
    "h100-80gb": Hardware("h100-80gb", 989.0, 84.942979072, 3.35, 900.0, IB_4X200, fp8_peak_tflops=1979.0),
    "h200": Hardware("h200", 989.0, 150.109945856, 4.8, 900.0, IB_4X200, fp8_peak_tflops=1979.0),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}


def load_overrides(text: str | None) -> dict[str, Hardware]:
    """The profile table with `text` (a JSON file path or a JSON string) merged in."""
    profiles = dict(PROFILES)
    if not text:
        return profiles
    path = pathlib.Path(text)
    try:
        data = json.loads(path.read_text() if path.is_file() else text)
    except (json.JSONDecodeError, OSError) as err:
        raise ConfigError(f"--hardware_json: not a JSON file or string ({err})") from None
    fields = {f.name for f in dataclasses.fields(Hardware)} - {"name"}
    for name, values in data.items():
        unknown = set(values) - fields
        if unknown:
            raise ConfigError(f"--hardware_json: unknown field(s) {', '.join(sorted(unknown))} for '{name}'; "
                              f"fields are {', '.join(sorted(fields))}")
        base = profiles.get(name.lower())
        if base is None:
            missing = fields - set(values) - {"pcie_gbps", "matmul_efficiency", "usable_hbm_fraction",
                                              "compute_capability"}
            if missing:
                raise ConfigError(f"--hardware_json: new GPU '{name}' needs {', '.join(sorted(missing))}")
            profiles[name.lower()] = Hardware(name.lower(), **{k: float(v) for k, v in values.items()})
        else:
            profiles[name.lower()] = dataclasses.replace(base, **{k: float(v) for k, v in values.items()})
    return profiles


def get(name: str, profiles: dict[str, Hardware] | None = None) -> Hardware:
    profiles = profiles or PROFILES
    key = ALIASES.get(name.lower(), name.lower())
    if key not in profiles:
        raise ConfigError(f"unknown GPU '{name}'; known: {', '.join(sorted(profiles))} "
                          f"(add one with --hardware_json)")
    return profiles[key]


def profile_for(device_kind: str) -> Hardware | None:
    """The profile of the GPU jax calls `device_kind` (e.g. 'NVIDIA H100 80GB HBM3'); None if none matches."""
    kind = device_kind.lower()
    for key in ("h200", "h100", "a100"):  # h200 first: a GH200's name must not match h100
        if key in kind:
            return get(key)
    return None
