"""Megatron's tp all-reduces in the compiled training step, the backward included.

Megatron's tensor-parallel block has two conjugate operators: `g` at its output (the row-parallel
sum: an all-reduce forward, the identity backward) and `f` at its input (the identity forward, an
all-reduce of the input gradient backward). jaxpar writes `g` as `Collectives.row_parallel_sum` and
`f` as `Collectives.enter_tensor_parallel`, so a decoder layer (an attention block and an MLP block)
runs 2 all-reduces over tp forward and 2 backward. tests/test_collectives.py counts the forward
alone; here the whole compiled step (`jit_train_step`: forward, backward, dp reduction, optimizer),
optimised by XLA, is read instruction by instruction, each tp all-reduce named by

  * where it runs: the forward layer scan (`jvp()/while`), the backward layer scan
    (`transpose(jvp())/while`), or once outside them; loops count `known_trip_count` = n_layers times;
  * its phase, from the op_name JAX gives it: forward (`jvp()`), backward (`transpose(jvp())`), or a
    forward op recomputed in the backward (`.../checkpoint/rematted_computation/...`);
  * what it is: the model code that called the collective, from the stack frames XLA keeps in the
    program (the first caller outside `Collectives`, and that caller's source line).

XLA may combine several all-reduces into one tuple all-reduce: each operand keeps its phase (the
op_names are joined as `prefix/(a:b)`), the instruction keeps one stack frame (its first operand's).
So operands are counted, not only instructions: when `enter_tensor_parallel` is made the identity
(JAX then reduces the gradient of each use: q, k, v, gate, up), XLA combines the 5 backward
all-reduces of a layer into 2 tuple all-reduces and the instruction count (jaxpar.compiler.hlo_collectives's "count")
stays 4 per layer; only the operands (and bytes) show it. The dp axis (the gradient reduction,
ZeRO 0) is told from tp by jaxpar.compiler.hlo_collectives's replica-group axis labels.
"""

import dataclasses
import functools
import linecache
import re
from collections import Counter

import pytest

from conftest import TINY_MODEL, builder_for, make_config, tp_local_params
from jaxpar.compiler import hlo_collectives
from jaxpar.config import RematConfig

DP, TP, LAYERS = 2, 4, 3  # 3 layers: a per-layer count cannot pass as a fixed one
B, S, D = 16 // DP, 16, TINY_MODEL.d_model  # make_config's global batch 16, sequence 16; B per dp rank
ACT, ROW, SCALAR = f"f32[{B},{S},{D}]", f"f32[{B},{S}]", "f32[]"
TOKENS = f"f32[1,{B * S},{D}]"  # the MLP's [B, S, D] as one row of tokens (llama.per_token_block): the same bytes
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # codegen only; the HLO passes are the same


@functools.cache
def compiled(remat: str):
    """(mesh, optimised HLO text) of the ZeRO-0 train step on (dp, pp, tp) = (2, 1, 4), fp32."""
    model = dataclasses.replace(TINY_MODEL, n_layers=LAYERS)
    config = dataclasses.replace(make_config(dp=DP, tp=TP, model=model), remat=RematConfig(policy=remat))
    builder = builder_for(config)
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    return builder.mesh, lowered.compile(FAST_COMPILE).as_text()


# ----------------------------------------------------------------------------- reading the program

def _section(text: str, name: str) -> dict[int, str]:
    m = re.search(rf"^{name}\n((?:\d+ .*\n)+)", text, re.M)
    assert m, f"no {name} section in the HLO text (XLA's stack-frame printing changed?)"
    return {int(k): v for k, v in (line.split(" ", 1) for line in m.group(1).splitlines())}


def stack_frames(text: str):
    """frame id -> [(function, file, line)], innermost first, from the module's stack-frame tables.

    XLA prints `parent_frame_id` one above the parent's id (0, i.e. printed 1, is "no parent")."""
    files = {k: v.strip('"') for k, v in _section(text, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _section(text, "FunctionNames").items()}
    fields = lambda v: {a: int(b) for a, b in re.findall(r"(\w+)=(\d+)", v)}  # noqa: E731
    locs = {k: fields(v) for k, v in _section(text, "FileLocations").items()}
    frames = {k: fields(v) for k, v in _section(text, "StackFrames").items()}

    def chain(frame_id: int) -> list[tuple[str, str, int]]:
        out = []
        while frame_id:
            loc = locs[frames[frame_id]["file_location_id"]]
            out.append((funcs[loc["function_name_id"]], files[loc["file_name_id"]], loc["line"]))
            frame_id = frames[frame_id]["parent_frame_id"] - 1
        return out
    return chain


def what(chain: list[tuple[str, str, int]]) -> str:
    """The model-level name of a collective: its first caller outside `Collectives`."""
    func, path, line = next(f for f in chain if not f[0].startswith("Collectives."))
    source = linecache.getline(path, line)
    if func == "decoder_layer":  # the two block inputs (`f`), told apart by their norm
        return {"attn_norm": "attention in", "mlp_norm": "mlp in"}[re.search(r"(attn_norm|mlp_norm)", source).group(1)]
    if func.endswith("<lambda>") and "swiglu_mlp(coll.enter_block" in source:  # the MLP block's input (`f`)
        return "mlp in"
    if func == "cross_entropy":  # max, normaliser, target logit of the vocab-parallel loss
        return "ce " + re.search(r"(max|sum_exp|target_logit)_BxS =", source).group(1)
    return {"attention": "attention out", "swiglu_mlp": "mlp out", "embed": "embedding",
            "head_logits": "head in", "StepBuilder._global_norm": "grad norm"}.get(func, f"{func}:{line}")


def _phase(op_name: str) -> str:
    if "rematted_computation" in op_name:
        return "recompute"
    if "transpose(" in op_name:
        return "backward"
    return "forward" if "jvp(" in op_name else "step"  # "step": outside the differentiated function


def _op_names(op_name: str) -> list[str]:
    """One op_name per combined operand: XLA joins them as `prefix/(a:b)`."""
    m = re.fullmatch(r"(.*?/)\((.*)\)", op_name)
    return [m.group(1) + part for part in m.group(2).split(":")] if m else [op_name]


def executed_collectives(text: str, mesh) -> list[dict]:
    """Every collective instruction the step runs: {op, axis, loop, times, operands}, operands a list
    of (phase, what, shape). loop: "forward" / "backward" (the layer scans) or None (outside)."""
    comps, entry = hlo_collectives.parse_module(text)
    chain = stack_frames(text)
    out = []

    def walk(name, loop, times):
        instrs = {i["name"]: i for i in comps[name]}
        for ins in comps[name]:
            op = ins["op"].removesuffix("-start")
            if op in hlo_collectives.OPS:
                meta = re.search(r'op_name="([^"]*)".*?stack_frame_id=(\d+)', ins["attrs"])
                shapes = [f"{m.group(1)}[{m.group(2)}]" for m in re.finditer(r"([a-z]\w*)\[([\d,]*)\]", ins["shape"])]
                names = _op_names(meta.group(1))
                names = names if len(names) == len(shapes) else names[:1] * len(shapes)
                source = what(chain(int(meta.group(2))))
                sources = [source] if len(shapes) == 1 else [None] * len(shapes)  # one frame per instruction
                axis = hlo_collectives.axis_label(hlo_collectives.parse_replica_groups(ins["attrs"], mesh.devices.size), mesh)
                out.append({"op": op, "axis": axis, "loop": loop, "times": times,
                            "operands": [(_phase(n), s, sh) for n, s, sh in zip(names, sources, shapes)],
                            "frame": source})
            elif ins["op"] == "while":
                body, trips = hlo_collectives._while_parts(comps, ins, instrs)
                phase = _phase(re.search(r'op_name="([^"]*)"', ins["attrs"]).group(1))
                walk(body, phase, times * trips)
            else:
                for callee in hlo_collectives._called(ins):
                    walk(callee, loop, times)

    walk(entry, None, 1)
    return out


# ----------------------------------------------------------------------------- the tests

# Per layer, in the layer scans: (loop, phase, what) of each tp all-reduce, all of one [B, S, D].
PER_LAYER = {
    # remat none: forward g twice, backward f twice; nothing recomputed.
    "none": Counter({("forward", "forward", "attention out"): 1, ("forward", "forward", "mlp out"): 1,
                     ("backward", "backward", "attention in"): 1, ("backward", "backward", "mlp in"): 1}),
    # remat full: the backward scan re-runs the layer's forward first, but only what the backward
    # needs: the attention output's all-reduce (the MLP's input is computed from it), not the MLP
    # output's (the layer's output is not needed to differentiate the layer; JAX's remat drops it,
    # it is absent before XLA too). So 2 forward + 1 recomputed + 2 backward = 5 per layer.
    "full": Counter({("forward", "forward", "attention out"): 1, ("forward", "forward", "mlp out"): 1,
                     ("backward", "recompute", "attention out"): 1,
                     ("backward", "backward", "attention in"): 1, ("backward", "backward", "mlp in"): 1}),
}


@pytest.mark.parametrize("remat", ["none", "full"])
def test_compiled_step_runs_two_tp_all_reduces_per_layer_forward_and_two_backward(remat):
    """The tp all-reduces one call of the compiled ZeRO-0 step executes on (dp, tp) = (2, 4), L = 3.

    Per layer, inside the layer scans, each one all-reduce of one f32 [B, S, D] (XLA combines none
    of them there, with these two policies):
      forward scan:  the attention output and the MLP output (Megatron g, the row-parallel sums);
      backward scan: the gradients of the attention input and of the MLP input (f's transpose);
      remat full: + the attention output's all-reduce once more, recomputed in the backward scan;
    so 4 per layer with remat none (2 + 2) and 5 with remat full (2 + 1 recomputed + 2).
    Once per step, outside the scans: 4 all-reduce instructions carrying 5 reductions,
      forward: the vocab-parallel embedding [B, S, D]; the cross-entropy's max and normaliser [B, S];
      one tuple all-reduce XLA combined from the backward's gradient of the head input [B, S, D]
        (the head's f) and the forward's target logit [B, S] (the gradient does not depend on it).
    Over dp, separately: the token count, each of the 9 layer weights' gradients inside the backward
    scan (once per layer), the head's, final norm's and embedding's, and the loss. Over dp and tp together: one scalar, the global gradient norm's sum of
    squares (StepBuilder._global_norm; XLA's partitioner used to add a tp all-reduce of 9 partial sums).
    """
    mesh, text = compiled(remat)
    executed = executed_collectives(text, mesh)
    assert {(c["op"], c["axis"]) for c in executed} == {("all-reduce", "tp"), ("all-reduce", "dp"),
                                                         ("all-reduce", "dp+tp")}, executed
    (norm,) = [c for c in executed if c["axis"] == "dp+tp"]
    assert (norm["loop"], norm["times"], norm["frame"], norm["operands"]) == (None, 1, "grad norm", [("step", "grad norm", SCALAR)])
    tp = [c for c in executed if c["axis"] == "tp"]

    # inside the layer scans: each all-reduce one [B, S, D] operand, run once per layer
    in_loops = [c for c in tp if c["loop"]]
    seen = [(c["loop"], c["times"], c["frame"], c["operands"]) for c in in_loops]
    assert {c["times"] for c in in_loops} == {LAYERS}, seen
    mlp = {"mlp in", "mlp out"}  # per token: one row of B x S
    assert all(len(c["operands"]) == 1 and c["operands"][0][2] == (TOKENS if c["operands"][0][1] in mlp else ACT)
               for c in in_loops), seen
    per_layer = Counter((c["loop"], *c["operands"][0][:2]) for c in in_loops)
    assert per_layer == PER_LAYER[remat]
    forward = sum(n for (_, phase, _), n in per_layer.items() if phase == "forward")
    backward = sum(n for (_, phase, _), n in per_layer.items() if phase == "backward")
    assert (forward, backward) == (2, 2)  # the design's claim, in the compiled program
    assert sum(per_layer.values()) == {"none": 4, "full": 5}[remat]

    # once per step, outside the scans
    outside = [c for c in tp if not c["loop"]]
    assert {c["times"] for c in outside} == {1}
    singles = Counter(c["operands"][0] for c in outside if len(c["operands"]) == 1)
    assert singles == Counter({("forward", "embedding", ACT): 1, ("forward", "ce max", ROW): 1,
                               ("forward", "ce sum_exp", ROW): 1})
    combined = sorted((c["frame"], sorted(c["operands"], key=str)) for c in outside if len(c["operands"]) > 1)
    assert combined == [("head in", [("backward", None, ACT), ("forward", None, ROW)])]  # + the target logit (ce)

    # what jaxpar.compiler.hlo_collectives (the dry-run report) counts per call: exactly these, loops times their trips
    (report,) = [e for e in hlo_collectives.collectives(text, mesh) if e["axis"] == "tp"]
    assert report["count"] == LAYERS * sum(per_layer.values()) + 4

    # dp: ZeRO 0 all-reduces each weight's gradient where the backward leaves it (issue 30): the 9 layer
    # weights' inside the backward scan, once per layer; the head's, final norm's and embedding's outside
    dp = [c for c in executed if c["axis"] == "dp"]
    in_scan = [c for c in dp if c["loop"]]
    assert len(in_scan) == 9 and all(c["loop"] == "backward" and c["times"] == LAYERS for c in in_scan), in_scan
    outside = [c for c in dp if not c["loop"]]
    shapes = Counter(op[2] for c in outside for op in c["operands"])
    assert (shapes[SCALAR], sum(shapes.values())) == (2, 2 + 3)  # token count, loss; 3 gradients
    n_bytes = sum(e["bytes"] for e in hlo_collectives.collectives(text, mesh) if e["axis"] == "dp")
    assert n_bytes == 4 * tp_local_params(dataclasses.replace(TINY_MODEL, n_layers=LAYERS), TP) + 2 * 4
