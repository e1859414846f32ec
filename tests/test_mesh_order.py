"""Device order (issue 18 item 4): tp groups stay inside a process (node) and dp crosses processes,
whatever order the devices are listed in; the HLO report labels axes by mesh position, not Device.id."""

import jax
jax.config.update("jax_num_cpu_devices", 8)

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, PartitionSpec as P  # noqa: E402

from conftest import free_port  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.compiler.hlo_collectives import collectives  # noqa: E402
from jaxpar.parallel.mesh import AXES, Layout, split_over_processes  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the mesh construction reads of a device."""
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "fake"


def nodes(processes: int, per_process: int) -> list[FakeDevice]:
    return [FakeDevice(p * per_process + k, p) for p in range(processes) for k in range(per_process)]


def process_grid(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index, otypes=[int])(grid)


@pytest.mark.parametrize("shape,per_process,inside,across", [
    ((2, 1, 4), 4, [1, 1, 4], [2, 1, 1]),
    ((4, 1, 2), 4, [2, 1, 2], [2, 1, 1]),
    ((2, 2, 8), 8, [1, 1, 8], [2, 2, 1]),  # 4 nodes of 8: tp = a node, pp and dp across nodes
    ((4, 2, 2), 8, [2, 2, 2], [2, 1, 1]),
    ((1, 1, 16), 8, [1, 1, 8], [1, 1, 2]),  # tp larger than a node: it has to cross
    ((2, 1, 4, 2), 4, [1, 1, 2, 2], [2, 1, 2, 1]),  # a VLA's split tp axis (tp, tpv)
])
def test_split_fills_a_process_from_the_innermost_axis(shape, per_process, inside, across):
    assert split_over_processes(shape, per_process) == (inside, across)


def test_a_shape_that_no_process_split_fits_is_a_one_line_error():
    with pytest.raises(ConfigError, match="cannot be laid out over processes of 4 devices") as err:
        split_over_processes((1, 1, 6), 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dp,tp", [(2, 4), (4, 2), (8, 2)])
def test_tp_groups_stay_inside_a_process_whatever_the_device_listing(dp, tp):
    """Devices listed interleaved across processes (as a topology-ordered or shuffled list can be):
    the grid still puts each tp group on one process and spreads dp over the processes."""
    devices = nodes(processes=dp * tp // 4, per_process=4)
    random.Random(0).shuffle(devices)
    grid = Layout(dp=dp, tp=tp)._grid_over_processes(devices)
    procs = process_grid(grid)
    assert grid.shape == (dp, 1, tp) and sorted(d.id for d in grid.flat) == list(range(dp * tp))
    for row in procs.reshape(-1, tp):
        assert len(set(row)) == 1, procs  # a tp group: one process
    assert set(procs[:, 0, 0]) == set(range(dp * tp // 4))  # dp crosses every process


@pytest.mark.parametrize("dp,cp,tp,processes,per_process", [(1, 8, 8, 8, 8), (2, 4, 4, 4, 8), (1, 2, 4, 2, 4)])
def test_tp_fills_a_node_and_a_cp_group_crosses_nodes(dp, cp, tp, processes, per_process):
    """Issue 48 item 3: cp x tp beyond a node (llama7b's 1,048,576 tokens: cp 8 across 8 nodes x tp 8). Each
    tp group stays on one process and each cp group's ranks are on different processes, every one of them;
    the leftover of a node goes to cp before dp."""
    grid = process_grid(Layout(dp=dp, cp=cp, tp=tp)._grid_over_processes(nodes(processes, per_process)))
    assert grid.shape == (dp, 1, cp, tp)
    for row in grid.reshape(-1, tp):
        assert len(set(row)) == 1, grid  # a tp group: one process
    inside = per_process // tp
    for group in np.moveaxis(grid, 2, -1).reshape(-1, cp):  # a cp group: cp / inside processes, inside ranks on each
        assert sorted(np.unique(group, return_counts=True)[1]) == [inside] * (cp // inside), grid


def test_several_processes_must_use_every_device():
    with pytest.raises(ConfigError, match="on several processes the mesh must use every device") as err:
        Layout(dp=1, tp=4)._grid_over_processes(nodes(2, 4))
    assert "\n" not in str(err.value)


def test_one_process_keeps_the_listed_order():
    mesh = Layout(dp=2, tp=4).make_mesh()
    assert list(mesh.devices.flat) == jax.devices()[:8] and mesh.axis_names == AXES


def test_hlo_labels_axes_by_mesh_position_not_device_id():
    """A mesh over shuffled devices: the program's replica groups are mesh positions, so a psum over tp
    is still labelled tp (reading them as Device.id gave 'other')."""
    devices = list(jax.devices()[:8])
    random.Random(1).shuffle(devices)
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(2, 1, 4), AXES, axis_types=(AxisType.Auto,) * 3)

    def f(x):
        x = lax.psum(x, "tp") + lax.psum(x, "dp")
        return lax.ppermute(x, "dp", [(0, 1), (1, 0)])

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    text = g.lower(np.ones((4, 4), np.float32)).compile().as_text()
    got = sorted((e["op"], e["axis"]) for e in collectives(text, mesh))
    assert got == [("all-reduce", "dp"), ("all-reduce", "tp"), ("collective-permute", "dp")]


def test_two_processes_of_four_devices_keep_every_tp_group_inside_a_process(tmp_path):
    """2 JAX processes x 4 emulated CPU devices (gloo), the trainer's own device set-up: for (2,1,4) and
    (4,1,2) each tp group is one process's devices, dp crosses the processes, and the compiled
    program's tp all-reduce is labelled tp."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "mesh_over_processes.py"), str(port), str(i),
                               str(tmp_path / f"out{i}.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
    for i in range(2):
        for layout in json.loads((tmp_path / f"out{i}.json").read_text()):
            dp, tp = layout["dp"], layout["tp"]
            grid = np.asarray(layout["processes"]).reshape(dp, tp)
            assert all(len(set(row)) == 1 for row in grid), layout
            assert set(grid[:, 0]) == {0, 1}, layout
            assert layout["labels"] == ["tp"], layout


def test_emulated_devices_get_a_load_tolerant_collective_timeout_unless_the_user_set_one(monkeypatch):
    """XLA:CPU's 40 s default killed a grain-worker test when the suite ran in 2 workers on 2 cores."""
    from jaxpar.parallel.mesh import CPU_COLLECTIVE_TIMEOUT_FLAG, CPU_WARN_STUCK_FLAG, emulate_cpu_devices
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    emulate_cpu_devices(8)
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {CPU_COLLECTIVE_TIMEOUT_FLAG}=660 {CPU_WARN_STUCK_FLAG}=30"
    monkeypatch.setenv("XLA_FLAGS", f"{CPU_COLLECTIVE_TIMEOUT_FLAG}=30 {CPU_WARN_STUCK_FLAG}=5")
    emulate_cpu_devices(8)
    assert os.environ["XLA_FLAGS"] == f"{CPU_COLLECTIVE_TIMEOUT_FLAG}=30 {CPU_WARN_STUCK_FLAG}=5"
