"""Step metrics: MFU, metrics.jsonl, TensorBoard events and the console progress line.

MFU = model FLOPs per second / (devices x peak dense bf16 FLOP/s). Model FLOPs are analytic
(jaxpar.models.flops): XLA's cost analysis counts a scan body once, so it cannot be used.
"""

from __future__ import annotations

import json
import pathlib

import jax

from jaxpar.compiler.hardware import profile_for
from jaxpar.files import write_atomic


def peak_flops_per_device(override_tflops: float = 0.0) -> float | None:
    """Peak dense bf16 FLOP/s of one device; None when unknown (e.g. CPU) and not configured."""
    if override_tflops > 0:
        return override_tflops * 1e12
    profile = profile_for(jax.devices()[0].device_kind)
    return profile.peak_flops if profile is not None else None


def mfu(flops_per_step: float, step_time_s: float, n_devices: int, peak_per_device: float | None) -> float | None:
    if peak_per_device is None or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / (n_devices * peak_per_device)


class MetricsWriter:
    """Appends one JSON object per step to WORKDIR/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, workdir: pathlib.Path, enabled: bool = True, resume_after: int = 0):
        self.enabled = enabled
        self.path = workdir / "metrics.jsonl"
        self._tb = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            self._keep_until(resume_after)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(workdir / "tb"))

    def _keep_until(self, step: int) -> None:
        """On resume keep the records up to the checkpointed step (so no step is logged twice);
        a fresh run (step 0) starts a fresh log."""
        kept = []
        if step and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
        write_atomic(self.path, "".join(line + "\n" for line in kept))  # a crash here keeps the old log

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
