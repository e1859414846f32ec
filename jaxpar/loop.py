"""The training loop: compile once, dispatch step N, then fetch step N-1's metrics (no per-step sync)."""

from __future__ import annotations

import pathlib
import time

import jax
from tqdm import tqdm

from jaxpar.config import Config
from jaxpar.data.synthetic import SyntheticData
from jaxpar.metrics import MetricsWriter, mfu, model_flops_per_step, peak_flops_per_device
from jaxpar.parallel.step import StepBuilder


def train(config: Config, mesh, workdir: pathlib.Path, show_progress: bool = True) -> list[dict]:
    """Train for `config.train.steps` steps; returns the per-step metric records it wrote."""
    train_cfg = config.train
    builder = StepBuilder(config, mesh)
    state = builder.init_state(train_cfg.seed)
    data = SyntheticData(config, builder.batch_sharding())
    compile_start = time.perf_counter()
    step_fn = builder.jit_train_step().lower(state, data.batch(0)).compile()
    compile_s = time.perf_counter() - compile_start

    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main)
    tokens_per_step = train_cfg.global_batch_size * builder.seq_len
    flops_per_step = model_flops_per_step(config, builder.seq_len)
    peak = peak_flops_per_device(config.hardware.peak_tflops)
    progress = tqdm(total=train_cfg.steps, disable=not (is_main and show_progress), unit="step",
                    desc=f"compiled in {compile_s:.1f}s; training")
    logger = StepLogger(writer, progress, tokens_per_step, flops_per_step, mesh.size, peak, train_cfg.log_every)
    for step in range(1, train_cfg.steps + 1):
        state, metrics = step_fn(state, data.batch(step - 1))
        logger.flush()  # the previous logged step's metrics, fetched while this step runs
        logger.submit(step, metrics, is_last=step == train_cfg.steps)
    logger.flush()
    progress.close()
    writer.close()
    return logger.records


class StepLogger:
    """Logs every `every`-th step (and the last). Fetching a step's metrics is the loop's only host
    sync, and it happens one step late, so the device always has the next step queued."""

    def __init__(self, writer, progress, tokens_per_step, flops_per_step, n_devices, peak, every):
        self.writer, self.progress, self.every = writer, progress, every
        self.tokens_per_step, self.flops_per_step, self.n_devices, self.peak = (
            tokens_per_step, flops_per_step, n_devices, peak)
        self.records, self.pending = [], None
        self.last_step, self.last_time = 0, time.perf_counter()

    def submit(self, step: int, metrics: dict, is_last: bool) -> None:
        if step % self.every == 0 or is_last:
            self.pending = (step, metrics)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = (now - self.last_time) / (step - self.last_step)  # mean over the steps since the last log
        record = {"step": step, **values, "step_time_s": step_time,
                  "tokens_per_s": self.tokens_per_step / step_time,
                  "mfu": mfu(self.flops_per_step, step_time, self.n_devices, self.peak)}
        self.records.append(record)
        self.writer.write(record)
        self.progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.progress.update(step - self.last_step)
        self.last_step, self.last_time = step, now
