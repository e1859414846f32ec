"""Collective matmul (mesh.collective_matmul, jaxpar.layers.collective_matmul): sequence parallelism's
all-gather and reduce-scatter as ppermute rings under the GEMMs, equal to the collectives they replace and
to one device, in the program jaxpar writes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import builder_for, make_config, replace
from jaxpar.compiler import hlo_collectives
from jaxpar.config import PipelineConfig, RematConfig, validate
from jaxpar.errors import ConfigError
from jaxpar.layers import collective_matmul, fp8, order
from jaxpar.layers.collectives import Collectives
from test_equivalence import LOSS_RTOL, assert_grads_close, reference, run
from test_pipeline import assert_matches_single_device, pipeline_config


def with_cm(config, mode: str = "on", sp: bool = True):
    return replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=sp, collective_matmul=mode))


# ----------------------------------------------------------------------------- the rings alone
def _rings_and_collectives(n: int, keep_gathered: bool = True):
    """(ring, reference) functions of (x, w_col, w_row) in a shard_map over n devices: the column ring
    against all_gather + einsum, the row ring against einsum + psum_scatter, both then summed to a loss.
    `keep_gathered` False: the column ring keeps only x's shard and gathers it again for dW by a second ring."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))

    def body(ring):
        def f(x, w_col, w_row):
            if ring:
                (h,) = collective_matmul.all_gather_linears(x, [("bsd,df->bsf", w_col)], ("tp",), keep_gathered)
                out = collective_matmul.linear_reduce_scatter("bsf,fd->bsd", jnp.tanh(h), w_row, ("tp",))
            else:
                h = jnp.einsum("bsd,df->bsf", jax.lax.all_gather(x, "tp", axis=1, tiled=True), w_col)
                out = jax.lax.psum_scatter(jnp.einsum("bsf,fd->bsd", jnp.tanh(h), w_row), "tp",
                                           scatter_dimension=1, tiled=True)
            return h, out
        specs = (P(None, "tp"), P(None, "tp"), P("tp", None))
        return jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(P(None, None, "tp"), P(None, "tp")))
    return body(True), body(False)


@pytest.mark.parametrize("n,keep_gathered", [(2, True), (4, True), (4, False)])
def test_the_rings_equal_the_collectives_forward_and_backward(n, keep_gathered):
    """Every output chunk lands at its sequence position, every rank's sum is its own chunk's, and the
    gradients of the rings' backward (reverse rings; dW on the kept gathered input, or on the shard
    gathered again by a ring) equal those of the collectives."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 4 * n, 8))
    w_col, w_row = jax.random.normal(keys[1], (8, 2 * n)), jax.random.normal(keys[2], (2 * n, 8))
    cotangent = jax.random.normal(keys[3], (2, 4 * n, 8))
    ring, plain = _rings_and_collectives(n, keep_gathered)
    for a, b in zip(jax.jit(ring)(x, w_col, w_row), jax.jit(plain)(x, w_col, w_row)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda *args: jnp.sum(fn(*args)[1] * cotangent)  # noqa: E731
    got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(x, w_col, w_row)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w_col, w_row)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _fp8_block(n: int, rings: bool, lives: bool, calibrating: bool = False):
    """A column linear, tanh, a row linear, through Collectives under precision=fp8 and sequence parallelism over n
    devices: the FP8 rings (`rings`) or the plain path (all-gather, FP8 GEMMs, reduce-scatter); `lives`: with
    delayed scaling's counters (rows: the column linear's, the row linear's), whose cotangent is summed over tp."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    coll = Collectives(tp_axis="tp", sequence_axis="tp", fp8=True, collective_matmul="on" if rings else "off",
                       fp8_calibrating=calibrating)

    def f(x, w_col, w_row, counters):
        counters = jax.lax.pcast(counters, ("tp",), to="varying")  # as fp8_counters.varying_over_tp
        col, row = (fp8.Scaled(w, counters[k]) if lives else w for k, w in enumerate((w_col, w_row)))
        (h,) = coll.column_linears(coll.enter_block(x), [("bsd,df->bsf", col)])
        return coll.row_linear("bsf,fd->bsd", jnp.tanh(h), row), counters
    specs = (P(None, "tp"), P(None, "tp"), P("tp", None), P())
    body = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(P(None, "tp"), P("tp")))
    return lambda x, w_col, w_row, counters: body(x, w_col, w_row, counters)[0]


@pytest.mark.parametrize("lives,calibrating", [(False, False), (True, False), (True, True)],
                         ids=["current", "delayed", "calibrating"])
def test_the_fp8_rings_compute_the_plain_fp8_paths_values(lives, calibrating):
    """precision=fp8: the rings' GEMMs are FP8 ones whose operands the plain path's scales quantize (the column
    input by the whole gathered input's amax, the row output gradient by the whole gathered gradient's; or both
    from the counters), so outputs and gradients equal the plain path's to float32 summation order, and the
    counters' cotangent (each rank's shards' bins, summed over tp) has the plain path's highest bin in every row, the
    only bin the counters' rule keeps (optim.fp8_counter_rule). A ring scaling its chunks
    by their own amaxes, or by a shard's, moves FP8 values and fails (tolerance 1e-5 against FP8's 2^-4)."""
    n = 4
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (2, 4 * n, 8)) * jnp.linspace(0.1, 4.0, 4 * n)[None, :, None]  # shards' amaxes differ
    w_col, w_row = jax.random.normal(keys[1], (8, 2 * n)), jax.random.normal(keys[2], (2 * n, 8))
    cotangent = jax.random.normal(keys[3], (2, 4 * n, 8)) * jnp.linspace(4.0, 0.1, 4 * n)[None, :, None]
    counters = jnp.zeros((2, len(fp8.OPERANDS), fp8.BINS)).at[:, :, 60:70].set(2.0)  # scales 2^(70 - 1 + min)
    ring, plain = (_fp8_block(n, rings, lives, calibrating) for rings in (True, False))
    np.testing.assert_allclose(jax.jit(ring)(x, w_col, w_row, counters), jax.jit(plain)(x, w_col, w_row, counters),
                               rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda *args: jnp.sum(fn(*args) * cotangent)  # noqa: E731
    got, want = (jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(x, w_col, w_row, counters) for fn in (ring, plain))
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    from test_fp8_delayed import top_bins
    got_top, want_top = top_bins(np.asarray(got[3])), top_bins(np.asarray(want[3]))
    np.testing.assert_array_equal(got_top, want_top)
    assert np.all(want_top >= 0) == lives  # (the plain path saw every operand)


# ----------------------------------------------------------------------------- equal to one device
@pytest.mark.parametrize("dp,tp,stage", [(2, 4, 1), (4, 2, 3), pytest.param(1, 4, 0, marks=pytest.mark.slow)])
def test_collective_matmul_matches_single_device(dp, tp, stage):
    ref_grads, ref_losses, _ = reference()
    grads, losses, _ = run(with_cm(make_config(dp=dp, tp=tp, stage=stage)))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.slow
def test_collective_matmul_under_remat_and_zero2_matches_single_device():
    ref_grads, ref_losses, _ = reference()
    grads, losses, _ = run(with_cm(replace(make_config(dp=2, tp=2, stage=2), remat=RematConfig(policy="selective"))))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_collective_matmul_pipeline_matches_single_device():
    assert_matches_single_device(with_cm(pipeline_config((1, 2, 2), "1f1b", 4)))


# ----------------------------------------------------------------------------- the program and the option
def _tp_ops(config) -> dict:
    """{op: count} of the tp collectives in the program jaxpar writes (before XLA combines them), every dtype's."""
    builder = builder_for(config)
    text = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch()).as_text(dialect="hlo")
    counts = {}
    for e in hlo_collectives.collectives(text, builder.mesh):
        if e["axis"] == "tp":
            counts[e["op"]] = counts.get(e["op"], 0) + e["count"]
    return counts


def test_the_layers_gather_and_scatter_by_rings_only_with_the_option():
    """(1,1,4), 2 layers: with the option each block's all-gather and reduce-scatter (forward, and their
    transposes backward) become tp - 1 permutes each; the embedding's reduce-scatter and the head's
    gather stay collectives (2 each: forward and backward). Off, no permute at all."""
    config = make_config(tp=4, seq_len=64, global_batch_size=8)
    layers, tp = config.model.n_layers, 4
    plain, rings = _tp_ops(with_cm(config, "off")), _tp_ops(with_cm(config, "on"))
    assert "collective-permute" not in plain
    assert "collective-permute" in rings, ("mesh.collective_matmul=on did not reach the layers: StepBuilder.collectives() "
                                           "must pass collective_matmul=config.mesh.collective_matmul")
    assert rings["collective-permute"] == 2 * layers * 2 * 2 * (tp - 1)  # blocks x (gather, scatter) x (fwd, bwd)
    assert rings["all-gather"] == rings["reduce-scatter"] == 2
    assert plain["all-gather"] == plain["reduce-scatter"] == 2 * (2 * layers + 1)


def test_fp8_runs_the_rings_with_one_amax_all_reduce_per_gathered_operand():
    """precision=fp8 keeps the rings (their GEMMs FP8): the same permutes as bf16's, plus one scalar all-reduce
    (max) over tp per gathered operand under current scaling: each column ring's input in the forward, each row
    ring's output gradient in the backward (2 blocks x 2 layers x 2); delayed scaling's counters need none."""
    config = make_config(tp=4, seq_len=64, global_batch_size=8, precision="bf16")
    layers = config.model.n_layers
    bf16 = _tp_ops(with_cm(config))
    current = _tp_ops(with_cm(replace(config, precision="fp8")))
    delayed = _tp_ops(with_cm(replace(config, precision="fp8", fp8=dataclasses.replace(config.fp8, recipe="delayed"))))
    assert current["collective-permute"] == delayed["collective-permute"] == bf16["collective-permute"]
    assert current["all-reduce"] - bf16["all-reduce"] == 2 * layers * 2
    assert delayed["all-reduce"] - bf16["all-reduce"] == 1  # the counters' one sum over tp (fp8_counters)


def test_the_option_is_validated_in_one_line():
    with pytest.raises(ConfigError, match="collective_matmul='sometimes' is unknown"):
        validate(with_cm(make_config(tp=2), "sometimes"))
    with pytest.raises(ConfigError, match="set mesh.sequence_parallel=true or leave it auto"):
        validate(with_cm(make_config(tp=2), "on", sp=False))
    zb = replace(make_config(dp=1, pp=2, tp=2), pipeline=PipelineConfig(microbatches=4, schedule="zb"))
    with pytest.raises(ConfigError, match="does not run in a zb pipeline"):
        validate(with_cm(zb))
    validate(with_cm(zb, "auto"))  # auto: zb keeps the collectives


def test_auto_is_on_for_gpu_programs_and_off_on_emulated_meshes():
    coll = Collectives(tp_axis="tp", sequence_axis="tp")
    with order.ordering(True):  # XLA:CPU
        assert not coll.matmul_rings
        assert dataclasses.replace(coll, collective_matmul="on").matmul_rings
    with order.ordering(False):  # a GPU program
        assert coll.matmul_rings
        assert not dataclasses.replace(coll, collective_matmul="off").matmul_rings
        assert not Collectives(tp_axis="tp").matmul_rings  # no sequence parallelism, nothing to decompose
    # auto: only chunks long enough to pay for the ring's cut GEMMs and copies (vla70b's 296 tokens did not)
    least = collective_matmul.AUTO_MIN_CHUNK_TOKENS
    assert coll._ring_pays(least) and not coll._ring_pays(least - 1)
    assert dataclasses.replace(coll, collective_matmul="on")._ring_pays(1)


def test_the_column_rings_keep_what_the_plain_path_keeps():
    """Under ZeRO-3 the layer policy never keeps an all-gather's output (zero.never_keep_gathered): the plain
    path keeps x's shard and gathers again in the backward, so the column ring keeps the shard too (its
    residual is 1 / tp of the gathered input: llama7b dp 16 x tp 4 peaked at 46.57 GiB against the plain path's
    39.63 when it kept the whole, BENCHMARKS.md) and all-gathers it again in the backward."""
    assert Collectives(tp_axis="tp", sequence_axis="tp").keeps_gathered_inputs
    assert not Collectives(tp_axis="tp", sequence_axis="tp", zero3_axis="dp").keeps_gathered_inputs
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))

    def kept_shape(keep_gathered):
        kept = []

        def f(x, w):
            outs, (x_kept, _) = collective_matmul._column_fwd(("bsd,df->bsf",), ("tp",), keep_gathered, x, w)
            kept.append(x_kept.shape)
            return outs[0]
        jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                                     out_specs=P(None, None, "tp")), jnp.ones((2, 4 * n, 8)), jnp.ones((8, 2 * n)))
        return kept[0]

    assert kept_shape(True) == (2, 4 * n, 8) and kept_shape(False) == (2, 4, 8)


def test_under_zero3_the_backward_gathers_the_column_input_again():
    """(2,1,4) ZeRO-3, 2 layers: each column block's backward all-gathers x's shard again for dW, as the plain
    path does under ZeRO-3's policy (which keeps no all-gather's output): the rings' permutes as without
    ZeRO-3, plus one all-gather per column block (the head's two as before)."""
    config = make_config(dp=2, tp=4, stage=3, seq_len=64, global_batch_size=8)
    layers, tp = config.model.n_layers, 4
    rings = _tp_ops(with_cm(config, "on"))
    assert rings["collective-permute"] == 2 * layers * 2 * 2 * (tp - 1)
    assert rings["all-gather"] == 2 + 2 * layers


def test_auto_leaves_the_rings_off_where_the_layers_run_dp_collectives():
    """XLA's GPU schedule keeps one collective in flight: the rings hold it across the blocks' GEMMs, which
    hid the layers' own dp collectives (llama7b dp 16 x tp 4 ZeRO-3 on 64 A100s: 2.082 s off, 2.164 s on,
    BENCHMARKS.md). So auto runs them only where the layers run none (dp 1, or dp reductions after the
    backward: pipelines, accumulation); `on` still forces them."""
    with order.ordering(False):  # a GPU program
        sp = Collectives(tp_axis="tp", sequence_axis="tp")
        assert sp.matmul_rings
        for per_layer_dp in ({"zero3_axis": "dp"}, {"zero2_axis": "dp"}, {"dp_reduce_axis": "dp"}):
            assert not dataclasses.replace(sp, **per_layer_dp).matmul_rings, per_layer_dp
            assert dataclasses.replace(sp, collective_matmul="on", **per_layer_dp).matmul_rings


def test_under_zero3_the_rings_and_the_regather_are_ordered():
    """The backward's all-gather of the column input (ZeRO-3) is ordered with the rings' permutes and ZeRO-3's
    own gathers and scatters on XLA:CPU's emulated mesh (tests/test_collective_order.py's check). Not checked
    here: the pairs left are tp all-reduces against ZeRO-3's gradient reduce-scatters, which the plain
    path under ZeRO-3 + sequence parallelism leaves unordered too (with 41 pairs in all, its all-gathers' among
    them), outside the rings."""
    from jaxpar.compiler import hlo_order
    from jaxpar.config import MeshConfig
    from test_collective_order import _train_step_hlo
    config = replace(make_config(dp=2, tp=4, stage=3),
                     mesh=MeshConfig(dp=2, tp=4, sequence_parallel=True, collective_matmul="on"))
    pairs = hlo_order.unordered_pairs(_train_step_hlo(config))
    assert not [p for p in pairs if any(op.startswith(("all_gather", "ppermute")) for op in p[1:])], pairs[:5]
