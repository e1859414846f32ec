"""Logical axes -> mesh axes: the one rules table, and the ZeRO stages as different mappings.

Model code names the dims of every weight with logical axes ("vocab", "embed", "heads", "mlp",
"layers", ...). `RULES` maps each to at most one mesh axis (Megatron layout: heads, kv heads, mlp
and vocab over tp; the stacked layer dim over pp). ZeRO adds one more mapping: the "embed" dim of a
ZeRO-sharded state goes over dp (the dim every weight has; Levanter/MaxText shard FSDP the same way):

| state            | stage 0 | stage 1 | stage 2 | stage 3 |
|------------------|---------|---------|---------|---------|
| params (compute) | -       | -       | -       | dp      |
| gradients        | -       | -       | dp      | dp      |
| optimizer state  | -       | dp      | dp      | dp      |
| fp32 master      | -       | dp      | dp      | dp      |

A rule that lands two logical dims of one array on the same mesh axis is an error, not a silent drop.
"""

from __future__ import annotations

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
}
ZERO_AXIS = "embed"  # the logical dim that ZeRO shards over dp
DP = "dp"


def logical_to_spec(logical: tuple[str, ...], zero_sharded: bool = False, unused_axes=()) -> P:
    """PartitionSpec of one array from its logical axes; `zero_sharded` puts ZERO_AXIS over dp.

    Mesh axes in `unused_axes` (those of size 1) are left out, so an array is only ever typed as
    varying over axes that really split it.
    """
    mesh_axes = []
    for name in logical:
        if name not in RULES:
            raise KeyError(f"logical axis '{name}' has no rule in jaxpar.sharding.RULES")
        axis = DP if (zero_sharded and name == ZERO_AXIS) else RULES[name]
        if axis is not None and axis in mesh_axes:
            raise ValueError(f"logical axes {logical} map two dims onto mesh axis '{axis}'")
        mesh_axes.append(axis)
    return P(*(None if axis in unused_axes else axis for axis in mesh_axes))


def is_axes_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def tree_specs(axes_tree: Any, zero_sharded: bool = False, unused_axes=()) -> Any:
    return jax.tree.map(lambda axes: logical_to_spec(axes, zero_sharded, unused_axes), axes_tree,
                        is_leaf=is_axes_leaf)


def unused_mesh_axes(mesh) -> tuple[str, ...]:
    return tuple(name for name, size in mesh.shape.items() if size == 1)


def zero_dim(logical: tuple[str, ...]) -> int:
    return logical.index(ZERO_AXIS)


class StateSpecs:
    """PartitionSpecs of params / grads / optimizer state / master weights for one ZeRO stage."""

    def __init__(self, axes_tree: Any, stage: int, mesh):
        unused = unused_mesh_axes(mesh)
        self.axes = axes_tree
        self.stage = stage
        self.params = tree_specs(axes_tree, stage >= 3, unused)
        self.grads = tree_specs(axes_tree, stage >= 2, unused)
        self.opt = tree_specs(axes_tree, stage >= 1, unused)  # also the fp32 master weights
