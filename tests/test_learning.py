"""Proof of learning (issue 7), as the README's commands run it. Minutes each: marked slow; `.ci/run`
runs them after the fast suite (`make test-learning`); BENCHMARKS.md records the measured curves."""

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
                           "--workdir", str(cwd / "run")], cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (cwd / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval_loss" in r], time.monotonic() - start


def test_vla_tiny_reaches_the_targets(tmp_path):
    """The issue-7 and issue-17 targets: held-out action-token accuracy >= 0.9 and closed-loop success >= 0.9
    (runs end at ~0.99; BENCHMARKS.md). That score counts four always-zero dims and the gripper, so the
    image-blind baseline is already 0.87: the two move dims, the only ones that need the image, must also
    be read (blind: 0.53 / 0.56). Wall time: the budget README and BENCHMARKS.md state, 15 minutes on
    this shared 2-core machine (CI's runs: 408-529 s; 7.2 min on a quiet machine, 2026-11-29)."""
    evals, seconds = train("vla_tiny.py", tmp_path)
    last = evals[-1]
    print(f"vla_tiny: {seconds:.0f} s wall")
    assert seconds < 900
    assert last["eval_action_accuracy"] >= 0.9, last
    assert min(last["eval_action_accuracy_by_dim"][:2]) >= 0.8, last
    assert last["eval_success_rate"] >= 0.9, last  # issue 17: 200 held-out scenes in closed loop


def test_llama_tiny_learns_the_held_out_files(tmp_path):
    """What a working run reaches, with a margin for noise: 1.95 bits per byte at step 2000 (BENCHMARKS.md;
    2.90 at step 250, the unigram baseline 4.45), so the bound is 2.15; the old 0.75 x unigram (3.34)
    passed runs that had hardly learned past step 250."""
    evals, _ = train("llama_tiny.py", tmp_path)
    assert evals[-1]["eval_bits_per_byte"] < 2.15, evals[-1]
    assert evals[-1]["unigram_bits_per_byte"] > 4.0, evals[-1]  # the baseline is computed, not zero
