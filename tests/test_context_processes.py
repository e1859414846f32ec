"""Context parallelism across processes (issue 48 item 3): a cp group that spans JAX processes (nodes on
a GPU cluster; here processes on loopback, gloo carrying the collectives) trains like one device, and
processes whose copies of the data differ stop before the first step, in one line.

Each run is `python -m jaxpar.train` (scripts/launch_local.sh for the multi-process ones) on llama_tiny's
byte-level text, read through grain by every process; with one device per process or tp filling a
process, every cp group here has its ranks on different processes (tests/test_mesh_order.py checks the
placement)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port, launch_failure

REPO = Path(__file__).resolve().parent.parent
GQA_TINY = ["--config", "llama_tiny", "--config.train.steps=3", "--config.train.log_every=1",
            "--config.model.n_kv_heads=2"]  # 4 query heads share 2 KV heads


def launch(processes: int, flags: list[str], workdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "JAXPAR_PORT": str(free_port())}
    return subprocess.run(["bash", str(REPO / "scripts" / "launch_local.sh"), str(processes), *flags,
                           "--workdir", str(workdir)], capture_output=True, text=True, timeout=600, env=env)


def one_device(flags: list[str], workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpar.train", *flags, "--config.mesh.dp=1", "--config.mesh.tp=1",
                           "--workdir", str(workdir)], capture_output=True, text=True, timeout=300)


def losses(workdir: Path) -> dict:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in records if "loss" in r],
            "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r]}


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory) -> dict:
    """The reference every layout here is compared with: GQA_TINY on one device, run once."""
    workdir = tmp_path_factory.mktemp("one_device")
    one = one_device(GQA_TINY, workdir)
    assert one.returncode == 0, one.stderr[-2000:]
    return losses(workdir)


def assert_trains_like_one_device(processes: int, layout: list[str], want: dict, tmp_path: Path) -> None:
    spread = launch(processes, GQA_TINY + layout, tmp_path / "spread")
    assert spread.returncode == 0, launch_failure(spread)
    got = losses(tmp_path / "spread")
    assert len(got["loss"]) == 3 and len(got["eval_loss"]) == 1
    for key in want:  # fp32 losses within 1e-5 (issue 48's target); they agree to about 1e-7
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=0)


def test_a_ring_over_two_processes_trains_like_one_device(one_device_losses, tmp_path):
    """cp 2 x tp 4 on 2 processes of 4 devices: tp fills each process, so every ring step's K / V send
    crosses processes; GQA's 2 KV heads are replicated over tp 4. Train and held-out losses."""
    assert_trains_like_one_device(2, ["--config.mesh.dp=1", "--config.mesh.cp=2", "--config.mesh.tp=4",
                                      "--config.mesh.cp_strategy=ring"], one_device_losses, tmp_path)


@pytest.mark.slow  # ~25 s; the ring above is make test's
def test_ulysses_over_two_processes_trains_like_one_device(one_device_losses, tmp_path):
    """cp 2 x tp 2, ulysses: the all-to-alls cross processes; 2 KV heads repeated for cp x tp = 4."""
    assert_trains_like_one_device(2, ["--config.mesh.dp=1", "--config.mesh.cp=2", "--config.mesh.tp=2",
                                      "--config.mesh.cp_strategy=ulysses"], one_device_losses, tmp_path)


@pytest.mark.slow  # 4 processes compile a pipeline: ~45 s
def test_all_gather_cp_and_a_pipeline_over_four_processes_train_like_one_device(one_device_losses, tmp_path):
    """pp 2 x cp 2 on 4 processes of one device: the pipeline's sends and cp's gathers all cross processes."""
    assert_trains_like_one_device(4, ["--config.mesh.dp=1", "--config.mesh.pp=2", "--config.pipeline.microbatches=4",
                                      "--config.mesh.cp=2", "--config.mesh.tp=1", "--config.mesh.cp_strategy=all_gather"],
                                  one_device_losses, tmp_path)


def write_dataset(root: Path, seed: int) -> Path:
    """A byte-level text dataset of made-up words (jaxpar.data.text.prepare_text), different per seed."""
    from jaxpar.data.text import prepare_text

    words = np.random.default_rng(seed).choice(["alpha", "beta", "gamma", "delta", "cp", "ring"], (40, 60))
    source = root / "src"
    source.mkdir(parents=True)
    for i, line in enumerate(words):
        (source / f"f{i}.txt").write_text(" ".join(line) + "\n")
    prepare_text(source, root / "train", root / "heldout", heldout_fraction=0.1)
    return root / "train"


@pytest.mark.slow  # make test's 15 minutes; a one-line error, not a training check
def test_processes_of_one_cp_group_reading_different_data_stop_in_one_line(tmp_path):
    """The two ranks of a cp group read their sequences on different processes (nodes): when the nodes'
    copies of data.train differ, both processes stop before the first step with one line naming it,
    where JAX alone would train on the halves of two different batches."""
    port = free_port()
    runs = []
    for process in range(2):
        data = write_dataset(tmp_path / f"node{process}", seed=process)
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxpar.train", *GQA_TINY, "--config.mesh.dp=1", "--config.mesh.cp=2",
             "--config.mesh.tp=1", f"--config.data.train={data}", "--config.data.eval=", "--config.data.generate=false",
             "--workdir", str(tmp_path / "run"), "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
             "--process_id", str(process)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for process, run in enumerate(runs):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 2, err[-3000:]
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert errors == ["jaxpar: error: processes 0 and 1 read different records for the same batch rows (data "
                          f"shard 0) from {tmp_path / f'node{process}' / 'train'}: every process must see the same "
                          "dataset (a node-local copy that differs?); give all nodes identical data"], err[-3000:]
        assert "Traceback" not in err and "done: step" not in out
