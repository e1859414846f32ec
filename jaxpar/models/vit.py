"""Vision encoder (ViT) and projector of the VLA: math only, logical axes per weight.

ViT: non-overlapping patches -> linear patch embedding + learned position embedding (initialised
to 2-D sin-cos by default, see `sincos_2d`), pre-LayerNorm
transformer blocks with bidirectional multi-head attention and a GELU MLP, final LayerNorm; with
`vision.bias` the linear layers have biases, which makes it SigLIP's vision tower (jaxpar.interop.hf_siglip). With
several cameras each image is encoded separately and the patch tokens are concatenated.
Optional FiLM conditioning on the instruction (RT-1's FiLM-EfficientNet; `vision.film`): the
instruction bytes' mean embedding gives a per-block scale and shift of every patch token, so a patch
can mark itself as "the thing named" inside the encoder (see `film_params`).
Pixels: the model's images travel as uint8 pixels (the data pipeline, synthetic batches, rollouts
and `generate --episode` alike: a quarter of float32's bytes on the host, in the batch transfer and in
the compiled step's batch argument); `features` scales them to [0, 1] (x / 255) and normalises them
per channel with vision.image_mean / image_std (`normalise`: SigLIP's encoder was trained on
(x / 255 - 0.5) / 0.5). Both are done here, in the encoder's forward on the device, so that every
path into the model (training, evaluation, closed-loop rollouts, generation, every parallel layout)
shares one definition and takes its statistics from the run's config.json, instead of each host-side
caller repeating it. Float pixels are still accepted and taken as already scaled to [0, 1] (no / 255):
transformers' pixel_values and the equivalence tests against it are floats; jaxpar's own paths send uint8.
Projector: a 2-layer GELU MLP into the LLM width (LLaVA / OpenVLA). Tensor parallel in the Megatron
layout over the vision tp axis, through the same `Collectives` hooks as the LLM, and with the same
checkpoint_name tags, so the remat policies of jaxpar.parallel.remat mean the same for the encoder.

The state token (vision.state_dims > 0): the robot's proprioceptive state [B, state_dims] (LeRobot's
observation.state) becomes one more prefix token after the image patches, a linear map of the state normalised
to [-1, 1] by the config's per-dim range (the data's q01 / q99, stored with the run as the actions' bins are).
Why here and not in the LLM: the encoder's output is already "the observation's tokens" to every parallel path
(the vision component's batch split and gather, a pipeline's first input, cp's slicing, ZeRO over the encoder's
data axes), so one more token there needs none of them changed, and the state is sliced with the images it
belongs to. pi0 reads the state as one token the same way; OpenVLA-OFT projects it with a small MLP.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import VisionConfig, patches_per_image
from jaxpar.layers import fp8
from jaxpar.layers.attention import core_attention, kernel
from jaxpar.layers.collectives import Collectives
from jaxpar.layers.norm import layer_norm
from jaxpar.models.llama import FP8_LIVES, FP8_LIVES_AXES

BLOCK_AXES = {
    "ln1_scale": ("vit_embed",), "ln1_bias": ("vit_embed",),
    "wq": ("vit_embed", "vit_heads", "head_dim"), "wk": ("vit_embed", "vit_heads", "head_dim"),
    "wv": ("vit_embed", "vit_heads", "head_dim"), "wo": ("vit_heads", "head_dim", "vit_embed"),
    "ln2_scale": ("vit_embed",), "ln2_bias": ("vit_embed",),
    "w_in": ("vit_embed", "vit_mlp"), "w_out": ("vit_mlp", "vit_embed"),
}
# vision.bias (SigLIP): biases of the patch embedding, q / k / v / out projections and the MLP. The
# per-head q / k / v biases and the MLP's inner bias are split over tp with their weights' outputs; the
# out-projection and MLP-out biases are added once, after the tp sum.
BLOCK_BIAS_AXES = {"q_bias": ("vit_heads", "head_dim"), "k_bias": ("vit_heads", "head_dim"),
                   "v_bias": ("vit_heads", "head_dim"), "o_bias": ("vit_embed",), "in_bias": ("vit_mlp",),
                   "out_bias": ("vit_embed",)}
STEM_AXES = {"patch_embed": ("patch", "vit_embed"), "pos_embed": ("patches", "vit_embed"),
             "final_scale": ("vit_embed",), "final_bias": ("vit_embed",)}
PROJECTOR_AXES = {"w1": ("vit_embed", "proj_mlp"), "w2": ("proj_mlp", "embed")}
# vision.state_dims > 0: the proprioceptive state's token, a linear map of the normalised state into the LLM's width
# (in the projector: it too maps an observation into the LLM's space; replicated over the encoder's tp, added after
# the image tokens' tp sum)
STATE_AXES = {"state_proj": ("state_dims", "embed"), "state_bias": ("embed",)}
FILM_AXES = {"film_embed": ("bytes", "vit_embed"), "film_proj": ("vit_embed", "vit_layers", "film_out")}
# fp8.recipe=delayed: the blocks' and the projector's linears carry delayed-scaling counters as the LLM's layers do
# (jaxpar.models.llama.FP8_LIVES; rows in these orders), K and V taking Q's input counters
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w_in", "w_out")
PROJECTOR_LINEARS = ("w1", "w2")
SAME_INPUT = {"wk": "wq", "wv": "wq"}
INSTRUCTION_VOCAB = 256  # FiLM reads the instruction's UTF-8 bytes (jaxpar.data.instructions); 0 pads


def block_axes(cfg: VisionConfig) -> dict:
    return {**BLOCK_AXES, **(BLOCK_BIAS_AXES if cfg.bias else {})}


def param_axes(cfg: VisionConfig, fp8_lives: bool = False) -> dict:
    """Logical axes of every weight; `fp8_lives`: with the delayed-scaling counters (`fp8_lives_shapes`)."""
    stem = {**STEM_AXES, **(FILM_AXES if cfg.film else {}), **({"patch_bias": ("vit_embed",)} if cfg.bias else {})}
    blocks = {k: ("vit_layers",) + v for k, v in block_axes(cfg).items()}
    projector = {**PROJECTOR_AXES, **(STATE_AXES if cfg.state_dims else {})}
    if fp8_lives:
        blocks[FP8_LIVES], projector[FP8_LIVES] = ("vit_layers",) + FP8_LIVES_AXES, FP8_LIVES_AXES
    return {"vit": {**stem, "blocks": blocks}, "projector": projector}


def fp8_lives_shapes(cfg: VisionConfig) -> dict:
    """fp8.recipe=delayed's counters, [(blocks,) linears, operands, bins], where they sit in the tree."""
    per_linear = (len(fp8.OPERANDS), fp8.BINS)
    return {"vit": {"blocks": {FP8_LIVES: (cfg.depth, len(BLOCK_LINEARS)) + per_linear}},
            "projector": {FP8_LIVES: (len(PROJECTOR_LINEARS),) + per_linear}}


def with_fp8_lives(params: dict, cfg: VisionConfig) -> dict:
    """`params` ({"vit", "projector"}) with counters that have seen nothing (zeros) where it has none."""
    shapes = fp8_lives_shapes(cfg)
    vit = {**params["vit"], "blocks": {FP8_LIVES: jnp.zeros(shapes["vit"]["blocks"][FP8_LIVES], jnp.float32),
                                       **params["vit"]["blocks"]}}
    projector = {FP8_LIVES: jnp.zeros(shapes["projector"][FP8_LIVES], jnp.float32), **params["projector"]}
    return {**params, "vit": vit, "projector": projector}


def without_fp8_lives(weights: dict) -> dict:
    """The weights alone (the counters are training state): what inference and the export read."""
    weights = dict(weights)
    if "vit" in weights:
        weights["vit"] = {**weights["vit"], "blocks": {k: v for k, v in weights["vit"]["blocks"].items()
                                                       if k != FP8_LIVES}}
    if "projector" in weights:
        weights["projector"] = {k: v for k, v in weights["projector"].items() if k != FP8_LIVES}
    return weights


def _linears_with_lives(params: dict, coll: Collectives, axes: dict, names: tuple, same_input=None) -> dict:
    """`params`' weights gathered for use (Collectives.gather_weights), each linear of `names` paired with its
    counters (fp8.with_lives) when `params` carries them."""
    weights = coll.gather_weights({k: v for k, v in params.items() if k != FP8_LIVES},
                                  {k: v for k, v in axes.items() if k in params})
    if FP8_LIVES in params:
        weights = fp8.with_lives({**weights, FP8_LIVES: params[FP8_LIVES]}, names, FP8_LIVES, same_input)
    return weights


def param_shapes(cfg: VisionConfig, llm_width: int) -> dict:
    d, n, f = cfg.width, cfg.n_heads, cfg.mlp_dim
    h = d // n
    block = {"ln1_scale": (d,), "ln1_bias": (d,), "wq": (d, n, h), "wk": (d, n, h), "wv": (d, n, h),
             "wo": (n, h, d), "ln2_scale": (d,), "ln2_bias": (d,), "w_in": (d, f), "w_out": (f, d)}
    stem = {"patch_embed": (cfg.patch_size ** 2 * cfg.channels, d), "pos_embed": (patches_per_image(cfg), d),
            "final_scale": (d,), "final_bias": (d,)}
    if cfg.film:  # a scale and a shift of the d channels after each block
        stem.update(film_embed=(INSTRUCTION_VOCAB, d), film_proj=(d, cfg.depth, 2 * d))
    if cfg.bias:
        stem["patch_bias"] = (d,)
        block.update(q_bias=(n, h), k_bias=(n, h), v_bias=(n, h), o_bias=(d,), in_bias=(f,), out_bias=(d,))
    projector = {"w1": (d, cfg.projector_dim), "w2": (cfg.projector_dim, llm_width)}
    if cfg.state_dims:
        projector.update(state_proj=(cfg.state_dims, llm_width), state_bias=(llm_width,))
    return {"vit": {**stem, "blocks": {k: (cfg.depth,) + s for k, s in block.items()}}, "projector": projector}


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
        if leaf == "film_embed":  # an embedding table: unit entries (only its direction matters, see film_params)
            leaves.append(jax.random.normal(jax.random.fold_in(key, 1000 + index), shape, jnp.float32))
            continue
        if leaf == "pos_embed" and cfg.pos_init == "sincos2d":
            leaves.append(sincos_2d(cfg.image_size // cfg.patch_size, cfg.width))
            continue
        dims = shape[1:] if "blocks" in name else shape  # stacked blocks: drop the layer dim
        fan_in = dims[-1] if leaf == "pos_embed" else math.prod(dims[:FAN_IN_DIMS.get(leaf, 1)])
        std = 1.0 / math.sqrt(fan_in)
        leaves.append(std * jax.random.normal(jax.random.fold_in(key, 1000 + index), shape, jnp.float32))
    return jax.tree.unflatten(treedef, leaves)


def film_params(stem: dict, instruction_BxT: jax.Array, depth: int) -> jax.Array:
    """[depth, B, 2, D] per-block (scale - 1, shift) of the patch tokens from the instruction bytes.

    The non-pad bytes' embeddings are averaged and standardised, then projected. Why: with the colour
    named only in the instruction, the LLM must compose two attention hops (instruction -> colour ->
    the patch of that colour), which a small model learns slowly; FiLM makes the match a per-patch,
    multiplicative feature inside the encoder, so the LLM needs one hop (docs/vla_tiny.md)."""
    real = (instruction_BxT > 0).astype(jnp.float32)
    emb_BxTxD = stem["film_embed"][instruction_BxT].astype(jnp.float32)
    mean_BxD = jnp.einsum("btd,bt->bd", emb_BxTxD, real) / jnp.maximum(real.sum(1, keepdims=True), 1.0)
    mean_BxD = layer_norm(mean_BxD, jnp.ones(()), jnp.zeros(()))  # standardised, no parameters
    film_BxLxF = jnp.einsum("bd,dlf->blf", mean_BxD.astype(stem["film_proj"].dtype), stem["film_proj"])
    b, d = film_BxLxF.shape[0], film_BxLxF.shape[-1] // 2
    return film_BxLxF.reshape(b, depth, 2, d).transpose(1, 0, 2, 3)


def param_count(cfg: VisionConfig, llm_width: int) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg, llm_width),
                                                   is_leaf=lambda x: isinstance(x, tuple)))


def pixel_stats(cfg: VisionConfig) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(per-channel mean, std) that `normalise` applies, or None when it is the identity (mean 0, std 1)."""
    if all(m == 0.0 for m in cfg.image_mean) and all(s == 1.0 for s in cfg.image_std):
        return None
    return tuple(cfg.image_mean), tuple(cfg.image_std)


def to_unit(pixels: jax.Array) -> jax.Array:
    """uint8 pixels -> float32 x / 255 in [0, 1] (the one place jaxpar scales pixels: on the device,
    inside the encoder); float pixels are taken as already in [0, 1] and returned untouched."""
    if pixels.dtype == jnp.uint8:
        return pixels.astype(jnp.float32) / 255.0
    if not jnp.issubdtype(pixels.dtype, jnp.floating):
        raise TypeError(f"images must be uint8 pixels (or floats in [0, 1]), not {pixels.dtype}")
    return pixels


def normalise(pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """(x - vision.image_mean) / vision.image_std over the last (channel) axis, in float32, where x is
    the pixels in [0, 1] (`to_unit`: uint8 / 255); just x for mean 0 and std 1 (float pixels then go
    through untouched, no op in the program). The same arithmetic as SiglipImageProcessor's rescale by
    1/255 and normalize."""
    pixels = to_unit(pixels)
    stats = pixel_stats(cfg)
    if stats is None:
        return pixels
    mean, std = (jnp.asarray(v, jnp.float32) for v in stats)
    return (pixels.astype(jnp.float32) - mean) / std


def patchify(images_BxHxWxC: jax.Array, patch: int) -> jax.Array:
    b, h, w, c = images_BxHxWxC.shape
    x = images_BxHxWxC.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def vit_block(x_BxNxD: jax.Array, p: dict, coll: Collectives, attention: str = "xla") -> jax.Array:
    """One pre-LN block; `attention` is the core-attention kernel (jaxpar.layers.attention.kernel).
    GELU is the tanh approximation (jax's default; SigLIP's gelu_pytorch_tanh)."""
    p = _linears_with_lives(p, coll, {**BLOCK_AXES, **BLOCK_BIAS_AXES}, BLOCK_LINEARS, SAME_INPUT)
    bias = lambda name: p.get(name, 0.0)  # noqa: E731  (vision.bias=false: no biases)
    h = layer_norm(x_BxNxD, p["ln1_scale"], p["ln1_bias"])
    q, k, v = (checkpoint_name(coll.linear("bnd,dhk->bnhk", h, p[w]) + bias(b), name)
               for w, b, name in (("wq", "q_bias", "query_proj"), ("wk", "k_bias", "key_proj"),
                                  ("wv", "v_bias", "value_proj")))
    o = core_attention(q, k, v, kernel(attention))  # bidirectional; "attention_out" (+ cuDNN's statistics)
    attended = coll.tp_sum(coll.linear("bnhk,hkd->bnd", o, p["wo"])) + bias("o_bias")
    x_BxNxD = x_BxNxD + checkpoint_name(attended, "attention_proj")
    h = layer_norm(x_BxNxD, p["ln2_scale"], p["ln2_bias"])
    hidden = jax.nn.gelu(checkpoint_name(coll.linear("bnd,df->bnf", h, p["w_in"]) + bias("in_bias"), "mlp_up"))
    out = coll.tp_sum(coll.linear("bnf,fd->bnd", hidden, p["w_out"])) + bias("out_bias")
    return x_BxNxD + checkpoint_name(out, "mlp_out")


def encode(params: dict, images_BxCamxHxWxC: jax.Array, cfg: VisionConfig, coll: Collectives,
           remat_policy: Callable | None = None, instruction_BxT: jax.Array | None = None,
           state_BxS: jax.Array | None = None) -> jax.Array:
    """Images (and, with cfg.film, the instruction bytes) -> projected image tokens
    [B, cameras x patches (+ 1: the state's token with cfg.state_dims), llm_width] in the params' dtype."""
    x = features(params, images_BxCamxHxWxC, cfg, coll, remat_policy, instruction_BxT)
    proj = _linears_with_lives(params["projector"], coll, param_axes(cfg)["projector"], PROJECTOR_LINEARS)
    hidden = jax.nn.gelu(coll.linear("bnd,df->bnf", x, proj["w1"]))
    tokens = coll.tp_sum(coll.linear("bnf,fd->bnd", hidden, proj["w2"]))  # Megatron's column / row pair over tp
    b = images_BxCamxHxWxC.shape[0]
    tokens = tokens.reshape(b, -1, tokens.shape[-1])
    if not cfg.state_dims:
        return tokens
    if state_BxS is None:
        raise ValueError("vision.state_dims > 0: the encoder reads the proprioceptive state; pass state_BxS")
    return jnp.concatenate([tokens, state_token(proj, state_BxS, cfg).astype(tokens.dtype)], axis=1)


def to_unit_range(x: jax.Array, low: jax.Array, high: jax.Array) -> jax.Array:
    """x -> [-1, 1] by its [low, high] (broadcast), clipped; where low == high (a value that never varies) 0. The
    state here and the l1 head's action targets (jaxpar.models.vla.normalise_values) share it."""
    span = jnp.where(high > low, high - low, 1.0)
    return jnp.where(high > low, jnp.clip(2.0 * (x - low) / span - 1.0, -1.0, 1.0), 0.0)


def normalise_state(state_BxS: jax.Array, cfg: VisionConfig) -> jax.Array:
    """The state -> [-1, 1] per dim by [state_low, state_high] (`to_unit_range`), in fp32."""
    low, high = (jnp.asarray(np.asarray(bound, np.float32)) for bound in cfg.state_range())
    return to_unit_range(state_BxS.astype(jnp.float32), low, high)


def state_token(proj: dict, state_BxS: jax.Array, cfg: VisionConfig) -> jax.Array:
    """The state's one prefix token [B, 1, llm_width]: a linear map of the normalised state (as pi0's state
    projection; OFT's proprio projector is an MLP). The same on every encoder tp rank (its weights are not split)."""
    unit = normalise_state(state_BxS, cfg).astype(proj["state_proj"].dtype)
    return (unit @ proj["state_proj"] + proj["state_bias"])[:, None, :]


def features(params: dict, images_BxCamxHxWxC: jax.Array, cfg: VisionConfig, coll: Collectives,
             remat_policy: Callable | None = None, instruction_BxT: jax.Array | None = None) -> jax.Array:
    """The encoder's output before the projector: [B x cameras, patches, width] after the final
    LayerNorm (SigLIP's last_hidden_state), from uint8 pixels (or floats in [0, 1]), scaled and
    normalised here (`normalise`)."""
    vit = params["vit"]
    b, cams = images_BxCamxHxWxC.shape[:2]
    stem_axes = {k: v for k, v in param_axes(cfg)["vit"].items() if k != "blocks"}  # (FiLM's too)
    stem = coll.gather_weights({k: vit[k] for k in stem_axes}, stem_axes)
    dtype = stem["patch_embed"].dtype
    images = normalise(images_BxCamxHxWxC, cfg)
    images = images.reshape(b * cams, *images.shape[2:]).astype(dtype)
    x = patchify(images, cfg.patch_size) @ stem["patch_embed"] + stem.get("patch_bias", 0.0) + stem["pos_embed"][None]
    if cfg.film:
        if instruction_BxT is None:
            raise ValueError("vision.film conditions the encoder on the instruction: pass instruction_BxT")
        film_LxBx2xD = jnp.repeat(film_params(stem, instruction_BxT, cfg.depth), cams, axis=1).astype(dtype)
    else:
        film_LxBx2xD = jnp.zeros((cfg.depth, 0), dtype)  # nothing to scan over but the blocks

    def body(carry, block_and_film):
        block, film = block_and_film
        carry = vit_block(carry, block, coll, cfg.attention)
        if cfg.film:
            carry = carry * (1 + film[:, 0, None]) + film[:, 1, None]
        return carry, None

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, (vit["blocks"], film_LxBx2xD))
    return layer_norm(x, stem["final_scale"], stem["final_bias"])


def flops_per_image_set(cfg: VisionConfig, llm_width: int) -> float:
    """Training FLOPs (3x forward) of encoding one example's images, attention included."""
    n = patches_per_image(cfg)
    matmul = sum(math.prod(s) for k, s in param_shapes(cfg, llm_width)["vit"]["blocks"].items()
                 if k.startswith("w")) / cfg.depth
    per_image = 2 * n * (cfg.depth * matmul + cfg.patch_size ** 2 * cfg.channels * cfg.width
                         + cfg.width * cfg.projector_dim + cfg.projector_dim * llm_width)
    per_image += cfg.depth * 4 * n * n * cfg.width  # scores and weighted values
    return 3.0 * cfg.cameras * per_image
