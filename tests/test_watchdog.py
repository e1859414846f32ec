"""Emulated CPU meshes (issue 26): threads enough for every device to wait in a collective, and a collective
that never completes ends the run with one line."""

import os
import subprocess
import sys
import textwrap

from jaxpar.training.watchdog import STUCK_EXIT_CODE

# A real deadlock: device 0 waits in a psum that device 1 (the other branch of a cond) never joins.
SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 " \\
                              "--xla_cpu_collective_call_terminate_timeout_seconds=120"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_num_cpu_devices", 2)
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxpar.training.watchdog import StepWatchdog
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    def body(x):
        return jax.lax.cond(jax.lax.axis_index("dp") == 0, lambda v: jax.lax.psum(v, "dp"), lambda v: v * 2, x)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
    healthy = jax.jit(lambda x: x + 1)
    with StepWatchdog(4, "checkpoints in WORKDIR", poll_s=0.2) as watchdog:
        for i in range(3):  # steps that finish keep it quiet
            watchdog.track(i + 1, healthy(jnp.ones(2)))
        watchdog.track(4, step(jnp.ones(2)))
        jax.block_until_ready(step(jnp.ones(2)))
    print("not reached")
""")


def test_a_stuck_collective_ends_the_run_with_one_line_naming_it():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100)
    assert run.returncode == STUCK_EXIT_CODE, run.stderr[-2000:]
    assert "not reached" not in run.stdout
    # XLA names the collective that waits (the warn-stuck flag jaxpar sets) ...
    assert "may be stuck" in run.stderr and "all reduce RendezvousKey" in run.stderr
    # ... and the run ends with jaxpar's one line, before XLA's abort and its stack dump
    errors = [line for line in run.stderr.splitlines() if line.startswith("jaxpar: error:")]
    assert len(errors) == 1 and "after step 3" in errors[0] and "checkpoints in WORKDIR" in errors[0], run.stderr
    assert "Termination timeout" not in run.stderr


POOL_SCRIPT = textwrap.dedent("""
    import os, pathlib
    from jaxpar.parallel.mesh import emulate_cpu_devices
    emulate_cpu_devices(8)
    import jax
    jax.devices()
    def name(task):
        try:
            return pathlib.Path(task, "comm").read_text().strip()
        except FileNotFoundError:  # a short-lived thread ended between the listing and the read
            return ""
    names = [name(t) for t in pathlib.Path("/proc/self/task").iterdir()]
    print(os.environ["PJRT_NPROC"], sum(name.endswith("XLAEigen") for name in names))
""")


def test_emulated_devices_get_threads_enough_to_all_wait_in_collectives():
    """XLA:CPU gives emulated devices a pool of max(cores, devices) threads: with every device but one
    blocked in a collective, the last one's concurrent work found no thread and make run's step hung
    (2 of 3 concurrent 2000-step runs). jaxpar asks for 4 threads per device (PJRT_NPROC, which this
    jaxlib reads when it creates the CPU client): 32 for 8 devices, whatever the machine's cores."""
    from jaxpar.parallel.mesh import THREADS_PER_DEVICE

    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    run = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    nproc, pool = map(int, run.stdout.split())
    assert nproc == pool == max(THREADS_PER_DEVICE * 8, os.cpu_count())
