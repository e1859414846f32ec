"""The collectives the compiled programs really contain: Megatron tp, ZeRO over dp, bf16 reductions.

Every expectation is derived here from the model shapes (not from the library's own accounting):
  * forward: 2 all-reduces over tp per layer ([B, S, D] activations), plus 1 for the vocab-parallel
    embedding ([B, S, D]) and 3 for the vocab-parallel cross-entropy (a max and two sums of [B, S]);
  * gradients over dp: all-reduce (ZeRO 0/1), reduce-scatter (ZeRO 2, 3), params all-gathered over
    dp (ZeRO 3), each moving exactly the tp-local parameter bytes.

Programs are only lowered where the pre-optimisation HLO says enough (cheap); a few are compiled to
check the optimised program (XLA combines collectives there, so it is checked by bytes, not counts).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import TINY_MODEL, XLA_DEFAULT_CODEGEN, builder_for, make_config, tp_local_params
from jaxpar.compiler import hlo_collectives
from jaxpar.config import RematConfig
from jaxpar.compiler.dry_run import local_param_count
from jaxpar.layers.collectives import after
from jaxpar.models import llama

B, S = 16, 16  # make_config's global batch and sequence length
D = TINY_MODEL.d_model
N_LAYER_WEIGHTS = 9  # attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down
N_OTHER_WEIGHTS = 3  # embed, final_norm, lm_head
N_MATMUL_WEIGHTS = 7  # the per-layer weights that are not norm scales
# The HLO backend (LLVM) optimisation level does not change the HLO passes, only codegen: it halves
# compile time on 2 cores. (test_optimised_hlo_does_not_depend_on_backend_opt_level checks it.)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ----------------------------------------------------------------------------- helpers

def layer_params_local(model, tp: int) -> int:
    return tp_local_params(model, tp) - tp_local_params(dataclasses.replace(model, n_layers=0), tp)


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


def explicit_groups(text: str) -> str:
    """Rewrite XLA's `replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}` form (optionally with
    `device_ids=([2,4]T(1,0))`) into explicit `{{0,4},{1,5},...}` groups: a second, independent
    reading of the form, which test_hlo_parser_reads_mesh_replica_groups holds jaxpar.compiler.hlo_collectives to, and
    which the instruction-level checks below use."""
    def repl(m):
        names = [item.split("=")[0].strip().strip("'") for item in m.group(1).split(",")]
        sizes = [int(item.split("=")[1]) for item in m.group(1).split(",")]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        axes = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
        rest = [i for i in range(len(sizes)) if i not in axes]
        rows = ids.transpose(rest + axes).reshape(-1, int(np.prod([sizes[i] for i in axes])))
        return "replica_groups={" + ",".join("{" + ",".join(map(str, r)) + "}" for r in rows) + "}"
    return _MESH_GROUPS.sub(repl, text)


def colls(text: str, mesh) -> list[dict]:
    return hlo_collectives.collectives(text, mesh)


def total(entries, op, axis=None, dtype=None) -> tuple[int, float]:
    """(count, bytes) summed over the entries of one op (optionally one axis / dtype)."""
    sel = [e for e in entries if e["op"] == op and axis in (None, e["axis"]) and dtype in (None, e["dtype"])]
    return sum(e["count"] for e in sel), sum(e["bytes"] for e in sel)


def collective_instrs(comps: dict, name: str, into_loops: bool) -> list[dict]:
    """Collective instructions reachable from computation `name`, each once (no trip counts)."""
    out = []
    for ins in comps.get(name, []):
        base = ins["op"].removesuffix("-start")
        if base in hlo_collectives.OPS:
            out.append(ins)
            continue
        callees = re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", ins["attrs"]) if ins["op"] in (
            "call", "fusion", "async-start", "conditional", "while") else []
        if ins["op"] == "while" and not into_loops:
            continue
        for callee in callees:
            out += collective_instrs(comps, callee, into_loops)
    return out


def while_bodies(comps: dict, name: str) -> list[str]:
    out = []
    for ins in comps.get(name, []):
        if ins["op"] == "while":
            out.append(re.search(r"body=%?([\w.\-]+)", ins["attrs"]).group(1))
        elif ins["op"] in ("call", "fusion", "async-start", "conditional"):
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", ins["attrs"]):
                out += while_bodies(comps, callee)
    return out


def reducer(comps: dict, ins: dict) -> str:
    """'max' or 'sum': the binary op of an all-reduce's to_apply computation."""
    body = comps[re.search(r"to_apply=%?([\w.\-]+)", ins["attrs"]).group(1)]
    ops = {i["op"] for i in body}
    assert len(ops & {"maximum", "add"}) == 1, ops
    return "max" if "maximum" in ops else "sum"


def array_shapes(ins: dict) -> list[str]:
    """'f32[8,16,64]' for each element of a (possibly tuple, combined) collective's shape."""
    return [f"{m.group(1)}[{m.group(2)}]" for m in re.finditer(r"([a-z]\w*)\[([\d,]*)\]", ins["shape"])]


# ----------------------------------------------------------------------------- programs

@functools.cache
def forward(n_layers: int, precision: str = "fp32", dp: int = 2, tp: int = 4):
    """(mesh, pre-optimisation HLO, lowered) of the sharded forward loss only (no gradients)."""
    config = make_config(dp=dp, tp=tp, precision=precision, model=dataclasses.replace(TINY_MODEL, n_layers=n_layers))
    builder = builder_for(config)
    coll = builder.collectives()

    def local_loss(params, batch):
        return llama.loss_sum(params, batch, config.model, coll)[0][None]

    fn = jax.jit(jax.shard_map(local_loss, mesh=builder.mesh, in_specs=(builder.specs.params, builder.batch_spec),
                               out_specs=P("dp")))
    lowered = fn.lower(builder.abstract_state().params, builder.abstract_batch())
    return builder.mesh, lowered.as_text(dialect="hlo"), lowered


@functools.cache
def forward_optimised(n_layers: int) -> str:
    return forward(n_layers)[2].compile(FAST_COMPILE).as_text()


@functools.cache
def step(dp: int, tp: int, stage: int, precision: str = "fp32", remat: str = "none", grad_reduce: str = "fp32"):
    """(builder, lowered train step, pre-optimisation HLO)."""
    config = dataclasses.replace(make_config(dp=dp, tp=tp, stage=stage, precision=precision),
                                 remat=RematConfig(policy=remat), grad_reduce=grad_reduce)
    builder = builder_for(config)
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    return builder, lowered, lowered.as_text(dialect="hlo")


@functools.cache
def step_optimised(dp: int, tp: int, stage: int) -> str:
    return step(dp, tp, stage)[1].compile(FAST_COMPILE).as_text()


def test_tp_local_param_count_matches_the_library():
    for dp, tp in [(2, 4), (4, 2)]:
        builder = builder_for(make_config(dp=dp, tp=tp))
        assert local_param_count(builder) == tp_local_params(TINY_MODEL, tp)
    assert tp_local_params(TINY_MODEL, 4) == 24896  # by hand: 2*128*64/4 + 64 + 2 * (128 + 16384/4 + 24576/4)
    assert tp_local_params(TINY_MODEL, 1) == llama.param_count(TINY_MODEL)


# ----------------------------------------------------------------------------- 1. Megatron forward

ACT = B // 2 * S * D * 4  # one f32 [B_local, S, D] activation on dp=2
ROW = B // 2 * S * 4  # one f32 [B_local, S] row of per-token scalars


@pytest.mark.parametrize("optimised", [False, True], ids=["pre", "optimised"])
def test_forward_two_tp_all_reduces_per_layer(optimised):
    got = {}
    for n_layers in (2, 4):
        mesh, pre, _ = forward(n_layers)
        text = forward_optimised(n_layers) if optimised else pre
        entries = colls(text, mesh)
        # nothing but all-reduces over tp: no all-gather (no full-logits gather), nothing over dp
        assert {(e["op"], e["axis"], e["dtype"]) for e in entries} == {("all-reduce", "tp", "f32")}, entries
        got[n_layers] = total(entries, "all-reduce", "tp")
        assert "trip_count_unknown" not in entries[0]

    # two more layers: 2 x 2 more all-reduces of [B, S, D] activations
    assert got[4][0] - got[2][0] == 2 * 2
    assert got[4][1] - got[2][1] == 2 * 2 * ACT
    # fixed part: embedding [B, S, D] + cross-entropy max and two sums of [B, S]
    fixed_bytes = got[2][1] - 2 * 2 * ACT
    assert fixed_bytes == ACT + 3 * ROW
    # 4 separate ops: the target-logit sum is sequenced after the normaliser's sum (a fixed order of
    # collectives on every device, see layers.collectives.after), so XLA cannot merge them
    assert got[2][0] - 2 * 2 == 4


@pytest.mark.parametrize("optimised", [False, True], ids=["pre", "optimised"])
def test_forward_scan_body_and_vocab_parallel_reductions(optimised):
    mesh, pre, _ = forward(2)
    text = explicit_groups(forward_optimised(2) if optimised else pre)
    comps, entry = hlo_collectives.parse_module(text)

    (body,) = while_bodies(comps, entry)  # the layer scan is the only loop
    in_layer = collective_instrs(comps, body, into_loops=True)
    assert [i["op"] for i in in_layer] == ["all-reduce", "all-reduce"]
    # row-parallel outputs of attention and MLP: summed [B_local, S, D]; the MLP's as one row of its B_local x S
    # tokens (llama.per_token_block)
    assert [array_shapes(ins) for ins in in_layer] == [[f"f32[{B // 2},{S},{D}]"], [f"f32[1,{B // 2 * S},{D}]"]]
    for ins in in_layer:
        assert reducer(comps, ins) == "sum"
        assert hlo_collectives.axis_label(hlo_collectives.parse_replica_groups(ins["attrs"], 8), mesh) == "tp"

    outside = collective_instrs(comps, entry, into_loops=False)
    assert {i["op"] for i in outside} == {"all-reduce"}
    by_kind = sorted((reducer(comps, i), shape) for i in outside for shape in array_shapes(i))
    assert by_kind == sorted([("sum", f"f32[{B // 2},{S},{D}]"),  # vocab-parallel embedding
                              ("max", f"f32[{B // 2},{S}]"),  # softmax max
                              ("sum", f"f32[{B // 2},{S}]"),  # softmax normaliser
                              ("sum", f"f32[{B // 2},{S}]")])  # target logit
    # and no [B, S, V] logits anywhere in a collective
    assert all(f",{TINY_MODEL.vocab_size}]" not in i["shape"] for i in in_layer + outside)  # no [.., V] operand


def test_forward_bf16_layers_reduce_bf16_and_cross_entropy_stays_f32():
    mesh, pre, _ = forward(2, precision="bf16")
    entries = colls(pre, mesh)
    assert total(entries, "all-reduce", "tp", "bf16") == (2 * 2 + 1, (2 * 2 + 1) * ACT // 2)  # layers + embedding
    assert total(entries, "all-reduce", "tp", "f32") == (3, 3 * ROW)  # max + 2 sums, fp32 logits
    assert total(entries, "all-gather") == (0, 0)


# ----------------------------------------------------------------------------- 2. ZeRO over dp

MESHES = [(2, 4), (4, 2)]
SCALARS = 2 * 4  # the token count and the loss: two f32 scalars psum'ed over dp


@pytest.mark.parametrize("dp,tp", MESHES)
def test_zero0_all_reduces_gradients_over_dp(dp, tp):
    builder, _, pre = step(dp, tp, 0)
    psi = tp_local_params(TINY_MODEL, tp)
    entries = colls(pre, builder.mesh)
    count, nbytes = total(entries, "all-reduce", "dp")
    assert nbytes == 4 * psi + SCALARS  # every tp-local gradient once, in fp32
    # one per weight and per layer, inside the backward's scan (issue 30: zero.reduce_tap), + 2 scalars
    assert count == N_OTHER_WEIGHTS + N_LAYER_WEIGHTS * TINY_MODEL.n_layers + 2
    assert total(entries, "reduce-scatter") == (0, 0)
    assert total(entries, "all-gather") == (0, 0)  # nothing is sharded over dp


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_reduce_scatter_gradients_over_dp(dp, tp, stage):
    """ZeRO-1 is Megatron's distributed optimizer (issue 46): like ZeRO-2 it reduce-scatters each gradient
    into the optimizer's shard, and no gradient is all-reduced whole."""
    builder, _, pre = step(dp, tp, stage)
    psi = tp_local_params(TINY_MODEL, tp)
    entries = colls(pre, builder.mesh)
    # the reduce-scatter inputs add up to the full tp-local gradient; each rank keeps 1/dp of it. They
    # run per weight and per layer inside the backward scan, so no rank holds its whole gradient.
    n_weights = N_OTHER_WEIGHTS + N_LAYER_WEIGHTS * TINY_MODEL.n_layers
    assert total(entries, "reduce-scatter", "dp") == (n_weights, 4 * psi)
    assert total(entries, "all-reduce", "dp") == (2, SCALARS)  # no gradient all-reduce, only the scalars
    # the updated dp-sharded weights gathered back, one all-gather per weight, in the step's own
    # shard_map (StepBuilder._gather_params: ordered on XLA:CPU) rather than by the partitioner
    assert total(entries, "all-gather") == (N_LAYER_WEIGHTS + N_OTHER_WEIGHTS, 4 * psi)


@pytest.mark.parametrize("dp,tp", MESHES)
def test_zero3_gathers_params_and_reduce_scatters_gradients(dp, tp):
    builder, _, pre = step(dp, tp, 3)
    psi = tp_local_params(TINY_MODEL, tp)
    n_weights = N_OTHER_WEIGHTS + N_LAYER_WEIGHTS * TINY_MODEL.n_layers  # per-layer gathers inside the scan
    entries = colls(pre, builder.mesh)
    assert total(entries, "reduce-scatter", "dp") == (n_weights, 4 * psi)
    count, nbytes = total(entries, "all-gather", "dp")
    assert count >= n_weights and nbytes >= 4 * psi  # every weight gathered at least once for the forward
    assert total(entries, "all-reduce", "dp") == (2, SCALARS)
    assert {e["axis"] for e in entries if e["op"] in ("all-gather", "reduce-scatter")} == {"dp"}


@pytest.mark.parametrize("dp,tp", MESHES)
def test_zero3_full_remat_gathers_layer_weights_again_for_backward(dp, tp):
    builder, _, pre = step(dp, tp, 3, remat="full")
    psi, layers = tp_local_params(TINY_MODEL, tp), layer_params_local(TINY_MODEL, tp)
    entries = colls(pre, builder.mesh)
    n_layer = N_LAYER_WEIGHTS * TINY_MODEL.n_layers
    assert total(entries, "all-gather", "dp") == (N_OTHER_WEIGHTS + 2 * n_layer, 4 * psi + 4 * layers)
    assert total(entries, "reduce-scatter", "dp") == (N_OTHER_WEIGHTS + n_layer, 4 * psi)


@pytest.mark.parametrize("dp,tp", [(2, 4)])
def test_zero3_does_not_keep_gathered_weights_for_backward(dp, tp):
    builder, _, pre = step(dp, tp, 3)
    entries = colls(pre, builder.mesh)
    count, _ = total(entries, "all-gather", "dp")
    # forward gathers 9 weights per layer; backward needs at least the 7 matmul weights again
    assert count >= N_OTHER_WEIGHTS + (N_LAYER_WEIGHTS + N_MATMUL_WEIGHTS) * TINY_MODEL.n_layers


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimised_step_moves_the_zero_bytes_over_dp(stage):
    dp, tp = 2, 4
    builder, _, pre = step(dp, tp, stage)
    psi = tp_local_params(TINY_MODEL, tp)
    entries = colls(step_optimised(dp, tp, stage), builder.mesh)
    ar_count, ar_bytes = total(entries, "all-reduce", "dp")
    rs_count, rs_bytes = total(entries, "reduce-scatter", "dp")
    ag_count, ag_bytes = total(entries, "all-gather", "dp")
    assert {e["axis"] for e in entries} == {"dp", "tp", "dp+tp"}, entries
    assert total(entries, "all-reduce", "dp+tp") == (1, 4)  # the global gradient norm: one f32 scalar
    if stage == 0:
        per_use = N_OTHER_WEIGHTS + N_LAYER_WEIGHTS * TINY_MODEL.n_layers  # each layer's, in the backward
        assert (ar_count, ar_bytes) == (per_use + 2, 4 * psi + SCALARS)
        assert rs_count == 0
    else:
        assert rs_bytes == 4 * psi
        assert (ar_count, ar_bytes) == (2, SCALARS)  # loss and token count only
    if stage == 0:
        assert ag_count == 0  # nothing is sharded over dp
    elif stage in (1, 2):
        assert ag_bytes == 4 * psi  # updated dp-sharded master -> replicated params, once
    else:
        # params stay dp-sharded after the update: no extra gather beyond the per-use ones
        assert (ag_count, ag_bytes) == total(colls(pre, builder.mesh), "all-gather", "dp")


def test_optimised_hlo_does_not_depend_on_backend_opt_level():
    mesh, _, lowered = forward(2)
    default = lowered.compile(XLA_DEFAULT_CODEGEN).as_text()  # a run's compile (conftest's is the fast one)
    assert colls(default, mesh) == colls(forward_optimised(2), mesh)


def test_hlo_parser_reads_mesh_replica_groups():
    """Collectives XLA's partitioner adds (a sharding constraint's gather; jaxpar's step now writes its
    own) print their groups as mesh axes; jaxpar.compiler.hlo_collectives reads them as the explicit groups."""
    builder, _, _ = step(2, 4, 1)
    mesh = builder.mesh
    gather = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P())),
                     in_shardings=NamedSharding(mesh, P("dp", "tp")))
    text = gather.lower(jax.ShapeDtypeStruct((8, 16), jnp.float32)).compile().as_text()
    assert "replica_groups=mesh[" in text  # the optimised program does use the form
    assert hlo_collectives.collectives(text, mesh) == hlo_collectives.collectives(explicit_groups(text), mesh)
    assert {e["op"] for e in hlo_collectives.collectives(text, mesh)} == {"all-gather"}


# ----------------------------------------------------------------------------- 3. reduction dtypes

@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_reduction_dtype_follows_precision(dp, tp, stage):
    """bf16 compute reduces gradients over dp in fp32 (grad_reduce's default, as Megatron), or in bf16
    with grad_reduce=bf16; ZeRO-3's per-use weight gathers move bf16 either way."""
    psi = tp_local_params(TINY_MODEL, tp)
    op = "all-reduce" if stage == 0 else "reduce-scatter"
    scalars = SCALARS if op == "all-reduce" else 0  # the f32 loss / token-count psums ride with all-reduce

    for grad_reduce, dtype, width in (("bf16", "bf16", 2), ("fp32", "f32", 4)):
        builder, _, pre = step(dp, tp, stage, "bf16", grad_reduce=grad_reduce)
        entries = colls(pre, builder.mesh)
        assert total(entries, op, "dp", dtype)[1] == width * psi + (scalars if dtype == "f32" else 0)
        assert total(entries, op, "dp", "bf16" if dtype == "f32" else "f32")[1] == (scalars if dtype == "bf16" else 0)
        if stage == 3:  # the per-use parameter gathers move bf16 weights
            assert total(entries, "all-gather", "dp", "bf16")[1] >= 2 * psi
            assert total(entries, "all-gather", "dp", "f32") == (0, 0)

    builder, _, pre = step(dp, tp, stage, "fp32")
    entries = colls(pre, builder.mesh)
    assert total(entries, op, "dp", "f32")[1] == 4 * psi + scalars
    assert [e for e in entries if e["dtype"] == "bf16"] == []


@pytest.mark.parametrize("stage,accumulate,remat", [(1, 1, "none"), (2, 1, "none"), (1, 2, "none"), (3, 1, "none"),
                                                    (3, 1, "full")])  # ZeRO-3: its gathers' transposes, prefetched
def test_reduce_scattered_sums_reach_the_optimizer_in_fp32(stage, accumulate, remat):
    """bf16 weights, fp32 sums (issue 46): the reduce-scatter's fp32 result is what the update reads, not a
    bf16 rounding of it widened again: the step's gradients leave the shard_map in fp32."""
    config = dataclasses.replace(make_config(dp=2, tp=4, stage=stage, precision="bf16", grad_accum=accumulate),
                                 remat=RematConfig(policy=remat))
    assert builder_for(config).zero.prefetches == (remat == "full")
    builder = builder_for(config)
    params = builder.abstract_state().params
    _, grads, _ = jax.eval_shape(builder.loss_and_grads, params, builder.abstract_batch())
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_after_orders_collectives_only_on_cpu(monkeypatch):
    """The ordering dependency is a CPU deadlock fix: on XLA:CPU it adds a real data dependency, on any
    other backend (GPUs) `after` is the identity and adds nothing to the program."""
    x, dep = jnp.ones((4,)), jnp.full((2,), 3.0)
    assert "jaxpar_after" in str(jax.make_jaxpr(after)(x, dep))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert after(x, dep) is x
    assert "jaxpar_after" not in str(jax.make_jaxpr(lambda a, b: after(a, b))(x, dep))
