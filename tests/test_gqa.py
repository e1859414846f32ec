"""Grouped-query attention in the equivalence family: n_kv_heads in {1, 2} with tp in {2, 4}, with and
without a pipeline. With more tp ranks than KV heads (Megatron's layout, sharding.kv_head_ways) the tp
axis is split into ("tp", "tpv") = (K, tp / K): each rank holds only the KV head its query heads use,
replicated over the tp / K ranks of "tpv" that share it, and its gradient is summed over those alone.
Where the tp axis is split for something else (a VLA's vision tp) every rank holds every KV head and
slices its own at use (Collectives.local_kv_heads): the `whole` cases."""

import dataclasses

import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from jaxpar.config import PipelineConfig
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

BATCH = 16
# (n_kv_heads, (dp, pp, tp), ZeRO stage, sequence parallel); 8 query heads. Three are `slow`: `make test`
# keeps a split, the replicated one with ZeRO-3, and a pipeline (tests/test_context_parallel.py has GQA
# with sequence parallelism).
CASES = [
    (2, (4, 1, 2), 1, False),  # KV heads split over tp (one per rank)
    pytest.param(1, (4, 1, 2), 2, False, marks=pytest.mark.slow),  # replicated: 2 ranks share the one KV head
    (2, (2, 1, 4), 3, False),  # replicated: 2 ranks per KV head, ZeRO-3 gathers
    pytest.param(1, (2, 1, 4), 1, True, marks=pytest.mark.slow),  # replicated, with sequence parallelism
    pytest.param(2, (2, 2, 2), 1, False, marks=pytest.mark.slow),  # pipeline, split
    (1, (1, 2, 4), 0, False),  # pipeline, replicated
]


@pytest.mark.parametrize("n_kv,layout,stage,sp", CASES)
def test_gqa_layout_matches_single_device(n_kv, layout, stage, sp):
    check_gqa_layout(n_kv, layout, stage, sp)


@pytest.mark.parametrize("n_kv,layout,stage", [pytest.param(2, (2, 1, 4), 1, marks=pytest.mark.slow),
                                             pytest.param(1, (1, 2, 4), 1, marks=pytest.mark.slow)])
def test_kv_heads_held_whole_on_an_unsplit_tp_axis(monkeypatch, n_kv, layout, stage):
    """The fallback: a mesh whose tp axis is not split for the KV heads."""
    import test_equivalence
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    dp, pp, tp = layout
    monkeypatch.setattr(test_equivalence, "builder_for",
                        lambda config: StepBuilder(config, Layout(dp=dp, pp=pp, tp=tp).make_mesh()))
    check_gqa_layout(n_kv, layout, stage, False, whole=True)


@pytest.mark.slow  # zb's equivalence is in `make test` (tests/test_pipeline.py); these add GQA's KV paths
@pytest.mark.parametrize("n_kv,layout,stage,sp", [(1, (1, 2, 4), 0, True), (2, (2, 2, 2), 1, False)])
def test_zero_bubble_splits_the_kv_projections_too(n_kv, layout, stage, sp):
    """zb's W computes the shared KV head's weight gradient (through the pick of this rank's head and
    its sum over the sharers) from the kept input and output gradient; with sequence parallelism W
    must not keep the input's all-gather (jaxpar.parallel.split_backward)."""
    check_gqa_layout(n_kv, layout, stage, sp, schedule="zb")


def check_gqa_layout(n_kv, layout, stage, sp, whole=False, schedule="1f1b"):
    dp, pp, tp = layout
    model = dataclasses.replace(TINY_MODEL, n_kv_heads=n_kv, n_layers=4)
    ref_grads, ref_losses, _ = reference(model=model, global_batch_size=BATCH)
    config = make_config(dp=dp, pp=pp, tp=tp, stage=stage, model=model, global_batch_size=BATCH)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=sp))
    if pp > 1:
        config = dataclasses.replace(config, pipeline=PipelineConfig(microbatches=4, schedule=schedule))
    grads, losses, state = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    wk = state.params["layers"]["wk"]  # [layers, embed, kv_heads, head_dim]
    local_heads = {shard.data.shape[2] for shard in wk.addressable_shards}
    assert local_heads == {n_kv if whole else max(n_kv // tp, 1)}  # split (Megatron), or every KV head


def test_dry_run_counts_one_kv_head_per_rank_and_reduces_it_over_its_sharers():
    """tp = 4 over 2 KV heads: each rank holds the one KV head its query heads use (D x 1 x H of wk and
    of wv per layer), which the compiled state, the ZeRO formula and the planner all count (written
    out here by hand), and the compiled step sums the KV gradients over the tp / K = 2 ranks sharing a
    head ("tpv"), not over all of tp."""
    from conftest import builder_for
    from jaxpar.compiler import dry_run as dr
    from jaxpar.planner.memory import local_params

    model = dataclasses.replace(TINY_MODEL, n_kv_heads=2)
    config = make_config(dp=2, tp=4, stage=0, model=model)
    d, n, k, h, f, v, tp = 64, 8, 2, 8, 128, 128, 4
    per_layer = 2 * d + (d * n * h + n * h * d + 3 * d * f) // tp + 2 * d * 1 * h  # wk, wv: one head each
    local = 2 * v * d // tp + d + model.n_layers * per_layer
    builder = builder_for(config)
    assert dict(builder.mesh.shape) == {"dp": 2, "pp": 1, "tp": k, "tpv": tp // k}
    report = dr.dry_run(config, builder.mesh)
    assert report["per_device_bytes"]["params"] == 4 * local  # fp32, no ZeRO
    assert report["analytic_bytes"]["params"] == 4 * local
    counts = local_params(config)
    assert counts["llm_layers"] + counts["llm_rest"] == local
    sharers = [row for row in report["collectives"] if row["axis"] == "tpv"]
    kv_grad_bytes = 4 * 2 * model.n_layers * d * h  # fp32 wk + wv of the local head, every layer
    assert [(row["op"], row["bytes"]) for row in sharers] == [("all-reduce", kv_grad_bytes)]
