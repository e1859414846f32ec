"""The trainer's preflight: a train step that will not fit its devices' memory stops before the state is
allocated, in one line, instead of with an allocator traceback minutes later.

The trainer compiles its step from abstract shapes before it allocates anything
(jaxpar.compiler.dry_run.compile_step: the executable it then runs, so the check costs no extra
compilation), and `check` compares the step's peak per device from XLA's memory analysis (argument +
output - alias + temp: jaxpar.compiler.dry_run.compiled_bytes, the dry run's figure) with the budget:

- `hardware.memory_gb` > 0: that many GB (1e9 bytes) per device, on any platform (CPU tests; a GPU
  shared with others), capped at the allocator's limit where the devices report one;
- else on GPUs the allocator's limit, `device.memory_stats()['bytes_limit']`: the device's memory x
  the fraction the allocator was given (jaxpar.compiler.hardware.apply_memory_fraction: USABLE_FRACTION,
  or the user's XLA_PYTHON_CLIENT_MEM_FRACTION). The device's own figure, not the hardware profile's:
  it is exactly what the allocator will hand out, under whatever fraction, on any GPU model, profiled or not;
- else (CPUs report no limit) there is nothing to check against, and no preflight.

When the peak is over the budget the line names both and the recommender's best layout for the same
model, devices and global batch whose planned peak fits the budget (jaxpar.planner.recommend, with the
planner's model of this platform's compiler), as the --config overrides to pass; or says that none fits.

Several processes: each compiles the same program, and XLA's memory analysis of a program is
deterministic, so every process reads the same peak; the budget is agreed (the smallest of all
processes'), so every process decides alike and, on the error path, all exit with status 2 together
rather than some waiting for the others in a collective.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.compiler import hardware
from jaxpar.compiler.dry_run import compiled_bytes
from jaxpar.compiler.hardware import GB
from jaxpar.config import Config, differences
from jaxpar.errors import ConfigError
from jaxpar.parallel.processes import meet
from jaxpar.planner import recommend

STAND_IN_PROFILE = "h100-80gb"  # speeds to rank layouts by where the devices match no profile (CPUs)


def check(config: Config, mesh, compiled, announce=print) -> None:
    """Raise the one-line ConfigError (exit status 2) when the compiled step's peak per device is over
    the budget; `announce` the comparison when it fits. Nothing when there is no budget (module docstring)."""
    found = budget(config, mesh)
    if found is None:
        return
    limit, source = found
    peak = compiled_bytes(compiled)["peak"]
    if peak <= limit:
        announce(f"memory: the step's compiled peak {_gb(peak)} per device fits the budget {_gb(limit)} ({source})")
        return
    raise ConfigError(f"the train step needs {_gb(peak)} per device (compiled peak: argument + output - alias + "
                      f"temp) but the budget is {_gb(limit)} ({source}); {recommendation(config, mesh, limit)}")


def budget(config: Config, mesh) -> tuple[float, str] | None:
    """(bytes per device, where that figure comes from), agreed by every process; None: no budget."""
    forced = config.hardware.memory_gb * GB
    if not forced and mesh.devices.flat[0].platform == "cpu":  # the same answer on every process: no collective
        return None
    limit = _agreed_minimum(_allocator_limit(mesh))
    if forced and (limit is None or forced <= limit):
        return forced, f"hardware.memory_gb={config.hardware.memory_gb:g}"
    if limit is None:
        return None
    capped = f"hardware.memory_gb={config.hardware.memory_gb:g} capped at " if forced else ""
    user = hardware.user_memory_fraction()
    fraction = f"{user[0]}={user[1]}" if user else "JAX's default fraction"
    return limit, f"{capped}the allocator's limit, {fraction}"


def _allocator_limit(mesh) -> float | None:
    """The smallest `bytes_limit` among this process's devices of the mesh; None where none reports one."""
    here = jax.process_index()
    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in mesh.devices.flat
              if device.process_index == here]
    known = [limit for limit in limits if limit]
    return float(min(known)) if known else None


def _agreed_minimum(value: float | None) -> float | None:
    """The smallest `value` of all processes (None counts as no limit); `value` itself with one process."""
    if jax.process_count() == 1:
        return value
    meet("the memory preflight")  # the run's first collective follows: processes compiled at their own speeds
    # float32 (JAX without x64): within 1e-7 of each limit, and the same array on every process
    values = multihost_utils.process_allgather(np.array([np.inf if value is None else value], np.float32))
    lowest = float(np.min(values))
    return None if np.isinf(lowest) else lowest


def recommendation(config: Config, mesh, limit: float) -> str:
    """The recommender's best layout of the mesh's devices other than this one whose planned peak fits
    `limit`, as the overrides that ask for it; or that there is none. (This layout can be among those
    the planner puts under the budget: its estimate is not the compiled peak.)"""
    devices = mesh.size
    per_process = sum(1 for device in mesh.devices.flat if device.process_index == jax.process_index())
    target = "cpu" if mesh.devices.flat[0].platform == "cpu" else "gpu"
    try:
        ranked = recommend.recommend(config, devices, per_process, _hardware(mesh, limit), top=2,
                                     target=target)["ranked"]
    except ConfigError:  # no layout fits (or none is valid): the recommender's own reason is about GPUs
        ranked = []
    others = [(r, differences(config, r["config"])) for r in ranked]
    others = [(r, flags) for r, flags in others if flags]
    if not others:
        return (f"the recommender finds no other layout of the {devices} devices that fits {_gb(limit)}: add "
                f"devices, or shrink train.global_batch_size, train.seq_len or the model")
    best, flags = others[0]
    return (f"the recommender's best layout of the {devices} devices that fits: {recommend.describe(best['config'])} "
            f"(planned peak {_gb(best['peak'])}): " + " ".join(f"--config.{key}={value}" for key, value in flags))


def _hardware(mesh, limit: float) -> hardware.Hardware:
    """The devices' profile (its speeds rank the layouts) with `limit` as all of its usable memory."""
    kind = mesh.devices.flat[0].device_kind
    profile = hardware.profile_for(kind) or dataclasses.replace(hardware.get(STAND_IN_PROFILE), name=kind)
    return dataclasses.replace(profile, hbm_gb=limit / GB, usable_hbm_fraction=1.0)


def _gb(n: float) -> str:
    return f"{n / GB:.4g} GB"
