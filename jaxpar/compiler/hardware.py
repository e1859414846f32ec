"""Hardware profiles for the planner: peak bf16 FLOP/s, HBM, and link bandwidths.

Everything here is editable: `--hardware_json FILE` (or a JSON string) overrides any field of any
profile or adds a new one, e.g. `{"a100-80gb": {"ib_gbps_per_node": 200}}`.

Sources. Peak dense bf16 and HBM figures are the vendors' data sheets (A100-80GB SXM 312 TFLOP/s,
2.0 TB/s; H100-80GB SXM 989 TFLOP/s, 3.35 TB/s; H200 989 TFLOP/s, 141 GB, 4.8 TB/s). NVLink is the
per-GPU bidirectional figure (A100 600 GB/s, the seed's table 6.3; H100/H200 900 GB/s). The
inter-node figures are the seed's (table 6.3 and section 8.1): InfiniBand 200 Gbps = 25 GB/s per
NIC, 4 NICs per node ("4 x IB 200Gbps, recommended"); RoCE v2 100 Gbps = 12.5 GB/s per NIC, 8 NICs
per node ("8 x RoCE 100Gbps, acceptable"); PCIe Gen5 64 GB/s for host offload.

`matmul_efficiency` is the fraction of peak the matmuls reach, fitted to the one GPU measurement
(the 1B Llama on an H200, BENCHMARKS.md): 0.55 puts the GPU dry run's estimate (jaxpar.compiler.gpu_program)
within 5% of the three measured step times. The planner and that estimate share it; recalibrate
whenever a GPU measurement lands. Large models' GEMMs likely run faster than the 1B model's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxpar.errors import ConfigError

GB = 1e9
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
    usable_hbm_fraction: float = 0.95  # CUDA context, allocator fragmentation, NCCL buffers
    compute_capability: float = 9.0  # 8.0 Ampere, 9.0 Hopper: what cuDNN attention may run (planner/kernels.py)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def usable_bytes(self) -> float:
        return self.hbm_gb * GB * self.usable_hbm_fraction


# The seed's table 6.3 / section 8.1 network: 4 x IB 200 Gbps per node (25 GB/s each).
IB_4X200 = 4 * 25.0
ROCE_8X100 = 8 * 12.5

PROFILES: dict[str, Hardware] = {
    "a100-80gb": Hardware("a100-80gb", 312.0, 80.0, 2.0, 600.0, IB_4X200, compute_capability=8.0),
    "h100-80gb": Hardware("h100-80gb", 989.0, 80.0, 3.35, 900.0, IB_4X200),
    "h200": Hardware("h200", 989.0, 141.0, 4.8, 900.0, IB_4X200),
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
