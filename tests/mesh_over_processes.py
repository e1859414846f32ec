"""One of 2 processes for tests/test_mesh_order.py: build the trainer's mesh over 2 x 4 CPU devices and
write, per layout, which process owns each mesh position and how the HLO labels a psum over tp.

    python tests/mesh_over_processes.py PORT PROCESS_ID OUT_JSON
"""

import json
import sys

port, process_id, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

from jaxpar.parallel.mesh import Layout, devices_for, emulate_cpu_devices, maybe_initialize_distributed  # noqa: E402

emulate_cpu_devices(4)
maybe_initialize_distributed(f"127.0.0.1:{port}", 2, process_id)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.compiler.hlo_collectives import collectives  # noqa: E402

results = []
for dp, tp in ((2, 4), (4, 2)):
    layout = Layout(dp=dp, tp=tp)
    mesh = layout.make_mesh(devices_for(layout, dry_run=False))
    step = jax.jit(jax.shard_map(lambda x: lax.psum(x, "tp"), mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))
    text = step.lower(jax.ShapeDtypeStruct((4, 4), np.float32)).compile().as_text()
    results.append({"dp": dp, "tp": tp, "processes": [d.process_index for d in mesh.devices.flat],
                    "labels": sorted(e["axis"] for e in collectives(text, mesh))})
with open(out, "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
