"""The order of every pipeline schedule table, stage by stage, written out from the schedules' definitions.

Why: tests/test_schedule.py checks the invariants the runtime needs (each item once, a consumer one tick
after its producer, the stash), and 1F1B's closed-form ticks, but a table can keep all of them and still
run a stage's slots in the wrong order: GPipe's backward in forward microbatch order passed the whole
fast suite (issue 46). Here each stage's timeline, tick by tick, is compared with one spelled out by
hand for small cases and built from the definitions below for a grid of p and m; the definitions
never use schedule.py's tick formulas.

A timeline cell is the slots one stage runs in one tick, in the runtime's order F, B, W: "F3" is the
forward of microbatch 3, "F3c1" the same through the stage's local chunk 1 (interleaved), "." idle.

- gpipe: every stage forwards microbatches 0..m-1 (stage s from tick s), then, after the last stage's
  last forward, runs the backwards in REVERSE microbatch order, the last stage first (stage s starts
  p-1-s ticks after the last stage).
- 1f1b (v = 1, PipeDream-flush in lockstep): stage s forwards 0..m-1 from tick s and runs the
  backwards in the SAME order, one per tick, beginning once its warmup forwards are done. Lockstep, the
  warmup is 2(p-1-s) forwards (the ticks microbatch 0 takes to reach the last stage and come back), not
  Megatron's p-1-s: an asynchronous stage 0 waits for B0 where a lockstep one keeps forwarding (the
  stash of 2(p-1-s)+1 that issue 46 item 3 wants bounded at Megatron's p). A schedule that adopts
  Megatron's warmup changes WARMUP below, on purpose.
- interleaved 1f1b (v > 1, Megatron): microbatches go in groups of p; stage s forwards a group through
  its chunk 0, then the same group through chunk 1, ..., chunk v-1, then the next group; its backwards
  go group by group too, with the chunks in reverse (v-1 first). Forwards start at tick s, backwards
  after Megatron's interleaved warmup, (v-1) p + 2(p-1-s) forwards.
- zb: 1f1b's F and B; the weight gradient W of microbatch i runs on every stage in one tick, in
  microbatch order, beginning where stage 0 runs its first B.
"""

import itertools

import numpy as np
import pytest

from jaxpar.parallel.schedule import IDLE, SCHEDULES, build


def timeline(table, stage: int) -> list[str]:
    """The table's stage column as cells ("F0B3", "F1c1", "."), one per tick."""
    cells = []
    for tick in range(table.ticks):
        cell = ""
        for kind in "FBW":
            mb, chunk = (int(a[tick, stage]) for a in table.table(kind))
            if mb != IDLE:
                cell += f"{kind}{mb}" + (f"c{chunk}" if table.virtual > 1 else "")
        cells.append(cell or ".")
    return cells


def written(rows: str) -> list[list[str]]:
    """Hand-written timelines: one line per stage, cells separated by spaces."""
    return [line.split() for line in rows.strip().splitlines()]


def place(ticks: int, runs: list[tuple[str, int, list[str]]]) -> list[str]:
    """A timeline of `ticks` cells from runs (kind, first tick, items), one item per tick, each tick's
    slots in F, B, W order."""
    slots = [dict() for _ in range(ticks)]
    for kind, first, items in runs:
        for offset, item in enumerate(items):
            assert kind not in slots[first + offset], "two items of one kind in a tick"
            slots[first + offset][kind] = kind + item
    return ["".join(cell[k] for k in "FBW" if k in cell) or "." for cell in slots]


# ----------------------------------------------------------------------------- by hand
BY_HAND = {
    ("gpipe", 2, 4, 1): """
        F0 F1 F2 F3 .  .  B3 B2 B1 B0
        .  F0 F1 F2 F3 B3 B2 B1 B0 .
    """,
    ("gpipe", 3, 4, 1): """
        F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
        .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
        .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .
    """,
    ("1f1b", 2, 4, 1): """
        F0 F1   F2B0 F3B1 B2   B3
        .  F0B0 F1B1 F2B2 F3B3 .
    """,
    ("1f1b", 3, 4, 1): """
        F0 F1   F2   F3   B0   B1   B2 B3
        .  F0   F1   F2B0 F3B1 B2   B3 .
        .  .    F0B0 F1B1 F2B2 F3B3 .  .
    """,
    ("1f1b", 4, 4, 1): """
        F0 F1 F2   F3   .    .    B0   B1 B2 B3
        .  F0 F1   F2   F3   B0   B1   B2 B3 .
        .  .  F0   F1   F2B0 F3B1 B2   B3 .  .
        .  .  .    F0B0 F1B1 F2B2 F3B3 .  .  .
    """,
    ("1f1b", 2, 4, 2): """
        F0c0 F1c0 F0c1     F1c1     F2c0B0c1 F3c0B1c1 F2c1B0c0 F3c1B1c0 B2c1 B3c1 B2c0 B3c0
        .    F0c0 F1c0     F0c1B0c1 F1c1B1c1 F2c0B0c0 F3c0B1c0 F2c1B2c1 F3c1B3c1 B2c0 B3c0 .
    """,
    ("zb", 2, 4, 1): """
        F0 F1   F2B0W0 F3B1W1 B2W2   B3W3
        .  F0B0 F1B1W0 F2B2W1 F3B3W2 W3
    """,
}


@pytest.mark.parametrize("case", BY_HAND, ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}")
def test_small_tables_match_the_timelines_written_by_hand(case):
    kind, p, m, v = case
    table = build(kind, p, m, v)
    expected = written(BY_HAND[case])
    assert len(expected) == p
    for stage in range(p):
        assert timeline(table, stage) == expected[stage], f"stage {stage}"


# ----------------------------------------------------------------------------- from the definitions
def gpipe(p: int, m: int) -> list[list[str]]:
    forward_end = m + p - 1  # the last stage's last forward runs at tick m + p - 2
    order = [str(i) for i in range(m)]
    return [place(2 * forward_end, [("F", s, order), ("B", forward_end + p - 1 - s, order[::-1])])
            for s in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1, weight: bool = False) -> list[list[str]]:
    """1F1B (v = 1), interleaved (v > 1) and, with `weight`, zb: see the module docstring."""
    name = (lambda i, c: f"{i}c{c}") if v > 1 else (lambda i, c: str(i))  # noqa: E731
    groups = [range(g * p, min(g * p + p, m)) for g in range(-(-m // p))]
    forwards = [name(i, c) for group in groups for c in range(v) for i in group]
    backwards = [name(i, c) for group in groups for c in reversed(range(v)) for i in group]
    ticks = v * m + (v - 1) * p + 2 * (p - 1)
    rows = []
    for s in range(p):
        warmup = (v - 1) * p + 2 * (p - 1 - s)
        runs = [("F", s, forwards), ("B", s + warmup, backwards)]
        if weight:
            runs.append(("W", 2 * (p - 1), [str(i) for i in range(m)]))
        rows.append(place(ticks, runs))
    return rows


GRID = [(p, m) for p in (2, 3, 4) for m in range(4, 9)]
DEFINED = {
    "gpipe": [((p, m, 1), lambda p=p, m=m: gpipe(p, m)) for p, m in GRID],
    "1f1b": [((p, m, 1), lambda p=p, m=m: one_f_one_b(p, m)) for p, m in GRID]
    + [((p, m, v), lambda p=p, m=m, v=v: one_f_one_b(p, m, v)) for p, m in GRID for v in (2, 3) if m % p == 0],
    "zb": [((p, m, 1), lambda p=p, m=m: one_f_one_b(p, m, weight=True)) for p, m in GRID],
}
CASES = [(kind, shape, rows) for kind, cases in DEFINED.items() for shape, rows in cases]


def test_every_schedule_build_accepts_is_defined_here():
    """A new schedule kind must bring its order here."""
    assert set(DEFINED) == set(SCHEDULES)


@pytest.mark.parametrize("kind,shape,rows", CASES, ids=[f"{k}-p{p}-m{m}-v{v}" for k, (p, m, v), _ in CASES])
def test_each_stage_runs_its_slots_in_the_defined_order(kind, shape, rows):
    p, m, v = shape
    table = build(kind, p, m, v)
    expected = rows()
    assert table.ticks == len(expected[0])
    for stage in range(p):
        assert timeline(table, stage) == expected[stage], f"stage {stage}"
