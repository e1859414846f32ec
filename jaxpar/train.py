"""CLI entry point: flags -> config -> devices -> train or dry run.

    python -m jaxpar.train --config llama_tiny.py [--config.mesh.tp=4 ...] [--workdir DIR] [--dry_run]

A config mistake prints one line naming the key and the fix and exits 2; no traceback.
On GPUs the XLA flag bundle of jaxpar/compiler/xla_flags.py is merged into XLA_FLAGS before JAX starts (a flag
already in XLA_FLAGS wins), and the line saying so is printed; so is the allocator's memory fraction, set
to jaxpar's budget (jaxpar.compiler.hardware.apply_memory_fraction) unless the user set one. Training turns
on JAX's persistent compilation cache in compile.cache_dir (default ~/.cache/jaxpar/xla; see enable_compilation_cache), so a
restarted run loads its compiled step instead of compiling it again.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors, parse_with_overrides
from jaxpar.errors import ConfigError
from jaxpar.files import write_atomic


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineArgumentParser(prog="python -m jaxpar.train", description=__doc__.splitlines()[0],
                                   usage_hint="--config NAME_OR_PATH [--config.KEY=VALUE ...] [--workdir DIR] [--dry_run]")
    parser.add_argument("--config", required=True, help="configs/NAME.py, a bare NAME, or a path")
    parser.add_argument("--workdir", default=None, help="where metrics.jsonl, tb/ and dry_run.json go")
    parser.add_argument("--dry_run", action="store_true", help="compile the real step, report memory and comms")
    parser.add_argument("--gpu", default=None, help="with --dry_run: compile for this GPU (h100, h200, a100-80gb) "
                        "with XLA's GPU compiler, no device needed")
    parser.add_argument("--gpus_per_node", type=int, default=8, help="with --gpu: GPUs per node of the topology")
    parser.add_argument("--coordinator_address", default=None, help="multi-host: host:port of process 0")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    return parse_with_overrides(parser, argv)


def ensure_writable(workdir: pathlib.Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--workdir {workdir} cannot be created ({err.strerror}); pass a writable directory") from None
    if not os.access(workdir, os.W_OK):
        raise ConfigError(f"--workdir {workdir} is not writable; pass a writable directory")


def launch_process_index(process_id: int | None) -> int:
    """This process's index, known before JAX starts: --process_id, else SLURM's task index when SLURM
    launched several tasks (jax.distributed auto-detects the same), else JAX_PROCESS_ID, else 0. Only
    process 0 generates demo data and announces; the others wait for it."""
    if process_id is not None:
        return process_id
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return int(os.environ.get("JAX_PROCESS_ID", "0"))


# JAX's own settings for its persistent cache; one set in the environment is the user's and is left alone.
CACHE_THRESHOLDS = {
    # every compilation is written, not only those over JAX's default 1 s: a restart pays for all the
    # small jits too (init, sharding, evaluation), and together they cost seconds
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,  # no size floor (and none chosen for the filesystem)
}


def enable_compilation_cache(cache_dir: str, is_first: bool) -> str | None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (compile.cache_dir) before anything
    compiles; returns the directory in use, or None when the cache is off.

    A restarted or resumed run then loads its executables (the train step, the evaluation, every small
    jit) instead of compiling them: for configs/llama_tiny.py on CPU the step's compile time drops from
    about 20 s to under 2 s (BENCHMARKS.md). Entries are keyed by the program, the jaxlib version, the
    backend, the XLA flags and the devices; a changed config or jaxlib is a miss, never a wrong hit.

    * A cache the user configured in JAX itself (JAX_COMPILATION_CACHE_DIR, even empty, or
      jax.config's jax_compilation_cache_dir) wins, with JAX's thresholds as they are; so does
      JAX_ENABLE_COMPILATION_CACHE=false. Otherwise every entry is written (CACHE_THRESHOLDS), except
      thresholds set in the environment (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, ...).
    * Several processes (multi-host) may share the directory: each looks its programs up there, but
      only JAX process 0 writes entries (jax._src.compiler._cache_write skips every process_id != 0,
      to avoid write contention on shared filesystems). So the directory must be one every node sees:
      on a node-local one the other nodes never find an entry and recompile at every start. On GPUs
      JAX makes the key the same on every process (cache_key.py strips the device assignment), and
      keeps XLA's per-fusion autotuning results under the directory too (process 0 updates, the others
      read). On XLA:CPU with several processes (scripts/launch_local.sh) the key hashes each process's
      view of the device topology, so only process 0 hits and the others compile at every start.
    * A directory that cannot be created or written (process 0) or read (the others) costs one warning
      line on stderr and the run continues without the cache: a cache must never stop training.
      Errors reading or writing single entries later are JAX's warnings, never fatal either.
    * The cache is trusted: whoever can write the directory can make this process run their code; keep
      it writable by the user only (the default, ~/.cache/jaxpar/xla, is).
    """
    import jax

    announce = print if is_first else (lambda _: None)
    if not jax.config.jax_enable_compilation_cache:
        announce("compilation cache: off (JAX_ENABLE_COMPILATION_CACHE=false)")
        return None
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or jax.config.jax_compilation_cache_dir is not None:
        user_dir = jax.config.jax_compilation_cache_dir or None
        announce(f"compilation cache: {user_dir or 'off'} (JAX_COMPILATION_CACHE_DIR; compile.cache_dir not used)")
        return user_dir
    if not cache_dir:
        announce("compilation cache: off (compile.cache_dir is empty)")
        return None
    path = pathlib.Path(cache_dir).expanduser().absolute()
    problem = _cache_dir_problem(path, writes=jax.process_index() == 0)
    if problem is not None:
        print(f"jaxpar: warning: compile.cache_dir={cache_dir}: {problem}; compiling without the persistent cache",
              file=sys.stderr)
        return None
    for name, value in CACHE_THRESHOLDS.items():
        if name.upper() not in os.environ:
            jax.config.update(name, value)
    jax.config.update("jax_compilation_cache_dir", str(path))
    announce(f"compilation cache: {path} (compile.cache_dir)")
    return str(path)


def _cache_dir_problem(path: pathlib.Path, writes: bool) -> str | None:
    """Why `path` cannot serve as the cache (None: it can). The writer really writes a file: os.access
    answers for the permission bits, not for a read-only or full filesystem."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"the directory cannot be created ({err.strerror or err})"
    if not writes:
        return None if os.access(path, os.R_OK | os.X_OK) else "the directory is not readable"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".jaxpar-probe-"):
            pass
    except OSError as err:
        return f"the directory is not writable ({err.strerror or err})"
    return None


def run(argv: list[str]) -> int:
    from jaxpar.config import pipeline_warning, to_dict
    from jaxpar.interop.pretrained import load_run_config  # (JAX only when a pretrained init is read)

    # Flags, config and workdir are checked before JAX is even imported: a mistake costs no start-up time.
    args, overrides = parse_args(argv)
    gpu = _gpu_target(args)  # before anything imports JAX (reading a pretrained init's fields does)
    config = load_run_config(args.config, overrides)
    if (warning := pipeline_warning(config)) is not None:
        print(warning, file=sys.stderr)
    workdir = pathlib.Path(args.workdir or f"runs/{pathlib.Path(args.config).stem}")
    ensure_writable(workdir)
    if not args.dry_run:  # data mistakes, like config ones, surface before JAX starts
        from jaxpar.data.demo import check_paths, ensure_demo_data

        from jaxpar.data.normalization import resolve_action_range, resolve_state_range

        ensure_demo_data(config, is_primary=launch_process_index(args.process_id) == 0)
        check_paths(config)
        config = resolve_action_range(config, workdir, is_primary=launch_process_index(args.process_id) == 0)
        config = resolve_state_range(config, workdir)

    from jaxpar.compiler.hardware import apply_memory_fraction
    from jaxpar.compiler.xla_flags import apply_gpu_bundle

    is_first = launch_process_index(args.process_id) == 0
    apply_gpu_bundle(announce=print if is_first else None, force=gpu is not None)  # before JAX starts: read once
    apply_memory_fraction(announce=print if is_first else None)  # likewise (a GPU dry run has no allocator)
    from jaxpar.parallel.mesh import Layout, devices_for, emulate_cpu_devices, maybe_initialize_distributed

    layout = Layout.for_config(config)
    processes = args.num_processes or 1
    if layout.size % processes:
        raise ConfigError(f"--num_processes={processes} does not divide the mesh's {layout.size} devices")
    emulate_cpu_devices(1 if gpu is not None else layout.size // processes)  # before JAX touches a backend
    maybe_initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    if gpu is not None:
        from jaxpar.compiler.gpu_aot import gpu_devices

        mesh = layout.make_mesh(gpu_devices(gpu, layout.size, args.gpus_per_node))
    else:
        mesh = layout.make_mesh(devices_for(layout, args.dry_run))
    import jax

    if jax.process_index() == 0:  # one writer; peers read the previous run's before JAX started (above)
        write_atomic(workdir / "config.json", json.dumps(to_dict(config), indent=2))
    if args.dry_run:
        from jaxpar.compiler.attention_choice import resolve_attention
        from jaxpar.compiler.dry_run import dry_run, format_report, write_report

        config, choice = resolve_attention(config, mesh)  # (training resolves it in jaxpar.training.loop.train)
        print(choice)
        from jaxpar.planner.report import gpu_figures

        report = dry_run(config, mesh, gpu, planner=gpu_figures)
        print(format_report(report))
        if jax.process_index() == 0:
            print(f"wrote {write_report(report, workdir)}")
        return 0

    enable_compilation_cache(config.compile.cache_dir, is_first)  # before the first compilation
    from jaxpar.training.loop import TrainingStopped, train

    try:
        records = train(config, mesh, workdir)
    except TrainingStopped as stop:
        print(f"jaxpar: stopped: {stop}", file=sys.stderr)
        return 1
    if jax.process_index() != 0:
        return 0
    if records:
        print(f"done: {summary(records)}; metrics in {workdir / 'metrics.jsonl'}")
    else:
        print(f"nothing to do: the checkpoint in {workdir / 'checkpoints'} is already at train.steps")
    return 0


def _gpu_target(args):
    """--gpu's target, its environment prepared before JAX starts (None without --gpu)."""
    if args.gpu is None:
        return None
    if not args.dry_run:
        raise ConfigError(f"--gpu={args.gpu} compiles for GPUs this machine does not have: add --dry_run")
    if args.num_processes not in (None, 1):
        raise ConfigError("--gpu compiles every device's program in one process: drop --num_processes")
    from jaxpar.compiler import gpu_aot

    gpu = gpu_aot.target(args.gpu)
    gpu_aot.prepare_environment()
    return gpu


def summary(records: list[dict]) -> str:
    """'step N, loss L' of the last train record, and the last evaluation's metrics if there was one."""
    last = [r for r in records if "loss" in r][-1]
    text = f"step {last['step']}, loss {last['loss']:.4f}"
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    if evals:
        text += ", " + ", ".join(f"{k} {v:.4f}" for k, v in evals[-1].items() if isinstance(v, float))
    return text


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
