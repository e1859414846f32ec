"""Training a VLA on LeRobot datasets through the CLI: both layouts (v2.1, v3.0, written by the
outside-reference writers of tests/test_lerobot.py), cameras picked by data.cameras, an episode held
out by data.eval_episodes, and the action bins between the data's quantiles, kept in config.json
and in every checkpoint and used again on resume. v2.1 training and the resume test are `slow`
(the v2.1 reader is covered frame by frame in tests/test_lerobot.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.data.normalization import resolve_action_range
from jaxpar.data.pipeline import make_source
from jaxpar.errors import ConfigError

from conftest import free_port, launch_failure
from test_lerobot import STATS_SHIFT, TOP, WRIST, actions_of, write_v21, write_v30

STEPS = 30


def train_cli(workdir, data, steps=STEPS, extra=()):
    args = [sys.executable, "-m", "jaxpar.train", "--config", "vla_tiny", "--workdir", str(workdir),
            "--config.mesh.dp=1", "--config.mesh.pp=2", "--config.mesh.tp=2", f"--config.train.steps={steps}",
            "--config.train.global_batch_size=4", "--config.train.log_every=1", "--config.train.lr=3e-3",
            "--config.train.warmup_steps=0", f"--config.data.train={data}", "--config.data.eval=",
            "--config.data.generate=false", "--config.data.eval_episodes=1", "--config.eval.every=0",
            f"--config.data.cameras={WRIST},{TOP}", "--config.vision.cameras=2", "--config.model.n_layers=2",
            *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a VLA trained through the CLI (both layouts; make test's 15-minute budget)
@pytest.mark.parametrize("version,writer", [("v2.1", write_v21), ("v3.0", write_v30)])
def test_a_vla_trains_on_a_lerobot_dataset(tmp_path, version, writer):
    data = tmp_path / "data"
    data.mkdir()
    writer(data)
    run = train_cli(tmp_path / "run", data)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])  # 11 training frames: memorised fast
    assert "eval_action_accuracy" in records[-1]  # the held-out episode was evaluated
    # v3.0: the bins split stats.json's q01 / q99 (which the fixture shifts off the true quantiles);
    # v2.1 has only per-episode stats, so they are computed from the actions and cached in the workdir
    has_stats = (data / "meta" / "stats.json").is_file()
    assert has_stats == (version == "v3.0") and (tmp_path / "run" / "action_stats.json").is_file() != has_stats
    shift = STATS_SHIFT if has_stats else 0.0
    actions = np.concatenate([actions_of(e) for e in range(3)])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["actions"]
    assert saved["normalization"] == "quantile"
    np.testing.assert_allclose(saved["q01"], np.quantile(actions, 0.01, axis=0) + shift, rtol=1e-6)
    np.testing.assert_allclose(saved["q99"], np.quantile(actions, 0.99, axis=0) + shift, rtol=1e-6)


@pytest.mark.slow  # three CLI starts; the range's checkpoint check is also what every resume runs
def test_resume_keeps_the_bins_its_checkpoints_were_trained_with(tmp_path):
    """The data's statistics change between runs (a re-exported dataset): the resumed run keeps the
    range of its checkpoints rather than re-binning under trained weights."""
    data = tmp_path / "data"
    data.mkdir()
    write_v30(data)
    first = train_cli(tmp_path / "run", data, steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    before = json.loads((tmp_path / "run" / "config.json").read_text())["actions"]
    stats = json.loads((data / "meta" / "stats.json").read_text())
    stats["action"]["q99"] = [v + 1.0 for v in stats["action"]["q99"]]
    (data / "meta" / "stats.json").write_text(json.dumps(stats))
    resumed = train_cli(tmp_path / "run", data, steps=3)
    assert resumed.returncode == 0 and "resuming from step 2" in resumed.stdout, resumed.stderr[-3000:]
    after = json.loads((tmp_path / "run" / "config.json").read_text())["actions"]
    assert after["q99"] == before["q99"] and after["q01"] == before["q01"]
    other = ["--config.actions.q01=" + ",".join(["-1"] * 7), "--config.actions.q99=" + ",".join(["1"] * 7)]
    refused = train_cli(tmp_path / "run", data, steps=4, extra=other)  # the checkpoint's range is recorded in it
    assert refused.returncode == 2 and "was trained with action bins between" in refused.stderr, refused.stderr[-3000:]
    fresh = resolve_action_range(load_config("vla_tiny", [f"data.train={data}", "data.eval=", "data.generate=false"]),
                                 tmp_path / "fresh")  # a new run reads the new statistics
    np.testing.assert_allclose(fresh.actions.q99, np.array(before["q99"]) + 1.0, rtol=1e-6)


def test_quantile_bins_for_jaxpar_episodes_are_computed_once_and_cached(tmp_path, monkeypatch):
    """normalization=quantile on an episode directory (no stats file): the quantiles of every
    action, written to WORKDIR/action_stats.json and read from there on the next start; `auto`
    keeps jaxpar's own episodes on the fixed [-1, 1] bins."""
    from jaxpar.data import normalization
    from jaxpar.data.episodes import write_split

    write_split(tmp_path / "train", 12, seed=3, size=16, grid=4, dims=7)
    overrides = [f"data.train={tmp_path / 'train'}", "data.eval=", "data.generate=false"]
    auto = resolve_action_range(load_config("vla_tiny", overrides), tmp_path / "w")
    assert auto.actions.q01 == () and auto.actions.normalization == "auto"
    config = load_config("vla_tiny", overrides + ["actions.normalization=quantile"])
    resolved = resolve_action_range(config, tmp_path / "w")
    actions = np.concatenate([np.load(p)["actions"] for p in sorted((tmp_path / "train").glob("*.npz"))])
    np.testing.assert_allclose(resolved.actions.q01, np.quantile(actions, 0.01, axis=0))
    np.testing.assert_allclose(resolved.actions.q99, np.quantile(actions, 0.99, axis=0))
    assert resolved.actions.q01[2:6] == resolved.actions.q99[2:6] == (0.0,) * 4  # padded dims never vary
    monkeypatch.setattr(normalization, "compute_quantiles", lambda directory: pytest.fail("not cached"))
    assert resolve_action_range(config, tmp_path / "w").actions == resolved.actions
    with pytest.raises(ConfigError, match="are for LeRobot datasets"):  # never a silent eval on train episodes
        make_source(load_config("vla_tiny", overrides + ["data.eval_episodes=2"]), str(tmp_path / "train"))


@pytest.mark.slow  # two 2-process starts
def test_two_processes_train_on_lerobot_and_restart_with_one_writer_per_file(tmp_path):
    """Issue 26: in a 2-process run (scripts/launch_local.sh) each file has one writer and is never
    read half-written: process 0 writes config.json, action_stats.json (a v2.1 dataset has no stats
    file, so the range is computed) and metrics.jsonl, each whole (a temporary file renamed over the
    target); the restarted run reads them back and resumes."""
    import os

    data = tmp_path / "data"
    data.mkdir()
    write_v21(data)
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "launch_local.sh")

    def launch(steps):
        flags = ["--config", "vla_tiny", "--workdir", str(tmp_path / "run"), "--config.mesh.dp=1",
                 "--config.mesh.pp=2", "--config.mesh.tp=2", f"--config.train.steps={steps}",
                 "--config.train.global_batch_size=4", "--config.train.log_every=1", "--config.checkpoint.every=2",
                 f"--config.data.train={data}", "--config.data.eval=", "--config.data.generate=false",
                 "--config.data.eval_episodes=1", "--config.eval.every=0", f"--config.data.cameras={WRIST},{TOP}",
                 "--config.vision.cameras=2", "--config.model.n_layers=2"]
        return subprocess.run(["bash", script, "2", *flags], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHON": sys.executable, "JAXPAR_PORT": str(free_port())})

    first = launch(2)
    assert first.returncode == 0, launch_failure(first)
    second = launch(4)
    assert second.returncode == 0 and second.stdout.count("resuming from step 2") == 1, launch_failure(second)
    run = tmp_path / "run"
    stats = json.loads((run / "action_stats.json").read_text())
    saved = json.loads((run / "config.json").read_text())["actions"]
    assert saved["q01"] == stats["q01"] and saved["q99"] == stats["q99"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # one writer; kept up to the checkpoint
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]  # each run's final evaluation
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind
