"""One of 2 processes for tests/test_processes.py: process 1 arrives LATE_S seconds after process 0
(more than gloo's 30 s) at two points that, unmet, fail on XLA:CPU: orbax's first barrier, and the
first call of a program whose collectives connect a new group of devices. Prints "ok" at the end.

    python tests/late_process.py PORT PROCESS_ID LATE_S [unmet]
"""

import sys
import time

port, process_id, late_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
unmet = sys.argv[4:] == ["unmet"]

from jaxpar.parallel.mesh import emulate_cpu_devices, maybe_initialize_distributed  # noqa: E402

emulate_cpu_devices(2)
maybe_initialize_distributed(f"127.0.0.1:{port}", 2, process_id)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from orbax.checkpoint._src.multihost import multihost as orbax_multihost  # noqa: E402

from jaxpar.parallel.processes import CompiledTogether, barriers_outside_gloo  # noqa: E402


def arrive_late() -> None:
    if process_id == 1:
        time.sleep(late_s)


if not unmet:
    barriers_outside_gloo()
arrive_late()
orbax_multihost.sync_global_processes("late process: orbax's barrier")

mesh = jax.make_mesh((4,), ("x",))
x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("x")), lambda index: np.ones(1, np.float32))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
step = total if unmet else CompiledTogether(total, "late process: first call")
arrive_late()  # as a process whose compile of the step took LATE_S longer would
assert float(step(x)) == 4.0
print("ok", flush=True)
jax.distributed.shutdown()
