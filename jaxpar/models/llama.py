"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; layers stacked and scanned.

Math only. Every weight declares its logical axes in `param_axes`; jaxpar.sharding maps them to the
mesh. Inside `jax.shard_map` the arrays are this device's shards (heads, d_ff and vocab divided by tp)
and the few reductions Megatron needs come from `Collectives`; on one device they are no-ops.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.config import ModelConfig
from jaxpar.layers import fp8, vocab_parallel
from jaxpar.layers.attention import attention
from jaxpar.layers.collectives import Collectives, after
from jaxpar.layers.mlp import swiglu_mlp
from jaxpar.layers.norm import rms_norm

LAYER_AXES = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
LINEAR_ORDER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the rows of the FP8 counters
LINEAR_WEIGHTS = frozenset(LINEAR_ORDER)  # used only by Collectives.linear
SAME_INPUT = {"wk": "wq", "wv": "wq", "w_up": "w_gate"}  # linears that read another's input (fp8.with_lives)
# fp8.recipe=delayed: per layer, each linear's delayed-scaling counters (jaxpar.layers.fp8, "delayed scaling"),
# stacked and sharded like a weight (ZeRO shards the bins), updated by the optimizer's counter rule, not AdamW
FP8_LIVES = "fp8_lives"
FP8_LIVES_AXES = ("fp8_linears", "fp8_operands", "fp8_bins")
EMBED_AXES = ("vocab", "embed")
HEAD_AXES = {"final_norm": ("embed",), "lm_head": ("embed", "vocab")}


def layer_axes(fp8_lives: bool = False) -> dict:
    """One layer's logical axes; `fp8_lives`: with the delayed-scaling counters (FP8_LIVES)."""
    return {**LAYER_AXES, FP8_LIVES: FP8_LIVES_AXES} if fp8_lives else LAYER_AXES


def param_axes(fp8_lives: bool = False) -> dict:
    """Logical axes of every weight; the stacked layer weights gain a leading "layers" dim."""
    return {
        "embed": EMBED_AXES,
        "layers": {name: ("layers",) + axes for name, axes in layer_axes(fp8_lives).items()},
        **HEAD_AXES,
    }


def fp8_lives_shape(cfg: ModelConfig) -> tuple[int, ...]:
    """The stacked layers' delayed-scaling counters: [layers, linears, operands, bins]."""
    return (cfg.n_layers, len(LINEAR_ORDER), len(fp8.OPERANDS), fp8.BINS)


def param_shapes(cfg: ModelConfig) -> dict:
    d, n, k, h, f, v, layers = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                                cfg.vocab_size, cfg.n_layers)
    per_layer = {
        "attn_norm": (d,), "wq": (d, n, h), "wk": (d, k, h), "wv": (d, k, h), "wo": (n, h, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    return {
        "embed": (v, d),
        "layers": {name: (layers,) + shape for name, shape in per_layer.items()},
        "final_norm": (d,),
        "lm_head": (d, v),
    }


def init(cfg: ModelConfig, key: jax.Array) -> dict:
    """fp32 weights: N(0, init_std), output projections scaled by 1/sqrt(2 n_layers), norms one.

    Each leaf's key is folded from its position, so values do not depend on how the tree is sharded.
    """
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for index, (path, shape) in enumerate(zip(paths, leaves)):
        if "norm" in path:
            out.append(jnp.ones(shape, jnp.float32))
            continue
        std = cfg.init_std / (math.sqrt(2 * cfg.n_layers) if ("wo" in path or "w_down" in path) else 1.0)
        out.append(std * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32))
    return jax.tree.unflatten(treedef, out)


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))


def decoder_layer(x_BxSxD: jax.Array, p: dict, cfg: ModelConfig, coll: Collectives, prefix_len: int = 0) -> jax.Array:
    """One layer, `p` its (gathered) weights. With sequence parallelism `x_BxSxD` is this rank's
    sequence shard: the norms run on it, and each tensor-parallel block gathers the whole sequence on
    entry and reduce-scatters on exit (Collectives.enter_block, column_linears, row_linear: collective
    matmuls where the Collectives say so). With fp8.recipe=delayed each linear takes its counters along."""
    p = fp8.with_lives(p, LINEAR_ORDER, FP8_LIVES, SAME_INPUT)
    h_BxSxD = coll.enter_block(rms_norm(x_BxSxD, p["attn_norm"], cfg.norm_eps))
    x_BxSxD = x_BxSxD + attention(h_BxSxD, p, cfg.rope_theta, coll, prefix_len, implementation=cfg.attention,
                                  rope_scaling=cfg.rope_scaling)
    return x_BxSxD + per_token_block(lambda h: swiglu_mlp(coll.enter_block(h), p, coll),
                                     rms_norm(x_BxSxD, p["mlp_norm"], cfg.norm_eps))


def per_token_block(block, h_BxSxD: jax.Array) -> jax.Array:
    """`block` (a tensor-parallel block whose work is per token: the MLP) on `h` as one row of B x S tokens.

    Why: its tp collectives gather and scatter along axis 1 (sequence parallelism), and NCCL along the
    major axis: gathered, [B, S/tp, D] lands as [S, B, D] and XLA transposes it into [B, S, D], then the
    output back before its reduce-scatter (vla70b on the GPU compiler: ~0.02 s of the step's 0.19 s of
    memory-bound kernels, issue 46). As [1, B x S/tp, D] the gathered tokens arrive rank-major, an order a
    per-token block does not see, and the reduce-scatter returns each rank its own tokens in its order."""
    b, s, d = h_BxSxD.shape
    return block(h_BxSxD.reshape(1, b * s, d)).reshape(b, s, d)


def run_layers(x_BxSxD: jax.Array, layers: dict, cfg: ModelConfig, coll: Collectives,
               remat_policy: Callable | None = None, prefix_len: int = 0) -> jax.Array:
    """Scan the stacked layers; `remat_policy` (a jax.checkpoint policy) wraps each layer if given."""
    def layer(x, weights):
        return decoder_layer(x, weights, cfg, coll, prefix_len)

    return coll.scan_layers(layer, x_BxSxD, layers, layer_axes(FP8_LIVES in layers), remat_policy)


def embed_tokens(params: dict, ids_BxS: jax.Array, coll: Collectives) -> jax.Array:
    ids_BxS, table = coll.use_weights(ids_BxS, params["embed"], EMBED_AXES)
    return vocab_parallel.embed(table, ids_BxS, coll)


def head_logits(params: dict, x_BxSxD: jax.Array, cfg: ModelConfig, coll: Collectives,
                last: int | None = None) -> jax.Array:
    """Final norm + vocab-parallel LM head: this rank's [B, S, V/tp] slice of fp32 logits.

    `last`: only the last `last` positions of the (tp-gathered) sequence, where a loss reads no
    other (a VLA's actions): the head's FLOPs and logits shrink by S / last. The slice comes before
    the norm; with sequence parallelism each rank's shard is cut to its own last `last` positions,
    gathered, and the last rank's kept (the caller guarantees they lie in its shard)."""
    # XLA:CPU, one order: the head's weight gradients (and their reductions) before the layers' backward
    x_BxSxD, head = coll.use_weights(x_BxSxD, {k: params[k] for k in HEAD_AXES}, HEAD_AXES)
    x_BxSxD = x_BxSxD if last is None else x_BxSxD[:, -last:]
    x_BxSxD = coll.enter_tensor_parallel(rms_norm(x_BxSxD, head["final_norm"], cfg.norm_eps))
    x_BxSxD = x_BxSxD if last is None else x_BxSxD[:, -last:]  # (sequence parallel: the last shard's)
    return jnp.einsum("bsd,dv->bsv", x_BxSxD, head["lm_head"], preferred_element_type=jnp.float32)


def head_loss_sum(params: dict, x_BxSxD: jax.Array, targets_BxS: jax.Array, mask_BxS: jax.Array,
                  cfg: ModelConfig, coll: Collectives, last: int | None = None) -> jax.Array:
    """Final norm, LM head and the masked sum of token cross-entropies (the last pipeline stage's job).
    `last`: the head on the last `last` positions only (head_logits); the mask must be zero elsewhere."""
    logits_BxSxV = head_logits(params, x_BxSxD, cfg, coll, last)
    if last is not None:
        targets_BxS, mask_BxS = targets_BxS[:, -last:], mask_BxS[:, -last:]
    token_loss_BxS = vocab_parallel.cross_entropy(logits_BxSxV, targets_BxS, coll)
    return jnp.sum(token_loss_BxS * mask_BxS.astype(jnp.float32))


def head_eval(params: dict, x_BxSxD: jax.Array, targets_BxS: jax.Array, cfg: ModelConfig,
              coll: Collectives) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and the predicted (argmax) next token: what evaluation needs."""
    logits_BxSxV = head_logits(params, x_BxSxD, cfg, coll)
    token_loss_BxS = vocab_parallel.cross_entropy(logits_BxSxV, targets_BxS, coll)
    return token_loss_BxS, vocab_parallel.argmax(after(logits_BxSxV, token_loss_BxS), coll)


def eval_sums(token_loss_BxS: jax.Array, pred_BxS: jax.Array, batch: dict) -> dict:
    """Masked sums whose ratios are the eval metrics: loss per token and next-token accuracy."""
    mask_BxS = batch["mask"].astype(jnp.float32)
    return {"loss": jnp.sum(token_loss_BxS * mask_BxS), "tokens": jnp.sum(mask_BxS),
            "correct": jnp.sum((pred_BxS == batch["targets"]) * mask_BxS)}


def loss_sum(params: dict, batch: dict, cfg: ModelConfig, coll: Collectives = Collectives(),
             remat_policy: Callable | None = None) -> tuple[jax.Array, Any]:
    """Sum over (masked) tokens of the next-token cross-entropy, and the token count."""
    x_BxSxD = embed_tokens(params, batch["inputs"], coll)
    x_BxSxD = run_layers(x_BxSxD, params["layers"], cfg, coll, remat_policy)
    total = head_loss_sum(params, x_BxSxD, batch["targets"], batch["mask"], cfg, coll)
    return total, jnp.sum(batch["mask"].astype(jnp.float32))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM-style model FLOPs:
    6 x (matmul weights) + 12 x n_layers x d_model x seq_len for attention scores and values."""
    shapes = param_shapes(cfg)
    matmul_params = sum(math.prod(s) for k, s in shapes["layers"].items() if "norm" not in k) + cfg.d_model * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
