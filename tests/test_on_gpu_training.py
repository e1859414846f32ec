"""The GPU lane's training checks (issue 45): what only a GPU runs, trained on one and compared.

- `train.nan_guard=select` (the default on GPUs) against `cond` over steps that include a skipped NaN step: each
  leaves the state as it was, and they give the same bits (tests/test_equivalence.py checks the same on XLA:CPU,
  where `auto` is the cond), compared with XLA's deterministic GPU ops (the test says why);
- `offload.update=host` (AdamW in `compute_on('device_host')`), `offload.params` and `remat.policy=offload` (pinned
  host memory kinds): the losses of the run without, within LOSS_RTOL (the layouts' tolerance);
- llama_tiny and vla_tiny as shipped, on one device, 20 steps through `python -m jaxpar.train` on the GPU against the
  same command on XLA:CPU, in fp32 and bf16 (the GPU's bf16 runs take cuDNN attention where `auto` picks it).
  Tolerance, the largest relative difference of a step's loss: fp32 1e-4, bf16 2e-3. Measured on one H200 on
  2026-12-04 (BENCHMARKS.md, "The GPU check"): fp32 1.7e-6 (llama_tiny) and 2.7e-5 (vla_tiny), so XLA's GPU dots
  on fp32 ran at fp32, not TF32; bf16 1.1e-5 (llama_tiny, cuDNN) and 1.9e-4 (vla_tiny, cuDNN in the ViT). Each
  model's loss falls by more than 10 times its tolerance over the 20 steps (18-23%), so a wrong run cannot pass.
  The CPU side's command runs in CI (`make test-slow`: the test below);
- the XLA flag bundle (jaxpar.compiler.xla_flags) accepted by the GPU runtime: the lane runs under it, and so does
  every GPU trainer run above.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import builder_for, lane_subprocess_env, make_config
from jaxpar.compiler.xla_flags import bundle_tokens, flag_name
from jaxpar.config import DebugConfig, OffloadConfig, RematConfig
from jaxpar.parallel.step import HOST
from test_equivalence import LOSS_RTOL, batches, run

REPO = pathlib.Path(__file__).resolve().parent.parent
STEPS = 20
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3}
CASES = [("llama_tiny", "fp32"), ("llama_tiny", "bf16"), ("vla_tiny", "fp32"), ("vla_tiny", "bf16")]


# ----------------------------------------------------------------------------- the step's GPU-only forms

def guarded_run(config) -> tuple:
    """(losses, a host copy of (params, master, opt_state) after each step, the final state) over
    test_equivalence's three batches."""
    builder = builder_for(config)
    state, step = builder.init_state(config.train.seed), builder.jit_train_step()
    losses, states = [], []
    for batch in batches(config):
        state, metrics = step(state, jax.device_put(batch, builder.batch_sharding()))
        losses.append(float(metrics["loss"]))
        states.append(jax.device_get((state.params, state.master, state.opt_state)))
    return np.array(losses), states, state


def bit_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def guard_comparison() -> dict:
    """cond twice and select once, bf16 with fp32 master weights, step 2's gradients NaN: what the test asserts."""
    cond = dataclasses.replace(make_config(precision="bf16"), debug=DebugConfig(nan_at_step=2),
                               train=dataclasses.replace(make_config().train, nan_guard="cond"))
    select = dataclasses.replace(cond, train=dataclasses.replace(cond.train, nan_guard="select"))
    cond_losses, cond_states, cond_state = guarded_run(cond)
    _, cond_again, _ = guarded_run(cond)
    select_losses, select_states, select_state = guarded_run(select)
    return {"skipped": [int(cond_state.skipped), int(select_state.skipped)],
            "skip_leaves_the_state": [bit_equal(states[1], states[0]) for states in (cond_states, select_states)],
            "cond_bit_equal_to_its_rerun": bit_equal(cond_states, cond_again),
            "select_bit_equal_to_cond": bit_equal(select_states, cond_states),
            "losses": {"cond": cond_losses.tolist(), "select": select_losses.tolist()}}


DETERMINISTIC = "--xla_gpu_deterministic_ops=true"


@pytest.mark.gpu
def test_select_nan_guard_gives_the_conds_bits_on_the_gpu(record_property):
    """Each guard leaves the whole state as it was over the NaN step, and select gives cond's bits. Compared in a
    process of its own with XLA's deterministic GPU ops: without them the cond run is not bit-equal to its own
    rerun on the GPU (the first lane run, 2026-12-04: scatter-adds in atomics), so bits could not be compared."""
    env = lane_subprocess_env("gpu", XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC}".strip())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    script = "import json, conftest, test_on_gpu_training as t; print(json.dumps(t.guard_comparison()))"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO / "tests", env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key, value in result.items():
        record_property(key, str(value))
    assert result["skipped"] == [1, 1] and result["skip_leaves_the_state"] == [True, True]
    assert result["cond_bit_equal_to_its_rerun"], f"{DETERMINISTIC} did not make the cond run repeat its bits"
    assert result["select_bit_equal_to_cond"], result["losses"]


def _offloaded(kind: str):
    """(the run without offload, the run with `kind`) on one device, fp32."""
    if kind == "params":  # ZeRO-3 with full remat and prefetch, which offload.params needs
        base = dataclasses.replace(make_config(stage=3), remat=RematConfig(policy="full"))
        return base, dataclasses.replace(base, offload=OffloadConfig(params=True))
    base = make_config()
    if kind == "host_update":
        return base, dataclasses.replace(base, offload=OffloadConfig(optimizer=True, update="host"))
    return base, dataclasses.replace(base, remat=RematConfig(policy="offload"))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["host_update", "params", "remat_offload"])
def test_offload_trains_as_the_run_without(kind, record_property):
    base, offloaded = _offloaded(kind)
    _, want, _ = run(base)
    _, got, state = run(offloaded)
    record_property("losses", f"without {want.tolist()} with {got.tolist()}")
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    if kind == "host_update":
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)} == {HOST}
    if kind == "params":
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {HOST}


@pytest.mark.gpu
def test_xla_flag_bundle_is_accepted_by_the_gpu_runtime():
    """The lane runs under the bundle (scripts/gpu_check.py sets it before JAX starts, as jaxpar.train does): an
    unknown or malformed flag would have ended the process at the backend's start; a jitted step runs."""
    flags = {flag_name(token) for token in os.environ.get("XLA_FLAGS", "").split()}
    missing = [token for token in bundle_tokens() if flag_name(token) not in flags]
    assert not missing, f"the lane runs without {missing}: run it through scripts/gpu_check.py"
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    got = jax.jit(lambda a: a @ a.T)(x)
    assert jax.devices()[0].platform == "gpu" and got.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ x.T.astype(np.float64), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- the shipped configs, GPU vs CPU

def train_command(name: str, precision: str, workdir: pathlib.Path) -> list[str]:
    """`python -m jaxpar.train` for `name` as shipped, on one device, 20 steps of synthetic data, every loss logged."""
    one_device = ["--config.mesh.dp=1", "--config.mesh.pp=1", "--config.mesh.tp=1"]
    if name == "vla_tiny":
        one_device += ["--config.pipeline.microbatches=1", "--config.eval.rollouts=0"]
    return [sys.executable, "-m", "jaxpar.train", "--config", f"{name}.py", "--workdir", str(workdir), *one_device,
            f"--config.precision={precision}", f"--config.train.steps={STEPS}", "--config.train.log_every=1",
            "--config.data.train=", "--config.data.eval=", "--config.data.generate=false",
            "--config.checkpoint.every=0", "--config.compile.cache_dir="]


def start(name: str, precision: str, platform: str, root: pathlib.Path) -> tuple:
    """Start one run; (process, workdir). The CPU side gets no GPU flags; the GPU side the lane's environment."""
    workdir = root / f"{name}_{precision}_{platform}"
    env = lane_subprocess_env(platform)
    log = open(root / f"{workdir.name}.log", "w")
    proc = subprocess.Popen(train_command(name, precision, workdir), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    return proc, workdir, log


def finish(proc, workdir: pathlib.Path, log, timeout: float = 300) -> dict:
    """{'losses', 'output'} of a started run, or {'error': what went wrong} (its output's tail)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = f"killed after {timeout:.0f} s"
    log.close()
    output = pathlib.Path(log.name).read_text(errors="replace")
    if code != 0:
        return {"error": f"{workdir.name} exited {code}:\n{output[-3000:]}", "output": output}
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    if len(losses) != STEPS:
        return {"error": f"{workdir.name}: {len(losses)} losses logged, not {STEPS}", "output": output}
    return {"losses": np.array(losses), "output": output}


def run_all(cases, platforms, root: pathlib.Path) -> dict:
    """Every (case, platform) run at once (tiny models: the GPU and 16 CPU cores share them), then collected;
    a failed run is its own case's failure only."""
    started = {(name, precision, platform): start(name, precision, platform, root)
               for name, precision in cases for platform in platforms}
    return {key: finish(*value) for key, value in started.items()}


def losses_of(result: dict) -> np.ndarray:
    assert "error" not in result, result.get("error")
    return result["losses"]


@pytest.fixture(scope="module")
def gpu_and_cpu_runs(tmp_path_factory):
    return run_all(CASES, ("gpu", "cpu"), tmp_path_factory.mktemp("shipped"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,precision", CASES)
def test_shipped_config_on_the_gpu_trains_as_on_xla_cpu(name, precision, gpu_and_cpu_runs, record_property):
    gpu, cpu = gpu_and_cpu_runs[name, precision, "gpu"], gpu_and_cpu_runs[name, precision, "cpu"]
    losses_of(gpu), losses_of(cpu)
    difference = np.abs(gpu["losses"] - cpu["losses"]) / np.abs(cpu["losses"])
    record_property("max_relative_loss_difference", f"{difference.max():.2e} (tolerance {TOLERANCE[precision]:g})")
    record_property("losses", f"gpu {np.round(gpu['losses'], 4).tolist()} cpu {np.round(cpu['losses'], 4).tolist()}")
    attention = [line for line in gpu["output"].splitlines() if line.startswith("attention:")]
    record_property("attention", attention[0] if attention else "(no attention line)")
    assert "XLA flags for GPUs" in gpu["output"], "the GPU run did not apply jaxpar's XLA flag bundle"
    if precision == "bf16":  # auto picks cuDNN for the LLM (causal) or the ViT (the VLA's LLM has a prefix mask)
        assert attention and "cudnn" in attention[0], attention
    assert difference.max() <= TOLERANCE[precision], (
        f"largest relative loss difference {difference.max():.3e} over {TOLERANCE[precision]:g}; "
        f"gpu {gpu['losses'].tolist()} cpu {cpu['losses'].tolist()}")
    drop = (cpu["losses"][0] - cpu["losses"][-1]) / cpu["losses"][0]
    assert drop > 10 * TOLERANCE[precision], f"the loss fell only {drop:.1%}: the comparison cannot tell runs apart"


@pytest.mark.slow  # two 20-step trainer runs (make test's 15-minute budget; CI runs make test-slow too)
def test_the_gpu_comparisons_cpu_side_trains(tmp_path):
    """The CPU half of the comparison above, as the lane runs it, for both models: 20 losses that fall by more
    than 10 x the fp32 tolerance (the bf16 runs share the command)."""
    runs = run_all([("llama_tiny", "fp32"), ("vla_tiny", "fp32")], ("cpu",), tmp_path)
    for (name, precision, _), result in runs.items():
        losses = losses_of(result)
        drop = (losses[0] - losses[-1]) / losses[0]
        assert drop > 10 * TOLERANCE[precision], (name, losses)
