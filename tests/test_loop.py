"""The training loop in-process: logging cadence, records, and that the loss goes down."""

import json

import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.training import loop
from jaxpar.training.loop import train


def test_log_every_writes_every_nth_and_the_last_step(tmp_path):
    config = make_config(dp=2, tp=4, stage=1, steps=7, log_every=3, lr=3e-3)
    records = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert [r["step"] for r in records] == [3, 6, 7]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6, 7]
    assert all(r["step_time_s"] > 0 and np.isfinite(r["loss"]) for r in records)


def test_synthetic_task_is_learnable(tmp_path):
    config = make_config(dp=2, tp=4, stage=2, steps=30, lr=3e-3, warmup_steps=3, seq_len=32)
    records = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert records[-1]["loss"] < 0.85 * records[0]["loss"]


def test_spike_detector_flags_three_sigma_jumps_only():
    from jaxpar.training.loop import SpikeDetector

    detector = SpikeDetector(window=20)
    steady = [2.0 + 0.01 * (i % 3) for i in range(15)]
    assert all(detector.observe(i, loss) is None for i, loss in enumerate(steady))
    assert detector.observe(15, 2.02) is None  # inside the band
    warning = detector.observe(16, 3.0)
    assert warning and "step 16" in warning and "3 sigma" in warning
    assert detector.observe(17, float("nan")) is None  # NaNs are the NaN guard's business


def _evaluation_at(due_step: int, error: Exception | None = None):
    """A stand-in for loop.Evaluation: due at `due_step` only, raising `error` there (None: it passes)."""
    class StandInEvaluation:
        def __init__(self, *args):
            pass

        def due(self, step):
            return step == due_step

        def run(self, step, params):
            if error is not None:
                raise error
    return StandInEvaluation


def test_a_failing_mid_run_evaluation_keeps_the_steps_before_it(tmp_path, monkeypatch):
    """An evaluation that raises (a simulator's error, a policy wrapper's bug) goes on as an error, but only after
    the steps since the last checkpoint are saved: a rerun resumes at the evaluation's step. A Meta-World run once
    lost 30 minutes this way."""
    monkeypatch.setattr(loop, "has_evaluation", lambda config: True)
    monkeypatch.setattr(loop, "Evaluation", _evaluation_at(2, RuntimeError("the simulator broke")))
    config = make_config(dp=2, tp=4, stage=1, steps=5)
    with pytest.raises(RuntimeError, match="the simulator broke"):
        train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_an_evaluation_failing_on_another_process_saves_here_too(tmp_path, monkeypatch):
    """Every process agrees whether an evaluation failed anywhere before any saves (a collective save joined by one
    process alone would wait forever); here the other process's failure is simulated by the agreement."""
    monkeypatch.setattr(loop, "has_evaluation", lambda config: True)
    monkeypatch.setattr(loop, "Evaluation", _evaluation_at(3))
    monkeypatch.setattr(loop, "_on_any_process", lambda here: True)  # another process's evaluation failed
    config = make_config(dp=2, tp=4, stage=1, steps=5)
    with pytest.raises(RuntimeError, match="step 3: the evaluation failed on another process"):
        train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
