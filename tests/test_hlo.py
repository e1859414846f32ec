import jax
jax.config.update("jax_num_cpu_devices", 8)

import re  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpar.compiler.hlo_collectives import axis_label, collectives, parse_replica_groups, summarize  # noqa: E402
from jaxpar.compiler.hlo_flops import executed_flops  # noqa: E402

AUTO = (jax.sharding.AxisType.Auto,) * 3


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 1, 4), ("dp", "pp", "tp"), axis_types=AUTO)


@pytest.fixture(scope="module")
def pp_mesh():
    return jax.make_mesh((1, 4, 2), ("dp", "pp", "tp"), axis_types=AUTO)


def _texts(f, mesh, *args):
    """(pre-optimization, optimized) HLO of f run under shard_map with replicated in/out."""
    specs = tuple(P() for _ in args)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
    low = g.lower(*args)
    return low.as_text(dialect="hlo"), low.compile().as_text()


def _find(entries, op, axis=None):
    return [e for e in entries if e["op"] == op and (axis is None or e["axis"] == axis)]


X = jnp.ones((8, 16), jnp.float32)


def test_psum_in_scan_counted_per_iteration(mesh):
    def f(x):
        return lax.scan(lambda c, _: (lax.psum(c, "tp"), None), x, None, length=5)[0]

    for text in _texts(f, mesh, X):
        (e,) = collectives(text, mesh)
        assert (e["op"], e["axis"], e["dtype"], e["count"]) == ("all-reduce", "tp", "f32", 5)
        assert e["bytes"] == 5 * 8 * 16 * 4
        assert "trip_count_unknown" not in e


def test_reduce_scatter_and_all_gather_over_dp(mesh):
    def f(x):
        y = lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)  # f32[4,16] out
        return lax.all_gather(y, "dp", tiled=True)

    for text in _texts(f, mesh, X):
        got = {(e["op"], e["axis"]): e for e in collectives(text, mesh)}
        assert set(got) == {("reduce-scatter", "dp"), ("all-gather", "dp")}
        assert got["reduce-scatter", "dp"]["bytes"] == 8 * 16 * 4  # its input
        assert got["all-gather", "dp"]["bytes"] == 8 * 16 * 4  # its output


def test_psum_over_two_axes(mesh):
    for text in _texts(lambda x: lax.psum(x, ("dp", "tp")), mesh, X):
        assert [(e["op"], e["axis"]) for e in collectives(text, mesh)] == [("all-reduce", "dp+tp")]


def test_ppermute_and_nested_scans_multiply(pp_mesh):
    perm = [(i, (i + 1) % 4) for i in range(4)]

    def f(x):
        def outer(c, _):
            inner = lambda c, _: (lax.ppermute(c, "pp", perm), None)  # noqa: E731
            return lax.scan(inner, c, None, length=4)[0], None

        return lax.scan(outer, x, None, length=3)[0]

    for text in _texts(f, pp_mesh, X):
        (e,) = collectives(text, pp_mesh)
        assert (e["op"], e["axis"], e["count"], e["bytes"]) == ("collective-permute", "pp", 12, 12 * 512)


def test_bf16_psum_keeps_dtype_before_optimization(mesh):
    pre, opt = _texts(lambda x: lax.psum(x, "tp"), mesh, X.astype(jnp.bfloat16))
    (e,) = collectives(pre, mesh)
    assert (e["dtype"], e["bytes"]) == ("bf16", 8 * 16 * 2)
    # XLA:CPU widens bf16 collectives to f32 after optimization; only assert op/axis there.
    assert [(e["op"], e["axis"]) for e in collectives(opt, mesh)] == [("all-reduce", "tp")]


def test_unknown_trip_count_is_flagged(mesh):
    pre, _ = _texts(lambda x: lax.scan(lambda c, _: (lax.psum(c, "tp"), None), x, None, length=5)[0], mesh, X)
    # make the loop bound a loop-carried value instead of a constant
    pre, n = re.subn(r"compare\(([\w.\-]+), [\w.\-]+\)", r"compare(\1, \1)", pre)
    assert n == 1
    (e,) = collectives(pre, mesh)
    assert e["count"] == 1 and e["trip_count_unknown"] is True


def test_iota_replica_groups():
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups("replica_groups=[2,4]<=[8], to_apply=%add", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("replica_groups={}, to_apply=%add", 8) == [list(range(8))]
    assert parse_replica_groups("replica_groups={{0,4},{1,5}}", 8) == [[0, 4], [1, 5]]


def test_axis_label_ignores_size_one_axes(mesh):
    assert axis_label([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == "tp"
    assert axis_label([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == "dp"
    assert axis_label([list(range(8))], mesh) == "dp+tp"
    assert axis_label([[0, 1], [2, 3], [4, 5], [6, 7]], mesh) == "other"


LITERAL = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {
  %p = (s32[], f32[8,256]{1,0}) parameter(0)
  %x = f32[8,256]{1,0} get-tuple-element(%p), index=1
  %ags = (f32[8,256]{1,0}, f32[16,256]{1,0}) all-gather-start(%x), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %agd = f32[16,256]{1,0} all-gather-done(%ags)
  %cps = (f32[8,256]{1,0}, f32[8,256]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,4},{4,0}}
  %cpd = f32[8,256]{1,0} collective-permute-done(%cps)
  %rss = (f32[16,256]{1,0}, f32[8,256]{1,0}) reduce-scatter-start(%agd), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %rsd = f32[8,256]{1,0} reduce-scatter-done(%rss)
  ROOT %t = (s32[], f32[8,256]{1,0}) tuple(%i, %cpd)
}

%cond (q: (s32[], f32[8,256])) -> pred[] {
  %q = (s32[], f32[8,256]{1,0}) parameter(0)
  %n = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(7)
  ROOT %lt = pred[] compare(%n, %lim), direction=LT
}

ENTRY %main (a: f32[8,256]) -> f32[8,256] {
  %a = f32[8,256]{1,0} parameter(0)
  %zero = s32[] constant(2)
  %init = (s32[], f32[8,256]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[8,256]{1,0}) while(%init), condition=%cond, body=%body
  %g = f32[8,256]{1,0} get-tuple-element(%w), index=1
  ROOT %ar = (f32[8,256]{1,0}, bf16[4]{0}) all-reduce(%g, %b), replica_groups={}, to_apply=%add
}
"""


def test_literal_module_async_ops_tuples_and_inferred_trip_count(mesh):
    got = {(e["op"], e["axis"], e["dtype"]): (e["count"], e["bytes"], e["async"]) for e in collectives(LITERAL, mesh)}
    assert got == {
        ("all-gather", "dp", "f32"): (5, 5 * 16 * 256 * 4, 5),  # trip count 7 - 2, output size, all async
        ("collective-permute", "dp", "f32"): (5, 5 * 8 * 256 * 4, 5),  # u32 contexts not counted
        ("reduce-scatter", "dp", "f32"): (5, 5 * 16 * 256 * 4, 5),  # GPU's (inputs, outputs): the input's bytes
        ("all-reduce", "dp+tp", "f32"): (1, 8 * 256 * 4, 0),  # tuple all-reduce: per dtype; synchronous
        ("all-reduce", "dp+tp", "bf16"): (1, 4 * 2, 0),
    }
    table = summarize(collectives(LITERAL, mesh))
    assert len(table.splitlines()) == 6 and "collective-permute" in table


# ----------------------------------------------------------------------------- mesh-axes replica groups
# XLA prints `replica_groups=mesh['a'=2,'b'=4], device_ids=(..) {'b'}`: a mesh of named axes (major
# to minor), optionally which device sits at each mesh position (an iota `[dims]T(perm)` or a
# row-major list; default: position k holds device k), and the axes the collective runs over.  Each
# group is the devices along the listed axes (in the listed order) at one position of the others.

MESH_GROUPS = [
    # worked out by hand
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", [list(range(8))]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),  # listed order
    ("mesh['axis_0'=2,'axis_1'=4] {}", [[i] for i in range(8)]),
    # device_ids=([2,4]T(1,0)): positions hold arange(8).reshape(2,4).T = 0,4,1,5,2,6,3,7
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=8,'axis_1'=1,'axis_2'=1], device_ids=([4,2]T(1,0)) {'axis_0'}", [[0, 2, 4, 6, 1, 3, 5, 7]]),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,'axis_3'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}",
     [[0, 2], [1, 3], [4, 6], [5, 7]]),
    # explicit device lists and sub-axes `a:(pre)size`: expected values from XLA's own tests
    # (xla/hlo/ir/replica_group_test.cc, MeshAxesReplicaGroupListTest)
    ("mesh[x=2,y=2], device_ids=(3,1,0,2) {x}", [[3, 0], [1, 2]]),
    ("mesh[x=2,y=2], device_ids=(3,1,0,2) {y}", [[3, 1], [0, 2]]),
    ("mesh[a=6,b=6] {a:(1)3}", [[i, i + 12, i + 24] for i in range(12)]),
    ("mesh[a=6,b=6] {a:(3)2}", [[i, i + 6] for i in [*range(6), *range(12, 18), *range(24, 30)]]),
    ("mesh[a=6,b=6] {b:(1)3}", [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11], [12, 14, 16], [13, 15, 17],
                                [18, 20, 22], [19, 21, 23], [24, 26, 28], [25, 27, 29], [30, 32, 34], [31, 33, 35]]),
    ("mesh[a=6,b=6] {a:(1)2,b:(1)2}", [[0, 3, 18, 21], [1, 4, 19, 22], [2, 5, 20, 23], [6, 9, 24, 27],
                                       [7, 10, 25, 28], [8, 11, 26, 29], [12, 15, 30, 33], [13, 16, 31, 34],
                                       [14, 17, 32, 35]]),
    ("mesh[a=6,b=6] {a:(3)2,b:(3)2}", [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11], [12, 13, 18, 19],
                                       [14, 15, 20, 21], [16, 17, 22, 23], [24, 25, 30, 31], [26, 27, 32, 33],
                                       [28, 29, 34, 35]]),
]


@pytest.mark.parametrize("text,groups", MESH_GROUPS)
def test_mesh_replica_groups(text, groups):
    n = sum(len(g) for g in groups)
    attrs = f"replica_groups={text}, dimensions={{0}}, use_global_device_ids=true, to_apply=%add"
    assert parse_replica_groups(attrs, n) == groups


# XLA's MaterializedReplicaGroupsMatchExpectedV2: the same groups in mesh and in iota form
@pytest.mark.parametrize("axes,iota", [
    ("a", "[1,8]<=[8]"), ("a:(1)2", "[4,2]<=[2,4]T(1,0)"), ("a:(1)4", "[2,4]<=[4,2]T(1,0)"),
    ("a:(2)2", "[4,2]<=[2,2,2]T(0,2,1)"), ("a:(2)4", "[2,4]<=[8]"), ("a:(4)2", "[4,2]<=[8]"),
    ("a:(1)2,a:(4)2", "[2,4]<=[2,2,2]T(1,0,2)"), ("a:(4)2,a:(1)2", "[2,4]<=[2,2,2]T(1,2,0)"),
])
def test_mesh_sub_axes_match_iota_form(axes, iota):
    mesh_form = parse_replica_groups(f"replica_groups=mesh['a'=8] {{{axes}}}, to_apply=%add", 8)
    assert mesh_form == parse_replica_groups(f"replica_groups={iota}, to_apply=%add", 8)


def test_mesh_replica_groups_reject_what_they_cannot_read():
    with pytest.raises(ValueError, match="unknown mesh axis"):
        parse_replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'dp'}", 8)
    with pytest.raises(ValueError, match="not a permutation"):
        parse_replica_groups("replica_groups=mesh[x=2,y=2], device_ids=(0,1,1,2) {x}", 4)


MESH_LITERAL = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[8,256]) -> (f32[2,256], f32[16,256], f32[8,256], f32[8,256]) {
  %a = f32[8,256]{1,0} parameter(0)
  %rs = f32[2,256]{1,0} reduce-scatter(%a), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %ag = f32[16,256]{1,0} all-gather(%a), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}, dimensions={0}, use_global_device_ids=true
  %ar = f32[8,256]{1,0} all-reduce(%a), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%add
  %cp = f32[8,256]{1,0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %t = (f32[2,256]{1,0}, f32[16,256]{1,0}, f32[8,256]{1,0}, f32[8,256]{1,0}) tuple(%rs, %ag, %ar, %cp)
}
"""


def test_literal_module_with_mesh_replica_groups(mesh):
    got = {(e["op"], e["axis"]): (e["count"], e["bytes"]) for e in collectives(MESH_LITERAL, mesh)}
    assert got == {
        ("reduce-scatter", "tp"): (1, 4 * 2 * 256 * 4),  # input = output x group size 4
        ("all-gather", "dp"): (1, 16 * 256 * 4),
        ("all-reduce", "dp+tp"): (1, 8 * 256 * 4),
        ("collective-permute", "tp"): (1, 8 * 256 * 4),  # source_target_pairs still read as before
    }


def _shard_order(mesh, spec, x) -> list[int]:
    """HLO device ids (positions in the jit's device assignment, the mesh's flat device order) of
    the shards of `x` under `spec` on dim 0, in shard order: the order an all-gather must use."""
    logical = {d: k for k, d in enumerate(mesh.devices.flat)}
    shards = jax.device_put(x, NamedSharding(mesh, spec)).addressable_shards
    return [logical[s.device] for s in sorted(shards, key=lambda s: s.index[0].start or 0)]


def test_mesh_replica_groups_of_compiled_programs():
    """GSPMD collectives over transposed mesh axes: XLA prints them as mesh axes (jaxlib 0.10 adds
    device_ids=(iota); 0.12 leaves an identity device order out)."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=AUTO)
    x = jnp.arange(64.0).reshape(8, 8)

    def compiled(fn, spec, out=P()):
        f = jax.jit(fn, in_shardings=NamedSharding(mesh, spec), out_shardings=NamedSharding(mesh, out))
        return f.lower(x).compile().as_text()

    # all-gather of rows sharded over (c, a, b): one group of all 8, ordered as the shards are
    text = compiled(lambda v: v * 2, P(("c", "a", "b")))
    (line,) = [ln for ln in text.splitlines() if " all-gather(" in ln]
    assert "replica_groups=mesh[" in line
    assert parse_replica_groups(line, 8) == [_shard_order(mesh, P(("c", "a", "b")), x)]
    assert [(e["op"], e["axis"], e["bytes"]) for e in collectives(text, mesh)] == [("all-gather", "a+b+c", 256)]

    # the collective runs over exactly the axes the operand is sharded on
    cases = [(lambda v: v * 2, P("b"), P(), "all-gather", "b", 8 * 8 * 4),
             (lambda v: v.sum(1), P(None, ("c", "a")), P(), "all-reduce", "a+c", 8 * 4),
             (lambda v: v * 2, P(("c", "b"), None), P(None, ("c", "b")), "all-to-all", "b+c", 2 * 8 * 4)]
    for fn, spec, out, op, axis, nbytes in cases:
        text = compiled(fn, spec, out)
        assert "replica_groups=mesh[" in text
        assert [(e["op"], e["axis"], e["bytes"]) for e in collectives(text, mesh)] == [(op, axis, nbytes)]


# ----------------------------------------------------------------------------- executed FLOPs
# Expected FLOPs are written out by hand: a matmul [m, k] x [k, n] is m n k multiply-adds = 2 m n k.

def _flops(f, *args) -> dict:
    """executed_flops of the optimized program, after checking the pre-optimization text agrees."""
    low = jax.jit(f).lower(*args)
    got = executed_flops(low.compile().as_text())
    assert executed_flops(low.as_text(dialect="hlo"))["total"] == got["total"]
    assert not got["trip_count_unknown"] and not got["uncounted"]
    return got


A, B = jnp.ones((8, 32), jnp.float32), jnp.ones((32, 16), jnp.float32)
W = jnp.ones((32, 32), jnp.float32)


def test_flops_of_one_matmul():
    assert _flops(jnp.matmul, A, B)["total"] == 2 * 8 * 32 * 16


def test_flops_of_batched_einsum_count_the_batch():
    x, y = jnp.ones((3, 5, 8, 32)), jnp.ones((3, 5, 32, 16))
    got = _flops(lambda x, y: jnp.einsum("abik,abkj->abij", x, y), x, y)
    assert got["total"] == got["dot"] == 2 * (3 * 5) * 8 * 16 * 32


def test_flops_of_a_contraction_over_two_dims():
    """The attention output projection: [b, s, heads, head_dim] x [heads, head_dim, d] sums heads x head_dim."""
    o, w = jnp.ones((2, 8, 4, 16)), jnp.ones((4, 16, 32))
    assert _flops(lambda o, w: jnp.einsum("bsnh,nhd->bsd", o, w), o, w)["total"] == 2 * (2 * 8 * 32) * (4 * 16)


def test_flops_of_convolutions():
    x, k = jnp.ones((2, 8, 8, 6)), jnp.ones((3, 3, 6, 4))
    dn = ("NHWC", "HWIO", "NHWC")
    same = _flops(lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn), x, k)
    assert same["total"] == same["convolution"] == 2 * (2 * 8 * 8 * 4) * (3 * 3 * 6)  # output x kernel per output
    strided = _flops(lambda x, k: lax.conv_general_dilated(x, k, (2, 2), "VALID", dimension_numbers=dn), x, k)
    assert strided["total"] == 2 * (2 * 3 * 3 * 4) * (3 * 3 * 6)
    # 2 feature groups: each output feature sees 3 of the 6 input features (the kernel's I dim is 6 / 2)
    grouped = _flops(lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn,
                                                           feature_group_count=2), x, jnp.ones((3, 3, 3, 4)))
    assert grouped["total"] == 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)


def test_flops_of_matmul_in_scan_multiply_by_its_length():
    def f(a, w):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), a, None, length=7)[0]

    assert _flops(f, A, W)["total"] == 7 * 2 * 8 * 32 * 32


def test_flops_of_nested_scans_multiply_through():
    def f(a, w):
        inner = lambda c, _: (jnp.sin(c @ w), None)  # noqa: E731
        outer = lambda c, _: (lax.scan(inner, c @ w, None, length=4)[0], None)  # noqa: E731
        return lax.scan(outer, a, None, length=3)[0]

    assert _flops(f, A, W)["total"] == 3 * (1 + 4) * 2 * 8 * 32 * 32


def test_flops_of_a_dot_inside_a_fusion():
    text = jax.jit(lambda a, b: jnp.tanh(a @ b) * 2.0 + 1.0).lower(A, B).compile().as_text()
    entry = text[text.index("ENTRY"):]
    assert " dot(" not in entry and "fusion(" in entry  # the dot only exists inside a fused computation
    assert executed_flops(text)["total"] == 2 * 8 * 32 * 16


FLOPS_LITERAL = """HloModule m, is_scheduled=true

%gemm (p0: f32[8,32], p1: f32[32,16]) -> f32[8,16] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cheap (q: (f32[8,32], f32[32,16])) -> f32[8,16] {
  %q = (f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %q0 = f32[8,32]{1,0} get-tuple-element(%q), index=0
  %q1 = f32[32,16]{1,0} get-tuple-element(%q), index=1
  %qt = f32[32,8]{1,0} transpose(%q0), dimensions={1,0}
  ROOT %z = f32[8,16]{1,0} dot(%qt, %q1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%costly (r: (f32[8,32], f32[32,16])) -> f32[8,16] {
  %r = (f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %r0 = f32[8,32]{1,0} get-tuple-element(%r), index=0
  %r1 = f32[32,16]{1,0} get-tuple-element(%r), index=1
  %once = f32[8,16]{1,0} fusion(%r0, %r1), kind=kOutput, calls=%gemm
  ROOT %twice = f32[8,16]{1,0} call(%r0, %r1), to_apply=%gemm
}

%inner (s: (s32[], f32[8,32], f32[32,16])) -> (s32[], f32[8,32], f32[32,16]) {
  %s = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %s0 = f32[8,32]{1,0} get-tuple-element(%s), index=1
  %s1 = f32[32,16]{1,0} get-tuple-element(%s), index=2
  %g = f32[8,16]{1,0} fusion(%s0, %s1), kind=kOutput, calls=%gemm
  ROOT %st = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%i, %s0, %s1)
}

%outer (o: (s32[], f32[8,32], f32[32,16])) -> (s32[], f32[8,32], f32[32,16]) {
  %o = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %w = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) while(%o), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %wt = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%i, %a, %b)
}

ENTRY %main (a: f32[8,32], b: f32[32,16], p: pred[]) -> f32[8,16] {
  %a = f32[8,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  %p = pred[] parameter(2)
  %ab = (f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%a, %b)
  %cond = f32[8,16]{1,0} conditional(%p, %ab, %ab), true_computation=%costly, false_computation=%cheap
  %init = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%z, %a, %b)
  %loop = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) while(%init), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
  %lib = (f32[8,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %fmha = (f32[8,16]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %out = f32[8,16]{1,0} add(%cond, %cond)
}
"""


def test_flops_literal_module_conditional_nested_whiles_and_library_calls():
    """The costlier branch of a conditional (2 gemms, not 1 and not 1 + 2; the cheap one contracts the
    lhs's first dim), a while in a while (3 x 5), a cuBLAS custom-call read from its dimension numbers,
    and a cuDNN attention call flagged as not counted."""
    gemm = 2 * 8 * 32 * 16
    got = executed_flops(FLOPS_LITERAL)
    assert got["total"] == got["dot"] == (2 + 3 * 5 + 1) * gemm
    assert got["uncounted"] == ["__cudnn$fmhaSoftmax"] and not got["trip_count_unknown"]


def test_flops_unknown_trip_count_is_flagged():
    got = executed_flops(FLOPS_LITERAL.replace('backend_config={"known_trip_count":{"n":"3"}}', ""))
    assert got["trip_count_unknown"] and got["total"] == (2 + 1 * 5 + 1) * 2 * 8 * 32 * 16


def _fmha_config(scores: str, mask: str) -> str:
    """A cuDNN fMHA backend_config as XLA prints it (abridged): the scores' shape and the mask type."""
    dims = ", ".join(f'"{d}"' for d in scores.split(","))
    return ('backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"algorithm": {"algo_id": "0", '
            '"is_cudnn_frontend": true}, "fmha_scale": 0.25, "intermediate_tensor_shape": {"element_type": "BF16", '
            f'"dimensions": [{dims}], "tuple_shapes": [], "layout": {{"minor_to_major": ["3", "2", "1", "0"]}}, '
            f'"is_dynamic_dimension": [false, false, false, false]}}, "is_flash_attention": true, "mask_type": "{mask}"}}}}')


# A causal forward and backward in a loop of 3 (BTNH, GQA: 4 query heads over 2 KV heads, head dim 32), a
# bidirectional forward with a bias in BNTH whose V heads are 16 wide (operand shapes from their producers),
# and an fMHA call without a backend_config.
BTNH = "bf16[2,64,4,32]{3,2,1,0}, bf16[2,64,2,32]{3,2,1,0}, bf16[2,64,2,32]{3,2,1,0}"
FMHA_LITERAL = f"""HloModule m, is_scheduled=true

%body (s: (s32[], bf16[2,64,4,32], bf16[2,64,2,32])) -> (s32[], bf16[2,64,4,32], bf16[2,64,2,32]) {{
  %s = (s32[], bf16[2,64,4,32]{{3,2,1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %q = bf16[2,64,4,32]{{3,2,1,0}} get-tuple-element(%s), index=1
  %kv = bf16[2,64,2,32]{{3,2,1,0}} get-tuple-element(%s), index=2
  %fwd = (bf16[2,4,64,32]{{3,1,2,0}}, f32[2,4,64]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %kv, %kv), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{{BTNH}}}, api_version=API_VERSION_STATUS_RETURNING, {_fmha_config("2,4,64,64", "CAUSAL")}
  %o = bf16[2,64,4,32]{{3,2,1,0}} get-tuple-element(%fwd), index=0
  %stats = f32[2,4,64]{{2,1,0}} get-tuple-element(%fwd), index=1
  %bwd = (bf16[2,64,4,32]{{3,1,2,0}}, bf16[2,64,2,32]{{3,1,2,0}}, bf16[2,64,2,32]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%q, %kv, %kv, %stats, %o, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", operand_layout_constraints={{{BTNH}, f32[2,4,64]{{2,1,0}}, bf16[2,64,4,32]{{3,2,1,0}}, bf16[2,64,4,32]{{3,2,1,0}}}}, {_fmha_config("2,4,64,64", "CAUSAL")}
  ROOT %t = (s32[], bf16[2,64,4,32]{{3,2,1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) tuple(%i, %q, %kv)
}}

ENTRY %main (q: bf16[2,64,4,32], kv: bf16[2,64,2,32], qn: bf16[2,4,64,32], vn: bf16[2,4,64,16], b: bf16[1,1,64,64]) -> bf16[2,4,64,16] {{
  %q = bf16[2,64,4,32]{{3,2,1,0}} parameter(0)
  %kv = bf16[2,64,2,32]{{3,2,1,0}} parameter(1)
  %qn = bf16[2,4,64,32]{{3,2,1,0}} parameter(2)
  %vn = bf16[2,4,64,16]{{3,2,1,0}} parameter(3)
  %b = bf16[1,1,64,64]{{3,2,1,0}} parameter(4)
  %z = s32[] constant(0)
  %init = (s32[], bf16[2,64,4,32]{{3,2,1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) tuple(%z, %q, %kv)
  %loop = (s32[], bf16[2,64,4,32]{{3,2,1,0}}, bf16[2,64,2,32]{{3,2,1,0}}) while(%init), condition=%c, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %bias = (bf16[2,4,64,16]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%qn, %qn, %vn, %b), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", {_fmha_config("2,4,64,64", "NO_MASK")}
  %bare = (bf16[2,4,64,16]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%qn, %qn, %vn), custom_call_target="__cudnn$fmhaSoftmaxDropout"
  ROOT %out = bf16[2,4,64,16]{{3,2,1,0}} get-tuple-element(%bias), index=0
}}
"""


def test_flops_of_cudnn_attention_forward_backward_causal_gqa_and_layouts():
    """jaxpar.compiler.hlo_flops.fmha_flops: forward S = QK^T and O = PV, 2 n (d_qk + d_v) for the n = b h s_q s_kv scores;
    backward S again, dV, dP, dQ, dK: 2 n (3 d_qk + 2 d_v) = 2.5 x the forward when d_qk = d_v; causal
    halves both. The call that cannot be read is named, not guessed."""
    n = 2 * 4 * 64 * 64  # the scores: batch 2, 4 query heads (GQA's 2 KV heads change no product), 64 x 64
    causal_forward, causal_backward = 2 * n * (32 + 32) / 2, 2 * n * (3 * 32 + 2 * 32) / 2
    assert causal_backward == 2.5 * causal_forward
    bias_forward = 2 * n * (32 + 16)  # no mask; head dims from the producers' shapes (BNTH: still the last dim)
    got = executed_flops(FMHA_LITERAL)
    assert got["attention"] == 3 * (causal_forward + causal_backward) + bias_forward
    assert got["total"] == got["attention"] and got["dot"] == 0
    assert got["uncounted"] == ["__cudnn$fmhaSoftmaxDropout"] and not got["trip_count_unknown"]


def test_every_operand_is_read_past_the_index_comments():
    """XLA writes /*index=5*/ before every fifth operand of a long list; jaxpar.compiler.hlo_order
    follows operands to decide which collectives are ordered, so losing them reported ordered pairs
    as unordered (a bf16 ZeRO-1 step's loss sum and embedding reduction)."""
    from jaxpar.compiler.hlo_collectives import parse_module

    text = """HloModule m

ENTRY %main (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %f = f32[] fusion(%p, %p, %p, %p, %p, /*index=5*/%a.1, %p, %p, %p, %p, /*index=10*/%b.2), kind=kLoop, calls=%c
}
"""
    comps, entry = parse_module(text)
    fusion = next(i for i in comps[entry] if i["name"] == "f")
    assert fusion["args"] == ["p"] * 5 + ["a.1"] + ["p"] * 4 + ["b.2"]
