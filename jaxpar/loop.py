"""The training loop: compile once, dispatch step N, then fetch step N-1's metrics (no per-step sync)."""

from __future__ import annotations

import pathlib
import time

import jax
from tqdm import tqdm

from jaxpar.config import Config
from jaxpar.data.synthetic import SyntheticData
from jaxpar.metrics import MetricsWriter, mfu, peak_flops_per_device
from jaxpar.models import llama
from jaxpar.parallel.step import StepBuilder


def train(config: Config, mesh, workdir: pathlib.Path, show_progress: bool = True) -> list[dict]:
    """Train for `config.train.steps` steps; returns the per-step metric records it wrote."""
    train_cfg = config.train
    builder = StepBuilder(config, mesh)
    state = builder.init_state(train_cfg.seed)
    data = SyntheticData(train_cfg.seed, train_cfg.global_batch_size, train_cfg.seq_len,
                         config.model.vocab_size, builder.batch_sharding())
    compile_start = time.perf_counter()
    step_fn = builder.jit_train_step().lower(state, data.batch(0)).compile()
    compile_s = time.perf_counter() - compile_start

    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main)
    tokens_per_step = train_cfg.global_batch_size * train_cfg.seq_len
    flops_per_step = llama.flops_per_token(config.model, train_cfg.seq_len) * tokens_per_step
    peak = peak_flops_per_device(config.hardware.peak_tflops)
    progress = tqdm(total=train_cfg.steps, disable=not (is_main and show_progress), unit="step",
                    desc=f"compiled in {compile_s:.1f}s; training")
    records, pending = [], None
    last_time = time.perf_counter()
    for step in range(train_cfg.steps):
        state, metrics = step_fn(state, data.batch(step))
        if pending is not None:
            last_time = _finish_step(pending, last_time, records, writer, progress, tokens_per_step,
                                     flops_per_step, mesh.size, peak)
        pending = (step + 1, metrics)
    _finish_step(pending, last_time, records, writer, progress, tokens_per_step, flops_per_step, mesh.size, peak)
    progress.close()
    writer.close()
    return records


def _finish_step(pending, last_time, records, writer, progress, tokens_per_step, flops_per_step,
                 n_devices, peak) -> float:
    """Fetch one step's metrics (this is the only host sync), log them, return the fetch time."""
    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    step_time = now - last_time
    record = {"step": step, **values, "step_time_s": step_time,
              "tokens_per_s": tokens_per_step / step_time,
              "mfu": mfu(flops_per_step, step_time, n_devices, peak)}
    records.append(record)
    writer.write(record)
    progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
    progress.update(1)
    return now
