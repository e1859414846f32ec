"""Read XLA HLO text: its computations and loops, and the collectives a compiled step executes.

The dry-run report needs to say, per call of the training step, how many
all-reduces / reduce-scatters / all-gathers / permutes / all-to-alls run, over
which mesh axes, in which dtype and how many bytes each device moves.  XLA
already wrote all of that into the HLO text; this module reads it back instead
of re-deriving it from the model code, so the report shows what really runs. (The FLOPs the
program executes are counted by jaxpar.compiler.hlo_flops, on this module's parser.)

Works on both texts JAX gives us:
  * optimized:  ``jax.jit(f).lower(*a).compile().as_text()`` -- names carry
    ``%``, whiles carry ``known_trip_count`` in ``backend_config``, the scan
    loop-compare sits inside a ``wrapped_compare`` fusion.
  * pre-optimization: ``jax.jit(f).lower(*a).as_text(dialect="hlo")`` -- no
    ``%``, no trip counts (inferred from the loop condition), shard_map
    collectives live in ``call``-ed ``closed_call`` computations.
Replica groups come as explicit `{{0,4},{1,5}}`, iota `[4,2]<=[2,4]T(1,0)` or (partitioner
collectives in optimized programs) mesh axes `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`, see
_mesh_replica_groups.  Device ids are the program's logical ids: positions in the jit's device
assignment, i.e. the mesh's flat device order, whatever the devices' own `Device.id` (a mesh built
over several processes, or in a topology order, lists devices out of id order); axis_label and
permute_axis read them as mesh positions.
Note: XLA:CPU widens bf16 collectives to f32 in the optimized program (their
reducer is renamed ``*_promoted``); the pre-optimization HLO keeps bf16, so use
it when the report should show the dtype the model asked for.

Bytes are per device per execution, the size of the full buffer: the array
for all-reduce / collective-permute / all-to-all, the output for all-gather,
the input (= output x group size) for reduce-scatter.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

OPS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\]")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_IOTA = re.compile(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128, "token": 0}


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside any (), [], {} nesting (layouts contain commas)."""
    out, depth, cur = [], 0, []
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return [x for x in out if x]


def _close(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] in "([{"
        depth -= s[j] in ")]}"
        if depth == 0:
            return j + 1
    return len(s)


def _tuple_elems(shape: str) -> list[str]:
    return _split_top(shape.strip()[1:-1]) if shape.strip().startswith("(") else [shape]


def _bytes_by_dtype(shape: str) -> dict[str, float]:
    """Per-element-type byte totals of an array or (nested) tuple shape."""
    out: dict[str, float] = {}
    for m in _ARRAY.finditer(re.sub(r"\{[^{}]*\}", "", shape)):  # drop layouts
        dt, dims = m.group(1), m.group(2).replace("<=", "")
        bits = _BITS.get(dt, 8 if dt.startswith("f8") else None)
        if bits is None:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d.strip()] or [1]))
        out[dt] = out.get(dt, 0) + n * bits / 8
    return out


def parse_module(text: str) -> tuple[dict[str, list[dict]], str | None]:
    """Computations as {name: [instr]}, plus the ENTRY name.

    An instr is {"name", "shape", "op", "args", "attrs"}; lines that do not
    start an instruction are joined onto the previous one.
    """
    comps: dict[str, list[dict]] = {}
    entry, cur, lines = None, None, []
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line) if line[:1] not in " \t" else None
            if m and not line.startswith("HloModule"):
                cur, lines = m.group(1), []
                entry = cur if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            comps[cur] = [i for i in map(_parse_instr, lines) if i]
            cur = None
        elif _INSTR.match(line) or not lines:
            lines.append(line)
        else:
            lines[-1] += " " + line.strip()
    return comps, entry


_COMMENT = re.compile(r"/\*.*?\*/")


def _parse_instr(line: str) -> dict | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = m.group(2)
    end = _close(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _close(rest, op.end() - 1)
    # (every fifth operand carries a comment, "/*index=5*/%name": without the comment a long operand
    # list lost those operands, and with them the paths jaxpar.compiler.hlo_order looks for)
    args = [_COMMENT.sub(" ", a).split()[-1].lstrip("%") for a in _split_top(rest[op.end():close - 1])
            if _COMMENT.sub(" ", a).strip()]
    return {"name": m.group(1), "shape": shape, "op": op.group(1), "args": args,
            "attrs": rest[close:]}


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", s)]


def parse_replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Device-id groups of `replica_groups=` (explicit, iota, mesh axes or `{}` = all).

    Each group is in XLA's order (the order an all-gather concatenates in).
    """
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return [list(range(n_devices))]
    rest = attrs[m.end():]
    iota = _IOTA.match(rest)
    if iota:
        shape, dims = (_ints(iota.group(k)) for k in (1, 2))
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose(_ints(iota.group(3)))
        return ids.reshape(shape).tolist()
    if rest.startswith("mesh["):
        return _mesh_replica_groups(rest)
    body = rest[1:_close(rest, 0) - 1]
    groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", body)]
    return groups or [list(range(n_devices))]


def _mesh_device_ids(body: str | None, sizes: list[int]) -> np.ndarray:
    """Device id at each position of a mesh of axis `sizes`, from its `device_ids=(body)`.

    `body` is an iota `[dims]T(perm)` (arange(n).reshape(dims).transpose(perm)) or an explicit
    row-major list of ids; no device_ids (None) means plain iota: position k holds device k.
    """
    n = int(np.prod(sizes))
    iota = re.fullmatch(r"\s*\[([\d,\s]+)\]\s*(?:T\(([\d,\s]+)\))?\s*", body or "")
    if body is None:
        ids = np.arange(n)
    elif iota:
        ids = np.arange(n).reshape(_ints(iota.group(1)))
        ids = ids.transpose(_ints(iota.group(2))) if iota.group(2) else ids
    else:
        ids = np.array(_ints(body)[-n:])  # the flat list (after its `[dims]`, if printed)
    if ids.size != n or sorted(ids.flat) != list(range(n)):
        raise ValueError(f"device_ids=({body}) is not a permutation of the {n} mesh devices")
    return ids.reshape(sizes)


def _mesh_replica_groups(text: str) -> list[list[int]]:
    """Groups of `mesh['a'=2,'b'=4], device_ids=(..) {'b'}`: one per position of the axes not listed.

    As XLA's MeshAxesReplicaGroupList: reshape the mesh's device ids to the axis sizes (a sub-axis
    `'a':(pre)size` splits axis a, major to minor, into [pre, size, rest]), move the listed axes
    last, in the listed order, and read each group off a row.  `{}` gives one group per device.
    """
    m = re.match(r"mesh\[([^\]]*)\]", text)
    items = [item.rsplit("=", 1) for item in _split_top(m.group(1))]
    names, sizes = [a.strip().strip("'\"") for a, _ in items], [int(b) for _, b in items]
    pos, dev_body = m.end(), None
    dev = re.match(r"\s*,\s*device_ids=\(", text[pos:])
    if dev:
        start = pos + dev.end() - 1
        pos = _close(text, start)
        dev_body = text[start + 1:pos - 1]
    axes = re.match(r"\s*\{([^{}]*)\}", text[pos:])
    if not axes:
        raise ValueError(f"no {{axes}} after replica_groups={text[:pos]}")
    refs = []  # (mesh axis, pre-size, size) of each listed axis, in the listed order
    for ref in _split_top(axes.group(1)):
        r = re.fullmatch(r"'?([^':]+?)'?\s*(?::\((\d+)\)(\d+))?", ref.strip())
        if not r or r.group(1) not in names:
            raise ValueError(f"unknown mesh axis {ref!r} in replica_groups={text[:pos]}")
        i = names.index(r.group(1))
        refs.append((i, int(r.group(2)), int(r.group(3))) if r.group(2) else (i, 1, sizes[i]))
    dims, where = [], {}  # split mesh shape; where[k] = dim of refs[k] in it
    for i, n in enumerate(sizes):
        done = 1  # product of the parts of axis i laid out so far (major first)
        for k in sorted((k for k, r in enumerate(refs) if r[0] == i), key=lambda k: refs[k][1]):
            pre, size = refs[k][1:]
            if pre != done:
                dims.append(pre // done)
            where[k] = len(dims)
            dims.append(size)
            done = pre * size
        if done != n or not any(r[0] == i for r in refs):
            dims.append(n // done)
    ids = _mesh_device_ids(dev_body, sizes).reshape(dims)
    listed = [where[k] for k in range(len(refs))]
    order = [d for d in range(len(dims)) if d not in listed] + listed
    group = int(np.prod([r[2] for r in refs]))
    return ids.transpose(order).reshape(-1, group).tolist()


def _mesh_ids(mesh) -> np.ndarray:
    """The program's logical device id at each mesh position: its flat index (not `Device.id`)."""
    return np.arange(mesh.devices.size).reshape(mesh.devices.shape)


def axis_label(groups: list[list[int]], mesh) -> str:
    """Mesh axes a replica-group partition varies over ("tp", "dp+tp", "other").

    Size-1 axes are skipped so the label with the fewest axes wins.
    """
    ids = _mesh_ids(mesh)
    want = {frozenset(g) for g in groups}
    live = [i for i, s in enumerate(ids.shape) if s > 1]
    if all(len(g) == 1 for g in want) and want <= {frozenset([i]) for i in ids.flat}:
        return "none"
    for k in range(1, len(live) + 1):
        for sub in itertools.combinations(live, k):
            rest = [i for i in range(ids.ndim) if i not in sub]
            rows = ids.transpose(rest + list(sub)).reshape(-1, int(np.prod([ids.shape[i] for i in sub])))
            if {frozenset(r.tolist()) for r in rows} == want:
                return "+".join(mesh.axis_names[i] for i in sub)
    return "other"


def permute_axis(attrs: str, mesh) -> str:
    """Mesh axes along which a collective-permute's source and target differ."""
    m = re.search(r"source_target_pairs=", attrs)
    body = attrs[m.end():_close(attrs, m.end())] if m else ""
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)
    ids = _mesh_ids(mesh)
    coord = {int(d): np.array(np.unravel_index(k, ids.shape)) for k, d in enumerate(ids.flat)}
    axes: set[int] = set()
    for s, t in pairs:
        if int(s) not in coord or int(t) not in coord:
            return "other"
        axes |= set(np.nonzero(coord[int(s)] != coord[int(t)])[0].tolist())
    return "+".join(mesh.axis_names[i] for i in sorted(axes)) or "none"


def _const(instrs: dict[str, dict], name: str) -> int | None:
    """Integer value of `name`, following copies/converts to a constant()."""
    ins = instrs.get(name)
    while ins and ins["op"] in ("copy", "convert", "bitcast") and ins["args"]:
        ins = instrs.get(ins["args"][0])
    ok = ins and ins["op"] == "constant" and ins["args"] and re.fullmatch(r"-?\d+", ins["args"][0])
    return int(ins["args"][0]) if ok else None


def _compare(comps, ins: dict) -> tuple[list[str], str] | None:
    """(operand names, attrs) of a compare, seen through a wrapped_compare fusion."""
    if ins["op"] == "compare":
        return ins["args"], ins["attrs"]
    callee = re.search(r"calls=%?([\w.\-]+)", ins["attrs"]) if ins["op"] == "fusion" else None
    body = comps.get(callee.group(1), []) if callee else []
    inner = next((i for i in body if i["op"] == "compare"), None)
    if inner is None:
        return None
    pidx = {i["name"]: int(i["args"][0]) for i in body if i["op"] == "parameter"}
    args = [ins["args"][pidx[a]] if pidx.get(a, 1 << 30) < len(ins["args"]) else a for a in inner["args"]]
    return args, inner["attrs"]


def _infer_trips(comps, cond: str, caller: dict[str, dict], init_name: str) -> int | None:
    """Trip count of `i < const` / `i <= const` loops (step 1, as JAX scans), else None."""
    instrs = {i["name"]: i for i in comps.get(cond, [])}
    flip = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}
    for ins in comps.get(cond, []):
        cmp = _compare(comps, ins)
        d = re.search(r"direction=(\w+)", cmp[1]) if cmp else None
        if not d or len(cmp[0]) != 2:
            continue
        vals = [_const(instrs, a) for a in cmp[0]]
        if (vals[0] is None) == (vals[1] is None):
            continue
        k = 0 if vals[0] is None else 1  # k: the induction-variable side
        direction = d.group(1) if k == 0 else flip.get(d.group(1), "")
        gte = instrs.get(cmp[0][k])
        if not gte or gte["op"] != "get-tuple-element":
            continue
        idx = int(re.search(r"index=(\d+)", gte["attrs"]).group(1))
        tup = caller.get(init_name)
        start = _const(caller, tup["args"][idx]) if tup and tup["op"] == "tuple" else None
        if start is None or direction not in ("LT", "LE"):
            return None
        return max(0, vals[1 - k] - start + (direction == "LE"))
    return None


def _collective_bytes(ins: dict, base: str, n_devices: int) -> dict[str, float]:
    """Per-dtype bytes of the full buffer one execution of `ins` moves."""
    shape, elems = ins["shape"], _tuple_elems(ins["shape"])
    # all-gather-start / reduce-scatter-start (GPU): (inputs, outputs); collective-permute-start: (in, out, u32[] ctx..)
    if ins["op"] in ("all-gather-start", "reduce-scatter-start", "collective-permute-start") and len(elems) >= 2:
        shape = elems[1]
    out = _bytes_by_dtype(shape)
    if base == "reduce-scatter":  # input = output x group size
        g = len(parse_replica_groups(ins["attrs"], n_devices)[0])
        out = {k: v * g for k, v in out.items()}
    return out


def _called(ins: dict) -> list[str]:
    """Computations a call / fusion / async-start / conditional runs (not reducers, not while)."""
    if ins["op"] not in ("call", "fusion", "async-start", "conditional"):
        return []
    attrs = ins["attrs"]
    called = re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", attrs)
    branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    return called + ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else [])


def _while_parts(comps, ins: dict, instrs: dict[str, dict]) -> tuple[str | None, int | None]:
    """(body computation, trip count or None) of a `while`: backend_config's known_trip_count
    (optimized text), else inferred from the `i < const` condition (pre-optimization text)."""
    attrs = ins["attrs"]
    body = re.search(r"body=%?([\w.\-]+)", attrs)
    cond = re.search(r"condition=%?([\w.\-]+)", attrs)
    trip = _TRIP.search(attrs)
    n = int(trip.group(1)) if trip else (
        _infer_trips(comps, cond.group(1), instrs, ins["args"][0]) if cond and ins["args"] else None)
    return (body.group(1) if body else None), n


def _walk(comps, name: str, mult: int, unknown: bool, mesh, acc: dict, depth: int = 0,
          in_async: bool = False) -> None:
    """Add the collectives of computation `name`, run `mult` times, into acc (`in_async`: the
    computation an async-start wraps, so its collectives run asynchronously)."""
    if depth > 64:  # guard against malformed (recursive) call graphs
        return
    instrs = {i["name"]: i for i in comps.get(name, [])}
    n_dev = int(np.asarray(mesh.devices).size)
    for ins in comps.get(name, []):
        op, attrs = ins["op"], ins["attrs"]
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op.endswith("-done") or op == "async-update":
            continue
        if base in OPS:
            axis = (permute_axis(attrs, mesh) if base == "collective-permute"
                    else axis_label(parse_replica_groups(attrs, n_dev), mesh))
            for dt, b in _collective_bytes(ins, base, n_dev).items():
                e = acc.setdefault((base, axis, dt, b), {"count": 0, "bytes": 0.0, "unknown": False, "async": 0})
                e["count"] += mult
                e["async"] += mult if (in_async or op.endswith("-start")) else 0
                e["bytes"] += mult * b
                e["unknown"] |= unknown
            continue
        if op == "while":
            body, n = _while_parts(comps, ins, instrs)
            if body:
                _walk(comps, body, mult * (1 if n is None else n), unknown or n is None, mesh, acc, depth + 1)
            continue
        for c in _called(ins):
            _walk(comps, c, mult, unknown, mesh, acc, depth + 1, in_async or op == "async-start")


def collectives(hlo_text: str, mesh, by_size: bool = False) -> list[dict]:
    """Collectives one call of the HLO program executes, grouped by (op, axis, dtype), and with
    `by_size` by the bytes one execution moves per device too ("bytes_each": e.g. the pipeline's
    activation-sized ones apart from its scalar sums).

    "async": how many of the `count` executions are asynchronous (a `-start` / `-done` pair or an
    async-start wrapper: GPU programs; XLA:CPU runs every collective synchronously).
    While bodies are multiplied by their trip count (backend_config's
    known_trip_count, else inferred from `i < const` in the condition; when
    neither works the body counts once and the entry gets
    "trip_count_unknown": True).  Every `conditional` branch is counted once,
    as if all branches ran, so the report is an upper bound for conditionals.
    Reducer computations (`to_apply` of all-reduce etc.) are not walked.
    """
    comps, entry = parse_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    sized: dict = {}
    _walk(comps, entry, 1, False, mesh, sized)
    acc: dict = {}
    for (op, axis, dt, each), e in sized.items():
        key = (op, axis, dt, each) if by_size else (op, axis, dt)
        total = acc.setdefault(key, {"count": 0, "bytes": 0.0, "unknown": False, "async": 0})
        for field in ("count", "bytes", "async"):
            total[field] += e[field]
        total["unknown"] |= e["unknown"]
    out = []
    for key, e in sorted(acc.items()):
        b = e["bytes"]
        d = {"op": key[0], "axis": key[1], "dtype": key[2], "count": e["count"],
             "bytes": int(b) if b == int(b) else b, "async": e["async"]}
        if by_size:
            d["bytes_each"] = int(key[3]) if key[3] == int(key[3]) else key[3]
        if e["unknown"]:
            d["trip_count_unknown"] = True
        out.append(d)
    return out


def human_bytes(n: float) -> str:
    k = min(3, int(np.log2(max(n, 1)) // 10))
    return f"{n:.0f} B" if k == 0 else f"{n / 1024 ** k:.2f} {('KiB', 'MiB', 'GiB')[k - 1]}"


def summarize(entries: list[dict]) -> str:
    """One aligned line per entry: op, axis, dtype, count, bytes per device."""
    if not entries:
        return "no collectives"
    rows = [("op", "axis", "dtype", "count", "bytes/device")]
    for e in entries:
        flag = " (trip count unknown)" if e.get("trip_count_unknown") else ""
        rows.append((e["op"], e["axis"], e["dtype"], str(e["count"]), human_bytes(e["bytes"]) + flag))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows)
