"""Processes meet before first collectives (jaxpar.parallel.processes): a 2-process CPU run whose one
process is over 30 s late (a slower compile on a loaded machine) still runs, where gloo alone gives up."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port

REPO = Path(__file__).resolve().parent.parent
LATE_S = 35  # gloo waits 30 s for a peer to connect a new group of devices


def run_pair(*extra: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "late_process.py"), str(port), str(i), str(LATE_S),
                               *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=400), *p.communicate()) for p in procs]


@pytest.mark.slow  # two late arrivals of 35 s
def test_a_process_35_s_late_at_orbax_and_at_a_first_call_still_meets_its_peer():
    for run in run_pair():
        assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
