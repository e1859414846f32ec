"""Vision encoder (ViT) and projector of the VLA: math only, logical axes per weight.

ViT: non-overlapping patches -> linear patch embedding + learned position embedding (initialised
to 2-D sin-cos by default, see `sincos_2d`), pre-LayerNorm
transformer blocks with bidirectional multi-head attention and a GELU MLP, final LayerNorm. With
several cameras each image is encoded separately and the patch tokens are concatenated.
Projector: a 2-layer GELU MLP into the LLM width (LLaVA / OpenVLA). Tensor parallel in the Megatron
layout over the vision tp axis, through the same `Collectives` hooks as the LLM, and with the same
checkpoint_name tags, so the remat policies of jaxpar.parallel.remat mean the same for the encoder.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import VisionConfig
from jaxpar.layers.collectives import Collectives
from jaxpar.layers.norm import layer_norm

BLOCK_AXES = {
    "ln1_scale": ("vit_embed",), "ln1_bias": ("vit_embed",),
    "wq": ("vit_embed", "vit_heads", "head_dim"), "wk": ("vit_embed", "vit_heads", "head_dim"),
    "wv": ("vit_embed", "vit_heads", "head_dim"), "wo": ("vit_heads", "head_dim", "vit_embed"),
    "ln2_scale": ("vit_embed",), "ln2_bias": ("vit_embed",),
    "w_in": ("vit_embed", "vit_mlp"), "w_out": ("vit_mlp", "vit_embed"),
}
STEM_AXES = {"patch_embed": ("patch", "vit_embed"), "pos_embed": ("patches", "vit_embed"),
             "final_scale": ("vit_embed",), "final_bias": ("vit_embed",)}
PROJECTOR_AXES = {"w1": ("vit_embed", "proj_mlp"), "w2": ("proj_mlp", "embed")}


def patches_per_image(cfg: VisionConfig) -> int:
    return (cfg.image_size // cfg.patch_size) ** 2


def image_tokens(cfg: VisionConfig) -> int:
    return cfg.cameras * patches_per_image(cfg)


def param_axes() -> dict:
    return {"vit": {**STEM_AXES, "blocks": {k: ("vit_layers",) + v for k, v in BLOCK_AXES.items()}},
            "projector": PROJECTOR_AXES}


def param_shapes(cfg: VisionConfig, llm_width: int) -> dict:
    d, n, f = cfg.width, cfg.n_heads, cfg.mlp_dim
    h = d // n
    block = {"ln1_scale": (d,), "ln1_bias": (d,), "wq": (d, n, h), "wk": (d, n, h), "wv": (d, n, h),
             "wo": (n, h, d), "ln2_scale": (d,), "ln2_bias": (d,), "w_in": (d, f), "w_out": (f, d)}
    stem = {"patch_embed": (cfg.patch_size ** 2 * cfg.channels, d), "pos_embed": (patches_per_image(cfg), d),
            "final_scale": (d,), "final_bias": (d,)}
    return {"vit": {**stem, "blocks": {k: (cfg.depth,) + s for k, s in block.items()}},
            "projector": {"w1": (d, cfg.projector_dim), "w2": (cfg.projector_dim, llm_width)}}


FAN_IN_DIMS = {"wo": 2}  # weights whose input spans two dims (heads x head_dim); the rest: the first dim


def sincos_2d(grid: int, width: int) -> jax.Array:
    """[grid*grid, width] 2-D sin-cos position code (MAE; big_vision's "sincos2d"): a quarter of the
    channels each for sin/cos of the row and of the column at width/4 geometric frequencies.

    Why: row and column are then separate, smooth features from step 0. On the one-square demo task the
    model could still not read one axis after 1500 steps from a random start; from this start it
    reads both by step 750 (docs/vla_tiny.md)."""
    omega = 1.0 / 10000.0 ** (jnp.arange(width // 4) / (width // 4))
    rows, cols = jnp.meshgrid(jnp.arange(grid), jnp.arange(grid), indexing="ij")
    rows = rows.reshape(-1, 1) * omega
    cols = cols.reshape(-1, 1) * omega
    return jnp.concatenate([jnp.sin(rows), jnp.cos(rows), jnp.sin(cols), jnp.cos(cols)], axis=1).astype(jnp.float32)


def init(cfg: VisionConfig, llm_width: int, key: jax.Array) -> dict:
    """LeCun-normal weights (std 1/sqrt(fan_in), as big_vision's ViT), position embedding 2-D sin-cos
    (`pos_init="sincos2d"`) or N(0, 1/width) (`"normal"`), LayerNorm scales 1 and biases 0; keys
    folded per leaf (layout-independent).

    A fixed 0.02 (GPT's init) is too small for a narrow encoder: at width 64 the attention logits
    stay near zero and a tiny ViT cannot learn where a patch is (checked on the demo task)."""
    shapes = param_shapes(cfg, llm_width)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    leaves = []
    for index, (path, shape) in enumerate(flat):
        name = jax.tree_util.keystr(path)
        leaf = name.split("'")[-2]
        if "scale" in name:
            leaves.append(jnp.ones(shape, jnp.float32))
            continue
        if "bias" in name:
            leaves.append(jnp.zeros(shape, jnp.float32))
            continue
        if leaf == "pos_embed" and cfg.pos_init == "sincos2d":
            leaves.append(sincos_2d(cfg.image_size // cfg.patch_size, cfg.width))
            continue
        dims = shape[1:] if "blocks" in name else shape  # stacked blocks: drop the layer dim
        fan_in = dims[-1] if leaf == "pos_embed" else math.prod(dims[:FAN_IN_DIMS.get(leaf, 1)])
        std = 1.0 / math.sqrt(fan_in)
        leaves.append(std * jax.random.normal(jax.random.fold_in(key, 1000 + index), shape, jnp.float32))
    return jax.tree.unflatten(treedef, leaves)


def param_count(cfg: VisionConfig, llm_width: int) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg, llm_width),
                                                   is_leaf=lambda x: isinstance(x, tuple)))


def patchify(images_BxHxWxC: jax.Array, patch: int) -> jax.Array:
    b, h, w, c = images_BxHxWxC.shape
    x = images_BxHxWxC.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def vit_block(x_BxNxD: jax.Array, p: dict, coll: Collectives) -> jax.Array:
    p = coll.gather_weights(p, BLOCK_AXES)
    h = layer_norm(x_BxNxD, p["ln1_scale"], p["ln1_bias"])
    q, k, v = (checkpoint_name(jnp.einsum("bnd,dhk->bnhk", h, p[w]), name)
               for w, name in (("wq", "query_proj"), ("wk", "key_proj"), ("wv", "value_proj")))
    o = checkpoint_name(jax.nn.dot_product_attention(q, k, v), "attention_out")  # bidirectional
    x_BxNxD = x_BxNxD + checkpoint_name(coll.tp_sum(jnp.einsum("bnhk,hkd->bnd", o, p["wo"])), "attention_proj")
    h = layer_norm(x_BxNxD, p["ln2_scale"], p["ln2_bias"])
    hidden = jax.nn.gelu(checkpoint_name(jnp.einsum("bnd,df->bnf", h, p["w_in"]), "mlp_up"))
    return x_BxNxD + checkpoint_name(coll.tp_sum(jnp.einsum("bnf,fd->bnd", hidden, p["w_out"])), "mlp_out")


def encode(params: dict, images_BxCamxHxWxC: jax.Array, cfg: VisionConfig, coll: Collectives,
           remat_policy: Callable | None = None) -> jax.Array:
    """Images -> projected image tokens [B, cameras x patches, llm_width] in the params' dtype."""
    vit = params["vit"]
    b, cams = images_BxCamxHxWxC.shape[:2]
    stem = coll.gather_weights({k: vit[k] for k in STEM_AXES}, STEM_AXES)
    dtype = stem["patch_embed"].dtype
    images = images_BxCamxHxWxC.reshape(b * cams, *images_BxCamxHxWxC.shape[2:]).astype(dtype)
    x = patchify(images, cfg.patch_size) @ stem["patch_embed"] + stem["pos_embed"][None]

    def body(carry, block):
        return vit_block(carry, block, coll), None

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, vit["blocks"])
    x = layer_norm(x, stem["final_scale"], stem["final_bias"])
    proj = coll.gather_weights(params["projector"], PROJECTOR_AXES)
    tokens = jax.nn.gelu(x @ proj["w1"]) @ proj["w2"]
    return tokens.reshape(b, cams * x.shape[1], tokens.shape[-1])


def flops_per_image_set(cfg: VisionConfig, llm_width: int) -> float:
    """Training FLOPs (3x forward) of encoding one example's images, attention included."""
    n = patches_per_image(cfg)
    matmul = sum(math.prod(s) for k, s in param_shapes(cfg, llm_width)["vit"]["blocks"].items()
                 if k.startswith("w")) / cfg.depth
    per_image = 2 * n * (cfg.depth * matmul + cfg.patch_size ** 2 * cfg.channels * cfg.width
                         + cfg.width * cfg.projector_dim + cfg.projector_dim * llm_width)
    per_image += cfg.depth * 4 * n * n * cfg.width  # scores and weighted values
    return 3.0 * cfg.cameras * per_image
