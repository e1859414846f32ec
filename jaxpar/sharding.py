"""Logical axes -> mesh axes: the one rules table, and where ZeRO's sharding goes.

Model code names the dims of every weight with logical axes ("vocab", "embed", "heads", "mlp",
"layers", ...). `RULES` maps each to at most one mesh axis (Megatron layout: heads, kv heads, mlp
and vocab over tp; the stacked layer dim over pp). ZeRO adds one more mapping: the "embed" dim of a
ZeRO-sharded state goes over dp (the dim every weight has; Levanter/MaxText shard FSDP the same way).
Which states each ZeRO stage shards, and everything else ZeRO does, is in jaxpar.parallel.zero.

A rule that lands two logical dims of one array on the same mesh axis is an error, not a silent drop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

RULES: dict[str, str | None] = {
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "layers": "pp",
    "embed": None,
    "head_dim": None,
    # a VLA's l1 action head (jaxpar.models.vla.ACTION_HEAD_AXES): its hidden dim split like the vocabulary (the head
    # it stands beside, computed where the LM head is), its per-dim outputs replicated
    "action_mlp": "tp",
    "action_dims": None,
    # the flow head's conditioning features (the noised value, the time's sines and cosines): replicated
    "flow_cond": None,
    # fp8.recipe=delayed's counters (jaxpar.models.llama.FP8_LIVES): replicated over tp like a norm (each
    # linear's tp shards combine theirs in the gradient's sum), stacked over pp with their layers
    "fp8_linears": None,
    "fp8_operands": None,
    "fp8_bins": None,
}
ZERO_AXIS = "embed"  # the logical dim that ZeRO shards over dp
FP8_BINS = "fp8_bins"  # what ZeRO shards of the counters, which have no "embed" dim
DP = "dp"
CP = "cp"  # context parallelism's axis (jaxpar.parallel.mesh.Layout), present when mesh.cp > 1


@dataclasses.dataclass(frozen=True)
class Rules:
    """One component's mapping: logical axis -> mesh axis, and where its ZeRO sharding goes."""

    table: dict
    zero_logical: tuple[str, ...] = (ZERO_AXIS, FP8_BINS)  # an array's ZeRO dim: the first of these it has
    zero_mesh: tuple[str, ...] = (DP,)  # the mesh axes ZeRO shards over


LLM_RULES = Rules(RULES)
TP_INNER = "tpv"  # the inner part of a split tp axis (jaxpar.parallel.mesh.Layout), present when a VLA's vision tp splits it


def tensor_axes(mesh) -> str | tuple[str, ...]:
    """The LLM's tensor-parallel mesh axes: "tp", or ("tp", "tpv") when the axis is split."""
    return ("tp", TP_INNER) if TP_INNER in mesh.shape else "tp"


def kv_heads_replicated(n_kv_heads: int, tp: int) -> bool:
    """More tp ranks than KV heads (Llama-3-70B: 8 KV heads, tp = 16): several tp ranks attend with the
    same KV head (Megatron, MaxText)."""
    return tp > n_kv_heads


def kv_head_ways(n_kv_heads: int, tp: int, tp_split: int = 1) -> int:
    """Over how many ranks the KV heads are split. tp when it divides them. With more tp ranks than KV
    heads, Megatron's layout: tp is split into ("tp", "tpv") of sizes (n_kv_heads, tp / n_kv_heads)
    (jaxpar.parallel.mesh.Layout), each KV head lives on the outer "tp" index its query heads have and is
    replicated over "tpv", so a rank holds one KV head and its gradient is summed over the tp / K ranks
    sharing it only. 1 (every rank holds every KV head, sliced at use: Collectives.local_kv_heads) when
    the tp axis is split otherwise, for a VLA's vision tp, and with one KV head (no waste: it is the one
    every rank uses)."""
    if not kv_heads_replicated(n_kv_heads, tp):
        return tp
    return n_kv_heads if tp_split > 1 and tp // tp_split == n_kv_heads else 1


def tp_split(tp: int, n_kv_heads: int, vision_tp: int = 1) -> int:
    """The size of the inner "tpv" part of a split tp axis (1: not split), jaxpar.parallel.mesh.Layout: a VLA's
    vision tp when it is a proper divisor of tp, else tp / n_kv_heads when there are fewer KV heads
    than tp ranks (kv_head_ways)."""
    if 1 < vision_tp < tp:
        return vision_tp
    if n_kv_heads == 1:  # one KV head on every rank: nothing to split, and no size-1 axis in the mesh
        return 1
    return tp // n_kv_heads if kv_heads_replicated(n_kv_heads, tp) and tp % n_kv_heads == 0 else 1


def tp_split_of(mesh) -> int:
    return mesh.shape.get(TP_INNER, 1)


def llm_rules(mesh, n_kv_heads: int | None = None) -> Rules:
    """The LLM's table on this mesh. With a pipeline the vocabulary goes over pp x tp (pp outer): the
    embedding and LM head are spread over the stages instead of replicated on each (jaxpar.parallel.pipeline).
    `n_kv_heads`: the KV heads go over the tp ranks kv_head_ways gives (None: over all of tp)."""
    tp = tensor_axes(mesh)
    table = {name: (tp if axis == "tp" else axis) for name, axis in RULES.items()}
    if n_kv_heads is not None:
        tp_size = mesh.shape["tp"] * tp_split_of(mesh)
        ways = kv_head_ways(n_kv_heads, tp_size, tp_split_of(mesh))
        table["kv_heads"] = tp if ways == tp_size else "tp" if ways > 1 else None
    if mesh.shape.get("pp", 1) > 1:
        table["vocab"] = ("pp",) + (tp if isinstance(tp, tuple) else (tp,))
        table["action_mlp"] = table["vocab"]
    return Rules(table, zero_mesh=data_axes(mesh))


def data_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the LLM's weights are replicated over and its gradients summed over: dp, and with
    context parallelism cp (each cp rank holds other tokens of the same sequences). ZeRO shards over them."""
    return (DP, CP) if CP in mesh.shape else (DP,)


def vision_rules(vision_tp: int, mesh) -> Rules:
    """The VLA's vision encoder + projector: Megatron layout on the axes of its own tp (all of tp,
    its inner part "tpv", or none), ZeRO over every mesh axis that splits the images. (The tp axis may
    be split for the vision tp or for the LLM's KV heads, kv_head_ways.)"""
    tp_axes = (("tp", TP_INNER) if TP_INNER in mesh.shape else ("tp",))
    outer = ("dp", "pp") + ((CP,) if CP in mesh.shape else ())  # cp's ranks encode other images too
    if vision_tp <= 1:
        tp, data = None, outer + tp_axes
    elif TP_INNER in mesh.shape and vision_tp == mesh.shape[TP_INNER]:
        tp, data = TP_INNER, outer + ("tp",)
    else:
        tp, data = tensor_axes(mesh), outer
    table = {"vit_embed": None, "vit_heads": tp, "vit_mlp": tp, "vit_layers": None, "patch": None,
             "patches": None, "proj_mlp": tp, "head_dim": None, "embed": None, "bytes": None, "state_dims": None,
             "film_out": None, "fp8_linears": None, "fp8_operands": None, "fp8_bins": None}
    # (the delayed-scaling counters have no ZeRO dim here: replicated over the data axes, whose size may not divide
    # the bins, and all-reduced, a few hundred KB)
    return Rules(table, ("vit_embed", "embed"), data)


def zero_dim(logical: tuple[str, ...], rules: Rules = LLM_RULES) -> int | None:
    """The dim ZeRO shards an array on; None for an array with none of the rules' ZeRO dims (e.g. a
    ViT's per-head q bias), which ZeRO leaves replicated over the data axes."""
    return next((logical.index(name) for name in rules.zero_logical if name in logical), None)


def logical_to_spec(logical: tuple[str, ...], zero_sharded: bool = False, unused_axes=(),
                    rules: Rules = LLM_RULES) -> P:
    """PartitionSpec of one array from its logical axes; `zero_sharded` puts its ZeRO dim over the
    rules' ZeRO mesh axes.

    Mesh axes in `unused_axes` (those of size 1) are left out, so an array is only ever typed as
    varying over axes that really split it.
    """
    zero_at = zero_dim(logical, rules) if zero_sharded else None
    zero_mesh = tuple(a for a in rules.zero_mesh if a not in unused_axes)
    entries, used = [], []
    for index, name in enumerate(logical):
        if name not in rules.table:
            raise KeyError(f"logical axis '{name}' has no rule in jaxpar.sharding")
        rule = rules.table[name]
        rule = rule if isinstance(rule, tuple) else (rule,)
        axes = zero_mesh if index == zero_at else tuple(a for a in rule if a and a not in unused_axes)
        if set(axes) & set(used):
            raise ValueError(f"logical axes {logical} map two dims onto mesh axes {axes}")
        used += axes
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def is_axes_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def leaf_names(axes_tree: Any) -> list[str]:
    """The name (last dict key) of every array of a logical-axes tree, in its flattening order: which
    weight a leaf is (e.g. "wq"), where a mechanism applies to some weights only (fp8.zero3_gather)."""
    paths = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=is_axes_leaf)[0]
    return [str(getattr(path[-1], "key", "")) if path else "" for path, _ in paths]


def tree_specs(axes_tree: Any, zero_sharded: bool = False, unused_axes=(), rules: Rules = LLM_RULES) -> Any:
    return jax.tree.map(lambda axes: logical_to_spec(axes, zero_sharded, unused_axes, rules), axes_tree,
                        is_leaf=is_axes_leaf)


def unused_mesh_axes(mesh) -> tuple[str, ...]:
    return tuple(name for name, size in mesh.shape.items() if size == 1)
