"""The static pipeline schedule tables (plain numpy): every invariant the SPMD runtime relies on."""

import itertools

import numpy as np
import pytest

from jaxpar.parallel.schedule import IDLE, SCHEDULES, build, ideal_bubble

KINDS = [("1f1b", 1), ("1f1b", 2), ("1f1b", 4), ("gpipe", 1), ("zb", 1)]
SHAPES = [(1, 3), (2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24)]
ODD_SHAPES = [(2, 3), (4, 5), (8, 3)]  # m not a multiple of p (or m < p): no interleaving
CASES = [(kind, v, p, m) for (kind, v), (p, m) in itertools.product(KINDS, SHAPES)]
CASES += [(kind, 1, p, m) for kind in SCHEDULES for p, m in ODD_SHAPES]


def case_id(case):
    kind, v, p, m = case
    return f"{kind}-v{v}-p{p}-m{m}"


@pytest.fixture(params=CASES, ids=case_id)
def table(request):
    kind, v, p, m = request.param
    return build(kind, p, m, v)


def work_kinds(table):
    return "FBW" if table.kind == "zb" else "FB"


def items(table, kind):
    """{(microbatch, virtual stage): tick} of one slot kind; fails on a repeated item."""
    mb_table, chunk_table = table.table(kind)
    out = {}
    for (tick, stage), mb in np.ndenumerate(mb_table):
        if mb == IDLE:
            assert chunk_table[tick, stage] == 0, f"{kind} chunk set on an idle cell ({tick}, {stage})"
            continue
        chunk = int(chunk_table[tick, stage])
        assert 0 <= chunk < table.virtual and 0 <= mb < table.microbatches
        key = (int(mb), chunk * table.stages + stage)
        assert key not in out, f"{kind} of microbatch {mb}, virtual stage {key[1]} runs twice"
        out[key] = tick
    return out


def all_items(table):
    return set(itertools.product(range(table.microbatches), range(table.virtual * table.stages)))


# ----------------------------------------------------------------------------- dependencies
def test_each_item_runs_exactly_once(table):
    for kind in work_kinds(table):
        assert set(items(table, kind)) == all_items(table), kind
    if table.kind != "zb":
        assert (table.weight == IDLE).all() and (table.weight_chunk == 0).all()


def test_forward_consumer_runs_one_tick_after_producer(table):
    forward = items(table, "F")
    for (i, k), tick in forward.items():
        if k > 0:
            assert tick == forward[i, k - 1] + 1, (i, k)


def test_backward_consumer_runs_one_tick_after_producer(table):
    backward = items(table, "B")
    last = table.virtual * table.stages - 1
    for (i, k), tick in backward.items():
        if k < last:
            assert tick == backward[i, k + 1] + 1, (i, k)


def test_last_stage_backward_in_the_tick_of_its_forward(table):
    forward, backward = items(table, "F"), items(table, "B")
    last = table.virtual * table.stages - 1
    for i in range(table.microbatches):
        if table.kind == "gpipe":  # autodiff of the forward scan: after all forwards
            assert backward[i, last] > max(forward.values())
        else:
            assert backward[i, last] == forward[i, last], i


def test_loss_row_marks_the_last_virtual_stage_forward(table):
    forward = items(table, "F")
    last = table.virtual * table.stages - 1
    expected = np.full(table.ticks, IDLE)
    for i in range(table.microbatches):
        expected[forward[i, last]] = i
    np.testing.assert_array_equal(table.loss, expected)


@pytest.mark.parametrize("p,m", SHAPES + ODD_SHAPES)
def test_zb_weight_after_backward_on_every_stage_in_stage_0s_backward_tick(p, m):
    table = build("zb", p, m)
    backward, weight = items(table, "B"), items(table, "W")
    for (i, k), tick in weight.items():
        assert tick >= backward[i, k]
        assert tick == backward[i, 0] == i + 2 * (p - 1)
    assert sum((table.weight != IDLE).any(axis=1)) == m


# ----------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("p,m", SHAPES + ODD_SHAPES)
def test_1f1b_v1_is_pipedream_flush(p, m):
    table = build("1f1b", p, m)
    for (i, s), tick in items(table, "F").items():
        assert tick == i + s
    for (i, s), tick in items(table, "B").items():
        assert tick == i + 2 * (p - 1) - s
    expected = [("F", p - 1), ("FLB", m), ("B", p - 1)]
    assert [(ph.kinds, ph.count) for ph in table.phases] == [e for e in expected if e[1]]


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_matches_the_unit_formula(p, m, v):
    """Group g = i // p, r = i % p; F unit u = g v p + c p + r at tick u + s, B unit
    w = g v p + (v-1-c) p + r at tick w + (p-1-s) + v p - 1 (the derivation in the brief)."""
    table = build("1f1b", p, m, v)
    forward, backward = items(table, "F"), items(table, "B")
    for i, c, s in itertools.product(range(m), range(v), range(p)):
        g, r = divmod(i, p)
        assert forward[i, c * p + s] == g * v * p + c * p + r + s
        assert backward[i, c * p + s] == g * v * p + (v - 1 - c) * p + r + (p - 1 - s) + v * p - 1
    active = lambda t: (t != IDLE).any(axis=1).sum()  # noqa: E731
    assert active(table.forward) == active(table.backward) == v * m + p - 1


def test_zb_phases_p4_m8():
    table = build("zb", 4, 8)
    assert [(ph.kinds, ph.count) for ph in table.phases] == [("F", 3), ("FLB", 3), ("FLBW", 5), ("BW", 3)]


def test_bubble_fraction_closed_form(table):
    p, m, v = table.stages, table.microbatches, table.virtual
    expected = 2 * (p - 1) / (3 * m + 2 * (p - 1)) if table.kind == "zb" else (p - 1) / (v * m + p - 1)
    assert table.bubble_fraction() == pytest.approx(expected, abs=1e-12)
    assert table.idle_fraction() == pytest.approx(expected, abs=1e-12)  # unweighted: F, B idle alike
    if table.kind != "zb":
        assert table.bubble_fraction() == pytest.approx(ideal_bubble(p, m, v), abs=1e-12)


def test_zb_bubble_is_two_thirds_of_1f1b():
    for p, m in [(4, 8), (8, 16)]:
        zb_idle = build("zb", p, m).bubble_fraction() * (3 * m + 2 * (p - 1))  # in units of tF = tB = tW
        one_f_idle = build("1f1b", p, m).bubble_fraction() * 3 * (m + p - 1)
        assert zb_idle == pytest.approx(2 / 3 * one_f_idle)


# ----------------------------------------------------------------------------- phases
def test_phases_cover_all_ticks_with_exactly_the_active_kinds(table):
    rows = {"F": table.forward, "B": table.backward, "W": table.weight}
    tick = 0
    previous = None
    for phase in table.phases:
        assert phase.first == tick and phase.count > 0
        assert phase.kinds and phase.kinds == "".join(k for k in "FLBW" if k in phase.kinds)
        assert phase.kinds != previous, "phases must be maximal runs"
        for t in range(phase.first, phase.first + phase.count):
            active = {k for k, row in rows.items() if (row[t] != IDLE).any()}
            active |= {"L"} if table.loss[t] != IDLE else set()
            assert set(phase.kinds) == active, (t, phase)
        tick, previous = phase.first + phase.count, phase.kinds
    assert tick == table.ticks


def test_slots_follow_the_phases(table):
    columns = [(slot.tick, slot.kind) for slot in table.slots()]
    expected = [(t, k) for ph in table.phases for t in range(ph.first, ph.first + ph.count)
                for k in ph.kinds if k != "L"]
    assert columns == expected


# ----------------------------------------------------------------------------- stash
def test_stash_slot_never_overwritten_while_live(table):
    """Per stage, per tick: F writes (microbatch, chunk) to its slot, then B and W read theirs."""
    assert set(table.stash) == {"F", "B", "W"}
    for kind in "FBW":
        mb, _ = table.table(kind)
        np.testing.assert_array_equal(table.stash[kind] == IDLE, mb == IDLE, err_msg=kind)
        assert table.stash[kind].max() < table.stash_slots
    for stage in range(table.stages):
        held = [None] * table.stash_slots
        for tick in range(table.ticks):
            for kind in work_kinds(table):
                mb, chunk = (a[tick, stage] for a in table.table(kind))
                if mb == IDLE:
                    continue
                slot = table.stash[kind][tick, stage]
                if kind == "F":
                    held[slot] = (mb, chunk)
                else:
                    assert held[slot] == (mb, chunk), (kind, tick, stage, slot)


def test_in_flight_counts_live_entries_and_stash_slots_cover_them(table):
    forward = items(table, "F")
    last_use = items(table, "W" if table.kind == "zb" else "B")
    p = table.stages
    expected = np.zeros(p, int)
    for stage in range(p):
        for t in range(table.ticks):
            live = sum(forward[key] <= t <= last_use[key] for key in forward if key[1] % p == stage)
            expected[stage] = max(expected[stage], live)
    np.testing.assert_array_equal(table.in_flight(), expected)
    assert table.stash_slots >= table.in_flight().max()
    assert table.stash_slots == table.in_flight().max()  # greedy interval colouring is optimal


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_in_flight_is_flat_in_m(p):
    """Stage s holds 2(p-1-s)+1 microbatches once m is that large; interleaved, (v+1)p-1-2s chunk
    inputs once m >= 2p: below 2vp-1 either way, and independent of m."""
    for m in range(4, 65, 4):
        flat = [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]
        np.testing.assert_array_equal(build("1f1b", p, m).in_flight(), flat)
        for v in (2, 4):
            if m % p == 0 and m >= 2 * p:
                peak = build("1f1b", p, m, v).in_flight()
                np.testing.assert_array_equal(peak, [(v + 1) * p - 1 - 2 * s for s in range(p)])
                assert peak.max() < 2 * v * p - 1


def test_gpipe_in_flight_grows_with_m():
    for m in range(4, 65, 4):
        assert build("gpipe", 4, m).in_flight().max() == m


@pytest.mark.parametrize("p,m", SHAPES + ODD_SHAPES)
def test_zb_peak_in_flight_equals_1f1b(p, m):
    assert build("zb", p, m).in_flight().max() == build("1f1b", p, m).in_flight().max()
    assert build("zb", p, m).stash_slots == build("1f1b", p, m).stash_slots


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args,fragment", [
    (("pipedream", 4, 8), "unknown pipeline schedule 'pipedream'; use one of 1f1b, gpipe, zb"),
    (("1f1b", 4, 8, 0), "virtual=0 must be >= 1"),
    (("zb", 4, 8, 2), "schedule 'zb' does not interleave (virtual=2); use virtual=1"),
    (("gpipe", 4, 8, 2), "schedule 'gpipe' does not interleave (virtual=2); use virtual=1"),
    (("1f1b", 4, 6, 2), "needs microbatches (6) divisible by stages (4); use microbatches=8 or virtual=1"),
    (("1f1b", 4, 0), "microbatches=0 must be >= 1"),
    (("1f1b", 0, 4), "stages=0 must be >= 1"),
])
def test_build_refuses_with_one_line(args, fragment):
    with pytest.raises(ValueError) as error:
        build(*args)
    assert fragment in str(error.value) and "\n" not in str(error.value)
