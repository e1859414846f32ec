"""AdamW (optax) with linear warmup + cosine decay and clipping by the true global gradient norm.

The optimizer runs outside shard_map on global (sharded) arrays, so `clip_by_global_norm` sees every
shard of every gradient: the norm is the same whatever the layout.
"""

from __future__ import annotations

import jax
import optax

from jaxpar.config import TrainConfig
from jaxpar.layers import fp8
from jaxpar.models.llama import FP8_LIVES


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


def fp8_counter_rule(history: int) -> optax.GradientTransformationExtraArgs:
    """fp8.recipe=delayed's update of the layers' counters (jaxpar.layers.fp8.next_lives): their "gradient"
    is the sum of one-hot amax bins each linear's uses saw; the update sets a seen bin's counter to
    `history` and counts the others down. No state, no learning rate: the NaN guard keeps the old counters
    as it keeps the weights."""
    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return jax.tree.map(lambda g, lives: fp8.next_lives(lives, g, history) - lives, updates, params), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def is_fp8_counters(path) -> bool:
    """Whether a tree path (jax.tree_util's) leads to the layers' FP8 counters: state, not a weight."""
    return FP8_LIVES in jax.tree_util.keystr(path)


def make_optimizer(train: TrainConfig, fp8_history: int | None = None) -> optax.GradientTransformation:
    """AdamW (after clipping, if train.grad_clip); with `fp8_history` (fp8.recipe=delayed) the layers' FP8
    counters are updated by `fp8_counter_rule` instead (optax.partition: AdamW, the clipping and the decay
    mask never see them; without it the optimizer state keeps the tree it always had)."""
    adamw = optax.adamw(lr_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps,
                        weight_decay=train.weight_decay, mask=decay_mask)
    if train.grad_clip > 0:
        adamw = optax.chain(clip_by_global_norm(train.grad_clip), adamw)
    if fp8_history is None:
        return adamw
    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "fp8_counters" if is_fp8_counters(path) else "weights", params)
    return optax.partition({"weights": adamw, "fp8_counters": fp8_counter_rule(fp8_history)}, labels)
