"""Training on real data: evaluation records, exact resume through the grain iterator state, the CLI."""

import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.parallel.checkpoint import Checkpointer
from jaxpar.config import CheckpointConfig, DataConfig, EvalConfig
from jaxpar.data.text import prepare_text, read_meta
from jaxpar.training.loop import train

REPO = pathlib.Path(__file__).resolve().parent.parent
TEXT_MODEL = dataclasses.replace(TINY_MODEL, vocab_size=264)  # byte tokenizer: 258 ids, padded for tp <= 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus (this repo's own Python sources), prepared into train / held-out shards."""
    out = tmp_path_factory.mktemp("corpus")
    prepare_text(REPO / "jaxpar", out / "train", out / "heldout", pattern="**/*.py", heldout_fraction=0.2)
    return out


def text_config(corpus, steps=4, every=2, checkpoint_every=0, **layout):
    config = make_config(model=TEXT_MODEL, steps=steps, **{"dp": 2, "tp": 4, "stage": 1, **layout})
    return dataclasses.replace(config, data=DataConfig(train=str(corpus / "train"), eval=str(corpus / "heldout")),
                               eval=EvalConfig(every=every, batches=2),
                               checkpoint=CheckpointConfig(every=checkpoint_every, keep=10))


def metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_eval_records_every_n_steps_and_at_the_end_with_bits_per_byte(corpus, tmp_path):
    config = text_config(corpus, steps=5, every=2)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    evals = [r for r in metrics(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    meta = read_meta(corpus / "heldout")
    for record in evals:
        bytes_per_token = meta["bytes"] / meta["tokens"]
        assert record["eval_bits_per_byte"] == pytest.approx(record["eval_loss"] / math.log(2) / bytes_per_token)
        assert record["unigram_bits_per_byte"] == meta["unigram_bits_per_byte"]
        assert 0 <= record["eval_accuracy"] <= 1
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # held-out loss falls while training
    assert evals[0]["eval_loss"] < math.log(TEXT_MODEL.vocab_size) + 0.5


def test_resume_reads_exactly_the_batches_an_uninterrupted_run_reads(corpus, tmp_path):
    """The grain iterator's position is in the checkpoint: resumed losses are bit-identical."""
    config = text_config(corpus, steps=6, every=0, checkpoint_every=3)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, eval=""))
    full = [r["loss"] for r in train(config, builder_for(config).mesh, tmp_path, show_progress=False)]
    for path in (tmp_path / "checkpoints").iterdir():
        if path.name.isdigit() and int(path.name) > 3:
            shutil.rmtree(path)
    meta = json.loads((tmp_path / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["data"] == {"grain": {"next_index": 3}}
    resumed = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == full[3:]


@pytest.mark.slow  # two CLI starts
def test_training_on_grain_data_gives_the_same_losses_on_another_layout(corpus, tmp_path):
    """(2,1,4) and (4,1,2) train on the same batches to the same losses (single process; the
    multi-shard reading itself is tested in test_data.py and by the 2-process test)."""
    losses = []
    for index, layout in enumerate((dict(dp=2, tp=4), dict(dp=4, tp=2))):
        config = text_config(corpus, steps=3, every=0, **layout)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, eval=""))
        losses.append([r["loss"] for r in train(config, builder_for(config).mesh, tmp_path / str(index),
                                                 show_progress=False)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "jaxpar.train", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # vla_tiny's whole demo; tests/test_learning.py runs it too
@pytest.mark.extra  # CI: test_learning's vla_tiny run generates its data and evaluates; test_vla_state trains and
# rolls out on a LeRobot split through the CLI
def test_vla_tiny_generates_its_data_on_first_use_and_evaluates(tmp_path):
    """The shipped demo with data.demo_format=lerobot: its data written as a LeRobot v3.0 dataset on
    first use, read back through the LeRobot reader (action bins from its stats.json), with held-out
    metrics and closed-loop rollouts at each evaluation."""
    proc = run_cli("--config", REPO / "configs" / "vla_tiny.py", "--config.train.steps=4", "--config.eval.every=2",
                   "--config.train.log_every=1", "--config.eval.rollouts=16", "--config.data.demo_format=lerobot",
                   "--config.data.train=data/vla_tiny_lerobot/train", "--config.data.eval=data/vla_tiny_lerobot/heldout",
                   "--workdir", tmp_path / "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = tmp_path / "data" / "vla_tiny_lerobot"
    info = json.loads((data / "train" / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == 4000
    assert not list(data.glob("*.partial-*"))
    evals = [r for r in metrics(tmp_path / "run") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"eval_action_accuracy", "eval_action_l1", "eval_action_accuracy_by_dim", "eval_success_rate",
            "eval_steps_to_success"} <= set(evals[-1])
    assert "eval_action_accuracy" in proc.stdout and "success_rate" in proc.stdout  # the summary line
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["actions"]  # bins from stats.json
    assert saved["normalization"] == "quantile" and saved["q01"][:2] == [-1.0, -1.0] and saved["q99"][2:6] == [0.0] * 4


@pytest.mark.parametrize("key", ["train", "eval"])
def test_a_missing_data_directory_is_a_one_line_error(key, tmp_path):
    for split in ("train", "eval"):  # both present, then one of them missing
        (tmp_path / split).mkdir()
        (tmp_path / split / "meta.json").write_text("{}")
    proc = run_cli("--config", "llama_tiny", "--config.data.generate=false", "--config.data.train=train",
                   "--config.data.eval=eval", f"--config.data.{key}=nowhere", "--workdir", tmp_path / "run",
                   cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"data.{key}=nowhere: no such directory" in lines[0] and "data.generate=true" in lines[0]


def test_checkpointer_meta_round_trips_the_data_state(tmp_path):
    config = make_config(steps=1)
    builder = builder_for(config)
    checkpoints = Checkpointer(tmp_path, config)
    checkpoints.save(1, builder.init_state(0), {"grain": {"next_index": 7}})
    checkpoints.wait()
    _, step, data_state = checkpoints.restore(builder.abstract_state())
    checkpoints.close()
    assert step == 1 and data_state == {"grain": {"next_index": 7}}


@pytest.mark.slow  # three CLI starts, one with a grain worker process
def test_grain_worker_processes_feed_the_same_batches(corpus, tmp_path):
    """data.workers=1 (grain's mp_prefetch, a child process) trains to the same losses as in-process
    reading, and its checkpointed data state resumes a run without workers."""
    common = ["--config", "llama_tiny", f"--config.data.train={corpus / 'train'}", "--config.data.eval=",
              "--config.train.steps=3", "--config.train.log_every=1", "--config.checkpoint.every=2"]
    losses = []
    for workers in (0, 1):
        proc = run_cli(*common, f"--config.data.workers={workers}", "--workdir", tmp_path / str(workers), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append([r["loss"] for r in metrics(tmp_path / str(workers))])
    assert losses[0] == losses[1]
    proc = run_cli(*common[:-2], "--config.train.steps=4", "--config.data.workers=0", "--workdir", tmp_path / "1",
                   cwd=tmp_path)
    assert proc.returncode == 0 and "resuming from step 3" in proc.stdout, proc.stderr[-3000:]
