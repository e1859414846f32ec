"""`profile.steps=START,END`: a jax.profiler trace of exactly those training steps in WORKDIR/profile.

The loop dispatches steps asynchronously, so "exactly" needs two host syncs: before step START is
dispatched the previous step's outputs are waited for (nothing earlier runs inside the trace), and
after step END is dispatched its outputs are waited for before the trace stops (all of END is in
it). Each step is wrapped in a `StepTraceAnnotation`, so TensorBoard's profile plugin (xprof) finds
the step boundaries. The trace lands in `WORKDIR/profile/plugins/profile/RUN/`: `HOST.xplane.pb`
(what TensorBoard's profile plugin and xprof read) and `perfetto_trace.json.gz` (open it at
ui.perfetto.dev). Every process writes its own host's files into the same directory.
"""

from __future__ import annotations

import contextlib
import pathlib

import jax


class StepProfiler:
    """Starts the trace before step START, stops it after step END (1-based steps, as in metrics.jsonl).

    A run resumed inside the range traces the steps it still runs; one resumed after END traces
    nothing. `close()` stops a trace a preemption or an error left open.
    """

    def __init__(self, steps: tuple[int, int] | None, workdir: pathlib.Path, announce=print):
        self.steps, self.directory, self.announce = steps, pathlib.Path(workdir) / "profile", announce
        self.active = False
        self.first = None  # the first step inside the trace

    def before(self, step: int, state) -> None:
        """Called with the number of the step about to be dispatched and the state it will consume."""
        if self.steps is None or self.active or not self.steps[0] <= step <= self.steps[1]:
            return
        jax.block_until_ready(state)  # earlier steps finish outside the trace
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active, self.first = True, step

    def annotate(self, step: int):
        """A context around one step's dispatch: the step marker TensorBoard uses, while tracing."""
        if not self.active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs) -> None:
        """Called with the step just dispatched and its outputs; stops the trace after step END."""
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(outputs)  # all of step END inside the trace
            self._stop(step)

    def close(self) -> None:
        if self.active:
            self._stop(None)

    def _stop(self, last: int | None) -> None:
        jax.profiler.stop_trace()
        self.active = False
        covered = (f"steps from {self.first} (stopped early)" if last is None else
                   f"step {last}" if last == self.first else f"steps {self.first}-{last}")
        self.announce(f"profile of {covered} written to {self.directory} (tensorboard --logdir {self.directory}, "
                      f"or perfetto_trace.json.gz in ui.perfetto.dev)")
