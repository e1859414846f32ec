"""Megatron sequence parallelism (mesh.sequence_parallel): equal to one device, and its collectives.

Outside the tensor-parallel blocks every tp rank holds 1/tp of the sequence, so each layer's two tp
all-reduces forward (and two backward) become reduce-scatter + all-gather pairs and the activations
that are not inside a tp block (residual stream, norms, the pipeline's stash and sends) shrink by tp.
"""

import dataclasses

import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.config import validate
from jaxpar.compiler.dry_run import dry_run
from jaxpar.errors import ConfigError
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run
import test_vla
from test_pipeline import assert_matches_single_device, pipeline_config


def with_sp(config, on: bool = True):
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=on))


# collective matmul (mesh.collective_matmul=on: the layers' gathers and scatters as ppermute rings under their
# GEMMs; more cases in tests/test_collective_matmul.py)
@pytest.mark.parametrize("dp,tp,stage,rings", [(2, 4, 1, "off"), (2, 2, 3, "off"), (1, 8, 2, "off"), (1, 8, 2, "on")])
def test_sequence_parallel_matches_single_device(dp, tp, stage, rings):
    ref_grads, ref_losses, _ = reference()
    config = with_sp(make_config(dp=dp, tp=tp, stage=stage))
    grads, losses, _ = run(dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, collective_matmul=rings)))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("schedule,virtual", [pytest.param("1f1b", 1, marks=pytest.mark.slow), ("1f1b", 2)])
def test_sequence_parallel_pipeline_matches_single_device(schedule, virtual):
    assert_matches_single_device(with_sp(pipeline_config((1, 2, 2), schedule, 4, virtual=virtual)))


def _tp_ops(report):
    """{(op, axis): count per step} of the tp collectives jaxpar wrote (before XLA combines them)."""
    return {(e["op"], e["axis"]): e["count"] for e in report["collectives_requested"] if e["axis"] == "tp"}


def test_layer_all_reduces_become_reduce_scatter_all_gather_and_temp_falls():
    """(1,1,4), L = 2 layers, counted in the program jaxpar writes. Without SP: per layer 2 all-reduces
    forward (attention and MLP outputs) and 2 backward (their inputs' gradients, one per block), the
    embedding's forward and the head input's backward, and the loss's 3 [B, S] scalars (max, normaliser,
    target logit). With SP each activation all-reduce becomes a reduce-scatter (forward: the 2L + 1
    row-parallel sums incl. the embedding; backward: the transposes of the 2L + 1 gathers) or an
    all-gather (the 2L block inputs and the head's, and their transposes), moving the same bytes; the
    all-reduces left are the loss scalars and the norm weights' gradients (2L + 1 of them, now computed
    on sequence shards). Both have one more all-reduce, of one scalar: the global gradient norm
    (over every mesh axis > 1, here tp alone)."""
    config = make_config(tp=4, seq_len=64, global_batch_size=8)
    base, sp = (dry_run(c, builder_for(c).mesh) for c in (config, with_sp(config)))
    layers, loss_scalars = config.model.n_layers, 3
    activation = 8 * 64 * config.model.d_model * 4  # bytes of one [B, S, D] f32 activation on a tp rank
    base_ops, sp_ops = _tp_ops(base), _tp_ops(sp)
    grad_norm = 1
    assert base_ops == {("all-reduce", "tp"): 4 * layers + 2 + loss_scalars + grad_norm}
    assert sp_ops == {("reduce-scatter", "tp"): 2 * (2 * layers + 1), ("all-gather", "tp"): 2 * (2 * layers + 1),
                      ("all-reduce", "tp"): loss_scalars + 2 * layers + 1 + grad_norm}
    moved = sum(e["bytes"] for e in sp["collectives_requested"] if e["axis"] == "tp" and e["op"] != "all-reduce")
    assert moved == 2 * (4 * layers + 2) * activation  # = the base's activation all-reduces, each one RS + one AG
    # each layer keeps two residual-stream tensors for its backward, the norms' inputs (the layer's input and
    # the sum after attention: jaxpar.layers.norm's rule keeps only those), which SP keeps split over tp
    fall = base["per_device_bytes"]["temp"] - sp["per_device_bytes"]["temp"]
    assert fall >= layers * 2 * (1 - 1 / 4) * activation, (fall, activation)


def test_sequence_parallel_needs_tp_and_a_divisible_sequence():
    with pytest.raises(ConfigError, match="needs mesh.tp > 1"):
        validate(with_sp(make_config(dp=2)))
    with pytest.raises(ConfigError, match="train.seq_len=18 over mesh.tp=4"):
        validate(with_sp(make_config(tp=4, seq_len=18)))


# both slow (make test's 15-minute budget): make test keeps the VLA's pipeline in tests/test_vla.py and
# sequence parallelism with a pipeline below
@pytest.mark.parametrize("vision_tp,collective_matmul", [pytest.param(1, "off", marks=pytest.mark.slow),
                                                         pytest.param(2, "off", marks=pytest.mark.slow),
                                                         pytest.param(2, "on", marks=pytest.mark.slow)])
def test_sequence_parallel_vla_matches_single_device(vision_tp, collective_matmul):
    """(2,2,2) 1F1B: the image + instruction prefix is assembled whole, then split over tp along S (with
    collective matmul: the LLM's layers gather and scatter it by rings, under the prefix-LM mask)."""
    ref_losses, ref_grads, _ = test_vla.reference()
    config = test_vla.with_values(test_vla.BASE, mesh=dict(dp=2, pp=2, tp=2, sequence_parallel=True,
                                                            collective_matmul=collective_matmul),
                                  vision=dict(tp=vision_tp), pipeline=dict(schedule="1f1b"), zero=dict(stage=1))
    losses, grads, _ = test_vla.run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)
