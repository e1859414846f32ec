"""Which collectives of a compiled program may start in different orders on different devices.

On XLA:CPU each emulated device runs the program on its own threads and starts any instruction whose
operands are ready, so two collectives with no data or control path between them may be entered in
one order by one device and in the other by another. Each then waits in a rendezvous the other never
joins: a deadlock, or, since every shard_map collective carries the same channel_id (XLA:CPU's
rendezvous op_id), two collectives over one group matched with each other. XLA:CPU's own ordering of
collectives (a "scheduling" edge through its communicator resource) fixes only the order in which
they are *launched*, not that one finishes before the next starts, and a program loaded from the
compilation cache rebuilds that resource per instruction, losing even that.

`unordered_pairs` reads the optimized HLO text (`compiled.as_text()`) and lists, per computation,
every pair of collective-holding instructions that no path of operands or control predecessors
orders. A collective-holding instruction is a collective, or a while / call / conditional / fusion
whose computations (transitively) hold one. jaxpar orders them with `layers.collectives.after`; the
tests assert this list is empty over a matrix of layouts (tests/test_collective_order.py).
"""

from __future__ import annotations

import re

from jaxpar.compiler.hlo_collectives import OPS, parse_module

_COLLECTIVE_OPS = frozenset(OPS) | {f"{op}-start" for op in OPS}
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")


def _called(ins: dict) -> list[str]:
    """The computations an instruction runs; an all-reduce's reducer (to_apply) holds no collective."""
    if ins["op"] in _COLLECTIVE_OPS:
        return []
    names = _CALLED.findall(ins["attrs"])
    branches = _BRANCHES.search(ins["attrs"])
    if branches:
        names += [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
    return names


def _holding(comps: dict[str, list[dict]]) -> set[str]:
    """Names of the computations that hold a collective, directly or through what they call."""
    memo: dict[str, bool] = {}

    def holds(name: str, depth: int = 0) -> bool:
        if name not in memo:
            memo[name] = False  # a malformed recursive call graph ends here
            memo[name] = depth < 64 and any(
                ins["op"] in _COLLECTIVE_OPS or any(holds(c, depth + 1) for c in _called(ins))
                for ins in comps.get(name, []))
        return memo[name]

    return {name for name in comps if holds(name)}


def _is_collective_node(ins: dict, holding: set[str]) -> bool:
    return ins["op"] in _COLLECTIVE_OPS or any(c in holding for c in _called(ins))


def _predecessors(ins: dict) -> list[str]:
    control = _CONTROL.search(ins["attrs"])
    extra = [c.strip().lstrip("%") for c in control.group(1).split(",")] if control else []
    return ins["args"] + [c for c in extra if c]


def _ancestors(instrs: list[dict]) -> dict[str, int]:
    """Each instruction's ancestors (operands and control predecessors, transitively) as a bitset."""
    index = {ins["name"]: k for k, ins in enumerate(instrs)}
    preds = {ins["name"]: [p for p in _predecessors(ins) if p in index] for ins in instrs}
    out: dict[str, int] = {}
    for ins in instrs:  # HLO text lists operands before their users; iterate to a fixed point anyway
        stack = [ins["name"]]
        while stack:
            name = stack[-1]
            pending = [p for p in preds[name] if p not in out]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if name not in out:
                bits = 0
                for p in preds[name]:
                    bits |= out[p] | (1 << index[p])
                out[name] = bits
    return out


def unordered_pairs(hlo_text: str) -> list[tuple[str, str, str]]:
    """(computation, instruction, instruction) for every pair of collective-holding instructions of
    one computation that no data or control path orders."""
    comps, _ = parse_module(hlo_text)
    holding = _holding(comps)
    pairs = []
    for comp in sorted(holding):
        instrs = comps[comp]
        nodes = [ins["name"] for ins in instrs if _is_collective_node(ins, holding)]
        if len(nodes) < 2:
            continue
        index = {ins["name"]: k for k, ins in enumerate(instrs)}
        ancestors = _ancestors(instrs)
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                if not (ancestors[b] >> index[a] & 1 or ancestors[a] >> index[b] & 1):
                    pairs.append((comp, a, b))
    return pairs


def describe(pairs: list[tuple[str, str, str]], limit: int = 12) -> str:
    """A few unordered pairs, one per line, for an assertion message."""
    lines = [f"{comp}: {a} || {b}" for comp, a, b in pairs[:limit]]
    if len(pairs) > limit:
        lines.append(f"... and {len(pairs) - limit} more")
    return "\n".join(lines)
