"""The Llama model against a naive reference written independently here (loops, explicit softmax).

The reference repeats KV heads explicitly, builds the causal mask by hand and applies RoPE as
complex rotation, so a mistake shared with jaxpar's code (scan, einsum layouts, rotate-half RoPE,
jax.nn.dot_product_attention, vocab-parallel cross-entropy) would show up here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ModelConfig
from jaxpar.layers.attention import rope
from jaxpar.models import llama


def rope_complex(x_SxNxH, theta):
    """RoPE as a complex rotation of (x[i], x[i + H/2]) pairs, the HF rotate-half convention."""
    seq, _, head_dim = x_SxNxH.shape
    half = head_dim // 2
    freqs = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(seq)[:, None] * freqs[None, :]
    z = (x_SxNxH[..., :half] + 1j * x_SxNxH[..., half:]) * np.exp(1j * angles)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def naive_loss(params, tokens, cfg: ModelConfig) -> float:
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    total = 0.0
    for b in range(tokens.shape[0]):
        x = p["embed"][inputs[b]]
        seq = x.shape[0]
        for layer in range(cfg.n_layers):
            w = {k: v[layer] for k, v in p["layers"].items()}
            x = x + naive_attention(rms(x, w["attn_norm"], cfg), w, cfg, seq)
            h = rms(x, w["mlp_norm"], cfg)
            gate, up = h @ w["w_gate"], h @ w["w_up"]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w["w_down"]
        logits = rms(x, p["final_norm"], cfg) @ p["lm_head"]
        logits = logits - logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= log_probs[np.arange(seq), targets[b]].sum()
    return total


def rms(x, scale, cfg):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * scale


def naive_attention(h, w, cfg, seq):
    group = cfg.n_heads // cfg.n_kv_heads
    q = rope_complex(np.einsum("sd,dnh->snh", h, w["wq"]), cfg.rope_theta)
    k = rope_complex(np.einsum("sd,dkh->skh", h, w["wk"]), cfg.rope_theta)
    v = np.einsum("sd,dkh->skh", h, w["wv"])
    out = np.zeros_like(q)
    for head in range(cfg.n_heads):
        kv = head // group
        scores = q[:, head] @ k[:, kv].T / np.sqrt(cfg.head_dim)
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, kv]
    return np.einsum("snh,nhd->sd", out, w["wo"])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_llama_matches_naive_reference(n_kv_heads):
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=n_kv_heads, d_ff=48,
                      rope_theta=500.0, init_std=0.2)
    params = llama.init(cfg, jax.random.key(1))
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.vocab_size))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((2, 10), np.float32)}
    loss, count = llama.loss_sum(params, batch, cfg)
    expected = naive_loss(params, tokens, cfg)
    assert float(count) == 20
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    assert abs(expected / 20 - np.log(cfg.vocab_size)) > 0.05, "init_std must make logits non-trivial"


def test_rope_matches_complex_rotation_and_is_relative():
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, 7, 2, 8)))
    np.testing.assert_allclose(np.asarray(rope(jnp.asarray(x), 100.0))[0], rope_complex(x[0], 100.0), atol=1e-5)
    q, k = np.ones((1, 7, 1, 8)), np.ones((1, 7, 1, 8))
    rq, rk = np.asarray(rope(jnp.asarray(q), 100.0))[0, :, 0], np.asarray(rope(jnp.asarray(k), 100.0))[0, :, 0]
    np.testing.assert_allclose(rq[3] @ rk[1], rq[5] @ rk[3], rtol=1e-5)  # depends only on i - j


def test_loss_mask_excludes_tokens():
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
    params = llama.init(cfg, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (1, 9), 0, 64))
    full = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((1, 8), np.float32)}
    half_mask = np.ones((1, 8), np.float32)
    half_mask[:, 4:] = 0
    loss_full, _ = llama.loss_sum(params, full, cfg)
    loss_half, count = llama.loss_sum(params, {**full, "mask": half_mask}, cfg)
    assert float(count) == 4 and float(loss_half) < float(loss_full)


def test_llama7b_parameter_count_is_llama2_7b():
    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008)
    assert llama.param_count(cfg) == 6_738_415_616
