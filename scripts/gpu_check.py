"""jaxpar's GPU lane and the one command for a lent GPU (issue 45).

    make test-gpu     # = python scripts/gpu_check.py --lane: the tests marked `gpu`, on this machine's NVIDIA GPU
    make gpu-check    # = python scripts/gpu_check.py --out_dir runs/gpu_check: the lane, then bench_gpu, reported

The lane is every test marked `gpu`; they live in tests/test_on_gpu_*.py (tests/test_gpu_lane.py holds them to that).
They run under the environment a GPU run has: jaxpar's XLA flag bundle merged into XLA_FLAGS before JAX starts
(jaxpar.compiler.xla_flags, as jaxpar.train does), XLA's default optimisation (tests/conftest.py skips the test
suite's fast CPU codegen when JAXPAR_GPU_LANE=1), and no preallocation, since the tests start trainer and generation
processes on the same GPU. Without an NVIDIA GPU the lane lists its tests and fails with one line: a lane that
skips would pass green on any machine.

`gpu-check` runs each lane file in its own process, then `scripts/bench_gpu.py`, each with its own timeout inside
`--budget` (a crash or a hang costs only its own rows), and writes OUT_DIR/report.md and report.json after every
part (every test's outcome, time and what it measured; the bench's table), with the commit it ran. On one H200
(2026-12-04) the whole check took 191 s: attention 58, generation 29, training 41 (107 once its trainer runs all
completed), the bench 60; the issue's limit is 10 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python scripts/gpu_check.py` from a plain checkout (no pip install -e)

from jaxpar.compiler.xla_flags import merge, runs_on_gpu  # noqa: E402

LANE_GLOB = "test_on_gpu_*.py"
# each lane file's timeout (s): the training file trains eight tiny runs and compiles a dozen steps
PART_TIMEOUT = {"test_on_gpu_attention.py": 150, "test_on_gpu_generate.py": 150, "test_on_gpu_training.py": 300}
BENCH_MIN_S = 60  # the bench needs at least this much of the budget to be worth starting


def lane_files() -> list[pathlib.Path]:
    return sorted((REPO / "tests").glob(LANE_GLOB))


def lane_env(results: pathlib.Path | None = None) -> dict:
    """The environment of the lane's pytest processes (module docstring)."""
    env = dict(os.environ, JAXPAR_GPU_LANE="1", XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = merge(env.get("XLA_FLAGS", ""))[0]
    if results is not None:
        env["JAXPAR_LANE_RESULTS"] = str(results)
    return env


def pytest_command(files, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *extra, *map(str, files)]


def lane(argv_extra: list[str]) -> int:
    """make test-gpu: list the lane's tests; run them on a GPU, or fail with one line without one."""
    listing = subprocess.run(pytest_command(lane_files(), "--collect-only", "-q"), cwd=REPO, env=lane_env(),
                             capture_output=True, text=True)
    print(listing.stdout.strip())
    if listing.returncode != 0:
        print(listing.stderr.strip()[-3000:], file=sys.stderr)
        print("make test-gpu: the lane's tests could not be collected (above)", file=sys.stderr)
        return listing.returncode
    on_gpu, why = runs_on_gpu()
    if not on_gpu:
        print(f"make test-gpu: needs an NVIDIA GPU and this machine has none ({why}); the tests above run only on "
              f"one (make gpu-check on a lent GPU)", file=sys.stderr)
        return 1
    return subprocess.run(pytest_command(lane_files(), "-v", *argv_extra), cwd=REPO, env=lane_env()).returncode


# ----------------------------------------------------------------------------- make gpu-check

def run_part(command: list[str], env: dict, timeout: float, log) -> tuple[int | None, float]:
    """(exit status or None on timeout, seconds) of one part, its output appended to `log`; on timeout its whole
    process group (the trainer and generation processes a test started too) is killed."""
    log.write(f"\n===== {shlex.join(command)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    log.write(f"===== exit {code} after {time.perf_counter() - start:.1f} s\n")
    log.flush()
    return code, time.perf_counter() - start


def environment() -> dict:
    """The device, driver, jax and cuDNN versions, from a child process (this one never starts JAX)."""
    probe = ("import json, jax; d = jax.devices(); v = None\n"
             "try:\n from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version; v = check_cudnn_version()\n"
             "except Exception as e: v = f'unavailable: {e}'\n"
             "print(json.dumps({'jax': jax.__version__, 'platform': d[0].platform, 'device_kind': d[0].device_kind,"
             " 'device_count': len(d), 'cudnn': v}))")
    facts = {"python": sys.version.split()[0]}
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                              env=lane_env())
        facts.update(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                     {"probe_error": (done.stderr.strip().splitlines() or ["?"])[-1]})
    except (subprocess.TimeoutExpired, ValueError, IndexError) as error:
        facts["probe_error"] = str(error)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["nvidia_smi"] = None
    return facts


def commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def read_results(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# jaxpar GPU check ({report['date']}, commit {report['commit']})", "",
             f"- device: {env.get('device_count')} x {env.get('device_kind')} ({env.get('nvidia_smi')}); jax "
             f"{env.get('jax')}, cuDNN {env.get('cudnn')}, Python {env.get('python')}",
             f"- command: `{report['command']}`; {report['seconds']:.0f} s in all", "",
             "| test | outcome | s | measured | message |", "|---|---|---|---|---|"]
    for part in report["parts"]:
        for row in part["tests"]:
            measured = "; ".join(f"{k}: {v}" for k, v in row["measured"].items()).replace("|", "/")
            lines.append(f"| {row['test'].split('::', 1)[-1]} | {row['outcome']} | {row['seconds']:.1f} | "
                         f"{measured} | {row['message'].replace('|', '/')} |")
        if part["status"] != "ok":
            lines.append(f"| {part['name']} (whole part) | {part['status']} | {part['seconds']:.0f} | | |")
    bench = report.get("bench") or {}
    lines += ["", f"## bench_gpu ({bench.get('status', 'not run')})", ""]
    if bench.get("table_path") and pathlib.Path(bench["table_path"]).exists():
        lines.append(pathlib.Path(bench["table_path"]).read_text())
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: pathlib.Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(report))


def check(args) -> int:
    """make gpu-check: the lane file by file, then the bench, inside args.budget seconds (module docstring)."""
    start = time.perf_counter()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit(args.commit), "command": shlex.join([sys.executable, *sys.argv]),
              "environment": environment(), "parts": [], "bench": None, "seconds": 0.0}
    if report["environment"].get("platform") != "gpu" and not args.rehearse:
        print(f"make gpu-check: needs an NVIDIA GPU; JAX sees {report['environment'].get('platform')} "
              f"({report['environment'].get('probe_error', runs_on_gpu()[1])})", file=sys.stderr)
        return 1
    with open(out_dir / "log.txt", "w") as log, tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for path in [f for f in lane_files() if not args.parts or f.name in args.parts.split(",")]:
            results = pathlib.Path(tmp) / f"{path.stem}.jsonl"
            timeout = min(PART_TIMEOUT.get(path.name, 150), left() - args.bench_s)
            code, seconds = run_part(pytest_command([path], "-q", "-rfE"), lane_env(results), timeout, log)
            status = "ok" if code == 0 else "timeout" if code is None else f"exit {code}"
            report["parts"].append({"name": path.name, "status": status, "seconds": round(seconds, 1),
                                    "tests": read_results(results)})
            report["seconds"] = time.perf_counter() - start
            write(report, out_dir)
            print(f"gpu_check: {path.name}: {status} in {seconds:.0f} s", flush=True)
        bench_dir = out_dir / "bench"
        if args.no_bench:
            status, seconds = "skipped: --no_bench", 0.0
        elif left() >= BENCH_MIN_S:
            command = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--out_dir", str(bench_dir),
                       "--budget", str(int(left() - 15))] + (["--smoke"] if args.rehearse else [])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            code, seconds = run_part(command, env, left(), log)
            status = "ok" if code == 0 else "timeout" if code is None else f"exit {code}"
        else:
            status, seconds = f"skipped: {left():.0f} s of --budget left", 0.0
        report["bench"] = {"status": status, "seconds": round(seconds, 1),
                           "table_path": str(bench_dir / "bench_gpu.md"),
                           "rows": json.loads((bench_dir / "bench_gpu.json").read_text())["variants"]
                           if (bench_dir / "bench_gpu.json").exists() else []}
        print(f"gpu_check: bench_gpu: {status} in {seconds:.0f} s", flush=True)
    report["seconds"] = time.perf_counter() - start
    write(report, out_dir)
    print(markdown(report), flush=True)
    good = all(p["status"] == "ok" for p in report["parts"]) and status == "ok"
    return 0 if good else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lane", action="store_true", help="make test-gpu: the `gpu` tests in one pytest run")
    parser.add_argument("--out_dir", default=str(REPO / "runs" / "gpu_check"))
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole check")
    parser.add_argument("--bench_s", type=float, default=200, help="seconds kept for bench_gpu after the lane")
    parser.add_argument("--commit", default=None, help="the commit the tree is (default: git rev-parse)")
    parser.add_argument("--no_bench", action="store_true", help="the lane's parts only")
    parser.add_argument("--parts", default="", help="only these lane files (comma-separated names), e.g. to rerun one")
    parser.add_argument("--rehearse", action="store_true",
                        help="without a GPU: every part runs (each `gpu` test fails at its setup), the bench --smoke")
    args, extra = parser.parse_known_args(argv)
    if args.lane:
        return lane(extra)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
