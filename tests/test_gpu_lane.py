"""The GPU lane without a GPU (issue 45 item 5): `make test-gpu` lists its tests and fails with one line, every `gpu`
test lives where the lane looks for it, and `make gpu-check`'s parts, results and report work end to end (rehearsed
on CPU, where each `gpu` test fails at its setup). The lane's CPU-side references run in its own files, unmarked."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"
CPU_ENV = {"PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home()), "JAX_PLATFORMS": "cpu", "CI": "true"}


def gpu_tests_in_source() -> dict[str, int]:
    """{file name: number of `@pytest.mark.gpu` decorators} over every test file."""
    counts = {path.name: len(re.findall(r"^\s*@pytest\.mark\.gpu\b", path.read_text(), re.MULTILINE))
              for path in (REPO / "tests").glob("test_*.py")}
    return {name: n for name, n in counts.items() if n}


def test_every_gpu_test_is_in_a_lane_file():
    """The lane runs tests/test_on_gpu_*.py: a `gpu` test elsewhere would never run anywhere."""
    files = gpu_tests_in_source()
    assert files and all(name.startswith("test_on_gpu_") for name in files), files
    assert re.search(r"^test-gpu:.*\n\t.*scripts/gpu_check\.py --lane$", (REPO / "Makefile").read_text(), re.MULTILINE)


def test_the_lane_lists_its_tests_and_fails_in_one_line_without_a_gpu():
    done = subprocess.run([sys.executable, str(SCRIPT), "--lane"], cwd=REPO, capture_output=True, text=True,
                          env=CPU_ENV, timeout=300)
    listed = [line for line in done.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0].split("/")[-1] for line in listed} == set(gpu_tests_in_source())
    assert len(listed) >= sum(gpu_tests_in_source().values())  # parametrized tests list once per case
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "make test-gpu: needs an NVIDIA GPU and this machine has none (JAX_PLATFORMS=cpu); the tests above run "
        "only on one (make gpu-check on a lent GPU)"]


@pytest.mark.slow  # three pytest processes (make test's 15-minute budget; CI runs make test-slow too)
def test_gpu_check_rehearsed_on_cpu_reports_every_lane_test(tmp_path):
    """Each lane file in its own process, every test's outcome in report.json and report.md, the commit named;
    here every `gpu` test fails at its setup with the one line saying it needs a GPU, and the check exits 1."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--no_bench", "--out_dir", str(tmp_path),
                           "--commit", "abc1234"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=CPU_ENV)
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["commit"] == "abc1234" and report["environment"]["platform"] == "cpu"
    assert [part["name"] for part in report["parts"]] == sorted(gpu_tests_in_source())
    rows = [row for part in report["parts"] for row in part["tests"]]
    listed = subprocess.run([sys.executable, str(SCRIPT), "--lane"], cwd=REPO, capture_output=True, text=True,
                            env=CPU_ENV).stdout
    assert sorted(row["test"] for row in rows) == sorted(line for line in listed.splitlines() if "::" in line)
    assert {row["outcome"] for row in rows} == {"failed"}
    assert all(row["message"].startswith("needs an NVIDIA GPU") for row in rows), rows[0]
    table = (tmp_path / "report.md").read_text()
    assert "commit abc1234" in table and "test_cudnn_attention_matches_xla[causal-64-2] | failed" in table
