"""GPU throughput of jaxpar's own train step: a ~1B Llama in bf16 at seq 2048, one subprocess per variant.

    make bench-gpu                                   # = python scripts/bench_gpu.py (writes runs/bench_gpu/)
    python scripts/bench_gpu.py [--variants cudnn-none,xla-selective] [--steps 5] [--warmup 2] [--batch 6]
    python scripts/bench_gpu.py --smoke              # tiny model on CPU, same code path (tests/test_bench_gpu.py)

Variants are names made of '-'-joined parts: an attention kernel (xla, cudnn; absent: auto), a remat
policy (none, dots, selective, full), `tpN`, `dpN`, `zeroK`, a precision (bf16, fp8; absent: bf16), `delayed`
(fp8.recipe=delayed; absent: current);
e.g. `cudnn-selective`, `cudnn-tp8`, `dp8-zero3-full`, `cudnn-selective-fp8`. `--batch` is per
data-parallel replica (global batch = batch x dp). Each variant runs
in its own process, so one that runs out of memory or time costs only its own row; its result is one
JSON line on the child's stdout. Writes OUT_DIR/bench_gpu.json and OUT_DIR/bench_gpu.md after every
variant, so a killed run keeps its rows. On GPUs the children run with jaxpar's XLA flag bundle
(jaxpar/compiler/xla_flags.py) merged into XLA_FLAGS; `--smoke` (CPU) reports variants that need a GPU
(cudnn) as skipped.

Default variants, and why (the whole run must fit 5 minutes on one H200; a variant costs ~30 s of
start-up, init, compile and 7 steps, so ~4 fit with room for a slow compile):
- cudnn with remat none / selective / full: the remat trade-off on the kernel a GPU run uses (auto
  picks cuDNN on H100 / H200), from fastest-if-it-fits to least memory;
- xla with selective only: the attention kernel's own effect at the policy that runs on both (XLA's
  none materialises the [B, N, S, S] scores, the memory cuDNN avoids; selective recomputes them);
- cudnn with selective in fp8 (precision=fp8, jaxpar.layers.fp8): FP8 GEMMs against the bf16 row of the
  same layout, the ratio issue 47 estimates from the GPU compiler (a device without FP8 tensor cores,
  A100, reports it skipped), with current and with delayed scaling (`-delayed`: fp8.recipe=delayed,
  calibrated on the first batch before timing);
- with several GPUs, also tp / ZeRO-1 / ZeRO-3 over all of them (cudnn, remat none), and ZeRO-3 in fp8;
  `--budget` skips what no longer fits. MFU counts the model's FLOPs against the dense bf16 peak in
  every row, fp8 too (as torchtitan and NeMo quote FP8 runs), so rows compare as throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python scripts/bench_gpu.py` from a plain checkout (no pip install -e)

from jaxpar.compiler.hardware import apply_memory_fraction  # noqa: E402
from jaxpar.config import (Config, Fp8Config, MeshConfig, ModelConfig, RematConfig, TrainConfig,  # noqa: E402
                           ZeroConfig, validate)

MARK = "BENCH_RESULT "  # prefix of the child's one result line on stdout
GIB = 2 ** 30
MODEL_1B = ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632)
MODEL_SMOKE = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"  # CPU compile time
REMATS = ("none", "dots", "selective", "full")
ATTENTIONS = ("xla", "cudnn")  # model.attention; a name without one runs `auto`
PRECISIONS = ("bf16", "fp8")  # precision; a name without one runs bf16
RECIPES = ("delayed",)  # fp8.recipe; a name without one runs current scaling


# ----------------------------------------------------------------------------- variants and config

def parse_variant(name: str, n_devices: int) -> dict:
    """'cudnn-dp8-zero3-full-fp8' -> {attention, remat, dp, tp, zero, precision}; zeroK without dpN spreads
    dp over the devices tp leaves."""
    spec = {"attention": "auto", "remat": "none", "dp": 1, "tp": 1, "zero": 0, "precision": "bf16", "recipe": "current"}
    explicit_dp = False
    for part in name.split("-"):
        if part in REMATS:
            spec["remat"] = part
        elif part in ATTENTIONS:
            spec["attention"] = part
        elif part in PRECISIONS:
            spec["precision"] = part
        elif part in RECIPES:
            spec["recipe"] = part
        elif m := re.fullmatch(r"(tp|dp|zero)(\d+)", part):
            spec[m[1]] = int(m[2])
            explicit_dp |= m[1] == "dp"
        else:
            raise ValueError(f"variant '{name}': unknown part '{part}' (use "
                             f"{', '.join(ATTENTIONS + REMATS + PRECISIONS + RECIPES)}, tpN, dpN, zeroK)")
    if spec["zero"] and not explicit_dp:
        spec["dp"] = max(n_devices // spec["tp"], 1)
    return spec


def default_variants(n_devices: int) -> list[str]:
    """cuDNN x the three remat policies, XLA x selective and cuDNN x selective in fp8 on one device; with
    several devices also tp and ZeRO-1/3 over all of them, ZeRO-3 in fp8 too (the module docstring says why)."""
    names = ["cudnn-none", "cudnn-selective", "cudnn-full", "xla-selective", "cudnn-selective-fp8",
             "cudnn-selective-fp8-delayed"]
    if n_devices > 1:
        names += [f"cudnn-tp{n_devices}", f"cudnn-dp{n_devices}-zero1", f"cudnn-dp{n_devices}-zero3",
                  f"cudnn-dp{n_devices}-zero3-fp8"]
    return names


def needs_gpu(spec: dict) -> str | None:
    """Why a variant cannot run without a GPU (reported as skipped on CPU), or None. fp8 runs on CPU
    (XLA:CPU upcasts FP8 dots: the code path, not the speed)."""
    return "cuDNN flash attention needs a GPU" if spec["attention"] == "cudnn" else None


def lacks_fp8(spec: dict, device_kind: str) -> str | None:
    """Why an fp8 variant cannot run on a GPU of `device_kind` (no FP8 tensor cores: jaxpar refuses
    precision=fp8 there), or None; a GPU jaxpar has no profile for is left to try."""
    from jaxpar.compiler.hardware import profile_for

    hw = profile_for(device_kind)
    if spec["precision"] == "fp8" and hw is not None and not hw.fp8_peak_flops:
        return f"precision=fp8 needs FP8 tensor cores, which {hw.name} lacks"
    return None


def make_config(spec: dict, args) -> Config:
    """The config of one variant (bf16 unless it says fp8); the global batch keeps `--batch` sequences per dp replica."""
    steps = args.warmup + args.steps
    config = Config(mesh=MeshConfig(dp=spec["dp"], tp=spec["tp"]), zero=ZeroConfig(stage=spec["zero"]),
                    precision=spec["precision"], remat=RematConfig(policy=spec["remat"]),
                    fp8=Fp8Config(recipe=spec["recipe"]),
                    model=dataclasses.replace(MODEL_SMOKE if args.smoke else MODEL_1B, attention=spec["attention"]),
                    train=TrainConfig(steps=steps, global_batch_size=args.batch * spec["dp"], seq_len=args.seq,
                                      warmup_steps=0))
    validate(config)
    return config


def peak_flops(device_kind: str, override_tflops: float) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s of one device from jaxpar.compiler.hardware, and where it came from."""
    from jaxpar.compiler.hardware import profile_for

    if override_tflops > 0:
        return override_tflops * 1e12, f"--peak_tflops {override_tflops:g}"
    if (hw := profile_for(device_kind)) is not None:
        return hw.peak_flops, f"jaxpar.compiler.hardware '{hw.name}': {hw.peak_tflops:g} TFLOP/s dense bf16"
    return None, f"no peak known for '{device_kind}': MFU not computed (pass --peak_tflops)"


# ----------------------------------------------------------------------------- child processes

def emit(record: dict) -> None:
    print(MARK + json.dumps(record), flush=True)


def probe(args) -> None:
    """Device facts for the parent, from a child, so the parent never holds GPU memory itself."""
    import jax

    devices = jax.devices()
    emit({"jax_version": jax.__version__, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
          "device_count": len(devices)})


def peak_memory_bytes(devices) -> int | None:
    """Largest peak_bytes_in_use over the mesh's devices; None where memory_stats is absent (CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    return max(peaks) if peaks and None not in peaks else None


def run_variant(args) -> None:
    """Build jaxpar's sharded step for one variant, compile it, time `steps` steps after `warmup`."""
    import jax

    from jaxpar.compiler.attention_choice import resolve_attention
    from jaxpar.data.synthetic import SyntheticData
    from jaxpar.parallel.mesh import Layout
    from jaxpar.models.flops import model_flops_per_step
    from jaxpar.parallel.step import StepBuilder

    spec = parse_variant(args.child, args.n_devices)
    config = make_config(spec, args)
    layout = Layout.for_config(config)
    if args.smoke:
        jax.config.update("jax_num_cpu_devices", layout.size)
    devices = jax.devices()[: layout.size]
    log = lambda msg: print(f"[{args.child}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    config, choice = resolve_attention(config, devices)  # cudnn where it cannot run: a one-line ConfigError
    log(choice)
    builder = StepBuilder(config, layout.make_mesh(devices))
    t0 = time.perf_counter()
    state = jax.block_until_ready(builder.init_state(config.train.seed))
    log(f"state initialised in {time.perf_counter() - t0:.1f} s on {len(devices)} x {devices[0].device_kind}")
    data = SyntheticData(config, builder.batch_sharding())
    batches = [data.batch(i) for i in range(config.train.steps)]  # made before timing: host work not timed
    t0 = time.perf_counter()
    if config.fp8_delayed:  # a fresh state's counters, as the trainer fills them (fp8_counters.calibrate)
        state = jax.block_until_ready(builder.jit_calibrate_fp8()(state, batches[0]))
    step = builder.jit_train_step().lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s")
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
        log(f"step {i + 1}/{len(batches)}: {times[-1]:.3f} s, loss {float(metrics['loss']):.4f}")
    step_s = statistics.median(times[args.warmup:])
    tokens = config.train.global_batch_size * config.train.seq_len
    peak, _ = peak_flops(devices[0].device_kind, args.peak_tflops)
    flops = model_flops_per_step(config, config.train.seq_len)
    loss, mem = float(metrics["loss"]), peak_memory_bytes(devices)
    emit({"variant": args.child, **spec, "attention": config.model.attention,  # the resolved kernel
          "devices": len(devices), "global_batch": config.train.global_batch_size,
          "compile_s": compile_s, "step_time_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s,
          "model_tflops_per_step": flops / 1e12,
          "mfu": flops / (step_s * len(devices) * peak) if peak else None,
          "peak_memory_bytes": mem, "peak_memory_gib": mem / GIB if mem is not None else None,
          "loss": loss, "loss_finite": math.isfinite(loss), "error": None})


# ----------------------------------------------------------------------------- parent

def child_env(args, probing: bool) -> dict:
    """On GPUs give the one running variant's allocator jaxpar's memory budget, as jaxpar.train does
    (jaxpar.compiler.hardware.apply_memory_fraction; JAX's default is 75%; a fraction you set wins) and
    keep the probe from reserving any. --smoke: CPU, cheap XLA optimisation and a compilation cache shared by
    the run's children (the remat variants share their init program): compiling is all its time."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if args.smoke:
        env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=args.cache_dir,
                   XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip())
    elif getattr(args, "gpu_xla_flags", None) is not None:  # the probe saw GPUs: jaxpar's bundle, user flags win
        env["XLA_FLAGS"] = args.gpu_xla_flags
    if probing:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        apply_memory_fraction(env)
    return env


def child_args(args) -> list[str]:
    flags = ["--batch", args.batch, "--seq", args.seq, "--steps", args.steps, "--warmup", args.warmup,
             "--peak_tflops", args.peak_tflops] + (["--smoke"] if args.smoke else [])
    return [str(f) for f in flags]


def spawn(args, flags: list[str], timeout: float, probing: bool = False) -> dict:
    """Run a child; its result line, or {'error': last stderr line (or the timeout)}. A failing child's
    stderr tail goes to our stderr, so the log shows how far it got."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *flags, *child_args(args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(args, probing))
        out, err, failure = proc.stdout, proc.stderr, None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out, err, failure = as_text(exc.stdout), as_text(exc.stderr), f"timeout after {timeout:.0f} s"
    results = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
    lines = [line for line in err.splitlines() if line.strip()]
    print("\n".join(lines[-40:]), file=sys.stderr, flush=True)
    if results and not failure:
        return results[-1]
    last = lines[-1].strip()[:500] if lines else "(no stderr)"
    return {"error": last if failure.startswith("exit") else f"{failure}; last stderr line: {last}"}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The summary table (one row per variant) under a few lines saying what was measured where."""
    lines = [f"# bench_gpu: Llama of {report['model']['params']:,} parameters, bf16 (fp8 where the variant says), "
             f"seq {report['seq']}, "
             f"batch {report['batch']} per dp replica",
             "", f"- device: {report['device_count']} x {report['device_kind']}, jax {report['jax_version']}",
             f"- MFU peak: {report['peak_source']}",
             f"- timing: median of {report['timed_steps']} steps after {report['warmup_steps']} warm-up steps",
             f"- command: `{report['command']}`", "",
             "| variant | tokens/s | MFU | step time (s) | peak memory (GiB) | compile (s) | loss | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["variants"]:
        lines.append(f"| {r['variant']} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.1%')} | "
                     f"{fmt(r.get('step_time_s'), '.3f')} | {fmt(r.get('peak_memory_gib'), '.1f')} | "
                     f"{fmt(r.get('compile_s'), '.1f')} | {fmt(r.get('loss'), '.4f')} | "
                     f"{(r.get('error') or r.get('skipped') or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: pathlib.Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out_dir / "bench_gpu.md").write_text(table)
    return table


def main_parent(args) -> int:
    """Probe the devices, then run each variant in turn inside the time budget; 0 when every row is good."""
    with tempfile.TemporaryDirectory(prefix="bench_gpu_cache_") as args.cache_dir:
        return run_all(args, time.perf_counter())


def run_all(args, start: float) -> int:
    facts = spawn(args, ["--probe"], timeout=180, probing=True)
    if facts.get("error"):
        print(f"bench_gpu: device probe failed: {facts['error']}", file=sys.stderr)
        return 1
    if facts["platform"] == "cpu" and not args.smoke:
        print("bench_gpu: no GPU visible (JAX sees only CPU); this trains a 1B model: use --smoke on CPU",
              file=sys.stderr)
        return 2
    names = args.variants.split(",") if args.variants else default_variants(facts["device_count"])
    model = MODEL_SMOKE if args.smoke else MODEL_1B
    from jaxpar.models.llama import param_count

    peak, source = peak_flops(facts["device_kind"], args.peak_tflops)
    report = {**facts, "command": shlex.join([sys.executable, *sys.argv]), "model": {
        **{k: getattr(model, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")},
        "params": param_count(model)}, "precision": "bf16", "batch": args.batch, "seq": args.seq,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "peak_tflops_per_device": peak and peak / 1e12,
        "peak_source": source, "xla_flags": gpu_xla_flags(args, facts), "variants": []}
    print(f"bench_gpu: {report['model']['params']:,} parameters; {facts['device_count']} x {facts['device_kind']}, "
          f"jax {facts['jax_version']}; MFU peak: {source}", flush=True)
    for name in names:
        row = run_one(args, name, facts, left=args.budget - (time.perf_counter() - start))
        report["variants"].append({"variant": name, **row})
        print(f"bench_gpu: {name}: " + (row.get("error") or row.get("skipped") or f"{row['tokens_per_s']:,.0f} "
              f"tokens/s, step {row['step_time_s']:.3f} s, compile {row['compile_s']:.1f} s"), flush=True)
        table = write(report, args.out_dir)
    print(table, flush=True)
    print(f"wrote {args.out_dir / 'bench_gpu.json'} and bench_gpu.md", flush=True)
    good = all(r.get("skipped") or (not r.get("error") and r.get("loss_finite")) for r in report["variants"])
    return 0 if good else 1


def gpu_xla_flags(args, facts: dict) -> str:
    """On GPUs the children get jaxpar's XLA flag bundle merged into XLA_FLAGS (what jaxpar.train does),
    said once here; the parent decides from the probe, so it never starts a JAX backend itself."""
    from jaxpar.compiler.xla_flags import merge

    if facts["platform"] != "gpu" or args.smoke:
        return os.environ.get("XLA_FLAGS", "")
    args.gpu_xla_flags, added, kept = merge(os.environ.get("XLA_FLAGS", ""))
    print(f"bench_gpu: XLA flags for GPUs (jaxpar/compiler/xla_flags.py): {' '.join(added) or '(none added)'}"
          + (f"; yours kept: {' '.join(kept)}" if kept else ""), flush=True)
    return args.gpu_xla_flags


def run_one(args, name: str, facts: dict, left: float) -> dict:
    """One variant's row: its child's result, {'skipped': why} for a GPU-only variant without a GPU, or
    {'error': ...} (bad name, failed child, budget used up)."""
    try:
        spec = parse_variant(name, facts["device_count"])
    except ValueError as err:
        return {"error": str(err)}
    if facts["platform"] != "gpu" and (why := needs_gpu(spec)):
        return {"skipped": f"skipped: {why} ({facts['platform'].upper()} here)", "error": None}
    if facts["platform"] == "gpu" and (why := lacks_fp8(spec, facts["device_kind"])):
        return {"skipped": f"skipped: {why}", "error": None}
    if left < 20:
        return {"error": f"skipped: --budget {args.budget:g} s used up"}
    return spawn(args, ["--child", name, "--n_devices", str(facts["device_count"])], timeout=min(args.timeout, left))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="", help="comma-separated names (default: by device count)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 2; smoke 1)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per dp replica (default 6: the largest whose remat=none step fits 141 GB; smoke 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; smoke 32)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per variant, start-up and compile included")
    p.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run; later variants are skipped")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="override the per-device peak for MFU")
    p.add_argument("--out_dir", type=pathlib.Path, default=pathlib.Path("runs/bench_gpu"))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (each variant emulates its mesh's devices)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--n_devices", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, full, smoke in (("steps", 5, 2), ("warmup", 2, 1), ("batch", 6, 4), ("seq", 2048, 32)):
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe(args)
        return 0
    if args.child:
        try:
            run_variant(args)
            return 0
        except Exception as err:  # noqa: BLE001 - the parent reads the last stderr line as the row's error
            import traceback

            traceback.print_exc()
            first = (str(err).strip().splitlines() or [""])[0]
            print(f"{type(err).__name__}: {first}"[:500], file=sys.stderr, flush=True)
            return 1
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
