"""The optimizer itself (jaxpar/parallel/optim.py): which weights decay, and the learning rate of every step.

Why here: the equivalence tests compare layouts that share this optimizer, so a wrong decay mask or a
schedule one step late passes them all (issue 46: both breaks passed the whole fast suite). These tests
state the expected values from the config by hand and check them through the real optax update and
the real train step.

Decay policy (optim.py's docstring; Megatron and big_vision alike): weight matrices decay, including
the token embedding, the LM head and the FiLM tables; norm scales, LayerNorm scales and biases, every
other bias and the ViT's learned position embedding do not.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.config import DebugConfig, TrainConfig, VisionConfig
from jaxpar.data.synthetic import synthetic_batch
from jaxpar.models import llama, vit
from jaxpar.parallel.optim import lr_schedule, make_optimizer

is_shape = lambda x: isinstance(x, tuple)  # noqa: E731

# Every leaf of the LLM, by hand: True = decays.
LLM_DECAY = {
    "embed": True, "lm_head": True, "final_norm": False,
    "layers/attn_norm": False, "layers/mlp_norm": False,
    "layers/wq": True, "layers/wk": True, "layers/wv": True, "layers/wo": True,
    "layers/w_gate": True, "layers/w_up": True, "layers/w_down": True,
}
# Every leaf of the ViT + projector with vision.bias (SigLIP) and vision.film on, by hand.
VISION_DECAY = {
    "vit/patch_embed": True, "vit/patch_bias": False, "vit/pos_embed": False,
    "vit/final_scale": False, "vit/final_bias": False,
    "vit/film_embed": True, "vit/film_proj": True,
    "vit/blocks/ln1_scale": False, "vit/blocks/ln1_bias": False,
    "vit/blocks/ln2_scale": False, "vit/blocks/ln2_bias": False,
    "vit/blocks/wq": True, "vit/blocks/wk": True, "vit/blocks/wv": True, "vit/blocks/wo": True,
    "vit/blocks/q_bias": False, "vit/blocks/k_bias": False, "vit/blocks/v_bias": False,
    "vit/blocks/o_bias": False, "vit/blocks/w_in": True, "vit/blocks/in_bias": False,
    "vit/blocks/w_out": True, "vit/blocks/out_bias": False,
    "projector/w1": True, "projector/w2": True,
}
FULL_VISION = VisionConfig(bias=True, film=True)


def name(path) -> str:
    return "/".join(str(p.key) for p in path)


def params_at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def leaf_names(tree) -> set:
    return {name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_shape)[0]}


def expected_lr(train: TrainConfig, n: int) -> float:
    """The lr of the n-th applied update (1-based), from the config alone: linear warmup from 0 that
    reaches `lr` at update `warmup_steps`, then a half cosine to lr * min_lr_ratio at update `steps`."""
    warmup, end = min(train.warmup_steps, train.steps), train.lr * train.min_lr_ratio
    if n <= warmup:
        return train.lr * n / warmup
    span = max(train.steps, warmup + 1) - warmup
    return end + (train.lr - end) * 0.5 * (1 + math.cos(math.pi * min(n - warmup, span) / span))


def test_the_decay_tables_name_every_leaf_of_the_models():
    """A new leaf must be classified here: the tables are the whole trees, for shapes and axes alike."""
    assert leaf_names(llama.param_shapes(TINY_MODEL)) == leaf_names(llama.param_axes()) == set(LLM_DECAY)
    shapes = vit.param_shapes(FULL_VISION, TINY_MODEL.d_model)
    assert leaf_names(shapes) == leaf_names(vit.param_axes(FULL_VISION)) == set(VISION_DECAY)
    extra = {"vit/film_embed", "vit/film_proj", "vit/patch_bias"} | {  # only with vision.film / vision.bias
        f"vit/blocks/{b}_bias" for b in ("q", "k", "v", "o", "in", "out")}
    plain = set(VISION_DECAY) - extra
    assert leaf_names(vit.param_shapes(VisionConfig(), TINY_MODEL.d_model)) == plain


def test_a_zero_gradient_adamw_update_shrinks_exactly_the_decayed_leaves():
    """With zero gradients Adam's moments stay 0, so the update is the decay alone: p (1 - lr_1 wd) on
    a decayed leaf, p itself elsewhere. The tree is the VLA's: LLM + ViT + projector, as the trainer
    builds it (StepBuilder._param_shapes)."""
    train = TrainConfig(steps=10, warmup_steps=0, lr=0.05, weight_decay=0.2, grad_clip=1.0)
    shapes = {**llama.param_shapes(TINY_MODEL), **vit.param_shapes(FULL_VISION, TINY_MODEL.d_model)}
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    rng = np.random.default_rng(0)
    params = treedef.unflatten([rng.uniform(0.5, 1.5, shape).astype(np.float32) for shape in leaves])
    tx = make_optimizer(train)

    @jax.jit  # one compile for the whole update (eager, each leaf's ops compile on their own)
    def first_update(params):
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        return optax.apply_updates(params, updates)

    new = jax.device_get(first_update(params))
    shrink = 1 - expected_lr(train, 1) * train.weight_decay
    expected = {**LLM_DECAY, **VISION_DECAY}
    decayed = set()
    for path, value in jax.tree_util.tree_flatten_with_path(new)[0]:
        before = params_at(params, path)
        if expected[name(path)]:
            np.testing.assert_allclose(value, before * shrink, rtol=1e-6, err_msg=name(path))
            decayed.add(name(path))
        else:
            np.testing.assert_array_equal(value, before, err_msg=name(path))
    assert decayed == {k for k, v in expected.items() if v}



# ----------------------------------------------------------------------------- the learning rate
SCHEDULE = TrainConfig(steps=10, warmup_steps=4, lr=0.4, min_lr_ratio=0.25)  # end value 0.1


@pytest.mark.parametrize("count,lr", [
    (0, 0.1),  # update 1: a quarter of the warmup, never 0
    (1, 0.2),
    (3, 0.4),  # update 4 = warmup_steps: the peak
    (4, 0.1 + 0.3 * 0.5 * (1 + math.cos(math.pi / 6))),  # first cosine step (6 decay steps)
    (6, 0.25),  # update 7: half way down the cosine, (0.4 + 0.1) / 2
    (9, 0.1),  # update 10 = steps: the end value
], ids=["update1", "update2", "update4-warmup-end", "update5", "update7-mid-decay", "update10-end"])
def test_lr_schedule_at_the_landmarks(count, lr):
    """lr_schedule takes optax's count (updates applied so far) and gives the lr of the next update;
    the values are written out for lr 0.4, warmup 4, 10 steps, min_lr_ratio 0.25."""
    assert float(lr_schedule(SCHEDULE)(count)) == pytest.approx(lr, rel=1e-6)


@pytest.mark.parametrize("train", [
    SCHEDULE,
    TrainConfig(steps=6, warmup_steps=0, lr=1e-3, min_lr_ratio=0.1),  # no warmup: cosine from update 1
    TrainConfig(steps=3, warmup_steps=5, lr=2e-3, min_lr_ratio=0.1),  # warmup longer than the run
], ids=["warmup", "no-warmup", "warmup-past-the-end"])
def test_lr_schedule_is_warmup_then_cosine_at_every_step(train):
    got = [float(lr_schedule(train)(count)) for count in range(train.steps)]
    np.testing.assert_allclose(got, [expected_lr(train, n) for n in range(1, train.steps + 1)], rtol=1e-6)


def adamw_reference(params, grads_per_step, train, lrs, decays):
    """AdamW by hand (float64, optax's form: bias-corrected moments, eps outside the root, decoupled
    decay p * wd added to the update before the lr), one list entry per applied update."""
    mu = {k: np.zeros_like(p) for k, p in params.items()}
    nu = {k: np.zeros_like(p) for k, p in params.items()}
    out = []
    for n, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        new = {}
        for k, p in params.items():
            mu[k] = train.b1 * mu[k] + (1 - train.b1) * grads[k]
            nu[k] = train.b2 * nu[k] + (1 - train.b2) * grads[k] ** 2
            step = (mu[k] / (1 - train.b1 ** n)) / (np.sqrt(nu[k] / (1 - train.b2 ** n)) + train.eps)
            new[k] = p - lr * (step + (train.weight_decay * p if decays[k] else 0.0))
        params = new
        out.append(params)
    return out


def flat(tree) -> dict:
    return {name(path): np.asarray(leaf, np.float64) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_train_step_reports_and_applies_the_scheduled_lr_and_decay():
    """Four real train steps (warmup 2 of 4 steps, no clipping), the second poisoned with a NaN so the
    NaN guard skips it. Reported `learning_rate`: the lr of the update each step makes, by hand 0.005,
    0.01 (the skipped step's would-be update 2), 0.01 (the skip did not advance the schedule), 0.0055
    (half way down the cosine to 0.001). The weights move as AdamW by hand with the lrs 0.005, 0.01,
    0.0055 and LLM_DECAY's mask, and not at all in the skipped step. This pins the lr the optimizer
    applies to the one the metrics report, skips included, and the decay mask inside the trainer."""
    config = make_config(steps=4, warmup_steps=2, lr=1e-2, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=0.0)
    config = dataclasses.replace(config, debug=DebugConfig(nan_at_step=2))
    train = config.train
    builder = builder_for(config)
    state = builder.init_state(train.seed)
    params0 = flat(jax.device_get(state.params))
    step = builder.jit_train_step(with_grads=True)
    grads, lrs, skipped, params = [], [], [], []
    for n in range(train.steps):
        batch = synthetic_batch(train.seed, n, train.global_batch_size, train.seq_len, config.model.vocab_size)
        state, metrics = step(state, jax.device_put(batch, builder.batch_sharding()))
        grads.append(flat(jax.device_get(metrics["grads"])))
        lrs.append(float(metrics["learning_rate"]))
        skipped.append(bool(metrics["skipped"]))
        params.append(flat(jax.device_get(state.params)))
    assert skipped == [False, True, False, False]
    np.testing.assert_allclose(lrs, [5e-3, 1e-2, 1e-2, 5.5e-3], rtol=1e-6)
    for k in LLM_DECAY:
        np.testing.assert_array_equal(params[1][k], params[0][k], err_msg=f"the skipped step moved {k}")
    applied = [params[0], params[2], params[3]]
    reference = adamw_reference(params0, [grads[0], grads[2], grads[3]], train, [5e-3, 1e-2, 5.5e-3], LLM_DECAY)
    for n, (got, want) in enumerate(zip(applied, reference), start=1):
        for k in LLM_DECAY:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=2e-6, err_msg=f"update {n}: {k}")
