"""The one device mesh: (dp, pp, tp) -> jax.sharding.Mesh with named axes, plus device set-up.

Axis order is (dp, pp, tp): tp is the fastest-varying axis, so on GPUs the tp group is a set of
neighbouring devices inside one NVLink node (Megatron's "TP inside a node" rule), pp next, dp outermost.

Axis types are Auto on purpose: jaxpar places every array with explicit NamedShardings and writes its
collectives by hand inside `jax.shard_map`, so it needs no sharding-in-types propagation.

Device set-up must run before JAX's first use of a backend: on a CPU-only host the trainer emulates
exactly as many CPU devices as the mesh needs (`jax_num_cpu_devices`); with GPUs it uses the real ones.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError
from jaxpar.sharding import TP_INNER

AXES = ("dp", "pp", "tp")



@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout of the global mesh.

    `tp_split` > 1 (a VLA whose vision.tp is a proper divisor of tp) splits the tp axis into
    ("tp", "tpv") of sizes (tp / tp_split, tp_split): the LLM is tensor-parallel over both, the
    vision encoder over "tpv" only, data-parallel over the rest. Same devices, same order.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    tp_split: int = 1

    @classmethod
    def for_config(cls, config) -> "Layout":
        """The layout a whole config needs (a VLA's vision tp may split the tp axis)."""
        vision_tp = config.vision.tp if config.model.kind == "vla" else 1
        split = vision_tp if 1 < vision_tp < config.mesh.tp else 1
        return cls(dp=config.mesh.dp, pp=config.mesh.pp, tp=config.mesh.tp, tp_split=split)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def axis_names(self) -> tuple[str, ...]:
        return AXES + (TP_INNER,) if self.tp_split > 1 else AXES

    @property
    def shape(self) -> tuple[int, ...]:
        if self.tp_split > 1:
            return (self.dp, self.pp, self.tp // self.tp_split, self.tp_split)
        return (self.dp, self.pp, self.tp)

    def make_mesh(self, devices=None) -> Mesh:
        """Mesh over `devices` (default: the first `size` devices of the default backend)."""
        if devices is None:
            devices = jax.devices()
        if len(devices) < self.size:
            platform = f"{devices[0].platform.upper()} " if len(devices) else ""
            raise ConfigError(
                f"mesh dp x pp x tp = {self.dp} x {self.pp} x {self.tp} = {self.size} needs {self.size} devices "
                f"but {len(devices)} {platform}devices are visible; shrink mesh.dp/pp/tp "
                f"or use --dry_run to compile on emulated devices")
        grid = np.asarray(devices[: self.size], dtype=object).reshape(self.shape)
        return Mesh(grid, self.axis_names, axis_types=(AxisType.Auto,) * len(self.axis_names))


def emulate_cpu_devices(count: int) -> None:
    """Ask the CPU backend for `count` devices; must run before the first JAX backend use."""
    jax.config.update("jax_num_cpu_devices", max(count, 1))


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
    """Start JAX's distributed runtime when flags or the environment ask for several processes.

    Explicit flags win; otherwise SLURM (SLURM_NTASKS > 1) or JAX's own env vars
    (JAX_COORDINATOR_ADDRESS) trigger auto-detection by `jax.distributed.initialize()`.
    """
    if coordinator:
        # CPU processes (tests, laptops) talk over gloo; GPUs use NCCL whatever this says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
        return True
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if slurm_tasks > 1 or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()
        return True
    return False


def devices_for(layout: Layout, dry_run: bool) -> list:
    """Real accelerators when there are enough; emulated CPU devices on a CPU host or for a dry run."""
    backend = jax.default_backend()
    if backend != "cpu":
        accelerators = jax.devices()
        if len(accelerators) >= layout.size:
            if len(accelerators) > layout.size:
                print(f"note: mesh uses {layout.size} of {len(accelerators)} {backend.upper()} devices")
            return accelerators
        if not dry_run:
            raise ConfigError(
                f"mesh dp x pp x tp = {layout.size} is larger than the {len(accelerators)} {backend.upper()} "
                f"devices here; shrink mesh.dp/pp/tp, launch on more hosts, or add --dry_run")
    cpus = jax.devices("cpu")
    if len(cpus) < layout.size:
        raise ConfigError(
            f"mesh needs {layout.size} devices but only {len(cpus)} CPU devices could be emulated "
            f"(JAX was initialised before jaxpar set jax_num_cpu_devices); run in a fresh process")
    return cpus
