"""The one device mesh: (dp, pp, tp) -> jax.sharding.Mesh with named axes, plus device set-up.

Axis order is (dp, pp, tp): tp is the fastest-varying axis, so on GPUs the tp group is a set of
neighbouring devices inside one NVLink node (Megatron's "TP inside a node" rule), pp next, dp outermost.
With several processes (one per node) the grid comes from `mesh_utils.create_hybrid_device_mesh`,
processes as the slow-network granules: each axis is split into a part inside a process and a part
across processes, filled innermost-first (tp, then cp, then pp, then dp), so a tp group stays inside one
node whenever tp divides a node's devices and dp is the axis that crosses nodes first. Context parallelism may
cross nodes too (cp x tp beyond a node, as a million-token sequence needs): its ring's sends, all-gathers
or all-to-alls then go over the network, and the processes of a cp group read the same sequences, which
jaxpar.data.pipeline checks before the first step. This does not depend on
the order `jax.devices()` lists devices in. On one process `jax.make_mesh` orders the devices (on
GPUs by their global id; on CPUs as listed).

Axis types are Auto on purpose: jaxpar places every array with explicit NamedShardings and writes its
collectives by hand inside `jax.shard_map`, so it needs no sharding-in-types propagation.

Device set-up must run before JAX's first use of a backend: on a CPU-only host the trainer emulates
exactly as many CPU devices as the mesh needs (`jax_num_cpu_devices`); with GPUs it uses the real ones.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import sys

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError
from jaxpar.sharding import TP_INNER, tp_split

AXES = ("dp", "pp", "tp")
# XLA:CPU's collective timeouts, which emulate_cpu_devices sets: its "may be stuck" line (naming the
# collective, a warning only) and its abort, which comes after the trainer's own watchdog has ended a
# stuck run with one line (jaxpar.training.watchdog.CPU_STUCK_S lies between the two).
CPU_WARN_STUCK_S = 30
CPU_TERMINATE_S = 660



@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout of the global mesh.

    `tp_split` > 1 splits the tp axis into ("tp", "tpv") of sizes (tp / tp_split, tp_split), same
    devices, same order; the LLM is tensor-parallel over both. Two reasons: a VLA whose vision.tp is a
    proper divisor of tp (the encoder is tensor-parallel over "tpv" only, data-parallel over the rest),
    and more tp ranks than KV heads (tp_split = tp / n_kv_heads: each KV head on its outer "tp" index,
    replicated over "tpv"; jaxpar.sharding.kv_head_ways). The vision split wins when both apply
    and differ; the KV heads are then held whole on every rank.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    tp_split: int = 1
    cp: int = 1  # context parallelism: an axis "cp" between pp and tp, present only when cp > 1

    @classmethod
    def for_config(cls, config) -> "Layout":
        """The layout a whole config needs (a VLA's vision tp may split the tp axis)."""
        vision_tp = config.vision.tp if config.model.kind == "vla" else 1
        split = tp_split(config.mesh.tp, config.model.n_kv_heads, vision_tp)
        return cls(dp=config.mesh.dp, pp=config.mesh.pp, tp=config.mesh.tp, tp_split=split, cp=config.mesh.cp)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def axis_names(self) -> tuple[str, ...]:
        names = ("dp", "pp") + (("cp",) if self.cp > 1 else ()) + ("tp",)
        return names + (TP_INNER,) if self.tp_split > 1 else names

    @property
    def shape(self) -> tuple[int, ...]:
        outer = (self.dp, self.pp) + ((self.cp,) if self.cp > 1 else ())
        if self.tp_split > 1:
            return outer + (self.tp // self.tp_split, self.tp_split)
        return outer + (self.tp,)

    def describe(self) -> str:
        """"dp x pp x tp = 2 x 1 x 4" (with cp when it splits)."""
        names, sizes = ("dp", "pp", "cp", "tp"), (self.dp, self.pp, self.cp, self.tp)
        kept = [(n, s) for n, s in zip(names, sizes) if n != "cp" or self.cp > 1]
        return " x ".join(n for n, _ in kept) + " = " + " x ".join(str(s) for _, s in kept)

    def make_mesh(self, devices=None) -> Mesh:
        """Mesh over `devices` (default: the default backend's devices; every one of them when they belong
        to several processes, else the first `size`)."""
        if devices is None:
            devices = jax.devices()
        if len(devices) < self.size:
            platform = f"{devices[0].platform.upper()} " if len(devices) else ""
            raise ConfigError(
                f"mesh {self.describe()} = {self.size} needs {self.size} devices "
                f"but {len(devices)} {platform}devices are visible; shrink mesh.dp/pp/tp "
                f"or use --dry_run to compile on emulated devices")
        types = (AxisType.Auto,) * len(self.axis_names)
        if len({d.process_index for d in devices}) > 1:
            return Mesh(self._grid_over_processes(devices), self.axis_names, axis_types=types)
        return jax.make_mesh(self.shape, self.axis_names, axis_types=types, devices=list(devices[: self.size]))

    def _grid_over_processes(self, devices) -> np.ndarray:
        """Device grid for a multi-process job: every process's devices, tp inside a process (see module doc)."""
        processes = sorted({d.process_index for d in devices})
        if len(devices) != self.size:
            raise ConfigError(
                f"mesh {self.describe()} = {self.size} but the job's {len(processes)} processes hold {len(devices)} "
                f"devices; on several processes the mesh must use every device: set mesh.dp/pp/tp to multiply "
                f"to {len(devices)} or launch fewer processes")
        inside, across = split_over_processes(self.shape, len(devices) // len(processes))
        tp_parts = 2 if self.tp_split > 1 else 1
        if math.prod(across[-tp_parts:]) > 1 and jax.process_index() == 0:
            print(f"note: tp={self.tp} is larger than a process's {len(devices) // len(processes)} devices or does "
                  f"not divide them: tp all-reduces cross nodes", file=sys.stderr)
        return mesh_utils.create_hybrid_device_mesh(inside, across, devices, process_is_granule=True)


def split_over_processes(shape: tuple[int, ...], per_process: int) -> tuple[list[int], list[int]]:
    """(inside, across) with inside[i] x across[i] == shape[i] and prod(inside) == per_process, filled from
    the innermost axis out: the fastest axis (tp) gets the largest share of a process's devices."""
    inside, left = [1] * len(shape), per_process
    for axis in reversed(range(len(shape))):
        inside[axis] = math.gcd(shape[axis], left)
        left //= inside[axis]
    if left != 1:
        raise ConfigError(
            f"mesh {' x '.join(map(str, shape))} cannot be laid out over processes of {per_process} devices "
            f"each; make each process's device count divide tp, or tp divide it")
    return inside, [size // part for size, part in zip(shape, inside)]


# XLA:CPU aborts a collective when one of its device threads is 40 s late (its default); emulated
# devices are threads of one process that a loaded host (a test suite in parallel, grain workers) can
# starve for that long, so the trainer waits longer, has XLA name a collective that waits more than
# 30 s, and ends a really stuck run itself with one line first (jaxpar.training.watchdog). A flag the user set wins.
CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
CPU_WARN_STUCK_FLAG = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"


# XLA:CPU runs each emulated device's program on a thread of a pool of max(cores, devices) threads
# (PjRtCpuClient: "at least CpuDeviceCount threads to launch one collective"), and the thunks a
# device's program runs concurrently go to a pool of the same size. When every device but one has a
# thread blocked in a collective, the last device's concurrent work waits for a thread that never
# frees: the step hangs at 0% CPU, whatever the collective order (seen: make run's layout, 2 of 3
# concurrent 2000-step runs within 200 steps on this 2-core machine). XLA sizes both pools from
# PJRT_NPROC when it is set; jaxpar gives them THREADS_PER_DEVICE threads per emulated device.
THREADS_PER_DEVICE = 4


def emulate_cpu_devices(count: int) -> None:
    """Ask the CPU backend for `count` devices, with threads enough for all of them to block in
    collectives at once, a load-tolerant collective timeout and a warning naming a stuck collective;
    must run before the first JAX backend use. Settings the user made (PJRT_NPROC, XLA_FLAGS) win."""
    jax.config.update("jax_num_cpu_devices", max(count, 1))
    if "PJRT_NPROC" not in os.environ:
        os.environ["PJRT_NPROC"] = str(max(THREADS_PER_DEVICE * count, os.cpu_count() or 1))
    flags = os.environ.get("XLA_FLAGS", "")
    for flag, seconds in ((CPU_COLLECTIVE_TIMEOUT_FLAG, CPU_TERMINATE_S), (CPU_WARN_STUCK_FLAG, CPU_WARN_STUCK_S)):
        if flag not in flags:
            flags = f"{flags} {flag}={seconds}".strip()
    os.environ["XLA_FLAGS"] = flags


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
    """Start JAX's distributed runtime when flags or the environment ask for several processes.

    Explicit flags win; otherwise SLURM (SLURM_NTASKS > 1) or JAX's own env vars
    (JAX_COORDINATOR_ADDRESS) trigger auto-detection by `jax.distributed.initialize()`.

    A process of a multi-process run also dumps every thread's Python stack when it dies on a signal
    (faulthandler): when one process fails or hangs, the coordination service aborts the others with a
    C++ stack that does not say where in jaxpar each one was.
    """
    from_environment = int(os.environ.get("SLURM_NTASKS", "1")) > 1 or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if not (coordinator or from_environment):
        return False
    faulthandler.enable(all_threads=True)
    if coordinator:
        # CPU processes (tests, laptops) talk over gloo; GPUs use NCCL whatever this says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    else:
        jax.distributed.initialize()
    return True


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
                f"mesh {layout.describe()} = {layout.size} is larger than the {len(accelerators)} {backend.upper()} "
                f"devices here; shrink mesh.dp/pp/tp, launch on more hosts, or add --dry_run")
    cpus = jax.devices("cpu")
    if len(cpus) < layout.size:
        raise ConfigError(
            f"mesh needs {layout.size} devices but only {len(cpus)} CPU devices could be emulated "
            f"(JAX was initialised before jaxpar set jax_num_cpu_devices); run in a fresh process")
    return cpus
