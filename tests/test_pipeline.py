"""Pipeline parallelism: schedule tables, single-device equivalence, and 1F1B's flat memory."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.config import ModelConfig, PipelineConfig
from jaxpar.dry_run import dry_run
from jaxpar.parallel.schedule import IDLE, build
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

FOUR_LAYERS = dataclasses.replace(TINY_MODEL, n_layers=4)
BATCH = 24  # divisible by dp x m for every case below


# ----------------------------------------------------------------------------- the schedule table


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 2), (4, 8), (4, 13), (8, 16)])
def test_schedule_table_order_and_bubble(kind, p, m):
    table = build(kind, p, m)
    for i in range(m):
        f_tick = [int(np.flatnonzero(table.forward[:, s] == i)[0]) for s in range(p)]
        b_tick = [int(np.flatnonzero(table.backward[:, s] == i)[0]) for s in range(p)]
        assert all(f_tick[s] < f_tick[s + 1] for s in range(p - 1)), "forward on s precedes s+1"
        assert all(b_tick[s + 1] < b_tick[s] for s in range(p - 1)), "backward on s+1 precedes s"
        last = p - 1  # the last stage may run the backward right after the forward, in the same tick
        assert all(f_tick[s] < b_tick[s] for s in range(last)) and f_tick[last] <= b_tick[last]
    for s in range(p):  # every microbatch exactly once per stage, each way
        assert sorted(table.forward[:, s][table.forward[:, s] != IDLE]) == list(range(m))
        assert sorted(table.backward[:, s][table.backward[:, s] != IDLE]) == list(range(m))
    assert table.idle_fraction() == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_keeps_o_p_microbatches_in_flight_gpipe_keeps_m():
    for m in (4, 16, 64):
        assert build("1f1b", 4, m).in_flight().max() <= 2 * 4 - 1
        assert build("gpipe", 4, m).in_flight().max() == m


def test_1f1b_phases_never_mix_kinds():
    """Warm-up ticks hold no backward and cool-down ticks no forward: the SPMD program can skip them."""
    table = build("1f1b", 4, 6)
    (_, w0, wn), (_, s0, sn), (_, c0, cn) = table.phases
    assert (table.backward[w0:w0 + wn] == IDLE).all() and (table.forward[c0:c0 + cn] == IDLE).all()
    assert wn == cn == 3 and sn == 6 and c0 + cn == table.ticks


# ----------------------------------------------------------------------------- equivalence with one device

CASES = [
    ((1, 2, 1), "1f1b", 3), ((1, 2, 1), "gpipe", 4),
    ((1, 4, 1), "1f1b", 6), ((1, 4, 1), "gpipe", 3), ((1, 4, 1), "1f1b", 2),
    ((2, 2, 2), "1f1b", 4), ((2, 2, 2), "gpipe", 3),
    ((1, 2, 4), "1f1b", 3), ((1, 2, 4), "gpipe", 2),
]


@pytest.mark.parametrize("layout,schedule,m", CASES + [((2, 2, 2), "1f1b-bf16", 4)])
def test_pipeline_matches_single_device(layout, schedule, m):
    dp, pp, tp = layout
    ref_grads, ref_losses, _ = reference(model=FOUR_LAYERS, global_batch_size=BATCH)
    bf16 = schedule.endswith("-bf16")
    config = make_config(dp=dp, pp=pp, tp=tp, stage=1 if dp > 1 else 0, model=FOUR_LAYERS, global_batch_size=BATCH,
                         precision="bf16" if bf16 else "fp32")
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule=schedule.split("-")[0], microbatches=m))
    grads, losses, state = run(config)
    if bf16:  # bf16 compute: close to the fp32 reference, not equal (see test_equivalence)
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=0, atol=0.03 * np.max(np.abs(e))),
                     grads, ref_grads)
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert_grads_close(grads, ref_grads)
    wq = state.params["layers"]["wq"]  # [layers, embed, heads, head_dim]: layers over pp, heads over tp
    local = {shard.data.shape for shard in wq.addressable_shards}
    assert local == {(4 // pp, wq.shape[1], wq.shape[2] // tp, wq.shape[3])}
    assert len(wq.sharding.device_set) == dp * pp * tp


def test_pipeline_with_zero2_matches_single_device():
    ref_grads, ref_losses, _ = reference(model=FOUR_LAYERS, global_batch_size=BATCH)
    config = make_config(dp=2, pp=2, tp=2, stage=2, model=FOUR_LAYERS, global_batch_size=BATCH)
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule="1f1b", microbatches=6))
    grads, losses, _ = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


# ----------------------------------------------------------------------------- memory from the compiled program

MEMORY_MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1024)


def temp_bytes(schedule: str, m: int) -> int:
    """Compiled temp bytes per device at p=4 with a fixed microbatch (2 x 128 tokens): the batch grows with m."""
    config = make_config(pp=4, model=MEMORY_MODEL, global_batch_size=2 * m, seq_len=128)
    config = dataclasses.replace(config, pipeline=PipelineConfig(schedule=schedule, microbatches=m))
    return dry_run(config, builder_for(config).mesh)["per_device_bytes"]["temp"]


def test_1f1b_memory_stays_flat_while_gpipe_grows():
    one_f_one_b = {m: temp_bytes("1f1b", m) for m in (4, 16)}
    gpipe = {m: temp_bytes("gpipe", m) for m in (4, 16)}
    assert one_f_one_b[16] < 1.25 * one_f_one_b[4]
    assert gpipe[16] > 2 * gpipe[4]
    assert one_f_one_b[16] < gpipe[16] / 4
