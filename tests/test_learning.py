"""Proof of learning (issue 7), as the README's commands run it. Minutes each: marked slow
(`make test-slow`); BENCHMARKS.md records the measured curves."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def train(config: str, cwd: pathlib.Path) -> tuple[list[dict], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", str(REPO / "configs" / config),
                           "--workdir", str(cwd / "run")], cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (cwd / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval_loss" in r], time.monotonic() - start


@pytest.mark.xfail(strict=True, reason="issue 7 target not met yet: 0.891 after 3000 steps (7 min); see "
                                       "BENCHMARKS.md. Remove this marker when the run reaches 0.9.")
def test_vla_tiny_reaches_90_percent_held_out_action_accuracy_in_10_minutes(tmp_path):
    evals, seconds = train("vla_tiny.py", tmp_path)
    assert evals[-1]["eval_action_accuracy"] >= 0.9, evals[-1]
    assert seconds < 600


def test_llama_tiny_beats_the_unigram_baseline_on_held_out_files(tmp_path):
    evals, _ = train("llama_tiny.py", tmp_path)
    assert evals[-1]["eval_bits_per_byte"] < 0.75 * evals[-1]["unigram_bits_per_byte"], evals[-1]
