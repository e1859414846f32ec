"""Autoregressive decoding of the Llama model with a KV cache (math only, like jaxpar.models.llama).

`forward` runs new tokens at positions start .. start + T - 1 through every layer, attending to the
cache (written in place at those positions) and returns this rank's vocab slice of their logits. The
prompt goes in as one call (prefill), then one token per call. Tensor parallelism comes from the
same `Collectives` hooks as training: each rank caches only its own KV heads. With context
parallelism (a Collectives with a context axis) the prefill is split over cp: each rank runs its
balanced chunks of the prompt, and every rank caches the whole prompt's K / V for the decoding after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import ModelConfig
from jaxpar.layers.attention import rope
from jaxpar.layers.collectives import Collectives
from jaxpar.layers.mlp import swiglu_mlp
from jaxpar.layers.norm import rms_norm
from jaxpar.models import llama


def init_cache(cfg: ModelConfig, batch: int, max_len: int, local_kv_heads: int, dtype=jnp.float32) -> dict:
    """Zeroed K and V caches, [layers, B, max_len, local KV heads, head_dim] each."""
    shape = (cfg.n_layers, batch, max_len, local_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _cached_attention(x_BxTxD, p, cfg: ModelConfig, coll: Collectives, k_cache, v_cache, start, prefix_len: int = 0):
    """Causal attention of T new positions over the cache (the first `prefix_len` positions see each
    other, as the VLA's prefix-LM mask); returns (output, updated caches)."""
    mine_T = coll.context_positions(x_BxTxD.shape[1])  # a prefill split over cp: this rank's prompt tokens
    positions_T = start + (jnp.arange(x_BxTxD.shape[1]) if mine_T is None else mine_T)
    q = rope(jnp.einsum("btd,dnh->btnh", x_BxTxD, p["wq"]), cfg.rope_theta, cfg.rope_scaling, positions_T)
    k = rope(jnp.einsum("btd,dkh->btkh", x_BxTxD, coll.local_kv_heads(p["wk"])), cfg.rope_theta, cfg.rope_scaling,
             positions_T)
    v = jnp.einsum("btd,dkh->btkh", x_BxTxD, coll.local_kv_heads(p["wv"]))
    kv = coll.context_unshard(jnp.concatenate([k, v], axis=-1))  # with cp: every rank caches the whole prompt
    k, v = jnp.split(kv, 2, axis=-1)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
    b, t, n, h = q.shape
    kv_heads = k_cache.shape[2]
    q_grouped = q.reshape(b, t, kv_heads, n // kv_heads, h)  # query heads share KV heads in groups
    scores = jnp.einsum("btkgh,bskh->bkgts", q_grouped, k_cache, preferred_element_type=jnp.float32) / jnp.sqrt(h)
    keys_S = jnp.arange(k_cache.shape[1])[None, :]
    visible_TxS = (keys_S <= positions_T[:, None]) | ((keys_S < prefix_len) & (positions_T[:, None] < prefix_len))
    probs = jax.nn.softmax(jnp.where(visible_TxS, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_cache.dtype), v_cache).reshape(b, t, n, h)
    return coll.row_parallel_sum(jnp.einsum("btnh,nhd->btd", out.astype(x_BxTxD.dtype), p["wo"])), k_cache, v_cache


def _cached_layer(x_BxTxD, p, cfg: ModelConfig, coll: Collectives, k_cache, v_cache, start, prefix_len: int):
    h = coll.enter_tensor_parallel(rms_norm(x_BxTxD, p["attn_norm"], cfg.norm_eps))
    attended, k_cache, v_cache = _cached_attention(h, p, cfg, coll, k_cache, v_cache, start, prefix_len)
    x_BxTxD = x_BxTxD + attended
    h = coll.enter_tensor_parallel(rms_norm(x_BxTxD, p["mlp_norm"], cfg.norm_eps))
    return x_BxTxD + swiglu_mlp(h, p, coll), k_cache, v_cache


def forward(params: dict, ids_BxT: jax.Array, cache: dict, start, cfg: ModelConfig,
            coll: Collectives = Collectives()) -> tuple[jax.Array, dict]:
    """(this rank's [B, T, V/tp] fp32 logits of the T new tokens, the updated cache)."""
    return forward_embedded(params, llama.embed_tokens(params, ids_BxT, coll), cache, start, cfg, coll)


def forward_embedded(params: dict, x_BxTxD: jax.Array, cache: dict, start, cfg: ModelConfig,
                     coll: Collectives = Collectives(), prefix_len: int = 0) -> tuple[jax.Array, dict]:
    """`forward` from input embeddings (a VLA's prefix is image tokens + embedded instruction),
    the first `prefix_len` positions attending bidirectionally."""
    x, cache = hidden_states(params, x_BxTxD, cache, start, cfg, coll, prefix_len)
    return llama.head_logits(params, x, cfg, coll), cache


def hidden_states(params: dict, x: jax.Array, cache: dict, start, cfg: ModelConfig, coll: Collectives = Collectives(),
                  prefix_len: int = 0) -> tuple[jax.Array, dict]:
    """The last layer's output for the new positions (before the final norm), and the updated cache."""
    def body(x, layer):
        p, k_cache, v_cache = layer
        x, k_cache, v_cache = _cached_layer(x, p, cfg, coll, k_cache, v_cache, start, prefix_len)
        return x, (k_cache, v_cache)

    x, (k_cache, v_cache) = jax.lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    return x, {"k": k_cache, "v": v_cache}


def predict_actions(params: dict, images_BxCamxHxWxC: jax.Array, instruction_BxT: jax.Array,
                    config, instruction_bytes_BxT: jax.Array | None = None,
                    state_BxS: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A VLA's greedy action tokens [B, dims] on one device, and the logits they were chosen from
    [B, dims, bins]: the image + instruction prefix in one call, then one action token per call,
    each the most likely among the action tokens only. With actions.chunk = H > 1: [B, H x dims] tokens
    (step-major) and their logits from one call over the prefix and the placeholder slots. Images are uint8 pixels, scaled in the encoder
    (jaxpar.models.vit.normalise). `instruction_bytes_BxT`: what FiLM reads when the LLM reads a
    tokenizer's ids (jaxpar.data.instructions). With actions.head = l1 or flow there are no tokens: ([B, H x dims] the
    actions in their own units, [B, H x dims] the head's normalised values). `state_BxS`: the robot's state, which
    the encoder reads with vision.state_dims (jaxpar.models.vit, "The state token")."""
    from jaxpar.models import vit, vla

    coll, cfg, dims = Collectives(), config.model, config.actions.dims
    film = instruction_BxT if instruction_bytes_BxT is None else instruction_bytes_BxT
    tokens = vit.encode(params, images_BxCamxHxWxC, config.vision, coll, None, film, state_BxS)
    first_action = cfg.vocab_size - config.actions.bins
    if config.actions.parallel_slots:  # every slot of the chunk in one call (jaxpar.models.vla: parallel decoding)
        slots = vla.action_targets(config)
        placeholders = jnp.full((instruction_BxT.shape[0], slots), vla.PLACEHOLDER_ID, instruction_BxT.dtype)
        x = vla.llm_inputs(params, tokens, jnp.concatenate([instruction_BxT, placeholders], axis=1), coll)
        cache = init_cache(cfg, x.shape[0], x.shape[1], cfg.n_kv_heads, x.dtype)
        if config.actions.continuous:
            x, _ = hidden_states(params, x, cache, 0, cfg, coll, vla.prefix_len(config))
            if config.actions.head == "flow":  # from one fixed noise (train.seed's) for every row: one observation,
                noise = jax.random.normal(jax.random.key(config.train.seed), (1, slots), jnp.float32)  # one chunk
                noise = jnp.broadcast_to(noise, (x.shape[0], slots))
                unit, positions = vla.flow_sample(params, x, noise, config, coll, slots)
            else:
                unit, positions = vla.l1_predictions(params, x, config, coll, slots)
            return vla.denormalise_values(config, unit, vla.slot_dims(config, positions)[1]), unit
        logits, _ = forward_embedded(params, x, cache, 0, cfg, coll, vla.prefix_len(config))
        scores = logits[:, -slots:, first_action:]
        return first_action + jnp.argmax(scores, axis=-1).astype(jnp.int32), scores
    x = vla.llm_inputs(params, tokens, instruction_BxT, coll)
    prefix = x.shape[1]
    cache = init_cache(cfg, x.shape[0], prefix + dims - 1, cfg.n_kv_heads, x.dtype)
    logits, cache = forward_embedded(params, x, cache, 0, cfg, coll, vla.prefix_len(config))
    out, scores = [], []
    for j in range(dims):
        scores.append(logits[:, -1, first_action:])
        token = first_action + jnp.argmax(scores[-1], axis=-1).astype(jnp.int32)
        out.append(token)
        if j + 1 < dims:
            logits, cache = forward(params, token[:, None], cache, prefix + j, cfg, coll)
    return jnp.stack(out, axis=1), jnp.stack(scores, axis=1)
