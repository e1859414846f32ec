import jax
jax.config.update("jax_num_cpu_devices", 8)

import re  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.hlo import axis_label, collectives, parse_replica_groups, summarize  # noqa: E402

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
    got = {(e["op"], e["axis"], e["dtype"]): (e["count"], e["bytes"]) for e in collectives(LITERAL, mesh)}
    assert got == {
        ("all-gather", "dp", "f32"): (5, 5 * 16 * 256 * 4),  # trip count 7 - 2, output size
        ("collective-permute", "dp", "f32"): (5, 5 * 8 * 256 * 4),  # u32 contexts not counted
        ("all-reduce", "dp+tp", "f32"): (1, 8 * 256 * 4),  # tuple all-reduce: per dtype
        ("all-reduce", "dp+tp", "bf16"): (1, 4 * 2),
    }
    table = summarize(collectives(LITERAL, mesh))
    assert len(table.splitlines()) == 5 and "collective-permute" in table
