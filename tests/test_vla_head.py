"""The VLA's LM head on the action positions only (issue 46 item 2): the static slice, equal to the
whole head, and on every parallel path the same loss and gradients as one device with the pipeline
delivering only those positions to the head."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.compiler import hlo_collectives
from jaxpar.config import load_config
from jaxpar.layers.collectives import Collectives
from jaxpar.models import llama, vla
from jaxpar.parallel.pipeline import activation_collectives
from jaxpar.parallel.schedule import pipeline_table

import test_vla
from test_vla import with_values

BASE = with_values(test_vla.BASE, actions=dict(instruction_len=34))  # sequence 56: divides cp 2 x 2, tp 4
SINGLE = with_values(test_vla.SINGLE, actions=dict(instruction_len=34))


@pytest.mark.parametrize("mesh,text_loss,expected", [
    (dict(), False, 7), (dict(), True, None),
    (dict(tp=4, sequence_parallel=True), False, 7),  # 56 / 4 = 14 tokens per shard: the last one holds them
    (dict(tp=8, sequence_parallel=True), False, 7),  # 7 per shard: exactly the actions
    (dict(tp=16, sequence_parallel=True), False, None),  # 3 per shard: the actions would straddle shards
    (dict(cp=2), False, 7), (dict(cp=4), False, 7),  # balanced chunks of 14 and 7: rank 0's late one
    (dict(cp=8), False, None),  # chunks of 3
    (dict(cp=2, tp=4, sequence_parallel=True), False, 7),  # 28 per cp rank, 7 per sp shard
])
def test_loss_positions_are_the_actions_where_one_rank_holds_them(mesh, text_loss, expected):
    """dims = 7 positions; None (the head on every position) with the text loss or where a cp chunk or sp
    shard is shorter than the actions."""
    config = with_values(BASE, mesh={**dict(dp=1, pp=1, tp=1), **mesh},
                         model=dict(text_loss=text_loss, prefix_lm=not text_loss))
    assert vla.loss_positions(config) == expected
    vla70b = load_config("configs/vla70b.py")
    assert vla.loss_positions(vla70b) == vla70b.actions.dims == 7  # sp: 296 / 8 = 37 per shard


def test_the_head_on_the_last_positions_equals_the_head_on_all():
    """One device: the masked loss and its gradients (input, final norm, LM head) are the same whether
    the head runs on every position or only on the last `dims`, where the mask is (make_batch)."""
    cfg = BASE.model
    batch = vla.synthetic_batch(BASE, 0, 3)
    seq, dims = batch["targets"].shape[1], BASE.actions.dims
    params = {k: v for k, v in llama.init(cfg, jax.random.key(0)).items() if k in llama.HEAD_AXES}
    params["final_norm"] = params["final_norm"] + 0.1 * jax.random.normal(jax.random.key(2), (cfg.d_model,))
    x = jax.random.normal(jax.random.key(1), (3, seq, cfg.d_model))
    assert np.all(np.asarray(batch["mask"])[:, :-dims] == 0) and np.all(np.asarray(batch["mask"])[:, -dims:])

    def loss(p, x, last):
        return llama.head_loss_sum(p, x, batch["targets"], batch["mask"], cfg, Collectives(), last)
    whole = jax.value_and_grad(loss, argnums=(0, 1))(params, x, None)
    actions = jax.value_and_grad(loss, argnums=(0, 1))(params, x, dims)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6), actions, whole)
    assert np.all(np.asarray(actions[1][1])[:, :-dims] == 0)  # no cotangent before the actions
    jaxpr = str(jax.make_jaxpr(lambda x: loss(params, x, dims))(x))
    assert f"{dims},{cfg.vocab_size}]" in jaxpr.replace(" ", "") and f"{seq},{cfg.vocab_size}]" not in jaxpr


def run(config, steps=3):
    """(losses, first gradients) of test_vla.run from this file's single-device state."""
    return test_vla.run(config, steps, single=SINGLE)[:2]


def run_and_compare(config):
    ref_losses, ref_grads, _ = test_vla.reference(SINGLE)
    losses, grads = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    def check(path, a, e):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, grads, ref_grads)


# (dp, pp, tp, sequence parallel, schedule, virtual): the head's slice before the pipeline's broadcast, under
# sequence parallelism (each tp rank's last positions, gathered, the last rank's kept), interleaved and zb
LAYOUTS = [
    (1, 2, 4, True, "1f1b", 1),
    (2, 1, 4, True, "zero1", 1),  # no pipeline, sequence parallel
    pytest.param(1, 2, 2, True, "1f1b", 2, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, False, "zb", 1, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, True, "gpipe", 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dp,pp,tp,sp,schedule,virtual", LAYOUTS)
def test_vla_head_on_actions_matches_single_device(dp, pp, tp, sp, schedule, virtual):
    pipe = dict(schedule=schedule, virtual_stages=virtual) if pp > 1 else dict(microbatches=1)
    config = with_values(BASE, mesh=dict(dp=dp, pp=pp, tp=tp, sequence_parallel=sp), vision=dict(tp=1),
                         pipeline=pipe, zero=dict(stage=int(schedule[-1]) if schedule.startswith("zero") else 1))
    assert vla.loss_positions(config) == 7
    run_and_compare(config)


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_the_pipeline_delivers_only_the_action_positions_to_the_head():
    """(1, 2, 2) 1F1B: the head's pp all-reduces (the last stage's output to every stage, the cotangent
    back) carry [b, dims, d] per microbatch, not [b, S, d]; with the text loss, [b, S, d] as before."""
    def head_sums(text_loss):
        config = with_values(BASE, mesh=dict(dp=1, pp=2, tp=2), vision=dict(tp=1),
                             model=dict(text_loss=text_loss, prefix_lm=not text_loss))
        b = test_vla.builder(config)
        text = b.jit_train_step().lower(b.abstract_state(), b.abstract_batch()).compile().as_text()
        sizes = collections.Counter()
        for e in hlo_collectives.collectives(text, b.mesh, by_size=True):
            if e["op"] == "all-reduce" and e["axis"] == "pp":
                sizes[e["bytes_each"]] += e["count"]
        micro = config.train.global_batch_size // config.pipeline.microbatches
        return sizes, micro * config.model.d_model * 4, activation_collectives(pipeline_table(config))
    sizes, per_position, counted = head_sums(False)
    seq = 56
    assert sizes[per_position * 7] == counted["head"]
    assert sizes[per_position * seq] == counted["first_input_grad"]  # the first input's gradient alone
    sizes, per_position, counted = head_sums(True)
    assert sizes[per_position * 7] == 0
    assert sizes[per_position * seq] == counted["head"] + counted["first_input_grad"]


def test_every_collective_is_ordered_with_the_head_on_actions_under_sp_and_interleaving():
    """XLA:CPU runs the emulated mesh only if every device issues its collectives in one order: the
    head's smaller broadcast, its tp gather of the shards' last positions and the G slots included."""
    from test_collective_order import _assert_ordered, _train_step_hlo

    config = with_values(BASE, mesh=dict(dp=1, pp=2, tp=2, sequence_parallel=True), vision=dict(tp=1),
                         pipeline=dict(schedule="1f1b", virtual_stages=2), zero=dict(stage=1))
    _assert_ordered(_train_step_hlo(config))
