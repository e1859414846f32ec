"""The training loop: compile once (before the state is allocated, so the memory preflight of
jaxpar.training.preflight can refuse a step that will not fit), resume, dispatch step N then fetch
step N-1's metrics, checkpoint, evaluate; optionally trace steps START..END with jax.profiler
(jaxpar.training.profiling).

The attention kernel (`model.attention`) is resolved for the mesh's devices here, before the step
is built, and said in one line (jaxpar.compiler.attention_choice).

The only host syncs are the metric fetches of logged steps (one step late, so the device always has
the next step queued), evaluations (every eval.every steps and at the end) and checkpoint saves,
which orbax writes asynchronously. SIGTERM / SIGINT
finish the current step, write a checkpoint, wait until it is durable and return; a second signal
exits at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import signal
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxpar.compiler.attention_choice import resolve_attention
from jaxpar.compiler.dry_run import compile_step
from jaxpar.parallel.checkpoint import Checkpointer
from jaxpar.config import Config, has_evaluation, profile_steps
from jaxpar.errors import ConfigError
from jaxpar.data.pipeline import eval_data, train_data
from jaxpar.training.metrics import MetricsWriter, mfu, peak_flops_per_device
from jaxpar.models.flops import model_flops_per_step
from jaxpar.parallel.evaluate import Evaluator, metrics_from_sums
from jaxpar.parallel.processes import CompiledTogether, meet
from jaxpar.parallel.step import StepBuilder
from jaxpar.training import preflight
from jaxpar.training.profiling import StepProfiler
from jaxpar.training.watchdog import CPU_STUCK_S, StepWatchdog

SPIKE_WINDOW = 50  # logged losses in the running window of the spike detector
SPIKE_SIGMAS = 3.0


class TrainingStopped(RuntimeError):
    """train.on_nan=stop met a non-finite step; the last good state was checkpointed."""


class Preemption:
    """SIGTERM / SIGINT: checkpoint and stop, at a step every process agrees on.

    One process: the first signal sets a flag the loop reads after each step; a second signal has
    its default effect. Several processes: a signal may reach them at different moments (a cluster
    preempts one node first), and a process that leaves the loop alone hangs the others in the
    next collective. JAX's distributed runtime has a preemption sync manager for this: it catches
    SIGTERM itself, tells the coordination service, and `reached_preemption_sync_point(step)`
    becomes true on every process at the same step (the largest step any process had reached,
    plus one). So with several processes SIGTERM is left to it, and SIGINT is turned into a SIGTERM
    of this process so that Ctrl-C takes the same agreed path."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        self._agreed = jax.process_count() > 1

    def __enter__(self):
        signals = (signal.SIGINT,) if self._agreed else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self._agreed:  # the sync manager's SIGTERM handler is the one that counts
            signal.signal(signum, self._previous[signum])
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.requested = True

    def should_stop(self, step: int) -> bool:
        """Whether to checkpoint and stop after `step`; the same answer on every process. Call it
        after every step (the sync manager counts on it)."""
        if self._agreed and multihost_utils.reached_preemption_sync_point(step):
            self.requested = True
        return self.requested

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(config: Config, mesh, workdir: pathlib.Path, show_progress: bool = True) -> list[dict]:
    """Train (or resume) to `config.train.steps`; returns the metric records written in this run."""
    is_main = jax.process_index() == 0
    config, choice = resolve_attention(config, mesh)
    if is_main:
        print(choice)
    builder = StepBuilder(config, mesh)
    data = train_data(config, builder.batch_sharding())
    # The step is compiled from abstract shapes before the state exists, so that a step that cannot fit
    # stops here, in one line, with nothing allocated (jaxpar.training.preflight).
    _, step_fn, compile_s = compile_step(builder, builder.abstract_state())
    preflight.check(config, mesh, step_fn, announce=print if is_main else lambda _: None)
    checkpoints = Checkpointer(workdir, config)
    try:
        meet("the first restore or initialisation")  # their first collectives (jaxpar.parallel.processes)
        state, start, data_state = _initial_state(builder, checkpoints)
        if data_state is not None:
            data.set_state(data_state)
        meet("the data check")  # then the processes of a data shard check they read the same rows (jaxpar.data.pipeline)
        data.check_agreement()
        meet("the first training step")  # each process initialised at its own speed (jaxpar.parallel.processes)
        progress = tqdm(total=config.train.steps, initial=start, disable=not (is_main and show_progress),
                        unit="step", desc=f"compiled in {compile_s:.1f}s; training")
        logger = StepLogger(MetricsWriter(workdir, enabled=is_main, resume_after=start), progress, config, builder,
                            mesh.size, start)
        evaluation = Evaluation(config, builder, logger) if has_evaluation(config) else None
        profiler = StepProfiler(profile_steps(config), workdir, announce=tqdm.write if is_main else lambda _: None)
        with Preemption() as preemption, _watchdog(mesh, checkpoints) as watchdog:
            try:
                calibrate = builder.jit_calibrate_fp8() if config.fp8_delayed and start == 0 else None
                step = _run_steps(config, step_fn, state, start, data, logger, checkpoints, preemption, evaluation,
                                  profiler, watchdog, calibrate)
            finally:
                profiler.close()
                progress.close()
                logger.writer.close()
    finally:
        checkpoints.close()  # waits for every started save to be durable
    if preemption.requested and is_main:
        print(f"preempted: checkpoint of step {step} written to {checkpoints.directory}")
    return logger.records


def _watchdog(mesh, checkpoints: Checkpointer):
    """On an emulated CPU mesh, a run whose step no longer finishes ends with one line (jaxpar.training.watchdog)."""
    if mesh.devices.flat[0].platform != "cpu" or mesh.size == 1:
        return contextlib.nullcontext()
    return StepWatchdog(CPU_STUCK_S, f"checkpoints in {checkpoints.directory}; rerun the command to resume")


def _run_steps(config, step_fn, state, start, data, logger, checkpoints, preemption, evaluation,
               profiler: StepProfiler, watchdog: StepWatchdog | None = None, calibrate=None) -> int:
    """The step loop; returns the last step run. Ends with a checkpoint of the last step (at the end,
    on preemption, or on a train.on_nan=stop), unless that step was just checkpointed, and, when the
    run reached train.steps, an evaluation of it. `calibrate` (fp8.recipe=delayed from a fresh state):
    run on the first batch before the first step (fp8_counters.calibrate)."""
    step, saved, every, steps = start, start, config.checkpoint.every, config.train.steps
    try:
        while step < steps and not preemption.should_stop(step):
            profiler.before(step + 1, state)
            with profiler.annotate(step + 1):
                waited = time.perf_counter()
                batch = data.next_batch()  # this process's rows read (or waited for) and placed on the devices
                logger.data_wait(time.perf_counter() - waited)
                if calibrate is not None and step == 0:
                    state = calibrate(state, batch)
                state, metrics = step_fn(state, batch)
            step += 1
            if watchdog is not None:
                watchdog.track(step, metrics["loss"])
            profiler.after(step, (state, metrics))
            logger.flush()  # the previous logged step's metrics, fetched while this step runs
            if config.train.on_nan == "stop" and bool(metrics["skipped"]):  # a host sync per step, this mode only
                logger.submit(step, metrics, is_last=True)
                logger.flush()
                raise TrainingStopped(f"step {step}: loss or gradients not finite and train.on_nan=stop; the step "
                                      f"was not applied, and the checkpoint of step {step} holds the weights "
                                      f"from before it")
            logger.submit(step, metrics, is_last=step == steps)
            if every and step % every == 0 and step < steps:
                checkpoints.save(step, state, data.get_state())
                saved = step
            if evaluation is not None and evaluation.due(step) and step < steps:
                _evaluate_keeping_work(evaluation, step, state, saved, checkpoints, data)
        logger.flush()
    except TrainingStopped:
        checkpoints.save(step, state, data.get_state())  # the skipped step left the weights as they were
        raise
    if step > saved:  # (after another error, except an evaluation's, the state may be gone: nothing is saved then)
        checkpoints.save(step, state, data.get_state())
    if evaluation is not None and step == steps > start:  # after the save: a failing evaluation loses no work
        evaluation.run(step, state.params)
    return step


def _evaluate_keeping_work(evaluation, step: int, state, saved: int, checkpoints: Checkpointer, data) -> None:
    """A mid-run evaluation. If it fails on any process (a simulator's error, a bug in a policy wrapper), every
    process learns so, they save the steps since the last checkpoint together (a collective save: one process
    alone would wait for the others forever), and the error goes on: a rerun resumes here."""
    error = None
    try:
        evaluation.run(step, state.params)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the save
        error = err
    if not _on_any_process(error is not None):
        return
    if step > saved:
        try:
            checkpoints.save(step, state, data.get_state())
        except Exception as save_error:  # (the evaluation's error is the one to report)
            raise (error or save_error) from save_error
    if error is not None:
        raise error
    raise RuntimeError(f"step {step}: the evaluation failed on another process (its error is in that process's log); "
                       f"the checkpoint of step {step} is saved, so rerunning the command resumes there")


def _fresh_state(builder: StepBuilder):
    """Random init, or the LLM's weights from init.from_hf (streamed shard by shard)."""
    config = builder.config
    llm_dir, vision_dir = config.init.llm_dir, config.init.vision_from_hf
    if not llm_dir and not vision_dir:
        return builder.init_state(config.train.seed)
    from jaxpar.interop import hf_siglip
    from jaxpar.interop import hf_llama

    llm = hf_llama.load_weights(llm_dir, config.model, builder.llm_weight_shardings()) if llm_dir else None
    vision = hf_siglip.load_vision(vision_dir, config.vision) if vision_dir else None
    if jax.process_index() == 0:
        print("initialised " + " and ".join(f"the {part} from {where}" for part, where in
                                            (("LLM", llm_dir), ("vision encoder", vision_dir)) if where))
    return builder.init_state_from(llm, config.train.seed, vision)


def _initial_state(builder: StepBuilder, checkpoints: Checkpointer):
    """The latest readable checkpoint, restored onto this layout; a fresh start only if there is none.

    A checkpoint that cannot be read (corrupted after it was completed: a file error or undecodable
    bytes) is moved aside, saying so, and the one before it is tried; if none can be read the run
    stops rather than silently starting over. Any other failure (out of memory during a resharded
    restore, a bug) propagates: the checkpoint is fine and must not be moved. With several
    processes every verdict is agreed (a checkpoint one process cannot read is skipped by all) and
    only process 0 moves it. The files are checked before the restore, without collectives, because
    orbax's restore waits in cross-process barriers: a process failing inside it alone would leave
    the others waiting there (until orbax's barrier timeout ends the run, moving nothing).
    """
    steps = checkpoints.all_steps()
    if not steps:
        return _fresh_state(builder), 0, None
    for step in sorted(steps, reverse=True):
        _, error = _unless_unreadable(lambda: checkpoints.check_readable(step))
        if not _on_any_process(error is not None):
            restored, error = _unless_unreadable(lambda: checkpoints.restore(builder.abstract_state(), step))
            if not _on_any_process(error is not None):
                if jax.process_index() == 0:
                    print(f"resuming from step {step} ({checkpoints.directory})")
                return restored
        _move_aside(checkpoints, step, error)
    raise ConfigError(f"no readable checkpoint in {checkpoints.directory}; move it away or use a fresh --workdir")


def _unless_unreadable(attempt):
    """(attempt()'s result, None), or (None, the error) if it found the checkpoint unreadable;
    ConfigError and any other failure raise."""
    try:
        return attempt(), None
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - sorted here: unreadable, or propagated
        if not is_unreadable(err):
            raise
        return None, err


def _move_aside(checkpoints: Checkpointer, step: int, error: BaseException | None) -> None:
    """Process 0 moves the agreed-unreadable checkpoint aside and says why; every other process waits
    for the move, then forgets the step too (else its next save of that step number is refused)."""
    if jax.process_index() == 0:
        moved = checkpoints.quarantine(step)
        reason = type(error).__name__ if error is not None else "unreadable on another process"
        print(f"warning: checkpoint of step {step} is unreadable ({reason}); moved it to {moved} and trying "
              f"the previous one")
    if jax.process_count() > 1:
        meet(f"checkpoint {step} moved aside")
        checkpoints.reload()


def is_unreadable(err: BaseException) -> bool:
    """Whether a restore failed because the checkpoint's files cannot be read (missing, truncated,
    undecodable: OSError, or the ValueError / KeyError that orbax and tensorstore raise for bad
    bytes), not because of memory or anything else."""
    text = str(err)
    if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return False
    return isinstance(err, (OSError, ValueError, KeyError, EOFError))


def _on_any_process(here: bool) -> bool:
    """True on every process when `here` is true on any process (a checkpoint found unreadable, an evaluation
    failed)."""
    if jax.process_count() == 1:
        return here
    return bool(np.any(multihost_utils.process_allgather(np.array([here], np.int32))))


class Evaluation:
    """Held-out metrics (data.eval, or data.eval_episodes held out of a LeRobot data.train) and
    closed-loop rollouts (eval.rollouts) every eval.every steps and at train.steps, written to
    metrics.jsonl."""

    def __init__(self, config: Config, builder: StepBuilder, logger: "StepLogger"):
        self.config, self.logger = config, logger
        self.data = eval_data(config, builder.batch_sharding())
        if self.data is not None:
            meet("the held-out data check")
            self.data.check_agreement()
        self.step_fn = (CompiledTogether(Evaluator(builder).jit_eval_step(), "the first evaluation step")
                        if self.data is not None else None)
        self.rollouts = None
        if config.eval.rollouts:
            from jaxpar.robot.rollout import TrainingRollouts

            self.rollouts = TrainingRollouts(config, builder)

    def due(self, step: int) -> bool:
        every = self.config.eval.every
        return bool(every and step % every == 0)

    def run(self, step: int, params) -> dict:
        record = {"step": step}
        if self.data is not None:
            record.update(self._held_out_metrics(params))
        if self.rollouts is not None:
            record.update(self.rollouts.run(params))
        self.logger.write_eval(record)
        return record

    def _held_out_metrics(self, params) -> dict:
        totals = {}
        for batch in self.data:  # summed on the host in float64: token counts stay exact
            for key, value in jax.device_get(self.step_fn(params, batch)).items():
                totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64)
        sums = {k: v.tolist() for k, v in totals.items()}
        metrics = metrics_from_sums(sums, self.data.bytes_per_token)
        if self.data.unigram_bits_per_byte is not None:
            metrics["unigram_bits_per_byte"] = self.data.unigram_bits_per_byte
        return metrics


class StepLogger:
    """Logs every `log_every`-th step (and the last); warns on loss spikes; enforces train.on_nan."""

    def __init__(self, writer, progress, config: Config, builder: StepBuilder, n_devices: int, start: int):
        self.writer, self.progress, self.config = writer, progress, config
        self.every = config.train.log_every
        self.tokens_per_step = config.train.global_batch_size * builder.seq_len
        self.flops_per_step = model_flops_per_step(config, builder.seq_len)
        self.n_devices, self.peak = n_devices, peak_flops_per_device(config.hardware.peak_tflops)
        self.records, self.pending, self.spikes = [], None, SpikeDetector()
        self.last_step, self.last_time = start, time.perf_counter()
        self.waited, self.waited_from = 0.0, start  # seconds in data.next_batch for the steps after waited_from

    def data_wait(self, seconds: float) -> None:
        """The time this step's data.next_batch took (the step loop waited for its input that long)."""
        self.waited += seconds

    def submit(self, step: int, metrics: dict, is_last: bool) -> None:
        if step % self.every == 0 or is_last:
            data_wait = self.waited / (step - self.waited_from)  # mean over the steps since the last logged one
            self.pending, self.waited, self.waited_from = (step, metrics, data_wait), 0.0, step

    def flush(self) -> None:
        if self.pending is None:
            return
        step, metrics, data_wait = self.pending
        self.pending = None
        values = jax.device_get(metrics)
        now = time.perf_counter()
        step_time = (now - self.last_time) / (step - self.last_step)  # mean over the steps since the last log
        record = {"step": step, **{k: float(values[k]) for k in ("loss", "grad_norm", "learning_rate")},
                  "skipped": bool(values["skipped"]), "skipped_total": int(values["skipped_total"]),
                  "step_time_s": step_time, "tokens_per_s": self.tokens_per_step / step_time,
                  "mfu": mfu(self.flops_per_step, step_time, self.n_devices, self.peak),
                  "data_wait_s": data_wait}
        self._check_spike(record)
        self.records.append(record)
        self.writer.write(record)
        self.progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.progress.update(step - self.last_step)
        self.last_step, self.last_time = step, now

    def write_eval(self, record: dict) -> None:
        self.flush()  # keep metrics.jsonl in step order
        self.records.append(record)
        self.writer.write(record)
        shown = ", ".join(f"{k[5:] if k.startswith('eval_') else k} {v:.4f}" for k, v in record.items()
                          if isinstance(v, float))
        if self.writer.enabled:  # process 0 says it
            tqdm.write(f"eval at step {record['step']}: {shown}")

    def _check_spike(self, record: dict) -> None:
        warning = self.spikes.observe(record["step"], record["loss"])
        if warning:
            record["loss_spike"] = True
            tqdm.write(warning)


class SpikeDetector:
    """Flags a loss above mean + 3 sigma of the last SPIKE_WINDOW logged (finite) losses."""

    def __init__(self, window: int = SPIKE_WINDOW, sigmas: float = SPIKE_SIGMAS, warmup: int = 10):
        self.window, self.sigmas, self.warmup, self.losses = window, sigmas, warmup, []

    def observe(self, step: int, loss: float) -> str | None:
        if not math.isfinite(loss):
            return None
        warning = None
        if len(self.losses) >= self.warmup:
            mean, sigma = statistics.fmean(self.losses), statistics.pstdev(self.losses)
            if sigma > 0 and loss > mean + self.sigmas * sigma:
                warning = (f"warning: loss spike at step {step}: {loss:.4f} > mean {mean:.4f} + {self.sigmas:g} "
                           f"sigma ({sigma:.4f}) of the last {len(self.losses)} logged steps")
        self.losses = (self.losses + [loss])[-self.window:]
        return warning
