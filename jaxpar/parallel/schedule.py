"""Pipeline schedules as static tables for a lockstep SPMD pipeline.

Why a table: every device runs the same program (one shard_map, no per-stage branches: divergent
collectives deadlock, see docs/design.md), so the pipeline is a scan over ticks in which each device
reads its own column of a [ticks, stages] table. The one table drives jaxpar.parallel.pipeline, the
bubble figure and scripts/plot_schedule.py, so for 1F1B, interleaved and zero-bubble the three cannot
disagree. GPipe is the exception: its table's forward half drives the forward scans, but its
backward is JAX's transpose of them, which the table's backward half only describes.

A tick has up to four slots, run in this order on every device: forward (F), loss (L, meaningful on
the last stage only), backward (B) and weight gradient (W, zero-bubble only). A kind costs time in a
tick when ANY stage has work of that kind (the others compute masked garbage), so the phases are
maximal runs of ticks with the same set of active kinds: one tick body per phase.

Invariants the runtime relies on (tests/test_schedule.py checks each):
- a consumer runs exactly one tick after its producer, so one ppermute per tick carries the
  activation: F(i, k) = F(i, k-1) + 1 and B(i, k) = B(i, k+1) + 1 for virtual stage k;
- B(i, last) runs in the tick of F(i, last), after L made the loss and its cotangent (not gpipe,
  whose backward is autodiff of the forward scan; its table is still truthful);
- W(i, k) >= B(i, k); each (microbatch, virtual stage, kind) runs once; a stage runs at most one
  item of a kind per tick.

Virtual stages (Megatron interleaving): virtual stage k = chunk * p + stage, so device s holds chunks
s, s+p, s+2p, ...; with v > 1 activations also go round the ring p-1 -> 0 (F) and 0 -> p-1 (B).

1f1b: microbatch i = g p + r (r < p) has base tick b = g v p + r; F(i, k) = b + k and
B(i, k) = b + 2(vp - 1) - k. With v = 1 this is PipeDream-flush (F at i + s, B at i + 2(p-1) - s;
phases F x (p-1), FLB x m, B x (p-1)). With v > 1 (m % p == 0) each device forwards p microbatches
through one chunk, then the same p through its next chunk; F and B are each active in vm + p - 1
ticks of 1/v the work, so the bubble is (p-1)/(vm+p-1). L is active only in the ticks where chunk
v-1 of the last stage forwards, so the steady state alternates FLB and FB phases.
gpipe: all forwards, then all backwards in reverse order (phases F, FL, B).
zb (zero bubble, Qi et al. 2023): the backward is split into B (input gradient, on the critical
path) and W (weight gradient, which may come late). F and B are 1f1b's; W(i) runs on EVERY stage in
the tick of stage 0's B(i) = i + 2(p-1), so W is active in only m ticks (p=4, m=8: F x3, FLB x3,
FLBW x5, BW x3, B x3).

Why zb gives 2/3 of 1F1B's bubble here, not ZB-H1's 1/3: ZB-H1 fills each device's own idle time
with its delayed W's, which needs per-device timing. In lockstep, stage 0's m forward ticks T and the
chain F(i, k) = F(i, 0) + k make F active in T + {0..p-1}: at least m + p - 1 ticks; likewise B; W
needs m. So any schedule obeying the invariants costs at least (m+p-1)(tF+tB) + m tW, and zb reaches
it: bubble (p-1)(tF+tB) against 1F1B's (p-1)(tF+tB+tW), whose B includes W; 2/3 when tF=tB=tW.

Stash: F writes its stage input to a slot that B (and W for zb) reads. A slot is live from its F
tick to its last use, inclusive (F runs before B/W in a tick, so a slot freed at t is reusable at
t+1). Slots are allocated statically per stage, greedily (lowest free slot) in F order, which is
optimal for intervals: stash_slots = max over stages of the peak live entries (in_flight()).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

IDLE = -1
SCHEDULES = ("1f1b", "gpipe", "zb")
KINDS = "FLBW"


@dataclasses.dataclass(frozen=True)
class Phase:
    """Ticks first .. first+count-1, in each of which exactly the slot kinds in `kinds` are active."""

    kinds: str  # subset of "FLBW" in that order
    first: int
    count: int


@dataclasses.dataclass(frozen=True)
class Slot:
    """One executed column of the program (for pictures): one kind in one tick, every stage's item."""

    kind: str  # "F", "B" or "W"
    tick: int
    microbatch_per_stage: tuple[int, ...]  # IDLE where the stage computes masked garbage
    chunk_per_stage: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static program of one pipelined step; tables are indexed [tick, stage]."""

    kind: str
    stages: int
    microbatches: int
    virtual: int
    forward: np.ndarray  # [ticks, stages] microbatch index or IDLE
    forward_chunk: np.ndarray  # [ticks, stages] local chunk 0..virtual-1 (0 where IDLE)
    backward: np.ndarray
    backward_chunk: np.ndarray
    weight: np.ndarray  # all IDLE unless kind == "zb"
    weight_chunk: np.ndarray
    loss: np.ndarray  # [ticks] microbatch whose last virtual stage forwards in this tick, or IDLE
    stash: dict  # {"F": slot written, "B": slot read, "W": slot read}, [ticks, stages], IDLE where no work
    stash_slots: int
    phases: tuple[Phase, ...]

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def table(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(microbatch, chunk) tables of slot kind "F", "B" or "W"."""
        return {"F": (self.forward, self.forward_chunk), "B": (self.backward, self.backward_chunk),
                "W": (self.weight, self.weight_chunk)}[kind]

    def slots(self) -> list[Slot]:
        """The executed F/B/W columns in program order (L is not a column: it is not stage work)."""
        out = []
        for phase in self.phases:
            for tick in range(phase.first, phase.first + phase.count):
                for kind in phase.kinds.replace("L", ""):
                    mb, chunk = self.table(kind)
                    out.append(Slot(kind, tick, tuple(map(int, mb[tick])), tuple(map(int, chunk[tick]))))
        return out

    @property
    def costs(self) -> dict[str, int]:
        """Relative time of a slot kind: B does the weight gradient too unless zb splits it off as W."""
        return {"F": 1, "B": 1, "W": 1} if self.kind == "zb" else {"F": 1, "B": 2}

    def _idle(self, costs: dict) -> float:
        """1 - busy / executed over every executed column, each weighted by its kind's cost."""
        executed = busy = 0.0
        for slot in self.slots():
            executed += costs[slot.kind] * self.stages
            busy += costs[slot.kind] * sum(mb != IDLE for mb in slot.microbatch_per_stage)
        return 1.0 - busy / executed

    def bubble_fraction(self, costs: dict | None = None) -> float:
        """Idle share of executed time, each slot weighted by its kind's cost (L is not counted):
        `costs` {kind: FLOPs or seconds of one slot} as measured (the dry run: the compiled program's
        FLOPs by slot, jaxpar.parallel.pipeline.measured_slot_flops) or modelled (the planner), else
        the nominal `Schedule.costs`. 1F1B's and GPipe's bubble is (p-1)/(vm+p-1) whatever F : B
        costs; zb's depends on F : B : W."""
        return self._idle(costs or self.costs)

    def idle_fraction(self) -> float:
        """Unweighted idle share of executed F/B/W cells (the old figure; prefer bubble_fraction)."""
        return self._idle({"F": 1, "B": 1, "W": 1})

    def gradients_final(self) -> dict:
        """The tick after which each gradient accumulator stops changing (1f1b family; not gpipe, whose
        backward is autodiff): {"head": last L, "chunks": (last tick any stage adds to chunk c, per c),
        "first": stage 0's last chunk-0 B}. The runtime reduces each over dp right after its tick, so
        the rest of the schedule can overlap it: the head during the cooldown, chunk c of an
        interleaved pipeline during the c p ticks after stage 0's last backward of it."""
        mb, chunk = self.table("W" if self.kind == "zb" else "B")
        last = lambda cells: int(np.nonzero(cells)[0].max())  # noqa: E731
        chunks = tuple(last(((mb != IDLE) & (chunk == c)).any(axis=1)) for c in range(self.virtual))
        first = last((self.backward[:, 0] != IDLE) & (self.backward_chunk[:, 0] == 0))
        return {"head": last(self.loss != IDLE), "chunks": chunks, "first": first}

    def in_flight(self) -> np.ndarray:
        """Per stage, the peak number of live stash entries (each one chunk's stage input)."""
        written = np.cumsum(self.stash["F"] != IDLE, axis=0)
        last = self.stash["W" if self.kind == "zb" else "B"] != IDLE
        freed_before = np.cumsum(last, axis=0) - last
        return (written - freed_before).max(axis=0)


def ideal_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """(p-1)/(vm+p-1): 1f1b's (interleaved or not) and gpipe's bubble_fraction, for the planner."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def _check(kind: str, stages: int, microbatches: int, virtual: int) -> None:
    """One line per mistake, naming the cause and the fix."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{kind}'; use one of {', '.join(SCHEDULES)}")
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if virtual < 1:
        raise ValueError(f"virtual={virtual} must be >= 1 (model chunks per stage; 1 = no interleaving)")
    if virtual > 1 and kind != "1f1b":
        raise ValueError(f"schedule '{kind}' does not interleave (virtual={virtual}); use virtual=1, "
                         "or schedule '1f1b' to interleave")
    if virtual > 1 and microbatches % stages:
        fit = -(-microbatches // stages) * stages
        raise ValueError(f"interleaved 1f1b (virtual={virtual}) needs microbatches ({microbatches}) divisible "
                         f"by stages ({stages}); use microbatches={fit} or virtual=1")


def _item_ticks(kind: str, p: int, m: int, v: int) -> dict[str, np.ndarray]:
    """Tick of every work item, [m, v p] per kind, indexed by (microbatch, virtual stage)."""
    i, k = np.arange(m)[:, None], np.arange(v * p)[None, :]
    if kind == "gpipe":
        half = m + p - 1
        return {"F": i + k, "B": half + (m - 1 - i) + (p - 1 - k)}
    base = (i // p) * v * p + i % p
    ticks = {"F": base + k, "B": base + 2 * (v * p - 1) - k}
    if kind == "zb":
        ticks["W"] = np.broadcast_to(i + 2 * (p - 1), ticks["F"].shape)
    return ticks


def _fill(item_ticks: np.ndarray, ticks: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """[ticks, stages] microbatch and chunk tables from item ticks; refuses two items in one cell."""
    mb, chunk = np.full((ticks, p), IDLE), np.zeros((ticks, p), int)
    for (i, k), t in np.ndenumerate(item_ticks):
        if mb[t, k % p] != IDLE:
            raise AssertionError(f"two items in tick {t} on stage {k % p}")
        mb[t, k % p], chunk[t, k % p] = i, k // p
    return mb, chunk


def _stash(item: dict[str, np.ndarray], ticks: int, p: int) -> tuple[dict, int]:
    """Greedy lowest-free-slot allocation per stage, in F order, of the intervals [F, last use]."""
    last = item["W"] if "W" in item else item["B"]
    slot_of = np.full(item["F"].shape, IDLE)
    for s in range(p):
        free_after: list[int] = []  # per slot, the last tick it is live
        own = [(i, k) for k in range(s, item["F"].shape[1], p) for i in range(item["F"].shape[0])]
        for i, k in sorted(own, key=lambda ik: item["F"][ik]):
            slot = next((n for n, t in enumerate(free_after) if t < item["F"][i, k]), len(free_after))
            free_after[slot:slot + 1] = [last[i, k]]
            slot_of[i, k] = slot
    stash = {}
    for name, when in item.items():
        table = np.full((ticks, p), IDLE)
        for (i, k), t in np.ndenumerate(when):
            table[t, k % p] = slot_of[i, k]
        stash[name] = table
    stash.setdefault("W", np.full((ticks, p), IDLE))
    return stash, int(slot_of.max()) + 1


def _phases(active: np.ndarray) -> tuple[Phase, ...]:
    """Maximal runs of ticks with the same active kinds; `active` is [ticks, 4] over F, L, B, W."""
    names = ["".join(c for c, on in zip(KINDS, row) if on) for row in active]
    phases, first = [], 0
    for t in range(1, len(names) + 1):
        if t == len(names) or names[t] != names[first]:
            phases.append(Phase(names[first], first, t - first))
            first = t
    return tuple(phases)


@functools.lru_cache(maxsize=512)
def build(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The table of schedule `kind` for p stages, m microbatches and v model chunks per stage. Cached
    (the planner's recommender asks for the same few tables thousands of times), so its arrays are
    read-only: a caller that wrote into one would change every later caller's table."""
    _check(kind, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    item = _item_ticks(kind, p, m, v)
    ticks = 1 + max(int(t.max()) for t in item.values())
    tables = {name: _fill(item.get(name, np.empty((0, 0), int)), ticks, p) for name in "FBW"}
    loss = np.full(ticks, IDLE)
    loss[item["F"][:, -1]] = np.arange(m)
    stash, slots = _stash(item, ticks, p)
    active = np.stack([tables["F"][0].max(1) > IDLE, loss > IDLE, tables["B"][0].max(1) > IDLE,
                       tables["W"][0].max(1) > IDLE], axis=1)
    for array in (*tables["F"], *tables["B"], *tables["W"], loss, *stash.values()):
        array.flags.writeable = False
    return Schedule(kind, p, m, v, *tables["F"], *tables["B"], *tables["W"], loss, stash, slots,
                    _phases(active))


def pipeline_table(config) -> Schedule | None:
    """The schedule table a config's pipeline runs (None without a pipeline); a validated config
    always builds one."""
    pp = config.pipeline
    if config.mesh.pp <= 1:
        return None
    return build(pp.schedule, config.mesh.pp, pp.microbatches, virtual=pp.virtual_stages)


def bubble_fraction(config, costs: dict | None = None) -> float:
    """Idle share of the executed pipeline slots from the schedule table, each slot weighted by `costs`
    (default the nominal F=1, B=2; zb F=B=W=1), 0 without a pipeline."""
    table = pipeline_table(config)
    return 0.0 if table is None else float(table.bubble_fraction(costs))
