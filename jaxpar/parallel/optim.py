"""AdamW (optax) with linear warmup + cosine decay and clipping by the true global gradient norm.

The optimizer runs outside shard_map on global (sharded) arrays, so `clip_by_global_norm` sees every
shard of every gradient: the norm is the same whatever the layout.
"""

from __future__ import annotations

import jax
import optax

from jaxpar.config import TrainConfig


def lr_schedule(train: TrainConfig) -> optax.Schedule:
    """Learning rate of optimizer step count+1: warmup reaches lr at step `warmup_steps`, never 0 at step 1."""
    warmup = min(train.warmup_steps, train.steps)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup > 0 else train.lr,
        peak_value=train.lr,
        warmup_steps=warmup,
        decay_steps=max(train.steps, warmup + 1),
        end_value=train.lr * train.min_lr_ratio,
    )
    return lambda count: schedule(count + 1)


NO_DECAY = ("norm", "scale", "bias", "pos_embed")  # norms, LayerNorm scale/bias, ViT position embedding


def decay_mask(params):
    """Weight decay on weight matrices only (Llama / Megatron / ViT practice): not on norm scales,
    biases or position embeddings."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(word in jax.tree_util.keystr(path) for word in NO_DECAY), params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm (same math, same empty state) that takes the global norm when the
    caller already has it: `update(grads, state, params, grad_norm=norm)`. The train step passes the
    norm it computed outside its NaN-guard cond, so the cond's branches hold no norm all-reduce."""
    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        g_norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        trigger = g_norm < max_norm
        updates = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps,
                        weight_decay=train.weight_decay, mask=decay_mask)
    if train.grad_clip > 0:
        return optax.chain(clip_by_global_norm(train.grad_clip), adamw)
    return adamw
