"""Checkpoints: exact resume, resharded resume, NaN guard, preemption, wrong-model refusal."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, free_port, launch_failure, make_config
from jaxpar.parallel.checkpoint import _model_fingerprint, fingerprint_mismatch
from jaxpar.config import CheckpointConfig, DebugConfig, PipelineConfig, load_config
from jaxpar.errors import ConfigError
from jaxpar.training.loop import TrainingStopped, train


def with_checkpoints(config, every, keep=20):
    return dataclasses.replace(config, checkpoint=CheckpointConfig(every=every, keep=keep))


def drop_checkpoints_after(workdir, step):
    for path in (workdir / "checkpoints").iterdir():
        if path.name.isdigit() and int(path.name) > step:
            shutil.rmtree(path)


def logged(workdir):
    """The train-step records of metrics.jsonl (evaluation records, tests/test_train_data.py, left out)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def test_resume_is_bit_identical_on_the_same_layout(tmp_path):
    config = with_checkpoints(make_config(dp=2, tp=4, stage=1, steps=8, lr=3e-3), every=3)
    full = [r["loss"] for r in train(config, builder_for(config).mesh, tmp_path, show_progress=False)]
    drop_checkpoints_after(tmp_path, 3)  # as if the run had stopped right after step 3's checkpoint
    resumed = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert [r["step"] for r in resumed] == [4, 5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == full[3:]  # bit-identical
    assert [r["step"] for r in logged(tmp_path)] == list(range(1, 9))  # no step logged twice


def test_checkpoint_restores_onto_another_layout(tmp_path):
    """(4,1,2) ZeRO-1 -> (2,2,2) ZeRO-2 with 1F1B: the checkpoint holds global arrays."""
    first = with_checkpoints(make_config(dp=4, tp=2, stage=1, steps=6, lr=3e-3), every=3)
    full = [r["loss"] for r in train(first, builder_for(first).mesh, tmp_path, show_progress=False)]
    drop_checkpoints_after(tmp_path, 3)
    second = dataclasses.replace(make_config(dp=2, pp=2, tp=2, stage=2, steps=6, lr=3e-3),
                                 pipeline=PipelineConfig(schedule="1f1b", microbatches=2))
    resumed = train(with_checkpoints(second, every=3), builder_for(second).mesh, tmp_path, show_progress=False)
    np.testing.assert_allclose([r["loss"] for r in resumed], full[3:], rtol=1e-5)


@pytest.mark.slow  # resharding stays in `make test` (onto another layout); this adds the pipeline's stages
def test_checkpoint_restores_across_pipeline_and_virtual_stages(tmp_path):
    """No pipeline -> (1,2,1) interleaved (v=2, layers stored by device) -> (1,4,1): the same losses as
    one uninterrupted run, so the stored layer order is recorded and moved on each restore."""
    model = dataclasses.replace(TINY_MODEL, n_layers=4)

    def layout(dp, pp, tp, virtual=1):
        config = make_config(dp=dp, pp=pp, tp=tp, stage=1 if dp > 1 else 0, steps=6, lr=3e-3, model=model)
        if pp > 1:
            config = dataclasses.replace(config, pipeline=PipelineConfig(microbatches=pp, virtual_stages=virtual))
        return with_checkpoints(config, every=2)

    def resume(config):
        return [r["loss"] for r in train(config, builder_for(config).mesh, tmp_path, show_progress=False)]

    full = resume(layout(2, 1, 4))
    drop_checkpoints_after(tmp_path, 2)
    interleaved = resume(layout(1, 2, 1, virtual=2))
    np.testing.assert_allclose(interleaved, full[2:], rtol=1e-5)
    drop_checkpoints_after(tmp_path, 4)
    np.testing.assert_allclose(resume(layout(1, 4, 1)), full[4:], rtol=1e-5)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    config = with_checkpoints(make_config(steps=2), every=1)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, d_ff=256), train=dataclasses.replace(
        config.train, steps=4))
    with pytest.raises(ConfigError, match="different model.*fresh --workdir"):
        train(other, builder_for(other).mesh, tmp_path, show_progress=False)


def test_a_checkpoint_from_before_a_new_field_restores_when_the_field_keeps_its_default():
    vla = load_config("vla_tiny", ["vision.film=false"])
    meta = json.loads(json.dumps(_model_fingerprint(vla)))  # as saved
    del meta["vision"]["film"]  # written before vision.film existed
    meta["vision"]["pos_init"] = "normal"  # init only: free to differ, as the layout
    assert fingerprint_mismatch(meta, vla) is None
    assert fingerprint_mismatch(meta, load_config("vla_tiny")).startswith("vision (")  # film on: new weights
    meta["vision"]["width"] = 32
    assert "vision" in fingerprint_mismatch(meta, vla)


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_nan_step_is_skipped_and_counted(tmp_path):
    config = dataclasses.replace(make_config(dp=2, tp=4, steps=5), debug=DebugConfig(nan_at_step=3))
    records = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert records[-1]["skipped_total"] == 1
    assert all(np.isfinite(r["loss"]) for r in records[3:])
    stop = dataclasses.replace(config, train=dataclasses.replace(config.train, on_nan="stop", log_every=4))
    with pytest.raises(TrainingStopped, match="step 3"):  # caught although step 3 is not a logged step
        train(stop, builder_for(stop).mesh, tmp_path / "stop", show_progress=False)
    saved = sorted(int(p.name) for p in (tmp_path / "stop" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [3]  # the state after the skipped step: step 2's weights, nothing of step 4


@pytest.mark.slow  # two CLI starts
def test_sigterm_checkpoints_and_exits_cleanly_then_resumes(tmp_path):
    args = [sys.executable, "-m", "jaxpar.train", "--config", "llama_tiny", "--workdir", str(tmp_path),
            "--config.train.log_every=1", "--config.train.steps=100000"]
    proc = subprocess.Popen(args + ["--config.checkpoint.every=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # every=1: the last step is always checkpointed already (no double save)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (tmp_path / "metrics.jsonl").exists() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "preempted: checkpoint of step" in out
    saved = max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved >= 3 and logged(tmp_path)[-1]["step"] <= saved
    resume = subprocess.run(args[:-1] + [f"--config.train.steps={saved + 2}"], capture_output=True, text=True,
                            timeout=300)
    assert resume.returncode == 0, resume.stderr[-2000:]
    assert f"resuming from step {saved}" in resume.stdout
    steps = [r["step"] for r in logged(tmp_path)]
    assert steps[-2:] == [saved + 1, saved + 2] and len(steps) == len(set(steps))
    os.sync()


def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, monkeypatch):
    # Every move aside in the same second (as on a fast machine): step 4 is moved aside twice below,
    # and the second copy must not collide with the first.
    monkeypatch.setattr("jaxpar.parallel.checkpoint.time", types.SimpleNamespace(time=lambda: 1796629135.0))
    config = with_checkpoints(make_config(steps=4), every=2)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    for path in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=5))
    records = train(longer, builder_for(longer).mesh, tmp_path, show_progress=False)
    assert "checkpoint" in capsys.readouterr().out and [r["step"] for r in records] == [3, 4, 5]
    for step in ("2", "3", "4", "5"):  # nothing readable at all: a clear error, never a fresh start
        for path in (tmp_path / "checkpoints" / step / "state").rglob("*"):
            if path.is_file():
                path.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no readable checkpoint"):
        train(longer, builder_for(longer).mesh, tmp_path, show_progress=False)
    moved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if "unreadable" in p.name)
    assert moved == ["2.unreadable.1796629135", "4.unreadable.1796629135", "4.unreadable.1796629135.1",
                     "5.unreadable.1796629135"]  # nothing lost


def test_a_restore_that_runs_out_of_memory_propagates_and_moves_nothing(tmp_path, monkeypatch):
    """Only unreadable files make a checkpoint 'unreadable': an out-of-memory error during a
    (resharded) restore is the layout's problem, not the checkpoint's, and must not cost it."""
    from jaxpar.training import loop
    from jaxpar.parallel.checkpoint import Checkpointer

    config = with_checkpoints(make_config(steps=2), every=2)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=3))

    def out_of_memory(self, abstract_state, step=None):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB")

    monkeypatch.setattr(Checkpointer, "restore", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        train(longer, builder_for(longer).mesh, tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    assert loop.is_unreadable(FileNotFoundError("state/array_metadatas")) and loop.is_unreadable(ValueError("bad"))
    assert not loop.is_unreadable(MemoryError()) and not loop.is_unreadable(TypeError("a bug"))


@pytest.mark.slow  # make test's 15 minutes; it trains two processes like one in tests/test_context_processes.py (the ring)
def test_two_processes_train_like_one(tmp_path):
    """scripts/launch_local.sh: 2 JAX processes x 4 emulated devices (gloo over loopback) == 1 x 8."""
    common = ["--config", "llama_tiny", "--config.train.steps=3"]
    one = subprocess.run([sys.executable, "-m", "jaxpar.train", *common, "--workdir", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "launch_local.sh")
    env = {**os.environ, "PYTHON": sys.executable, "JAXPAR_PORT": str(free_port())}
    two = subprocess.run(["bash", script, "2", *common, "--workdir", str(tmp_path / "two")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert two.returncode == 0, launch_failure(two)
    assert two.stdout.count("done: step 3") == 1  # only process 0 reports
    np.testing.assert_allclose([r["loss"] for r in logged(tmp_path / "two")],
                               [r["loss"] for r in logged(tmp_path / "one")], rtol=1e-6)


@pytest.mark.slow  # a 2-process run and a resume (make test keeps test_two_processes_train_like_one)
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step_then_resumes(tmp_path):
    """A cluster may preempt one node first: the processes agree on the step to stop at (JAX's
    preemption sync point), both exit 0 after one checkpoint of that step, and the run resumes from
    it. Without the agreement the signalled process leaves the loop alone and the other hangs in
    its next collective (the test then times out)."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "launch_local.sh")
    workdir = tmp_path / "run"
    launch = subprocess.Popen(["bash", script, "2", "--config", "llama_tiny", "--workdir", str(workdir),
                               "--config.train.log_every=1", "--config.train.steps=100000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHON": sys.executable, "JAXPAR_PORT": str(free_port())},
                              start_new_session=True)
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.5)
    second = subprocess.run(["pgrep", "-f", f"{workdir} .*--process_id 1"], capture_output=True, text=True)
    os.kill(int(second.stdout.split()[0]), signal.SIGTERM)  # process 1 only
    out, err = launch.communicate(timeout=240)
    assert launch.returncode == 0, err[-2000:]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and out.count(f"preempted: checkpoint of step {saved[0]}") == 1
    assert err.count(f"Reached preemption sync point, step={saved[0]}") >= 2  # each process, the same step
    resume = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "llama_tiny", "--workdir",
                             str(workdir), f"--config.train.steps={saved[0] + 1}"],
                            capture_output=True, text=True, timeout=300)
    assert resume.returncode == 0 and f"resuming from step {saved[0]}" in resume.stdout, resume.stderr[-2000:]


@pytest.mark.slow  # a 2-process run after a 1-process one
def test_a_checkpoint_one_process_cannot_read_is_skipped_by_every_process(tmp_path):
    """Two processes restore the latest checkpoint (step 4); process 1 cannot read it, process 0 can.
    They agree: both fall back to step 2, process 0 alone moves step 4 aside and says so once, and
    the run continues 3, 4, 5 from step 2's weights. Without the agreement process 0 resumes at 4,
    process 1 at 2, and the first collective hangs (the test times out)."""
    common = ["--config", "llama_tiny", "--config.checkpoint.every=2", "--config.checkpoint.keep=5",
              "--config.train.log_every=1"]
    first = subprocess.run([sys.executable, "-m", "jaxpar.train", *common, "--config.train.steps=4",
                            "--workdir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    losses = {r["step"]: r["loss"] for r in logged(tmp_path / "run")}
    port = free_port()
    script = os.path.join(os.path.dirname(__file__), "restore_fails_on_one_process.py")
    procs = [subprocess.Popen([sys.executable, script, "4", *common, "--config.train.steps=5", "--workdir",
                               str(tmp_path / "run"), "--coordinator_address", f"127.0.0.1:{port}",
                               "--num_processes", "2", "--process_id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs[1][1][-2000:]
    out = outs[0][0] + outs[1][0]
    assert out.count("checkpoint of step 4 is unreadable (unreadable on another process)") == 1, out
    assert out.count("resuming from step 2") == 1, out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "5"]
    records = logged(tmp_path / "run")  # kept up to the restored step 2, then the resumed steps
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    # step 3's loss comes from step 2's restored weights (step 4's would also see the 5-step LR schedule)
    np.testing.assert_allclose(records[2]["loss"], losses[3], rtol=1e-6)


@pytest.mark.slow  # two CLI starts
def test_kill_9_during_async_saves_leaves_a_readable_checkpoint(tmp_path):
    """Checkpoint every step and SIGKILL the trainer mid-run: a save is almost surely in flight.
    Orbax finalises a step by renaming its temporary directory, so the resume finds a complete one."""
    args = [sys.executable, "-m", "jaxpar.train", "--config", "llama_tiny", "--workdir", str(tmp_path),
            "--config.checkpoint.every=1", "--config.checkpoint.keep=2"]
    proc = subprocess.Popen(args + ["--config.train.steps=100000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((tmp_path / "checkpoints").glob("[0-9]*"))) < 3:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.kill()
    proc.wait(timeout=60)
    complete = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert complete, "at least one complete checkpoint must survive"
    target = complete[-1] + 2
    resume = subprocess.run(args + [f"--config.train.steps={target}"], capture_output=True, text=True, timeout=300)
    assert resume.returncode == 0, resume.stderr[-2000:]
    assert "resuming from step" in resume.stdout
    assert logged(tmp_path)[-1]["step"] == target


def test_a_checkpoint_of_another_precision_is_refused_not_quarantined(tmp_path):
    config = with_checkpoints(make_config(steps=2), every=1)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    bf16 = dataclasses.replace(config, precision="bf16", train=dataclasses.replace(config.train, steps=3))
    with pytest.raises(ConfigError, match="different state"):
        train(bf16, builder_for(bf16).mesh, tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


@pytest.mark.slow  # resharding stays in `make test` (onto another layout); this adds context parallelism
def test_checkpoint_restores_across_context_parallelism(tmp_path):
    """(2, cp 2, 2) ZeRO-3 (states sharded over dp x cp), trained by the real loop -> (4,1,2) ZeRO-1
    without cp: the same losses as one uninterrupted cp run."""
    cp_run = make_config(dp=2, tp=2, stage=3, steps=6, lr=3e-3)
    cp_run = with_checkpoints(dataclasses.replace(cp_run, mesh=dataclasses.replace(cp_run.mesh, cp=2)), every=3)
    full = [r["loss"] for r in train(cp_run, builder_for(cp_run).mesh, tmp_path, show_progress=False)]
    drop_checkpoints_after(tmp_path, 3)
    second = with_checkpoints(make_config(dp=4, tp=2, stage=1, steps=6, lr=3e-3), every=3)
    resumed = train(second, builder_for(second).mesh, tmp_path, show_progress=False)
    np.testing.assert_allclose([r["loss"] for r in resumed], full[3:], rtol=1e-5)
