"""profile.steps=START,END: a jax.profiler trace of exactly those training steps in WORKDIR/profile."""

import gzip
import json

import jax
import pytest

from conftest import builder_for, make_config, replace
from jaxpar.config import ConfigError, ProfileConfig, load_config, profile_steps, validate
from jaxpar.training.loop import train
from jaxpar.training.profiling import StepProfiler


def traced_steps(workdir) -> list[int]:
    """The step numbers of the StepTraceAnnotation events in the run's Perfetto trace."""
    (trace,) = (workdir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return sorted(int(e["args"]["step_num"]) for e in events
                  if e.get("name") == "train" and "step_num" in e.get("args", {}))


def test_trace_covers_exactly_the_profiled_steps(tmp_path):
    config = replace(make_config(tp=2, steps=5, log_every=1), profile=ProfileConfig(steps="2,4"))
    records = train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # profiling changes nothing else
    assert len(list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))) == 1  # TensorBoard / xprof
    assert traced_steps(tmp_path) == [2, 3, 4]


def test_the_trace_waits_for_the_steps_before_start_and_for_step_end_before_stop(tmp_path, monkeypatch):
    """The loop dispatches asynchronously: the previous step's state is waited for before the trace
    starts, step END's outputs before it stops (a GPU would otherwise leave them outside the trace)."""
    events = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append(("wait", x)) or x)
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: events.append(("start",)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: events.append(("stop",)))
    profiler = StepProfiler((2, 3), tmp_path, announce=lambda line: events.append(("say", line)))
    for step in range(1, 5):
        profiler.before(step, f"state {step - 1}")
        events.append(("dispatch", step))
        profiler.after(step, f"outputs {step}")
    profiler.close()
    assert events[:7] == [("dispatch", 1), ("wait", "state 1"), ("start",), ("dispatch", 2), ("dispatch", 3),
                          ("wait", "outputs 3"), ("stop",)]
    assert events[7][0] == "say" and "profile of steps 2-3 written to" in events[7][1]
    assert events[8:] == [("dispatch", 4)]  # nothing traced after END, and close() has nothing to stop


def test_no_profile_by_default(tmp_path):
    config = make_config(steps=1)
    train(config, builder_for(config).mesh, tmp_path, show_progress=False)
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("steps,fragment", [
    ("3,2", "END=2 is before START=3; give END >= START"),
    ("-1,2", "START and END must be >= 1"),
    ("0,2", "START and END must be >= 1"),
    ("2,-3", "START and END must be >= 1"),
    ("2", "is not START,END; write e.g. --config.profile.steps=5,7"),
    ("a,b", "is not START,END"),
    ("1,2,3", "is not START,END"),
    ("2,9", "ends after train.steps=3; pick END <= 3"),
])
def test_bad_profile_steps_are_one_line_config_errors(steps, fragment):
    config = replace(make_config(), profile=ProfileConfig(steps=steps))
    with pytest.raises(ConfigError) as err:
        validate(config)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_profile_steps_from_the_command_line_override():
    config = load_config("llama_tiny", ["profile.steps=5,7"])
    assert profile_steps(config) == (5, 7)
    assert profile_steps(load_config("llama_tiny")) is None
