"""Grouped-query attention in the equivalence family: n_kv_heads in {1, 2} with tp in {2, 4}, with and
without a pipeline. With more tp ranks than KV heads the KV projections are replicated over tp
(sharding.kv_heads_replicated) and each rank attends with its query heads' one KV head."""

import dataclasses

import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from jaxpar.config import PipelineConfig
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run

BATCH = 16
# (n_kv_heads, (dp, pp, tp), ZeRO stage, sequence parallel); 8 query heads. Two are `slow`: `make test`
# keeps a split, the replicated ones with ZeRO-3 and with SP, and a pipeline.
CASES = [
    (2, (4, 1, 2), 1, False),  # KV heads split over tp (one per rank)
    pytest.param(1, (4, 1, 2), 2, False, marks=pytest.mark.slow),  # replicated: 2 ranks share the one KV head
    (2, (2, 1, 4), 3, False),  # replicated: 2 ranks per KV head, ZeRO-3 gathers
    (1, (2, 1, 4), 1, True),  # replicated, with sequence parallelism
    pytest.param(2, (2, 2, 2), 1, False, marks=pytest.mark.slow),  # pipeline, split
    (1, (1, 2, 4), 0, False),  # pipeline, replicated
]


@pytest.mark.parametrize("n_kv,layout,stage,sp", CASES)
def test_gqa_layout_matches_single_device(n_kv, layout, stage, sp):
    dp, pp, tp = layout
    model = dataclasses.replace(TINY_MODEL, n_kv_heads=n_kv, n_layers=4)
    ref_grads, ref_losses, _ = reference(model=model, global_batch_size=BATCH)
    config = make_config(dp=dp, pp=pp, tp=tp, stage=stage, model=model, global_batch_size=BATCH)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=sp))
    if pp > 1:
        config = dataclasses.replace(config, pipeline=PipelineConfig(microbatches=4))
    grads, losses, state = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
    wk = state.params["layers"]["wk"]  # [layers, embed, kv_heads, head_dim]
    local_heads = {shard.data.shape[2] for shard in wk.addressable_shards}
    assert local_heads == {n_kv // tp if n_kv >= tp else n_kv}  # split, or every KV head on every rank


def test_dry_run_counts_the_replicated_kv_heads():
    """tp = 4 over 2 KV heads: every rank holds both KV heads' projections, which the compiled state,
    the ZeRO formula and the planner all count (written out here by hand)."""
    from conftest import builder_for
    from jaxpar import dry_run as dr
    from jaxpar.planner.memory import local_params

    model = dataclasses.replace(TINY_MODEL, n_kv_heads=2)
    config = make_config(dp=2, tp=4, stage=0, model=model)
    d, n, k, h, f, v, tp = 64, 8, 2, 8, 128, 128, 4
    per_layer = 2 * d + (d * n * h + n * h * d + 3 * d * f) // tp + 2 * d * k * h  # wk, wv whole
    local = 2 * v * d // tp + d + model.n_layers * per_layer
    report = dr.dry_run(config, builder_for(config).mesh)
    assert report["per_device_bytes"]["params"] == 4 * local  # fp32, no ZeRO
    assert report["analytic_bytes"]["params"] == 4 * local
    counts = local_params(config)
    assert counts["llm_layers"] + counts["llm_rest"] == local
