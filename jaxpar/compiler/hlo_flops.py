"""The FLOPs a compiled step executes, and the library kernels it calls, counted from XLA HLO text
(on jaxpar.compiler.hlo_collectives' parser): matmuls (dots, convolutions, cuBLAS GEMMs) and cuDNN fused
attention, loop bodies times their trip counts. MFU's model FLOPs say what the model needs; this says
what the program runs (remat recomputation, masked pipeline slots, replicated work included).
"""

from __future__ import annotations

import re

import numpy as np

from jaxpar.compiler.hlo_collectives import _ARRAY, _called, _close, _ints, _split_top, _tuple_elems, _while_parts, parse_module


# ----------------------------------------------------------------------------- executed FLOPs
# MFU's model FLOPs (6N) say what the model needs; this says what the compiled program runs, remat
# recomputation, masked pipeline slots and replicated work included.

FP8_GEMM = "__cublas$lt$matmul$f8"  # XLA's FP8 GEMM on Hopper and newer (jaxpar.layers.fp8's pattern)
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", FP8_GEMM, "__onednn$matmul")  # dots lowered to a library
_FMHA = "__cudnn$fmha"  # cuDNN fused attention: __cudnn$fmhaSoftmax, ...Backward, ScaleBias..., ...F8
_MAYBE_COMPUTE = re.compile(r"gemm|matmul|conv|fmha|attention", re.I)
_CAUSAL = re.compile(r'"mask_type"\s*:\s*"(?:PADDING_)?CAUSAL"')


def _dims(shape: str) -> list[int]:
    """Dimensions of an array shape, or of the first element of a tuple shape (custom-call results)."""
    m = _ARRAY.search(_tuple_elems(shape)[0])
    return [int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip()] if m else []


def _dot_flops(ins: dict, instrs: dict[str, dict]) -> float | None:
    """2 x output elements x contracted size (each output element sums `contracted` products; batch
    dims are output dims). None when the lhs shape or the dimension numbers cannot be read."""
    lhs = instrs.get(ins["args"][0]) if ins["args"] else None
    spec = (re.search(r"lhs_contracting_dims=\{([\d,\s]*)\}", ins["attrs"]) or
            re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins["attrs"]))
    if lhs is None or spec is None:
        return None
    lhs_dims = _dims(lhs["shape"])
    contracted = int(np.prod([lhs_dims[i] for i in _ints(spec.group(1))] or [1]))
    return 2.0 * float(np.prod(_dims(ins["shape"]) or [1])) * contracted


def _conv_flops(ins: dict, instrs: dict[str, dict]) -> float | None:
    """2 x output elements x kernel elements per output feature. XLA's kernel input-feature dim is
    already input features / feature_group_count (and batch_group_count splits the lhs batch, not the
    kernel), so kernel elements / output features is exactly the products summed per output element."""
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins["attrs"])
    kernel = instrs.get(ins["args"][1]) if len(ins["args"]) > 1 else None
    if labels is None or kernel is None:
        return None
    k_dims = _dims(kernel["shape"])
    per_output = float(np.prod(k_dims)) / k_dims[labels.group(1).index("o")]
    return 2.0 * float(np.prod(_dims(ins["shape"]) or [1])) * per_output


def _operand_dims(ins: dict, instrs: dict[str, dict], k: int) -> list[int]:
    """Dimensions of operand `k` of a custom-call: its operand_layout_constraints entry, else its producer's shape."""
    m = re.search(r"operand_layout_constraints=\{", ins["attrs"])
    if m:
        shapes = _split_top(ins["attrs"][m.end():_close(ins["attrs"], m.end() - 1) - 1])
        if k < len(shapes):
            return _dims(shapes[k])
    producer = instrs.get(ins["args"][k]) if k < len(ins["args"]) else None
    return _dims(producer["shape"]) if producer else []


def fmha_flops(ins: dict, instrs: dict[str, dict]) -> float | None:
    """Matmul FLOPs of one cuDNN fused-attention call (target __cudnn$fmha*), None when unreadable.

    The backend_config's `intermediate_tensor_shape` is the scores' [b, h, s_q, s_kv] (h: query heads;
    GQA's shared K/V heads change no product); the head dims are the last dims of Q (operand 0) and V
    (operand 2), forward and backward alike (q, k, v, [bias,] ... / q, k, v, stats, dO, O, ...), in
    either layout (BTNH, BNTH). With n = b h s_q s_kv:
      forward, two matmuls: S = Q K^T (2 n d_qk) and O = P V (2 n d_v): 4 n d when d_qk = d_v = d;
      backward, flash attention's five (it keeps no P: it recomputes S = Q K^T from Q, K and the saved
        softmax statistics), then dV = P^T dO (2 n d_v), dP = dO V^T (2 n d_v), dQ = dS K (2 n d_qk),
        dK = dS^T Q (2 n d_qk): 2 n (3 d_qk + 2 d_v), 10 n d = 2.5 x the forward.
    A causal mask (mask_type CAUSAL / PADDING_CAUSAL) halves both: the kernel skips the blocks above the
    diagonal, and half is the usual convention (FlashAttention's and Megatron's counts), where the
    unmasked entries are s (s + 1) / 2 of s^2 and the kernel's tiles straddle the diagonal anyway.
    The softmax, scaling and masking are elementwise work and not counted (as everywhere here)."""
    attrs = ins["attrs"]
    target = re.search(r'custom_call_target="([^"]+)"', attrs)
    scores = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]', attrs)
    q_dims, v_dims = _operand_dims(ins, instrs, 0), _operand_dims(ins, instrs, 2)
    if not target or scores is None or not q_dims or not v_dims:
        return None
    n = float(np.prod(_ints(scores.group(1))))
    d_qk, d_v = q_dims[-1], v_dims[-1]
    flops = 2.0 * n * ((3 * d_qk + 2 * d_v) if "Backward" in target.group(1) else (d_qk + d_v))
    return flops / 2 if _CAUSAL.search(attrs) else flops


def is_fp8_gemm(ins: dict) -> bool:
    """Whether an instruction is an FP8 cuBLASLt GEMM (priced at the FP8 peak: jaxpar.compiler.gpu_program)."""
    return ins["op"] == "custom-call" and f'custom_call_target="{FP8_GEMM}"' in ins["attrs"]


def _instr_flops(ins: dict, instrs: dict[str, dict]) -> tuple[str, float | None] | None:
    """(kind, FLOPs) of a matmul-like instruction, None for anything else. kind: "dot", "convolution",
    "attention" (cuDNN fused attention) or, for a library call that cannot be read, its target."""
    op = ins["op"]
    if op == "dot":
        return "dot", _dot_flops(ins, instrs)
    if op == "convolution":
        return "convolution", _conv_flops(ins, instrs)
    target = re.search(r'custom_call_target="([^"]+)"', ins["attrs"]) if op == "custom-call" else None
    if target and target.group(1) in _GEMM_TARGETS:
        return "dot", _dot_flops(ins, instrs)
    if target and target.group(1).startswith(_FMHA):
        flops = fmha_flops(ins, instrs)
        return ("attention", flops) if flops is not None else (target.group(1), None)
    if target and _MAYBE_COMPUTE.search(target.group(1)):
        return target.group(1), None
    return None


def _scope(ins: dict, scopes: tuple[str, ...]) -> str | None:
    """The first of `scopes` (jax.named_scope names) in the instruction's op_name metadata, if any."""
    op_name = re.search(r'op_name="([^"]*)"', ins.get("attrs", ""))
    path = op_name.group(1).split("/") if op_name else []
    return next((s for s in scopes if s in path), None)


def _comp_flops(comps, name: str, memo: dict, depth: int = 0, scopes: tuple[str, ...] = ()) -> dict:
    """{"dot", "convolution", "attention", "unknown_trip", "uncounted", "scopes"} of one execution of
    computation `name` ("scopes": FLOPs by the named scope their instruction was traced in).

    Called computations are added, while bodies multiplied by their trip count (nested loops multiply
    through), and a conditional counts its most expensive branch (see executed_flops)."""
    if name in memo:
        return memo[name]
    out = {"dot": 0.0, "convolution": 0.0, "attention": 0.0, "unknown_trip": False, "uncounted": set(),
           "scopes": dict.fromkeys(scopes, 0.0)}
    if depth > 64:  # malformed (recursive) call graph
        return out
    instrs = {i["name"]: i for i in comps.get(name, [])}
    for ins in comps.get(name, []):
        own = _instr_flops(ins, instrs)
        if own is not None:
            kind, flops = own
            if flops is None:
                out["uncounted"].add(kind if kind not in ("dot", "convolution") else f"{kind} {ins['name']}")
            else:
                out[kind] += flops
                scope = _scope(ins, scopes)
                if scope is not None:
                    out["scopes"][scope] += flops
            continue
        if ins["op"] == "while":
            body, n = _while_parts(comps, ins, instrs)
            parts = [(_comp_flops(comps, body, memo, depth + 1, scopes), 1 if n is None else n)] if body else []
            out["unknown_trip"] |= n is None
        else:
            called = [_comp_flops(comps, c, memo, depth + 1, scopes) for c in _called(ins)]
            if ins["op"] == "conditional" and called:
                called = [max(called, key=lambda c: c["dot"] + c["convolution"] + c["attention"])]
            parts = [(c, 1) for c in called]
        for sub, times in parts:
            out["dot"] += times * sub["dot"]
            out["convolution"] += times * sub["convolution"]
            out["attention"] += times * sub["attention"]
            out["unknown_trip"] |= sub["unknown_trip"]
            out["uncounted"] |= sub["uncounted"]
            for scope, flops in sub["scopes"].items():
                out["scopes"][scope] += times * flops
    memo[name] = out
    return out


def executed_flops(hlo_text: str, scopes: tuple[str, ...] = ()) -> dict:
    """Matmul FLOPs one device executes in one call of the program (an SPMD program's shapes are one
    device's shards): every `dot`, `convolution`, library GEMM custom-call and cuDNN fused-attention
    call (its matmuls, fmha_flops: a GPU program's core attention), inside fusions, calls,
    async wrappers and while bodies (x known_trip_count, else the trip count inferred from the loop
    condition; nested loops multiply through). Elementwise work is not counted (nor in model FLOPs).

    A conditional runs one branch, known only at run time: each counts its costliest branch, an upper
    bound, exact when the branches cost the same. The train step's conditionals are the NaN guard
    (jaxpar/parallel/step.py: optimizer update vs identity, no matmul in either) and context parallelism's
    block kinds (jaxpar.layers.ring: two branches of equal FLOPs), so the rule is exact there; unlike the sum
    over branches (`collectives`), it cannot count work that never runs.

    Returns {"total", "dot", "convolution", "attention" (cuDNN fused attention), "trip_count_unknown" (a
    loop counted once), "uncounted" (custom-calls that look like matmuls but cannot be read; unreadable
    dots), "by_scope" (the FLOPs of instructions traced in each of `scopes`, jax.named_scope names: the
    pipeline's slots)}."""
    comps, entry = parse_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    got = _comp_flops(comps, entry, {}, scopes=tuple(scopes))
    return {"total": got["dot"] + got["convolution"] + got["attention"], "dot": got["dot"], "by_scope": got["scopes"],
            "convolution": got["convolution"], "attention": got["attention"],
            "trip_count_unknown": got["unknown_trip"], "uncounted": sorted(got["uncounted"])}


# ----------------------------------------------------------------------------- library kernels

def custom_call_counts(hlo_text: str) -> dict[str, int]:
    """How many times one call of the program runs each custom-call target (cuBLAS GEMMs, cuDNN
    attention, ...): while bodies times their trip count (once when unknown), every branch of a
    conditional counted."""
    comps, entry = parse_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    counts: dict[str, int] = {}

    def walk(name: str, mult: int, depth: int) -> None:
        if depth > 64:
            return
        instrs = {i["name"]: i for i in comps.get(name, [])}
        for ins in comps.get(name, []):
            target = re.search(r'custom_call_target="([^"]+)"', ins["attrs"]) if ins["op"] == "custom-call" else None
            if target:
                counts[target.group(1)] = counts.get(target.group(1), 0) + mult
            elif ins["op"] == "while":
                body, n = _while_parts(comps, ins, instrs)
                if body:
                    walk(body, mult * (n or 1), depth + 1)
            else:
                for called in _called(ins):
                    walk(called, mult, depth + 1)

    walk(entry, 1, 0)
    return dict(sorted(counts.items()))
