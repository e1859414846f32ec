"""Pipeline schedules as static tables: tick x stage -> which microbatch runs forward / backward.

The one table drives the scan in jaxpar.parallel.pipeline, the bubble figure and the picture made by
scripts/plot_schedule.py, so the three cannot disagree.

1F1B (PipeDream-flush / Megatron): forward of microbatch i on stage s at tick i + s; the last stage
computes the loss and starts the backward in the same tick; backward of i on stage s at tick
i + 2(p-1) - s. Ticks fall into three phases in which every stage does the same kind of work (the
SPMD program cannot branch per stage, see docs/design.md): p-1 warm-up ticks (forward slot only),
m steady ticks (forward + backward slot), p-1 cool-down ticks (backward slot only). Stage s holds at
most 2(p-1-s)+1 <= 2p-1 microbatches in flight, whatever m is.

GPipe: all forwards (m+p-1 ticks), then all backwards in reverse order (m+p-1 ticks).

Both execute (m+p-1) forward slots and (m+p-1) backward slots per stage, of which m each are busy:
the idle (bubble) fraction is (p-1)/(m+p-1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

IDLE = -1
SCHEDULES = ("1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One column of the executed program: a forward or a backward slot of one tick."""

    kind: str  # "F" or "B"
    tick: int
    microbatch_per_stage: tuple[int, ...]  # IDLE where the stage has nothing to do


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str
    stages: int
    microbatches: int
    forward: np.ndarray  # [ticks, stages] microbatch index or IDLE
    backward: np.ndarray  # [ticks, stages]
    phases: tuple[tuple[str, int, int], ...]  # (name, first tick, tick count); name in warmup/steady/cooldown/...

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def slots(self) -> list[Slot]:
        """The executed F/B slots in time order: warm-up ticks only run F, cool-down ticks only B."""
        out = []
        for name, first, count in self.phases:
            kinds = {"warmup": "F", "steady": "FB", "cooldown": "B", "forward": "F", "backward": "B"}[name]
            for tick in range(first, first + count):
                for kind in kinds:
                    table = self.forward if kind == "F" else self.backward
                    out.append(Slot(kind, tick, tuple(int(v) for v in table[tick])))
        return out

    def idle_fraction(self) -> float:
        cells = [mb for slot in self.slots() for mb in slot.microbatch_per_stage]
        return sum(mb == IDLE for mb in cells) / len(cells)

    def in_flight(self) -> np.ndarray:
        """Per stage, the most microbatches forwarded but not yet backwarded at any tick."""
        peak = np.zeros(self.stages, int)
        for stage in range(self.stages):
            live = 0
            for tick in range(self.ticks):
                live += self.forward[tick, stage] != IDLE
                peak[stage] = max(peak[stage], live)
                live -= self.backward[tick, stage] != IDLE
        return peak


def ideal_bubble(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    p, m = stages, microbatches
    ticks = m + 2 * (p - 1)
    forward = np.full((ticks, p), IDLE, int)
    backward = np.full((ticks, p), IDLE, int)
    for i in range(m):
        for s in range(p):
            forward[i + s, s] = i
            backward[i + 2 * (p - 1) - s, s] = i
    phases = (("warmup", 0, p - 1), ("steady", p - 1, m), ("cooldown", m + p - 1, p - 1))
    return Schedule("1f1b", p, m, forward, backward, phases)


def gpipe(stages: int, microbatches: int) -> Schedule:
    p, m = stages, microbatches
    half = m + p - 1
    forward = np.full((2 * half, p), IDLE, int)
    backward = np.full((2 * half, p), IDLE, int)
    for i in range(m):
        for s in range(p):
            forward[i + s, s] = i
            backward[half + (m - 1 - i) + (p - 1 - s), s] = i
    return Schedule("gpipe", p, m, forward, backward, (("forward", 0, half), ("backward", half, half)))


def build(kind: str, stages: int, microbatches: int) -> Schedule:
    if kind == "1f1b":
        return one_f_one_b(stages, microbatches)
    if kind == "gpipe":
        return gpipe(stages, microbatches)
    raise ValueError(f"unknown pipeline schedule '{kind}'; use one of {', '.join(SCHEDULES)}")
