"""A stuck collective on an emulated CPU mesh ends the run with one clear line, not a silent hang.

Emulated devices are threads of one process, and a collective that some device never joins (a
deadlock: jaxpar/layers/order.py says how jaxpar prevents them) leaves the main thread waiting at
0% CPU. XLA:CPU names the stuck collective after `CPU_WARN_STUCK_S` (its warn-stuck flag, set by
jaxpar.parallel.mesh.emulate_cpu_devices) and would abort the process after its terminate timeout with a
fatal log and a stack dump of every thread. The trainer's `StepWatchdog` ends the run first: when no
training step has finished for `CPU_STUCK_S`, it prints one line saying what happened and where the
last checkpoint is, and exits with status 3. The terminate timeout stays above it
(`CPU_TERMINATE_S`), and both stay long enough for a loaded machine: a test suite in two workers or
grain workers can starve one device thread for tens of seconds.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

from jaxpar.parallel.mesh import CPU_TERMINATE_S, CPU_WARN_STUCK_S  # noqa: F401  (the mesh sets XLA:CPU's flags)

CPU_STUCK_S = 600  # no step finished for this long: the run ends with one line (StepWatchdog)
assert CPU_WARN_STUCK_S < CPU_STUCK_S < CPU_TERMINATE_S
STUCK_EXIT_CODE = 3


class StepWatchdog:
    """A daemon thread that ends the process when no tracked step has finished for `limit_s` seconds.

    The loop `track`s each dispatched step with one of its outputs; the thread polls them in order
    (`jax.Array.is_ready`, which never blocks), so the steps JAX runs ahead of the host cost nothing,
    and a step counts as finished when its results exist, whatever the host is doing meanwhile."""

    def __init__(self, limit_s: float, where: str, poll_s: float = 1.0):
        self.limit_s, self.where, self.poll_s = limit_s, where, poll_s
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._finished = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxpar-step-watchdog", daemon=True)

    def __enter__(self) -> "StepWatchdog":
        self._last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def track(self, step: int, output) -> None:
        """Step `step` was dispatched; `output` (a jax.Array) is ready when it has finished."""
        with self._lock:
            if not self._pending:
                self._last = time.monotonic()  # the clock runs from when there is something to wait for
            self._pending.append((step, output))

    def _poll(self) -> float:
        """Seconds the oldest unfinished step has been waited for (0 when none is pending)."""
        with self._lock:
            while self._pending and self._pending[0][1].is_ready():
                self._finished = self._pending.popleft()[0]
                self._last = time.monotonic()
            return time.monotonic() - self._last if self._pending else 0.0

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = self._poll()
            if waited >= self.limit_s:
                after = "the first step" if self._finished is None else f"step {self._finished}"
                print(f"jaxpar: error: no training step finished for {waited:.0f} s after {after}: a collective "
                      f"of the emulated CPU mesh is stuck (XLA's 'may be stuck' lines above name it), a jaxpar "
                      f"bug to report; {self.where}", file=sys.stderr, flush=True)
                os._exit(STUCK_EXIT_CODE)
