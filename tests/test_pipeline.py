"""Pipeline parallelism: single-device equivalence of every schedule, and flat memory in m.

The schedule tables themselves are tested in tests/test_schedule.py."""

import collections
import dataclasses
import re

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.compiler import hlo_collectives
from jaxpar.config import ModelConfig, PipelineConfig, RematConfig
from jaxpar.compiler.dry_run import dry_run
from jaxpar.parallel.pipeline import Pipeline
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

FOUR_LAYERS = dataclasses.replace(TINY_MODEL, n_layers=4)
BATCH = 24  # divisible by dp x m for every case below


# ----------------------------------------------------------------------------- equivalence with one device
EIGHT_LAYERS = dataclasses.replace(TINY_MODEL, n_layers=8)  # (1,4,1) interleaved: 2 layers per stage



def pipeline_config(layout, schedule, m, remat="none", virtual=1, precision="fp32", recompute=False):
    dp, pp, tp = layout
    model = EIGHT_LAYERS if pp * virtual > 4 else FOUR_LAYERS
    config = make_config(dp=dp, pp=pp, tp=tp, stage=1 if dp > 1 else 0, model=model, global_batch_size=BATCH,
                         precision=precision)
    return dataclasses.replace(config, remat=RematConfig(policy=remat), pipeline=PipelineConfig(
        schedule=schedule, microbatches=m, virtual_stages=virtual, stage_recompute=recompute))


def assert_matches_single_device(config):
    ref_grads, ref_losses, _ = reference(model=config.model, global_batch_size=BATCH)
    grads, losses, state = run(config)
    if config.precision == "bf16":  # bf16 compute: close to the fp32 reference, not equal (see test_equivalence)
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=0, atol=0.03 * np.max(np.abs(e))),
                     grads, ref_grads)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert_grads_close(grads, ref_grads)
    dp, pp, tp = config.mesh.dp, config.mesh.pp, config.mesh.tp
    wq = state.params["layers"]["wq"]  # [layers, embed, heads, head_dim]: layers over pp, heads over tp
    local = {shard.data.shape for shard in wq.addressable_shards}
    assert local == {(config.model.n_layers // pp, wq.shape[1], wq.shape[2] // tp, wq.shape[3])}
    assert len(wq.sharding.device_set) == dp * pp * tp
    head = state.params["lm_head"]  # [embed, vocab]: the vocabulary over pp x tp, not replicated over pp
    assert {shard.data.shape for shard in head.addressable_shards} == {(head.shape[0], head.shape[1] // (pp * tp))}


SCHEDULES = [("1f1b", 1), ("1f1b", 2), ("zb", 1), ("gpipe", 1)]
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 4)]
MICROBATCHES = {(1, 2, 1): 4, (1, 4, 1): 8, (2, 2, 2): 4, (1, 2, 4): 2}

# The fast suite: every schedule and remat policy at least once, on different layouts.
FAST = [((2, 2, 2), "1f1b", 1, "none"), ((1, 2, 4), "1f1b", 1, "full"), ((1, 2, 1), "1f1b", 2, "selective"),
        ((1, 4, 1), "zb", 1, "none"), ((1, 2, 1), "gpipe", 1, "full")]


@pytest.mark.parametrize("layout,schedule,virtual,remat", FAST)
def test_pipeline_matches_single_device(layout, schedule, virtual, remat):
    assert_matches_single_device(pipeline_config(layout, schedule, MICROBATCHES[layout], remat, virtual))


@pytest.mark.parametrize("layout,virtual,remat", [((1, 2, 4), 2, "selective"),
                                                  pytest.param((2, 2, 2), 1, "none", marks=pytest.mark.slow)])
def test_reading_backward_residuals_before_the_forward_writes_matches_single_device(monkeypatch, layout, virtual,
                                                                                     remat):
    """GPU programs read a tick's B residuals before its F writes the stash, B taking F's fresh ones where
    the slots match (Pipeline._entries_before_forward); XLA:CPU does not by default. Forced on here."""
    monkeypatch.setattr(Pipeline, "read_stash_early", True)
    assert_matches_single_device(pipeline_config(layout, "1f1b", MICROBATCHES[layout], remat, virtual))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "selective", "full"])
@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_matrix_matches_single_device(layout, schedule, virtual, remat):
    """The issue's whole matrix: {(1,2,1), (1,4,1), (2,2,2), (1,2,4)} x {1f1b, interleaved, zb, gpipe} x remat."""
    if (layout, schedule, virtual, remat) in FAST:
        pytest.skip("in the fast suite")
    assert_matches_single_device(pipeline_config(layout, schedule, MICROBATCHES[layout], remat, virtual))


def test_stage_recompute_matches_single_device():
    assert_matches_single_device(pipeline_config((1, 2, 2), "1f1b", 4, "selective", recompute=True))


def test_a_stage_whose_layers_the_virtual_stages_do_not_divide_fails_loudly():
    """Config validation refuses it; a config built past validation (as the tests' helpers do) must not run
    chunks of no layer, which trained the embedding and head alone and passed as a pipeline (the first
    version of tests/test_fp8.py's once-per-step test did: 2 layers over pp 2 x 2 virtual stages)."""
    config = pipeline_config((1, 2, 1), "1f1b", 4, virtual=2)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=2))
    with pytest.raises(ValueError, match=r"^pipeline.virtual_stages=2 does not divide the 1 layers per stage"):
        run(config)


@pytest.mark.slow  # two bf16 compiles
def test_bf16_pipeline_is_close_to_single_device():
    assert_matches_single_device(pipeline_config((2, 2, 2), "1f1b", 4, "none", virtual=2, precision="bf16"))


@pytest.mark.slow  # `make test` runs (2,2,2) ZeRO-2 with 1F1B (v = 2): test_early_dp_reductions_match_single_device
def test_pipeline_with_zero2_matches_single_device():
    ref_grads, ref_losses, _ = reference(model=FOUR_LAYERS, global_batch_size=BATCH)
    config = make_config(dp=2, pp=2, tp=2, stage=2, model=FOUR_LAYERS, global_batch_size=BATCH)
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule="1f1b", microbatches=6))
    grads, losses, _ = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


# ----------------------------------------------------------------------------- dp reductions issued early

def dp_config(schedule, virtual, stage):
    config = pipeline_config((2, 2, 2), schedule, 4, "none", virtual)
    return dataclasses.replace(config, zero=dataclasses.replace(config.zero, stage=stage))


@pytest.mark.parametrize("schedule,virtual,stage", [("1f1b", 2, 2), pytest.param("zb", 1, 1, marks=pytest.mark.slow)])
def test_early_dp_reductions_match_single_device(schedule, virtual, stage):
    """Each part is reduced over dp once its gradient is final: the head after the last loss slot,
    each interleaved chunk after stage 0's last backward of it (ZeRO-2: reduce-scattered chunk by
    chunk, then put back together); zb's layer gradients come from its W slots."""
    assert_matches_single_device(dp_config(schedule, virtual, stage))


def test_without_a_dp_reduction_the_layer_gradients_are_taken_whole_after_the_last_tick():
    """dp = 1 (or ZeRO-2/3, which reduce inside the backward): nothing to overlap, so the accumulator
    is not cut chunk by chunk (each cut is a copy of it: the GPU compiler held ~3 more fp32 copies of
    vla70b's stage gradients at v = 10); with a dp reduction each chunk is taken as it is final."""
    from jaxpar.parallel import schedule
    from jaxpar.parallel.pipeline import Pipeline
    table = schedule.build("1f1b", 2, 4, virtual=2)
    alone = Pipeline(table, None, ("pp",))
    assert alone.final_at == {table.ticks - 1: [("head",), ("layers", None)]}  # ("first",) after its own backward
    # the scans are cut only at the phases' ends and where the first input's gradient sums (G) start or stop
    sums = alone.sum_ticks != schedule.IDLE
    switches = {t for t in range(1, table.ticks) if sums[t] != sums[t - 1]}
    ends = {p.first + p.count for p in table.phases}
    assert {first + count for _, first, count in alone._segments()} == ends | switches
    reduced = Pipeline(table, None, ("pp", "dp"), reduce_dp=lambda part, grads: grads)
    assert sorted(part for parts in reduced.final_at.values() for part in parts if part[0] == "layers") == [
        ("layers", 0), ("layers", 1)]
    assert len(reduced.final_at) > 1  # the second chunk's gradient is final before the last tick


def ops_within(comps, name: str) -> set[str]:
    """The ops of computation `name` and of every computation it calls."""
    ops, stack, seen = set(), [name], set()
    while stack:
        for ins in comps.get(stack.pop(), []):
            ops.add(ins["op"])
            stack.extend(c for c in hlo_collectives._called(ins) if c not in seen and not seen.add(c))
    return ops


def ticks_after_each_dp_reduction(config) -> tuple[collections.Counter, int]:
    """In the program jaxpar writes (before XLA's passes, which cannot add dependencies): for each
    non-scalar dp all-reduce / reduce-scatter, how many pipeline ticks run in scans that are not among
    its inputs, i.e. could overlap it; and the ticks of all the scans beside it (the tick scans: those
    that send activations)."""
    builder = builder_for(config)
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    comps, _ = hlo_collectives.parse_module(lowered.as_text(dialect="hlo"))
    after, ticks = collections.Counter(), set()
    for instrs in comps.values():
        by_name = {i["name"]: i for i in instrs}
        loops = {i["name"]: hlo_collectives._while_parts(comps, i, by_name) for i in instrs if i["op"] == "while"}
        scans = {name: trips for name, (body, trips) in loops.items()  # tick scans send; the first input's loops do not
                 if "collective-permute" in ops_within(comps, body)}
        for ins in instrs:
            if ins["op"] not in ("all-reduce", "reduce-scatter") or not scans or ins["shape"].startswith("f32[]"):
                continue
            groups = hlo_collectives.parse_replica_groups(ins["attrs"], config.mesh.dp * config.mesh.pp * config.mesh.tp)
            if hlo_collectives.axis_label(groups, builder.mesh) != "dp":
                continue
            inputs, stack = set(), [ins["name"]]
            while stack:
                for arg in by_name[stack.pop()]["args"]:
                    if arg in by_name and arg not in inputs:
                        inputs.add(arg)
                        stack.append(arg)
            after[sum(n for scan, n in scans.items() if scan not in inputs)] += 1
            ticks.add(sum(scans.values()))
    return after, ticks


# (2,2,2), m = 4, p = 2: 2 head leaves (final norm, LM head), 9 weights per layer chunk, 1 embedding.
# 1F1B (schedule.py): F(i, k) = b + k, B(i, k) = b + 2(vp - 1) - k, b = (i // p) v p + i % p; the last
# microbatch i = 3 has b = 3 (v = 1) or 5 (v = 2), so the schedule has b + 2(vp - 1) + 1 = 6 or 12 ticks.
# head: final after the last loss slot F(3, vp - 1) = 4 or 8: 6 - 4 - 1 = 1 tick after it, or 12 - 8 - 1 = 3;
# chunk 1 (v = 2): final after B(3, k = p) = 9, 2 ticks after; chunk 0 and the embedding: after the last tick.
@pytest.mark.parametrize("virtual,expected,ticks", [(1, {1: 2, 0: 10}, 6), (2, {3: 2, 2: 9, 0: 10}, 12)])
@pytest.mark.parametrize("stage", [1, 2])
def test_dp_reductions_are_issued_before_the_ticks_after_their_last_use(virtual, expected, ticks, stage):
    """v = 2: the second chunk's layer gradients are reduced 2 ticks before the end (reducing every
    part after the last tick fails here). v = 1 is the control: the layers can only follow the last
    tick; the head's reduction has the cooldown beside it (the scans pass its accumulator through)."""
    after, scan_ticks = ticks_after_each_dp_reduction(dp_config("1f1b", virtual, stage))
    assert scan_ticks == {ticks}
    assert after == collections.Counter(expected)


# ----------------------------------------------------------------------------- pp collectives: executed, counted

def collectives_in_scope(text: str, scope: str) -> collections.Counter:
    """Collective ops of a compiled program traced inside jax.named_scope `scope` (the pipeline's slots)."""
    comps, _ = hlo_collectives.parse_module(text)
    found = collections.Counter()
    for instrs in comps.values():
        for ins in instrs:
            op = ins["op"].removesuffix("-start")
            op_name = re.search(r'op_name="([^"]*)"', ins.get("attrs", ""))
            if op in hlo_collectives.OPS and op_name and scope in op_name.group(1).split("/"):
                found[op] += 1
    return found


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("1f1b", 2), pytest.param("zb", 1, marks=pytest.mark.slow),
                                              ("gpipe", 1)])
def test_the_step_executes_the_pp_collectives_the_planner_counts(schedule, virtual):
    """(1, 2, 2), m = 4: in the compiled step (loops x trip counts) the activation-sized collectives
    over pp are the ones jaxpar.parallel.pipeline.activation_collectives counts from the table (and
    the planner prices): the first input's pp x tp all-reduce runs once per microbatch (m = 4), not
    once per forward tick (v m + p - 1 = 5 or 9), and its gradient's psum over pp likewise."""
    from jaxpar.parallel.pipeline import activation_collectives
    from jaxpar.parallel.schedule import pipeline_table

    config = pipeline_config((1, 2, 2), schedule, 4, "none", virtual)
    builder = builder_for(config)
    text = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch()).compile().as_text()
    activation = BATCH // 4 * config.train.seq_len * config.model.d_model * 4  # one microbatch, fp32
    got = collections.Counter()
    for e in hlo_collectives.collectives(text, builder.mesh, by_size=True):
        if e["bytes_each"] == activation and "pp" in e["axis"].split("+"):
            got[(e["op"], e["axis"])] += e["count"]
    counted = activation_collectives(pipeline_table(config))
    if schedule != "gpipe":  # m - 1 of the first input's gradient sums run in the ticks' G slots (one op per
        in_ticks = collectives_in_scope(text, "pipeline_G")  # scan body that has G slots), nothing else does
        assert set(in_ticks) == {"all-reduce"} and in_ticks["all-reduce"] >= 1
    if schedule == "zb":  # W is weight-gradient matmuls alone: no input gradient, so no tp all-reduce of it
        assert collectives_in_scope(text, "pipeline_W") == collections.Counter()
        assert collectives_in_scope(text, "pipeline_B")["all-reduce"] > 0  # B's input gradient (scopes read)
    assert counted["first_input"] == counted["first_input_grad"] == 4
    assert got == {("collective-permute", "pp"): counted["sends"], ("all-reduce", "pp+tp"): counted["first_input"],
                   ("all-reduce", "pp"): counted["head"] + counted["first_input_grad"]}


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 4, 8, 2), ("1f1b", 2, 4, 3), ("zb", 4, 8, 1)])
def test_the_first_input_gradient_is_summed_in_the_tick_after_stage_0s_backward(kind, p, m, v):
    """G slots: microbatch i's first-input gradient is summed over pp in the tick after stage 0's
    chunk-0 backward of it (whose B slot wrote it), once; only the last tick's microbatch is left for
    after the ticks. With v = 1 the sums fill the cool-down (its last p - 1 ticks)."""
    import types

    from jaxpar.parallel import schedule as pipeline_schedule
    from jaxpar.parallel.first_input import FirstInputs

    table = pipeline_schedule.build(kind, p, m, v)
    sums = FirstInputs._grad_sum_ticks(types.SimpleNamespace(table=table))
    stage0 = [(t, table.backward[t, 0]) for t in range(table.ticks)
              if table.backward[t, 0] >= 0 and table.backward_chunk[t, 0] == 0]
    assert sorted(mb for _, mb in stage0) == list(range(m))
    assert stage0[-1][0] == table.ticks - 1  # the last microbatch's: after the ticks
    expected = np.full(table.ticks, -1)
    for t, mb in stage0[:-1]:
        expected[t + 1] = mb
    np.testing.assert_array_equal(sums, expected)
    if v == 1:  # the cool-down's p - 1 ticks (B only) hold p - 1 of them
        assert (sums[-(p - 1):] >= 0).all()


# ----------------------------------------------------------------------------- memory from the compiled program

MEMORY_MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1024)


def temp_bytes(schedule: str, m: int, virtual: int = 1, recompute: bool = False, pp: int = 4) -> int:
    """Compiled temp bytes per device with a fixed microbatch (2 x 128 tokens): the batch grows with m."""
    config = make_config(pp=pp, model=MEMORY_MODEL, global_batch_size=2 * m, seq_len=128)
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule=schedule, microbatches=m,
                                                                 virtual_stages=virtual, stage_recompute=recompute))
    return dry_run(config, builder_for(config).mesh)["per_device_bytes"]["temp"]


@pytest.mark.slow
def test_1f1b_memory_is_bounded_in_m_while_gpipe_grows():
    """1F1B's stash holds the residuals of min(m, 2p - 1) microbatches (+ a spare entry): O(p), whatever
    m is once m >= 2p - 1 = 7 (below that it needs, and allocates, fewer). GPipe keeps all m."""
    one_f_one_b = {m: temp_bytes("1f1b", m) for m in (8, 16)}
    gpipe = {m: temp_bytes("gpipe", m) for m in (8, 16)}
    assert one_f_one_b[16] < 1.25 * one_f_one_b[8]
    assert gpipe[16] > 1.5 * gpipe[8]
    assert one_f_one_b[16] < gpipe[16] / 2


@pytest.mark.slow
@pytest.mark.parametrize("schedule,virtual,recompute", [("1f1b", 1, False), ("1f1b", 2, False), ("zb", 1, False),
                                                         ("1f1b", 1, True)])
@pytest.mark.parametrize("pp,ms", [(2, (4, 16)), (4, (8, 16))])
def test_pipeline_memory_stays_flat_in_m(schedule, virtual, recompute, pp, ms):
    """Interleaved, zero-bubble and stage recompute hold O(p) microbatches too. The stash saturates at
    min(m, 2p - 1) microbatches (lockstep 1F1B, docs/design.md): at p = 2 from m = 3, so m = 4 -> 16 is
    flat; at p = 4 only from m = 7 (m = 4 needs, and allocates, 4 of the 7), so there m = 8 -> 16."""
    small, large = (temp_bytes(schedule, m, virtual, recompute, pp) for m in ms)
    assert large < 1.25 * small
