"""`python -m jaxpar.train` end to end: one-line errors before compilation, a real run, a dry run.

Every CLI call is a subprocess with JAX_LOG_COMPILES=1, so any compilation would print extra lines
on stderr: an error test that sees exactly one stderr line also proves nothing was compiled.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxpar.errors import ConfigError
from jaxpar.parallel.mesh import AXES, Layout, devices_for
from jaxpar.train import parse_args

REPO = pathlib.Path(__file__).resolve().parent.parent
METRIC_KEYS = {"step", "loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s", "mfu"}


def run_cli(*args, cwd, timeout=180) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jaxpar.train", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jaxpar: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- one-line errors

CLI_MISTAKES = {
    # id: (arguments after `--config llama_tiny.py`, fragments of the one stderr line: the key and the fix)
    "tp_n_heads": (["--config.mesh.tp=3"], ["mesh.tp=3", "model.n_heads=4", "choose a tp that divides"]),
    "tp_n_kv_heads": (["--config.model.d_model=96", "--config.model.n_heads=12", "--config.model.n_kv_heads=6"],
                      ["mesh.tp=4", "model.n_kv_heads=6", "one must divide the other"]),
    "tp_d_ff": (["--config.model.d_ff=250"], ["mesh.tp=4", "model.d_ff=250", "choose a tp"]),
    "tp_vocab": (["--config.model.vocab_size=250"], ["mesh.tp=4", "model.vocab_size=250", "choose a tp"]),
    "batch_dp": (["--config.train.global_batch_size=15"], ["train.global_batch_size=15", "multiple of 2"]),
    "batch_accum": (["--config.train.grad_accum=3"], ["train.grad_accum", "multiple of 6"]),
    "unknown_key": (["--config.model.d_modle=64"], ["unknown config key 'model.d_modle'", "d_model"]),
    "unknown_group": (["--config.optim.lr=1"], ["unknown config key 'optim.lr'", "train"]),
    "zero_stage": (["--config.zero.stage=4"], ["zero.stage=4", "use 0, 1, 2 or 3"]),
    "pp_n_layers": (["--config.mesh.pp=3"], ["mesh.pp=3", "model.n_layers=2", "use a pp that divides"]),
    "precision": (["--config.precision=fp16"], ["precision='fp16'", "use fp32, bf16 or fp8"]),
    "bad_int": (["--config.mesh.tp=two"], ["--config.mesh.tp=two", "an int"]),
    "bad_float": (["--config.train.lr=fast"], ["--config.train.lr=fast", "a float"]),
    "not_config_flag": (["--lr=3"], ["'--lr=3'", "--config.KEY=VALUE"]),
    "positional": (["mesh.tp=2"], ["'mesh.tp=2'", "--config.KEY=VALUE"]),
    "no_value": (["--config.mesh.tp", "4"], ["--config.mesh.tp=VALUE"]),
    "bad_flag_value": (["--num_processes=many"], ["--num_processes", "usage"]),
}


@pytest.mark.parametrize("extra,fragments", CLI_MISTAKES.values(), ids=CLI_MISTAKES.keys())
def test_mistakes_are_one_line_and_exit_2(extra, fragments, tmp_path):
    # Run from a tmp cwd: the bare name must still resolve to the repo's configs/.
    proc = run_cli("--config", "llama_tiny.py", *extra, "--workdir", tmp_path / "wd", cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "wd").exists()  # refused before anything was written


def test_mistake_from_the_repo_cwd_with_a_bare_name():
    proc = run_cli("--config", "llama_tiny", "--config.mesh.tp=3", "--workdir", "/nonexistent-never-created",
                   cwd=REPO)
    assert_one_line_error(proc, "mesh.tp=3", "model.n_heads=4")


def test_missing_config_file(tmp_path):
    proc = run_cli("--config", "no_such_config", cwd=tmp_path)
    assert_one_line_error(proc, "'no_such_config' not found", "llama_tiny.py")


def test_missing_config_flag(tmp_path):
    assert_one_line_error(run_cli("--dry_run", cwd=tmp_path), "--config", "usage")


def test_unknown_key_inside_a_config_file(tmp_path):
    path = tmp_path / "my_config.py"
    path.write_text("import ml_collections\n\n\ndef get_config():\n    c = ml_collections.ConfigDict()\n"
                    "    c.mesh = dict(dp=1, tp=1)\n    c.train = dict(steps=2, sead=1)\n    return c\n")
    proc = run_cli("--config", path, cwd=REPO)
    assert_one_line_error(proc, "unknown config key 'train.sead'", "seed")


def test_unwritable_workdir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_cli("--config", "llama_tiny", "--workdir", blocker / "run", cwd=tmp_path)
    assert_one_line_error(proc, f"--workdir {blocker / 'run'}", "writable directory")


def test_pipeline_mistakes_are_one_line_errors(tmp_path):
    proc = run_cli("--config", "llama_tiny", "--config.mesh.pp=2", "--config.pipeline.schedule=zigzag",
                   "--workdir", tmp_path / "wd", cwd=tmp_path)
    assert_one_line_error(proc, "pipeline.schedule='zigzag'", "1f1b, gpipe")
    proc = run_cli("--config", "llama_tiny", "--config.mesh.dp=1", "--config.mesh.pp=2", "--config.pipeline.microbatches=3",
                   "--workdir", tmp_path / "wd", cwd=tmp_path)
    assert_one_line_error(proc, "global_batch_size=16", "mesh.dp x pipeline.microbatches", "multiple of 3")
    proc = run_cli("--config", "llama_tiny", "--config.mesh.dp=1", "--config.mesh.pp=2", "--config.zero.stage=3",
                   "--workdir", tmp_path / "wd", cwd=tmp_path)
    assert_one_line_error(proc, "zero.stage=3", "mesh.pp=2", "zero.stage 0, 1 or 2")


def test_cli_flags_are_frozen():
    args, overrides = parse_args(["--config", "x.py", "--workdir", "w", "--dry_run", "--config.mesh.tp=2",
                                  "--config.train.lr=0.1"])
    assert (args.config, args.workdir, args.dry_run) == ("x.py", "w", True)
    assert overrides == ["mesh.tp=2", "train.lr=0.1"]
    args, overrides = parse_args(["--config=y"])
    assert (args.config, args.workdir, args.dry_run, overrides) == ("y", None, False, [])


# ----------------------------------------------------------------------------- device checks (in-process)


def test_make_mesh_with_too_few_devices_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as err:
        Layout(dp=1, pp=1, tp=4).make_mesh(jax.devices()[:2])
    message = str(err.value)
    assert "\n" not in message
    for fragment in ("1 x 1 x 4 = 4 needs 4 devices", "2 CPU devices", "shrink mesh.dp/pp/tp"):
        assert fragment in message
    with pytest.raises(ConfigError, match="but 0 devices"):
        Layout(dp=2).make_mesh([])


def test_make_mesh_axis_order_puts_tp_fastest():
    mesh = Layout(dp=2, pp=1, tp=4).make_mesh()
    assert mesh.axis_names == AXES == ("dp", "pp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "tp": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    assert [d.id for d in mesh.devices[1, 0, :]] == [d.id for d in jax.devices()[4:8]]  # one tp group


def test_too_few_accelerators_refused_unless_dry_run(monkeypatch):
    """The GPU case, emulated: 2 'GPUs' for a 4-device mesh."""
    real_devices = jax.devices
    fake_gpus = real_devices()[:2]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: fake_gpus if backend is None else real_devices(backend))
    with pytest.raises(ConfigError) as err:
        devices_for(Layout(tp=4), dry_run=False)
    assert "\n" not in str(err.value)
    assert "larger than the 2 GPU devices" in str(err.value) and "--dry_run" in str(err.value)
    assert len(devices_for(Layout(tp=4), dry_run=True)) >= 4  # a dry run compiles on emulated CPU devices
    assert devices_for(Layout(tp=2), dry_run=False) == fake_gpus


# ----------------------------------------------------------------------------- real runs


def read_metrics(workdir: pathlib.Path) -> list[dict]:
    """The train-step records (llama_tiny also evaluates at the last step: tests/test_train_data.py)."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


def test_short_training_run(tmp_path):
    workdir = tmp_path / "run"
    proc = run_cli("--config", "llama_tiny.py", "--config.train.steps=5", "--config.train.log_every=1",
                   "--workdir", workdir, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = read_metrics(workdir)
    assert len(records) == 5
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for record in records:
        assert METRIC_KEYS <= set(record), record
        assert record["mfu"] is None  # no peak FLOP/s for CPUs
        for key in ("loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s"):
            assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record)
        assert record["step_time_s"] > 0 and record["tokens_per_s"] > 0 and record["grad_norm"] > 0
    assert 0 < records[0]["loss"] < 2 * math.log(256)  # about ln(vocab) at init
    events = list((workdir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and b"loss" in events[0].read_bytes()
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["train"]["steps"] == 5 and saved["mesh"] == {"dp": 2, "pp": 1, "tp": 4, "sequence_parallel": False, "cp": 1,
                                                              "cp_strategy": "all_gather", "collective_matmul": "auto"}


@pytest.mark.slow  # make test's 15-minute budget (test_short_training_run trains dp 2 x tp 4 through the CLI)
def test_tp4_mesh_emulates_its_devices(tmp_path):
    """(dp, pp, tp) = (1, 1, 4) needs 4 devices: the CPU host emulates them; no flag beyond the override."""
    workdir = tmp_path / "tp4"
    proc = run_cli("--config", "llama_tiny", "--config.mesh.dp=1", "--config.mesh.tp=4", "--config.train.steps=2",
                   "--config.train.log_every=1", "--workdir", workdir, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(workdir)] == [1, 2]
    saved_mesh = json.loads((workdir / "config.json").read_text())["mesh"]
    assert saved_mesh == {"dp": 1, "pp": 1, "tp": 4, "sequence_parallel": False, "cp": 1, "cp_strategy": "all_gather",
                          "collective_matmul": "auto"}


def test_dry_run_report(tmp_path):
    workdir = tmp_path / "dry"
    proc = run_cli("--config", "llama_tiny.py", "--dry_run", "--workdir", workdir, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((workdir / "dry_run.json").read_text())
    for key in ("devices", "mesh", "param_count", "per_device_bytes", "analytic_bytes", "collectives", "compile_s"):
        assert key in report, key
    assert report["devices"] == 8 and report["mesh"] == {"dp": 2, "pp": 1, "tp": 4}
    assert isinstance(report["param_count"], int) and report["param_count"] > 0
    per_device = report["per_device_bytes"]
    for key in ("params", "opt_state", "argument", "output", "temp", "peak"):
        assert isinstance(per_device[key], int) and per_device[key] >= 0, key
    assert per_device["params"] > 0 and per_device["peak"] >= per_device["params"]
    assert report["compile_s"] > 0
    assert not (workdir / "metrics.jsonl").exists()  # a dry run trains nothing


@pytest.mark.parametrize("env,flag,expected", [
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, None, 2),  # SLURM auto-detection: the flag is not given
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "3"}, None, 0),  # one SLURM task: a single-process run
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, 1, 1),  # an explicit --process_id wins
    ({"JAX_PROCESS_ID": "1"}, None, 1),
    ({}, None, 0),
])
def test_process_index_is_known_before_jax_starts(monkeypatch, env, flag, expected):
    """Issue 18: under SLURM every process used to think it was primary and generate the demo data."""
    from jaxpar.train import launch_process_index

    for key in ("SLURM_NTASKS", "SLURM_PROCID", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_process_index(flag) == expected


def test_only_process_zero_generates_demo_data_under_slurm(monkeypatch, tmp_path):
    from jaxpar import train
    from jaxpar.data import demo

    calls = []

    def fake_ensure(config, is_primary=True):
        calls.append(is_primary)
        raise SystemExit(0)  # stop before JAX starts

    monkeypatch.setattr(demo, "ensure_demo_data", fake_ensure)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for procid in ("1", "0"):
        monkeypatch.setenv("SLURM_PROCID", procid)
        with pytest.raises(SystemExit):
            train.run(["--config", "llama_tiny.py", "--workdir", str(tmp_path / procid)])
    assert calls == [False, True]


def test_a_reader_that_stops_early_gets_no_traceback():
    """`python -m jaxpar.plan ... | head -1`: the pipe closes while the planner still prints."""
    script = ("import sys; from jaxpar.cli import main_with_one_line_errors\n"
              "def run(argv):\n    for i in range(100000):\n        print('layout', i)\n    return 0\n"
              "sys.exit(main_with_one_line_errors(run, []))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "layout 0\n"
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == ""
