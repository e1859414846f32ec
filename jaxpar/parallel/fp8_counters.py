"""fp8.recipe=delayed's counters in the parallel train step (the recipe itself: jaxpar.layers.fp8, "delayed
scaling"; docs/design.md "Delayed scaling").

The counters (`params["layers"][llama.FP8_LIVES]`, and a VLA's encoder's and projector's: jaxpar.parallel.vision)
are replicated over tp like a norm, but each tp rank's
linears see only their own shards' amaxes. Left to JAX, each linear would type them varying at its use and
sum their cotangent over tp there: 7 more all-reduces in every layer's backward, each one more collective to
order on XLA:CPU. Instead they enter the model typed varying over tp once (`varying_over_tp`), their
cotangent stays on its rank through the whole backward, and it is summed over tp once, after every other
reduction (`summed_over_tp`). dp, cp and pp need nothing of their own: the counters ride the weights'
ZeRO reductions and pipeline stages.

`calibrate`: a fresh state has seen no amax, so the trainer fills its counters (the LLM's, and a VLA's
encoder's: jaxpar.parallel.vision) from one forward and backward of the first batch with current scaling
before the first step.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpar.layers import fp8
from jaxpar.layers.order import after
from jaxpar.models import vla
from jaxpar.parallel.optim import is_fp8_counters
from jaxpar.parallel.zero import gather_axes, mesh_axes_of
from jaxpar.sharding import tensor_axes


def tp_axes(mesh) -> tuple[str, ...]:
    """The LLM's tp mesh axes that split anything (size > 1)."""
    return tuple(a for a in mesh_axes_of(tensor_axes(mesh)) if mesh.shape[a] > 1)


def varying_over_tp(params: dict, axes: tuple[str, ...]) -> dict:
    """`params` (the LLM's weights, or the vision encoder's) with their counters typed varying over `axes` (none:
    as they are)."""
    if not axes:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, w: jax.lax.pcast(w, axes, to="varying") if is_fp8_counters(path) else w, params)


def summed_over_tp(grads: dict, axes: tuple[str, ...]) -> dict:
    """The counters' cotangent (each use's one-hot amax bins) summed over `axes` in one all-reduce, after every
    other gradient reduction in `grads` (XLA:CPU: one order). A bin any shard saw is nonzero in the sum: the max
    over the shards."""
    counters = [(path, g) for path, g in jax.tree_util.tree_leaves_with_path(grads) if is_fp8_counters(path)]
    if not axes or not counters:
        return grads
    paths, leaves = zip(*counters)
    summed = dict(zip(paths, jax.lax.psum(after(list(leaves), grads), axes)))
    return jax.tree_util.tree_map_with_path(lambda path, g: summed.get(path, g), grads)


def calibrate(builder, state, batch: dict):
    """The counters of a fresh state from `batch` (Transformer Engine's calibration, run once): its forward and
    backward with each linear scaled by its operands' own amaxes (Collectives.fp8_calibrating), whose bins
    become the counters as a step's would: the LLM's layers' and a VLA's encoder's and projector's. Nothing else
    changes: the weights, the optimizer state and the step count stay, and the first train step then runs on the
    same batch. Why: a scale of 1 (Transformer Engine's and Flax's start) flushes the first step's output
    gradients below E5M2's subnormals."""
    calibrating = copy.copy(builder)
    calibrating.fp8_calibrating = True
    # (the flow head's draws: the first step's)
    loss, grads, _ = calibrating.loss_and_grads(state.params, vla.flow_noise(builder.config, batch, state.step))
    grads = after(grads, loss)  # (XLA:CPU: the loss's sum first)
    history, mesh = builder.config.fp8.amax_history, builder.mesh
    master, compute = {}, {}
    for path, seen in jax.tree_util.tree_leaves_with_path(grads):
        if not is_fp8_counters(path):
            continue
        spec_opt, spec_params = (_at(specs, path) for specs in (builder.specs.opt, builder.specs.params))
        lives = fp8.next_lives(jnp.zeros(seen.shape, jnp.float32), seen.astype(jnp.float32), history)
        master[path] = jax.lax.with_sharding_constraint(lives, NamedSharding(mesh, spec_opt))
        compute[path] = master[path].astype(builder.compute_dtype)
        if (how := gather_axes(spec_opt, spec_params)) is not None:  # ZeRO 1-2: the optimizer's shards, gathered
            compute[path] = jax.shard_map(lambda a, how=how: jax.lax.all_gather(a, how[1], axis=how[0], tiled=True),
                                          mesh=mesh, in_specs=spec_opt, out_specs=spec_params,
                                          check_vma=False)(compute[path])
    replaced = lambda new: lambda path, x: new.get(path, x)  # noqa: E731
    return state.replace(master=jax.tree_util.tree_map_with_path(replaced(master), state.master),
                         params=jax.tree_util.tree_map_with_path(replaced(compute), state.params))


def _at(tree, path):
    """The entry of a tree of dicts at a key path."""
    for key in path:
        tree = tree[key.key]
    return tree
