"""Where each layer of an interleaved pipeline sits in the stored stacked-layer arrays (and moving
trees between orders): device s's chunks must be contiguous in its pp block of the layer dim."""

from __future__ import annotations

import jax
import numpy as np


def layer_order(n_layers: int, stages: int, virtual: int) -> np.ndarray | None:
    """Which model layer each position of the stored stacked-layer arrays holds, or None for the model's
    own order (virtual == 1). The layer dim is split over pp in contiguous blocks, so with interleaving
    device s must find its chunks s, s+p, s+2p, ... next to each other: position (s, j, l) holds layer
    (j p + s) c + l, c = n_layers / (p v). Checkpoints record the order and restore across it."""
    if virtual == 1:
        return None
    chunk = n_layers // (stages * virtual)
    s, j, l = np.meshgrid(np.arange(stages), np.arange(virtual), np.arange(chunk), indexing="ij")
    return ((j * stages + s) * chunk + l).reshape(-1)


def reorder_layers(tree, source: np.ndarray | None, target: np.ndarray | None):
    """Move every stacked-layer leaf (under a top-level "layers" key of a parameter-shaped tree: params,
    master weights, Adam moments, gradients) from order `source` to order `target` (None: model order)."""
    if source is None and target is None:
        return tree
    n = len(source if source is not None else target)
    source = np.arange(n) if source is None else source
    target = np.arange(n) if target is None else target
    take = np.argsort(source)[target]  # stored position, in the source order, of each target position

    def move(path, leaf):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return leaf[take] if keys[:1] == ["layers"] and getattr(leaf, "ndim", 0) and leaf.shape[0] == n else leaf
    return jax.tree_util.tree_map_with_path(move, tree)
