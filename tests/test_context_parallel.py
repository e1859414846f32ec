"""Context parallelism (issue 31): the sequence split over a cp mesh axis for the whole layer, K / V
gathered over cp; every layout gives the single-device losses and gradients (tests/test_equivalence.py's
data and steps), and refuses what is not built with one line."""

import dataclasses

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.compiler import hlo_collectives
from jaxpar.config import PipelineConfig, validate
from jaxpar.errors import ConfigError
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

# (dp, cp, tp, ZeRO stage, sequence parallel, n_kv_heads); seq_len 16, batch 16, 8 query heads
FAST = [
    (2, 4, 1, 1, False, 8),  # ZeRO-1 over dp x cp = 8
    (1, 2, 2, 3, False, 8),  # ZeRO-3's gathers over dp x cp, with tp
    (2, 2, 2, 2, True, 2),  # ZeRO-2, sequence parallelism inside each cp chunk, GQA (a KV head per tp rank)
]
SLOW = [
    (1, 2, 1, 0, False, 8),
    (1, 4, 1, 0, False, 8),
    (1, 4, 2, 0, False, 1),  # one KV head on every tp rank
    (2, 2, 2, 0, False, 8),
]


def context_config(dp, cp, tp, stage, sp, n_kv):
    model = dataclasses.replace(TINY_MODEL, n_kv_heads=n_kv)
    config = make_config(dp=dp, tp=tp, stage=stage, model=model)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, cp=cp, sequence_parallel=sp))
    validate(config)
    return config


def check(layout, strategy="all_gather"):
    config = context_config(*layout)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, cp_strategy=strategy))
    ref_grads, ref_losses, _ = reference(model=config.model)
    grads, losses, state = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    assert dict(builder_for(config).mesh.shape)["cp"] == layout[1]


@pytest.mark.parametrize("layout", FAST, ids=str)
def test_context_parallel_matches_single_device(layout):
    check(layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW, ids=str)
def test_context_parallel_matrix_matches_single_device(layout):
    check(layout)


RING = [(1, 4, 1, 0, False, 8), pytest.param((2, 2, 2, 3, True, 2), marks=pytest.mark.slow),
        pytest.param((1, 2, 2, 1, False, 1), marks=pytest.mark.slow)]
ULYSSES = [(1, 4, 1, 1, False, 8), pytest.param((2, 2, 2, 3, True, 2), marks=pytest.mark.slow),
           pytest.param((1, 2, 2, 0, False, 1), marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout", ULYSSES, ids=str)
def test_ulysses_matches_single_device(layout):
    """cp_strategy=ulysses: q, k, v all-to-all from sequence- to head-sharded over cp, attention as on one device,
    the output back; with ZeRO-3, sequence parallelism and GQA (one KV head per tp rank, repeated to cp)."""
    check(layout, strategy="ulysses")


@pytest.mark.parametrize("layout", RING, ids=str)
def test_ring_attention_matches_single_device(layout):
    """cp_strategy=ring: K / V blocks passed around cp, merged by log-sum-exp; with ZeRO-3, sequence
    parallelism and GQA (two KV heads, and one on every tp rank)."""
    check(layout, strategy="ring")


# (dp, tp, ZeRO stage, schedule, virtual stages, cp strategy) at pp = 2, cp = 2, m = 4; 4 layers, batch 24
PIPELINED = [
    (1, 2, 0, "1f1b", 1, "all_gather"),
    pytest.param(2, 1, 1, "zb", 1, "all_gather", marks=pytest.mark.slow),  # zb's split backward, dp x cp reductions
    pytest.param(2, 1, 2, "1f1b", 2, "all_gather", marks=pytest.mark.slow),  # interleaved, ZeRO-2 chunk by chunk
    pytest.param(1, 2, 0, "gpipe", 1, "all_gather", marks=pytest.mark.slow),
    pytest.param(1, 2, 1, "1f1b", 2, "ulysses", marks=pytest.mark.slow),  # the heads' all-to-alls in every chunk
]


@pytest.mark.parametrize("dp,tp,stage,schedule,virtual,strategy", PIPELINED)
def test_context_parallel_pipeline_matches_single_device(dp, tp, stage, schedule, virtual, strategy):
    """The stages send [B, S / cp] chunks; each stage's layers gather K / V over cp (or trade heads: ulysses)."""
    model = dataclasses.replace(TINY_MODEL, n_layers=4)
    config = make_config(dp=dp, pp=2, tp=tp, stage=stage, model=model, global_batch_size=24)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, cp=2, cp_strategy=strategy),
                                 pipeline=PipelineConfig(schedule=schedule, microbatches=4, virtual_stages=virtual))
    validate(config)
    ref_grads, ref_losses, _ = reference(model=model, global_batch_size=24)
    grads, losses, _ = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


def test_each_rank_takes_its_tokens_and_gathers_the_keys_over_cp():
    """Every device receives its dp shard's sequences whole and slices its own tokens (no data moves
    for the balanced order: no collective-permute), and each layer gathers K and V over cp (their
    transposes, reduce-scatters over cp, in the backward), in the program jaxpar writes."""
    config = context_config(1, 4, 2, 0, False, 8)
    builder = builder_for(config)
    assert builder.batch_spec == P(None, None)
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    by_axis = {}
    for row in hlo_collectives.collectives(lowered.as_text(dialect="hlo"), builder.mesh):
        by_axis[(row["op"], row["axis"])] = by_axis.get((row["op"], row["axis"]), 0) + row["count"]
    layers = config.model.n_layers
    assert by_axis[("all-gather", "cp")] == 2 * layers
    assert by_axis[("reduce-scatter", "cp")] == 2 * layers
    assert not any(op == "collective-permute" for op, _ in by_axis)


@pytest.mark.parametrize("overrides,message", [
    (dict(cp=4, seq=12), "mesh.cp=4 cuts the train.seq_len=12 into 2 x cp chunks, which do not divide it; make it a "
                         "multiple of 8"),
    (dict(cp=2, strategy="deepspeed"), "mesh.cp_strategy='deepspeed' is unknown; use all_gather, ring or ulysses"),
    (dict(cp=2, tp=8, strategy="ulysses"), "mesh.cp_strategy=ulysses splits the 8 query heads over cp x tp = 16, "
                                           "which does not divide them; use a cp x tp that divides 8, or "
                                           "cp_strategy=all_gather or ring"),
    (dict(cp=4, tp=2, kv=6, heads=24, strategy="ulysses"),
     "mesh.cp_strategy=ulysses splits each tp rank's 3 KV heads over cp=4 (or repeats them to cp), which neither "
     "divides; use a cp dividing or divisible by 3, or cp_strategy=all_gather or ring"),
])
def test_context_parallel_refusals_are_one_line(overrides, message):
    heads = overrides.get("heads", 8)
    model = dataclasses.replace(TINY_MODEL, n_heads=heads, n_kv_heads=overrides.get("kv", 8), d_model=8 * heads)
    config = make_config(seq_len=overrides.get("seq", 16), model=model)
    mesh = dataclasses.replace(config.mesh, cp=overrides["cp"], pp=overrides.get("pp", 1), tp=overrides.get("tp", 1),
                               cp_strategy=overrides.get("strategy", "all_gather"))
    with pytest.raises(ConfigError) as err:
        validate(dataclasses.replace(config, mesh=mesh))
    assert str(err.value) == message


# (dp, pp, cp, tp, vision tp, ZeRO stage / pipeline schedule, strategy) for the VLA: image tokens, the
# instruction and the actions under the prefix-LM mask, split over cp like any sequence
VLA_LAYOUTS = [
    ((2, 1, 2, 2, 2, "zero1", "all_gather")),  # the encoder's images split over cp too; ZeRO-1 over dp x cp
    pytest.param((1, 2, 2, 2, 1, "1f1b", "ring"), marks=pytest.mark.slow),  # the pipeline's image cotangents
    pytest.param((1, 1, 4, 2, 2, "zero3", "all_gather"), marks=pytest.mark.slow),
    pytest.param((2, 1, 2, 2, 2, "zero1", "ulysses"), marks=pytest.mark.slow),  # the prefix-LM mask on whole heads
]


@pytest.mark.parametrize("layout", VLA_LAYOUTS, ids=str)
def test_vla_context_parallel_matches_single_device(layout):
    """The VLA's assembled sequence (56 tokens: 16 image, 34 instruction, 6 actions) is cut over cp after
    the encoder; each cp rank's image-token cotangent is its own tokens' share, summed over cp before
    the encoder's backward."""
    import jax
    import test_vla

    dp, pp, cp, tp, vision_tp, how, strategy = layout
    single = test_vla.with_values(test_vla.SINGLE, actions=dict(instruction_len=34))
    ref_losses, ref_grads, _ = test_vla.reference(single)
    pipe = dict(schedule=how) if pp > 1 else dict(microbatches=1)
    config = test_vla.with_values(
        test_vla.BASE, mesh=dict(dp=dp, pp=pp, tp=tp, cp=cp, cp_strategy=strategy), vision=dict(tp=vision_tp),
        pipeline=pipe, zero=dict(stage=int(how[-1]) if how.startswith("zero") else 1),
        actions=dict(instruction_len=34))
    validate(config)
    losses, grads, state = test_vla.run(config, single=single)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    def check(path, a, e):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, grads, ref_grads)
    assert dict(test_vla.builder(config).mesh.shape)["cp"] == cp
