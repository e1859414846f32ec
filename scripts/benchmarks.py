"""Reproduce the figures in BENCHMARKS.md (CPU host, 8 emulated devices). Prints markdown tables.

    python scripts/benchmarks.py zero_memory        # llama7b, dp=8, ZeRO 0-3: dry-run bytes vs the formula
    python scripts/benchmarks.py pipeline_schedules [4,8,16]  # p=4: bubble, executed FLOPs, temp, CPU step time per schedule
    python scripts/benchmarks.py step_time          # llama_tiny step-time ratios (alternating, one process)
    python scripts/benchmarks.py remat_memory       # llama7b dry-run bytes per remat policy and with optimizer offload
    python scripts/benchmarks.py remat_time         # llama_tiny step time per remat policy / offload vs none
    python scripts/benchmarks.py checkpoint_time    # orbax save (blocking / total), restore times, bytes on disk (du)
"""

import dataclasses
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxpar.config import ModelConfig, OffloadConfig, RematConfig, load_config  # noqa: E402
from jaxpar.data.synthetic import synthetic_batch  # noqa: E402
from jaxpar.compiler.dry_run import dry_run  # noqa: E402
from jaxpar.parallel.mesh import Layout  # noqa: E402
from jaxpar.parallel.step import StepBuilder  # noqa: E402

GB = 1e9
MB = 1e6
SEED_TABLE_2_3_GB = {0: 76, 1: 52, 2: 38, 3: 22}  # first seed article, table 2.3 (7B, 8 x A100)


# llama7b.py's layout until 2026-12-05 (its docstring), the base of the llama7b tables in BENCHMARKS.md
LLAMA7B_TP8 = ["mesh.dp=1", "mesh.pp=1", "mesh.tp=8", "zero.stage=1", "remat.policy=full"]


def with_layout(config, dp=1, pp=1, tp=1, stage=None, **pipeline):
    mesh = dataclasses.replace(config.mesh, dp=dp, pp=pp, tp=tp)
    zero = config.zero if stage is None else dataclasses.replace(config.zero, stage=stage)
    pipe = dataclasses.replace(config.pipeline, **pipeline) if pipeline else config.pipeline
    return dataclasses.replace(config, mesh=mesh, zero=zero, pipeline=pipe)


def mesh_for(config):
    return Layout.for_config(config).make_mesh()


def zero_memory():
    base = load_config("llama7b.py", LLAMA7B_TP8)
    print("| ZeRO | params | opt_state | grads (formula) | formula total | temp | peak | seed table 2.3 |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in range(4):
        config = with_layout(base, dp=8, stage=stage)
        r = dry_run(config, mesh_for(config))
        pd, an = r["per_device_bytes"], r["analytic_bytes"]
        print(f"| {stage} | {pd['params'] / GB:.2f} | {pd['opt_state'] / GB:.2f} | {an['grads'] / GB:.2f} | "
              f"{an['total'] / GB:.2f} | {pd['temp'] / GB:.2f} | {pd['peak'] / GB:.2f} | "
              f"{SEED_TABLE_2_3_GB[stage]} |")


PIPELINE_MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1024)
PIPELINE_VARIANTS = {  # name: (schedule, virtual stages, stage recompute)
    "gpipe": ("gpipe", 1, False),
    "1f1b, stage recompute": ("1f1b", 1, True),
    "1f1b, residuals kept": ("1f1b", 1, False),
    "interleaved v=2": ("1f1b", 2, False),
    "zb": ("zb", 1, False),
}


def _pipeline_config(m: int, variant: str | None):
    """p=4 (or one device when `variant` is None), 8 layers, a fixed microbatch of 2 x 128 tokens."""
    base = dataclasses.replace(load_config("llama_tiny.py"), model=PIPELINE_MODEL)
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch_size=2 * m, seq_len=128))
    if variant is None:
        return with_layout(base, stage=0)
    schedule, virtual, recompute = PIPELINE_VARIANTS[variant]
    return with_layout(base, pp=4, stage=0, schedule=schedule, microbatches=m, virtual_stages=virtual,
                       stage_recompute=recompute)


def pipeline_schedules(microbatches: str = "4,8,16"):
    """Per schedule at p=4 and m in {4, 8, 16}: bubble (table), executed / model FLOPs and temp bytes
    (compiled program), CPU step time relative to one device on the same global batch (alternated)."""
    print("| schedule | m | bubble | executed / model FLOPs | temp (MB) | CPU step / (1,1,1) |")
    print("|---|---|---|---|---|---|")
    for m in (int(x) for x in microbatches.split(",")):
        configs = {"(1,1,1)": _pipeline_config(m, None), **{v: _pipeline_config(m, v) for v in PIPELINE_VARIANTS}}
        seconds = time_alternating(configs, rounds=8)
        for variant in PIPELINE_VARIANTS:
            report = dry_run(configs[variant], mesh_for(configs[variant]))
            ratio = report["executed_flops_per_device"] / report["model_flops_per_device"]
            print(f"| {variant} | {m} | {report['bubble_fraction']:.3f} | {ratio:.2f} | "
                  f"{report['per_device_bytes']['temp'] / 1e6:.1f} | {seconds[variant] / seconds['(1,1,1)']:.2f} |",
                  flush=True)


def compiled_step(config):
    builder = StepBuilder(config, mesh_for(config))
    state = builder.init_state(config.train.seed)
    t = config.train
    batch = jax.device_put(synthetic_batch(t.seed, 0, t.global_batch_size, t.seq_len, config.model.vocab_size),
                           builder.batch_sharding())
    step = builder.jit_train_step().lower(state, batch).compile()
    return step, state, batch


def time_alternating(configs: dict, rounds: int = 30, steps_per_round: int = 3) -> dict:
    """Median seconds per step of each config, timed in alternation so machine noise hits all alike."""
    compiled = {name: list(compiled_step(c)) for name, c in configs.items()}
    times = {name: [] for name in configs}
    for _ in range(rounds):
        for name, entry in compiled.items():
            step, state, batch = entry
            start = time.perf_counter()
            for _ in range(steps_per_round):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / steps_per_round)
            entry[1] = state
    return {name: statistics.median(ts) for name, ts in times.items()}


def _describe(label, config):
    """One stderr line naming the shapes a table was measured with (the configs change over time)."""
    m, t = config.model, config.train
    print(f"{label}: d_model {m.d_model}, {m.n_layers} layers, vocab {m.vocab_size}, d_ff {m.d_ff}, batch "
          f"{t.global_batch_size} x {t.seq_len} tokens, {config.precision}", file=sys.stderr)


def step_time():
    base = load_config("llama_tiny.py")
    _describe("llama_tiny", base)
    dp_tp = time_alternating({"(1,1,1)": with_layout(base, stage=0),
                              "(2,1,4) zero1": with_layout(base, dp=2, tp=4, stage=1),
                              "(8,1,1) zero1": with_layout(base, dp=8, stage=1)})
    print("| layout (dp,pp,tp) | median step (ms) | ratio to 1 device |")
    print("|---|---|---|")
    for name, seconds in dp_tp.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / dp_tp['(1,1,1)']:.2f} |")
    deeper = dataclasses.replace(base.model, n_layers=4)
    pipe_base = dataclasses.replace(base, model=deeper)
    m = 8
    pp = time_alternating({"(1,1,1)": with_layout(pipe_base, stage=0),
                           "(1,4,1) 1f1b": with_layout(pipe_base, pp=4, stage=0, schedule="1f1b", microbatches=m),
                           "(1,4,1) gpipe": with_layout(pipe_base, pp=4, stage=0, schedule="gpipe", microbatches=m)})
    print(f"\n| layout, m={m} | median step (ms) | ratio to (1,1,1) | ideal (m+p-1)/m |")
    print("|---|---|---|---|")
    for name, seconds in pp.items():
        ideal = 1.0 if name == "(1,1,1)" else (m + 3) / m
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / pp['(1,1,1)']:.2f} | {ideal:.3f} |")


def variants(base):
    """Each remat policy, then optimizer offload (with selective remat), on the same layout."""
    out = {policy: dataclasses.replace(base, remat=RematConfig(policy=policy))
           for policy in ("none", "dots", "selective", "offload", "full")}
    out["selective + offload.optimizer"] = dataclasses.replace(out["selective"], offload=OffloadConfig(optimizer=True))
    return out


def remat_memory():
    base = load_config("llama7b.py", LLAMA7B_TP8)
    print(f"llama7b, mesh {base.mesh}, ZeRO-{base.zero.stage}, {base.precision}, "
          f"batch {base.train.global_batch_size} x {base.train.seq_len}")
    print("| remat | device opt_state | host opt_state | temp | peak |")
    print("|---|---|---|---|---|")
    for name, config in variants(base).items():
        pd = dry_run(config, mesh_for(config))["per_device_bytes"]
        print(f"| {name} | {pd['opt_state'] / GB:.2f} | {pd['opt_state_host'] / GB:.2f} | {pd['temp'] / GB:.2f} | "
              f"{pd['peak'] / GB:.2f} |")


def remat_time():
    tiny = load_config("llama_tiny.py")
    wider = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, d_model=256, d_ff=1024, n_layers=4),
                                train=dataclasses.replace(tiny.train, seq_len=256, global_batch_size=8))
    for label, base, rounds in (("llama_tiny", tiny, 30), ("llama_tiny widened: d_model 256, 4 layers, 8 x 256 tokens",
                                                           wider, 8)):
        _describe(label, base)
        times = time_alternating(variants(base), rounds=rounds)
        print(f"\n{label}, mesh {base.mesh}\n\n| remat | median step (ms) | relative to none |\n|---|---|---|")
        for name, seconds in times.items():
            print(f"| {name} | {seconds * 1e3:.1f} | {seconds / times['none']:.2f} |")


def _du(path) -> tuple[int, int]:
    """Bytes of the checkpoint at `path` on disk: (allocated, `du -s --block-size=1`; apparent, `du -sb`)."""
    import subprocess

    def du(*flags):
        return int(subprocess.run(["du", "-s", *flags, str(path)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])

    return du("--block-size=1"), du("-b")


def _checkpoint_times(config, workdir, steps=8):
    """Bytes on disk of one durable checkpoint (measured), seconds (blocking part of an async save, save
    until durable, restore) and the step-time cost of starting a save."""
    import pathlib
    import shutil
    import tempfile

    from jaxpar.parallel.checkpoint import Checkpointer

    step_fn, state, batch = compiled_step(config)
    pathlib.Path(workdir).mkdir(exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(dir=workdir))
    try:
        checkpoints = Checkpointer(root, config)
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        checkpoints.save(1, state)  # warm-up: the first save also sets up orbax's machinery
        checkpoints.wait()
        start = time.perf_counter()
        checkpoints.save(100, state)
        blocking = time.perf_counter() - start
        checkpoints.wait()
        total = time.perf_counter() - start
        on_disk = _du(checkpoints.directory / "100")
        plain, saving = [], []
        for i in range(steps):  # alternate: steps with and without a save starting alongside
            t = time.perf_counter()
            state, metrics = step_fn(state, batch)
            if i % 2:
                checkpoints.save(2 + i, state)
            jax.block_until_ready(metrics)
            (saving if i % 2 else plain).append(time.perf_counter() - t)
            checkpoints.wait()
        builder = StepBuilder(config, mesh_for(config))
        start = time.perf_counter()
        restored, _, _ = checkpoints.restore(builder.abstract_state())
        jax.block_until_ready(restored)
        restore = time.perf_counter() - start
        checkpoints.close()
        return on_disk, blocking, total, restore, statistics.median(saving) / statistics.median(plain)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def checkpoint_time():
    tiny = load_config("llama_tiny.py")
    big = load_config("llama7b.py", LLAMA7B_TP8)
    big = dataclasses.replace(big, model=dataclasses.replace(big.model, n_layers=1), mesh=dataclasses.replace(
        big.mesh, dp=1, tp=1), zero=dataclasses.replace(big.zero, stage=0),  # 8 emulated copies would not fit 24 GB
                              train=dataclasses.replace(big.train, global_batch_size=1, seq_len=128))
    print("| state | params | state MB (computed: params x bytes per param) | on disk MB (measured: du -s of "
          "one checkpoint step, allocated / apparent) | save, blocking (s) | save, until durable (s) | restore (s) | "
          "step time with a save starting / without |")
    print("|---|---|---|---|---|---|---|---|")
    # steps: how many steps are timed, half of them starting a save (llama_tiny's are cheap: take more)
    for label, config, steps in (("llama_tiny", tiny, 40), ("llama7b shapes, 1 of 32 layers, 1 device", big, 8)):
        _describe(label, config)
        on_disk, blocking, total, restore, ratio = _checkpoint_times(config, "runs", steps)
        params = sum(x.size for x in jax.tree.leaves(StepBuilder(config, mesh_for(config)).abstract_state().params))
        per_param = 2 + 12 if config.precision == "bf16" else 4 + 8  # bf16 + fp32 master, m, v | fp32 + m, v
        print(f"| {label} | {params:,} | {params * per_param / MB:,.2f} (x {per_param}) | {on_disk[0] / MB:,.2f} / "
              f"{on_disk[1] / MB:,.2f} | {blocking:.2f} | {total:.2f} | {restore:.2f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    {"zero_memory": zero_memory, "pipeline_schedules": pipeline_schedules, "step_time": step_time,
     "remat_memory": remat_memory, "remat_time": remat_time, "checkpoint_time": checkpoint_time}[sys.argv[1]](
        *sys.argv[2:])
