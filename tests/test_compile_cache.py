"""compile.cache_dir: JAX's persistent compilation cache, so a restarted run does not recompile.

Every run here is a fresh `python -m jaxpar.train` process (the cache only matters across processes)
with an environment cleaned of the user's own JAX cache settings: those win over compile.cache_dir
(jaxpar.train.enable_compilation_cache), and this file tests compile.cache_dir itself. HOME points
into tmp_path, so the default ~/.cache/jaxpar/xla of a run is a path this test can look at.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxpar.train import _cache_dir_problem

REPO = pathlib.Path(__file__).resolve().parent.parent
# llama_tiny's layout (dp=2 x tp=4, ZeRO-1) on synthetic data: its step takes ~20 s to compile on CPU.
TINY = ["--config", "llama_tiny", "--config.train.steps=2", "--config.train.log_every=1", "--config.data.train=",
        "--config.data.eval=", "--config.data.generate=false"]
ONE_DEVICE = TINY + ["--config.mesh.dp=1", "--config.mesh.tp=1"]  # compiles faster: for the runs that don't time
COMPILED_IN = re.compile(r"compiled in ([0-9.]+)s")
JAX_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_MAX_SIZE",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def clean_env(home: pathlib.Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in JAX_CACHE_ENV}
    return {**env, "HOME": str(home), "JAX_PLATFORMS": "cpu", **extra}


def train(*args, home: pathlib.Path, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=clean_env(home, **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def compile_seconds(proc: subprocess.CompletedProcess) -> float:
    """The step's compile time the trainer reports (jaxpar.training.loop: 'compiled in X.Xs; training')."""
    match = COMPILED_IN.search(proc.stderr)
    assert match, proc.stderr[-3000:]
    return float(match.group(1))


def losses(workdir: pathlib.Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def entries(cache: pathlib.Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.exists() else set()


@pytest.mark.slow  # two CLI starts (make test's 15-minute budget)
def test_second_start_loads_the_step_from_the_cache_and_an_empty_key_writes_nothing(tmp_path):
    cache, home = tmp_path / "xla", tmp_path / "home"
    first = train(*TINY, f"--config.compile.cache_dir={cache}", "--workdir", tmp_path / "one", home=home)
    assert f"compilation cache: {cache} (compile.cache_dir)" in first.stdout
    written = entries(cache)
    assert any(name.startswith("jit_train_step-") for name in written), written
    assert any(name.startswith("jit__init-") for name in written), written  # small jits too (threshold 0 s)

    second = train(*TINY, f"--config.compile.cache_dir={cache}", "--workdir", tmp_path / "two", home=home,
                   JAX_LOG_COMPILES="1")
    assert "Persistent compilation cache hit for 'jit_train_step'" in second.stderr
    cold, warm = compile_seconds(first), compile_seconds(second)
    # measured on 2 busy CPU cores (load 9-12): 18-24 s cold, 1.4-1.9 s warm (tracing + lowering + a file read)
    assert warm < 0.5 * cold, (cold, warm)
    assert losses(tmp_path / "two") == losses(tmp_path / "one")  # the loaded executable computes the same
    assert entries(cache) == written  # nothing recompiled, so nothing new

    off = train(*ONE_DEVICE, "--config.compile.cache_dir=", "--workdir", tmp_path / "off", home=home,
                JAX_LOG_COMPILES="1")
    assert "compilation cache: off (compile.cache_dir is empty)" in off.stdout
    assert "Persistent compilation cache" not in off.stderr
    assert entries(cache) == written and not (home / ".cache").exists()  # neither the old dir nor the default


@pytest.mark.slow  # two CLI starts (make test's 15-minute budget)
def test_default_dir_is_per_user_and_an_unwritable_one_warns_once_and_trains(tmp_path):
    home = tmp_path / "home"
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = train(*ONE_DEVICE, f"--config.compile.cache_dir={blocker / 'xla'}", "--workdir", tmp_path / "run",
                 home=home)
    warnings = [line for line in proc.stderr.splitlines() if "compile.cache_dir" in line]
    assert warnings == [f"jaxpar: warning: compile.cache_dir={blocker / 'xla'}: the directory cannot be created "
                        f"(Not a directory); compiling without the persistent cache"], proc.stderr[-3000:]
    assert "compilation cache" not in proc.stderr  # nothing from JAX's cache: it was never turned on
    assert len(losses(tmp_path / "run")) == 2 and "done: step 2" in proc.stdout
    assert not (home / ".cache").exists()


def run_snippet(home: pathlib.Path, cache_dir: str, **env) -> list[str]:
    """enable_compilation_cache in a fresh process (JAX reads its env at import); prints what JAX got."""
    code = ("import jax; from jaxpar.train import enable_compilation_cache as e; "
            f"d = e({cache_dir!r}, True); c = jax.config; "
            "print(d, c.jax_compilation_cache_dir, c.jax_persistent_cache_min_compile_time_secs, "
            "c.jax_persistent_cache_min_entry_size_bytes, sep='|')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=clean_env(home, **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()


def test_a_cache_configured_in_jax_wins_and_env_thresholds_are_kept(tmp_path):
    home, user = tmp_path / "home", tmp_path / "users_own"
    announce, result = run_snippet(home, "~/.cache/jaxpar/xla", JAX_COMPILATION_CACHE_DIR=str(user))
    assert announce == f"compilation cache: {user} (JAX_COMPILATION_CACHE_DIR; compile.cache_dir not used)"
    assert result == f"{user}|{user}|1.0|0"  # JAX's own thresholds untouched
    assert not (home / ".cache").exists()
    announce, result = run_snippet(home, "", JAX_COMPILATION_CACHE_DIR="")
    assert result == "None||1.0|0" and "off" in announce
    # the key's "~" is the user's home; a threshold set in the environment is the user's too
    announce, result = run_snippet(home, "~/.cache/jaxpar/xla", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2.5")
    default = home / ".cache" / "jaxpar" / "xla"
    assert result == f"{default}|{default}|2.5|-1" and default.is_dir()
    announce, result = run_snippet(home, "~/.cache/jaxpar/xla", JAX_ENABLE_COMPILATION_CACHE="false")
    assert result == "None|None|1.0|0" and "JAX_ENABLE_COMPILATION_CACHE=false" in announce


def test_cache_dir_problems(tmp_path, monkeypatch):
    assert _cache_dir_problem(tmp_path / "new" / "dir", writes=True) is None and (tmp_path / "new" / "dir").is_dir()
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # the write probe leaves nothing behind
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot be created (Not a directory)" in _cache_dir_problem(blocker / "xla", writes=False)
    import tempfile

    def read_only(**kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    assert _cache_dir_problem(tmp_path, writes=True) == "the directory is not writable (Read-only file system)"
    assert _cache_dir_problem(tmp_path, writes=False) is None  # a reader (process > 0) needs no write access
