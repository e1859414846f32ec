"""Autoregressive decoding of the Llama model with a KV cache (math only, like jaxpar.models.llama).

`forward` runs new tokens at positions start .. start + T - 1 through every layer, attending to the
cache (written in place at those positions) and returns this rank's vocab slice of their logits. The
prompt goes in as one call (prefill), then one token per call. Tensor parallelism comes from the
same `Collectives` hooks as training: each rank caches only its own KV heads.
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


def _cached_attention(x_BxTxD, p, cfg: ModelConfig, coll: Collectives, k_cache, v_cache, start):
    """Causal attention of T new positions over the cache; returns (output, updated caches)."""
    positions_T = start + jnp.arange(x_BxTxD.shape[1])
    q = rope(jnp.einsum("btd,dnh->btnh", x_BxTxD, p["wq"]), cfg.rope_theta, cfg.rope_scaling, positions_T)
    k = rope(jnp.einsum("btd,dkh->btkh", x_BxTxD, coll.local_kv_heads(p["wk"])), cfg.rope_theta, cfg.rope_scaling,
             positions_T)
    v = jnp.einsum("btd,dkh->btkh", x_BxTxD, coll.local_kv_heads(p["wv"]))
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
    b, t, n, h = q.shape
    kv_heads = k_cache.shape[2]
    q_grouped = q.reshape(b, t, kv_heads, n // kv_heads, h)  # query heads share KV heads in groups
    scores = jnp.einsum("btkgh,bskh->bkgts", q_grouped, k_cache, preferred_element_type=jnp.float32) / jnp.sqrt(h)
    visible_TxS = jnp.arange(k_cache.shape[1])[None, :] <= positions_T[:, None]
    probs = jax.nn.softmax(jnp.where(visible_TxS, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_cache.dtype), v_cache).reshape(b, t, n, h)
    return coll.row_parallel_sum(jnp.einsum("btnh,nhd->btd", out.astype(x_BxTxD.dtype), p["wo"])), k_cache, v_cache


def _cached_layer(x_BxTxD, p, cfg: ModelConfig, coll: Collectives, k_cache, v_cache, start):
    h = coll.enter_tensor_parallel(rms_norm(x_BxTxD, p["attn_norm"], cfg.norm_eps))
    attended, k_cache, v_cache = _cached_attention(h, p, cfg, coll, k_cache, v_cache, start)
    x_BxTxD = x_BxTxD + attended
    h = coll.enter_tensor_parallel(rms_norm(x_BxTxD, p["mlp_norm"], cfg.norm_eps))
    return x_BxTxD + swiglu_mlp(h, p, coll), k_cache, v_cache


def forward(params: dict, ids_BxT: jax.Array, cache: dict, start, cfg: ModelConfig,
            coll: Collectives = Collectives()) -> tuple[jax.Array, dict]:
    """(this rank's [B, T, V/tp] fp32 logits of the T new tokens, the updated cache)."""
    x = llama.embed_tokens(params, ids_BxT, coll)

    def body(x, layer):
        p, k_cache, v_cache = layer
        x, k_cache, v_cache = _cached_layer(x, p, cfg, coll, k_cache, v_cache, start)
        return x, (k_cache, v_cache)

    x, (k_cache, v_cache) = jax.lax.scan(body, x, (params["layers"], cache["k"], cache["v"]))
    return llama.head_logits(params, x, cfg, coll), {"k": k_cache, "v": v_cache}
