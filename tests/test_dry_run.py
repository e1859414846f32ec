"""The AOT dry run: per-device state bytes against the ZeRO table, XLA's memory numbers, Llama-2-7B.

Expected bytes are written out here from the ZeRO paper's table (Psi = tp-local parameter count,
counted by hand in conftest.tp_local_params): bf16: params 2 Psi, fp32 master + Adam m, v 12 Psi; fp32:
params 4 Psi, Adam 8 Psi. ZeRO >= 1 divides the optimizer state by dp, ZeRO 3 the params too. Every
dimension of these models divides by dp and tp, so the state's shards are these byte counts exactly,
plus the optimizer's two int32 step counters (COUNTERS). The library's own formula
(dry_run.zero_formula_bytes, with Psi from the shard shapes) is checked against the measured shards and
the gradients the compiled step reduces, not against a copy of itself. Each dry run compiles once
(module cache).

The dry runs compile with the XLA backend (LLVM) optimisation level at 0 (the small model's here, every
in-process compile by tests/conftest.py): HLO passes, buffer assignment and so memory_analysis are
unchanged (test_fast_compile_keeps_memory_analysis), and it takes about a third of the time on 2 cores.
The Llama-2-7B runs compile the CLI's HLO for the real model.
"""

import dataclasses
import functools
from unittest import mock

import jax
import pytest

from conftest import LLAMA7B_TP8, XLA_DEFAULT_CODEGEN, make_config, tp_local_params
from jaxpar.compiler import dry_run as dr
from jaxpar.config import MeshConfig, ModelConfig, ZeroConfig, load_config
from jaxpar.parallel.mesh import Layout
from jaxpar.parallel.step import StepBuilder

MODEL = ModelConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512)
MESHES = [(8, 1), (4, 2)]
STAGES = [0, 1, 2, 3]
LLAMA7B_PARAMS = 6_738_415_616
MODEL_PARAMS = 1_836_288  # 2 x 1024 x 256 + 256 + 2 x (2 x 256 + 4 x 256^2 + 3 x 256 x 512)
COUNTERS = 8  # optax's int32 step counts in the optimizer state (Adam's bias correction, the lr schedule)


def expected_bytes(precision: str, stage: int, psi: int, dp: int) -> dict:
    p, k = (2, 12) if precision == "bf16" else (4, 8)
    return {"params": p * psi / (dp if stage >= 3 else 1), "opt_state": k * psi / (dp if stage >= 1 else 1)}


def mesh_for(config):
    return Layout.for_config(config).make_mesh()


FAST_COMPILE = {"xla_backend_optimization_level": 0}
_compile = jax.stages.Lowered.compile


def _fast_compile(self, compiler_options=None, **kwargs):
    return _compile(self, {**FAST_COMPILE, **(compiler_options or {})}, **kwargs)


def small_config(dp: int, tp: int, stage: int, grad_reduce: str = "fp32"):
    config = make_config(dp=dp, tp=tp, stage=stage, precision="bf16", model=MODEL)
    return dataclasses.replace(config, grad_reduce=grad_reduce)


@functools.cache
def report(dp: int, tp: int, stage: int, grad_reduce: str = "fp32") -> dict:
    config = small_config(dp, tp, stage, grad_reduce)
    with mock.patch.object(jax.stages.Lowered, "compile", _fast_compile):
        return dr.dry_run(config, mesh_for(config))


@functools.cache
def llama7b(dp: int, tp: int, stage: int) -> dict:
    config = load_config("llama7b.py", LLAMA7B_TP8)
    config = dataclasses.replace(config, mesh=MeshConfig(dp=dp, pp=1, tp=tp), zero=ZeroConfig(stage=stage))
    return dr.dry_run(config, mesh_for(config))


def test_model_sizes():
    assert tp_local_params(MODEL, 1) == MODEL_PARAMS == report(8, 1, 0)["param_count"]
    assert tp_local_params(MODEL, 2) == 918_784  # all but the 5 norm scales (5 x 256) halve


# ----------------------------------------------------------------------------- 4. the ZeRO table

# every stage on both meshes; stages 1-2 on (4, 2) are `slow` (make test's 15-minute budget; CI runs both)
@pytest.mark.parametrize("dp,tp,stage", [pytest.param(dp, tp, stage, marks=[pytest.mark.slow] if (dp, tp) == (4, 2)
                                                       and stage in (1, 2) else [])
                                          for dp, tp in MESHES for stage in STAGES])
def test_state_bytes_match_zero_table_bf16(dp, tp, stage):
    rep = report(dp, tp, stage)
    pd, an = rep["per_device_bytes"], rep["analytic_bytes"]
    want = expected_bytes("bf16", stage, tp_local_params(MODEL, tp), dp)
    # the real shard shapes are the ZeRO table, byte for byte ...
    assert pd["params"] == want["params"]
    assert pd["opt_state"] == want["opt_state"] + COUNTERS
    assert pd["opt_state_host"] == 0
    # ... and so is the library's formula
    assert (an["params"], an["opt_state"]) == (pd["params"], pd["opt_state"] - COUNTERS)
    # its gradients are what the step holds after reducing them over dp in fp32 (grad_reduce's default),
    # read from the program: reduce-scattered into a 1/dp shard, else all-reduced whole (that entry also
    # holds the loss and the token count, two f32 scalars, and with tp = 1 the gradient norm's sum of squares,
    # an all-reduce over every mesh axis > 1: dp alone)
    reduced = {e["op"]: e["bytes"] for e in rep["collectives_requested"] if e["axis"] == "dp" and e["dtype"] == "f32"}
    scalars = 8 + (4 if tp == 1 else 0)
    assert an["grads"] == (reduced["reduce-scatter"] / dp if "reduce-scatter" in reduced else reduced["all-reduce"] - scalars)


def test_zero3_bf16_dp8_params_are_an_eighth():
    pd = report(8, 1, 3)["per_device_bytes"]
    assert pd["params"] == 2 * MODEL_PARAMS / 8 == 459_072
    assert pd["opt_state"] == 12 * MODEL_PARAMS / 8 + COUNTERS == 2_754_440



@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dp,tp", MESHES)
def test_state_bytes_match_zero_table_fp32(dp, tp, stage):
    """fp32 (4 + 8 bytes, no master): the abstract state the dry run measures, without compiling."""
    config = make_config(dp=dp, tp=tp, stage=stage, precision="fp32", model=MODEL)
    builder = StepBuilder(config, mesh_for(config))
    state = builder.abstract_state()
    assert state.master is None
    want = expected_bytes("fp32", stage, tp_local_params(MODEL, tp), dp)
    params_bytes = dr.bytes_by_memory_kind(state.params)["device"]
    opt_bytes = dr.bytes_by_memory_kind((state.master, state.opt_state))["device"]
    assert params_bytes == want["params"]
    assert opt_bytes == want["opt_state"] + COUNTERS
    # the library's formula, with its Psi counted from the shard shapes, is the measured shards; fp32
    # gradients have the params' shapes and dtype: the params' bytes before any ZeRO-3 split, then split
    # over dp from ZeRO-1 on (reduce-scattered into the optimizer's shard: issue 46)
    formula = dr.zero_formula_bytes(config, dr.local_param_count(builder), dp)
    assert (formula["params"], formula["opt_state"]) == (params_bytes, opt_bytes - COUNTERS)
    unsplit_params = params_bytes * (dp if stage == 3 else 1)
    assert formula["grads"] == unsplit_params / (dp if stage >= 1 else 1)


# ----------------------------------------------------------------------------- 5. XLA's numbers

@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dp,tp", MESHES)
def test_memory_analysis_and_collectives_are_reported(dp, tp, stage):
    rep = report(dp, tp, stage)
    pd = rep["per_device_bytes"]
    assert pd["peak"] == pd["argument"] + pd["output"] - pd["alias"] + pd["temp"]
    assert pd["temp"] > 0
    state = pd["params"] + pd["opt_state"] + 8  # + the int32 step and skipped-steps counters
    batch = 3 * (16 // dp) * 16 * 4  # inputs, targets (int32) and mask (f32), this device's rows
    assert pd["argument"] == state + batch
    assert pd["alias"] == state  # the state is donated: updated in place
    assert pd["output"] >= state
    assert rep["collectives"] and all(e["bytes"] > 0 and e["count"] > 0 for e in rep["collectives"])
    assert rep["collectives_requested"] and all(e["bytes"] > 0 for e in rep["collectives_requested"])
    assert 0 < rep["compile_s"] < 120
    assert (rep["devices"], rep["mesh"], rep["zero_stage"]) == (8, {"dp": dp, "pp": 1, "tp": tp}, stage)
    # the gradients go over dp as the stage says, in fp32 (grad_reduce's default): all-reduced by ZeRO-0,
    # reduce-scattered into the optimizer's shard by ZeRO 1-3; the weights are gathered in bf16: ZeRO-3's per
    # use, ZeRO-1 and 2's once after the update (the compute-dtype copy)
    assert _dp_ops(rep, "f32") == [{"all-reduce"}, {"reduce-scatter"}, {"reduce-scatter"}, {"reduce-scatter"}][stage]
    assert _dp_ops(rep, "bf16") == ({"all-gather"} if stage >= 1 else set())


def _dp_ops(rep: dict, dtype: str) -> set:
    """Collectives over dp in `dtype` as jaxpar wrote them, leaving out the loss / token-count scalars."""
    return {e["op"] for e in rep["collectives_requested"]
            if e["axis"] == "dp" and e["dtype"] == dtype and e["bytes"] > 64 * e["count"]}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_reduce_bf16_moves_the_gradients_in_bf16(stage):
    rep = report(4, 2, stage, "bf16")
    assert _dp_ops(rep, "bf16") == [None, {"reduce-scatter", "all-gather"}, {"reduce-scatter", "all-gather"},
                                    {"reduce-scatter", "all-gather"}][stage]
    assert _dp_ops(rep, "f32") == set()


def test_fast_compile_keeps_memory_analysis():
    """The suite's fast compile (conftest.fast_codegen_in_this_process) keeps a run's argument, output and alias
    bytes exactly; XLA:CPU's elemental emitters fuse a few elementwise ops apart from the fusion emitters, which
    moves the temp bytes by 192 of 4,967,448 here: within 0.01%. (No test pins temp bytes.)"""
    config = small_config(4, 2, 3)
    builder = StepBuilder(config, mesh_for(config))
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    mem = lowered.compile(XLA_DEFAULT_CODEGEN).memory_analysis()  # a run's compile (conftest's is the fast one)
    pd = report(4, 2, 3)["per_device_bytes"]
    assert (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes) == (
        pd["argument"], pd["output"], pd["alias"])
    assert abs(pd["temp"] - mem.temp_size_in_bytes) <= 1e-4 * mem.temp_size_in_bytes


@pytest.mark.parametrize("dp,tp", MESHES)
def test_zero3_divides_state_by_dp(dp, tp):
    z0, z3 = report(dp, tp, 0)["per_device_bytes"], report(dp, tp, 3)["per_device_bytes"]
    assert z0["opt_state"] - COUNTERS == dp * (z3["opt_state"] - COUNTERS)  # the counters are not split
    assert z0["params"] == dp * z3["params"]
    assert z3["peak"] < z0["peak"]


def test_nan_guard_does_not_hold_two_states():
    """The NaN guard updates in place (a lax.cond around the optimizer): a where(finite, new, old) over
    the whole state kept old and new master weights, moments and params alive at once, 25 MB of temp
    here instead of 12 MB (+42 GB per device for Llama-2-7B dp=8 ZeRO-0). train.nan_guard=auto, the
    default, is the cond on XLA:CPU."""
    rep = report(8, 1, 0)
    assert rep["nan_guard"] == "cond"
    assert rep["per_device_bytes"]["temp"] < 8 * MODEL_PARAMS


# ----------------------------------------------------------------------------- 6. Llama-2-7B

def test_llama7b_tp8_zero1():
    rep = llama7b(1, 8, 1)
    pd = rep["per_device_bytes"]
    assert (rep["config"]["precision"], rep["config"]["remat"]["policy"]) == ("bf16", "full")
    assert rep["param_count"] == LLAMA7B_PARAMS
    assert rep["compile_s"] < 60
    psi = tp_local_params(load_config("llama7b.py").model, 8)
    assert psi == 842_534_912  # 2*32000*4096/8 + 4096 + 32 * (2*4096 + (4*4096^2 + 3*4096*11008)/8)
    assert pd["params"] == 2 * psi
    assert pd["opt_state"] == 12 * psi + COUNTERS  # dp = 1: nothing to shard over
    assert pd["temp"] > 0 and pd["peak"] > pd["params"] + pd["opt_state"]


@pytest.mark.slow  # make test's 15-minute budget (test_state_bytes_match_zero_table_bf16 keeps ZeRO-3's table)
def test_llama7b_dp8_zero3():
    rep = llama7b(8, 1, 3)
    pd = rep["per_device_bytes"]
    assert rep["param_count"] == LLAMA7B_PARAMS
    assert rep["compile_s"] < 60
    assert pd["params"] == 2 * LLAMA7B_PARAMS / 8  # 32000, 4096 and 11008 all divide by 8
    assert pd["opt_state"] == 12 * LLAMA7B_PARAMS / 8 + COUNTERS
    # full remat: every layer weight is gathered for the forward and again for the backward
    gathers = {e["dtype"]: e for e in rep["collectives_requested"] if e["op"] == "all-gather" and e["axis"] == "dp"}
    assert set(gathers) == {"bf16"}
    assert gathers["bf16"]["count"] == 3 + 2 * 9 * 32


# ----------------------------------------------------------------------------- 7. FLOPs

def hand_train_flops(model: ModelConfig, batch: int, seq: int) -> int:
    """Matmul FLOPs of one train step of the Llama model on one device, written out matmul by matmul
    (2 m n k each): per layer q, k, v, o projections, the attention scores q k^T and the weighted values
    (full S x S: XLA's attention masks, it does not skip), gate, up and down; then the LM head. The
    backward runs two matmuls of the same size per forward matmul (the two operands' gradients; the first
    layer's input gradient too, which the embedding's gradient needs), so a step is 3 x forward. The
    embedding is a gather (no matmul)."""
    t, d, f, v = batch * seq, model.d_model, model.d_ff, model.vocab_size
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    per_layer = (2 * t * d * q + 2 * 2 * t * d * kv  # q, k, v projections
                 + 2 * batch * model.n_heads * seq * seq * model.head_dim  # scores q k^T
                 + 2 * batch * model.n_heads * seq * seq * model.head_dim  # probabilities x v
                 + 2 * t * q * d  # output projection
                 + 2 * 2 * t * d * f + 2 * t * f * d)  # gate, up, down
    return 3 * (model.n_layers * per_layer + 2 * t * d * v)


def test_executed_flops_of_a_one_device_step_equal_the_hand_count():
    """Tiny Llama, one device, remat none: every matmul the compiled step runs is one of the hand count's,
    exactly; and this model's 6N + attention FLOPs are the same number (d_model = heads x head_dim)."""
    config = make_config()  # 1 device, remat none, fp32, batch 16 x 16 tokens
    with mock.patch.object(jax.stages.Lowered, "compile", _fast_compile):
        rep = dr.dry_run(config, mesh_for(config))
    want = hand_train_flops(config.model, 16, 16)
    assert rep["executed_flops_per_device"] == want
    assert rep["executed_flops"]["dot"] == want and rep["executed_flops"]["convolution"] == 0
    assert not rep["executed_flops"]["trip_count_unknown"] and rep["executed_flops"]["uncounted"] == []
    assert rep["model_flops_per_device"] == rep["flops_per_step"] == want
    assert rep["bubble_fraction"] == 0.0
    assert "executed 1.447e+08 (compiled program), model 1.447e+08" in dr.format_report(rep)


@pytest.mark.parametrize("dp,tp", MESHES)
def test_executed_flops_split_evenly_over_8_devices(dp, tp):
    """dp x tp, remat none: each device runs exactly 1/8 of the model's matmuls (tp splits heads, d_ff and
    the vocabulary; dp the batch); the optimizer, the norms and the loss have none."""
    rep = report(dp, tp, 1)
    assert rep["model_flops_per_device"] == rep["flops_per_step"] / 8
    assert rep["executed_flops_per_device"] == hand_train_flops(MODEL, 16, 16) / 8
