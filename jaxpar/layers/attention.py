"""Grouped-query causal self-attention with RoPE, Megatron layout.

Q/K/V projections are column-parallel (each tp rank owns n_heads/tp query heads and n_kv_heads/tp
KV heads, or, with more ranks than KV heads, the one KV head its query heads share; no collective); the output projection is row-parallel (one all-reduce over tp).
Under sequence parallelism the projections' all-gather and the output's reduce-scatter are Collectives'
(column_linears, row_linear), collective matmuls where it says so (jaxpar.layers.collective_matmul).

The core attention runs on the kernel the caller names (`implementation`, plain data resolved at
start by jaxpar.compiler.attention_choice): "xla" (jax's reference path: materialises the [B, N, S, S]
scores) or "cudnn" (cuDNN flash attention: the causal mask is a kernel mask type, so masked blocks
are skipped; the prefix-LM mask goes in as `mask`, which jax hands to cuDNN as a dense additive
bias). "auto" can only reach a layer unresolved (a model built without a device in mind, e.g. the
single-device references of the tests) and means "xla", the path that runs everywhere.

The cuDNN call goes through `cudnn_attention` (jaxpar.layers.cudnn), jax's own kernel wrapped in a custom_vjp of ours whose
forward names the residuals the kernel's backward reads: the output ("attention_out") and the softmax
statistics ("attention_stats", the row log-sum-exp, f32 [B, N, S]). A remat policy that keeps both
(jaxpar.parallel.remat: selective, dots, offload) runs the flash forward once per layer; jax's own
custom_vjp hides the statistics from the policies, so naming the output alone re-ran it in the backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import ulysses
from jaxpar.layers.collectives import Collectives
from jaxpar.layers.cudnn import cudnn_attention


def rope_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """The rotary inverse frequencies, [head_dim / 2] float32. `scaling` = (factor, low_freq_factor,
    high_freq_factor, original_max_len) applies Llama 3's rule: wavelengths longer than
    original_max_len / low_freq_factor are slowed by `factor`, shorter than original_max_len /
    high_freq_factor kept, and those between interpolated smoothly."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling:
        factor, low, high, original = scaling
        wavelength = 2 * np.pi / freqs
        smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        freqs = (1 - smooth) * freqs / factor + smooth * freqs
    return freqs.astype(np.float32)


def rope(x_BxSxNxH: jax.Array, theta: float, scaling: tuple | None = None,
         positions_S: jax.Array | None = None) -> jax.Array:
    """Rotary embedding, rotate-half form (as in HF Llama), at `positions_S` (default 0..S-1)."""
    seq_len, head_dim = x_BxSxNxH.shape[1], x_BxSxNxH.shape[-1]
    freqs_H2 = jnp.asarray(rope_frequencies(head_dim, theta, scaling))
    if positions_S is None:
        positions_S = jnp.arange(seq_len)
    angles_SxH2 = positions_S.astype(jnp.float32)[:, None] * freqs_H2[None, :]
    cos = jnp.cos(angles_SxH2)[None, :, None, :]
    sin = jnp.sin(angles_SxH2)[None, :, None, :]
    x32 = x_BxSxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxSxNxH.dtype)


def prefix_lm_mask(seq_len: int, prefix_len: int) -> jax.Array:
    """[1, 1, S, S] bool: causal, except that the first `prefix_len` positions see each other (PaliGemma)."""
    rows, cols = jnp.arange(seq_len)[:, None], jnp.arange(seq_len)[None, :]
    return ((cols <= rows) | (cols < prefix_len))[None, None]


def kernel(implementation: str) -> str:
    """The `implementation` argument of jax.nn.dot_product_attention for a config's attention value."""
    if implementation not in ("auto", "xla", "cudnn", ""):
        raise ValueError(f"attention implementation '{implementation}' is unknown; use xla or cudnn")
    return "cudnn" if implementation == "cudnn" else "xla"


def core_attention(q_BxSxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, implementation: str,
                   mask: jax.Array | None = None, is_causal: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v on the kernel `implementation` names ("xla" or "cudnn", after `kernel`),
    its output named "attention_out" for remat. cuDNN goes through cudnn_attention, which names the
    output itself with the softmax statistics beside it (named twice, a policy would keep it twice)."""
    if implementation == "cudnn":
        return cudnn_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, is_causal=is_causal)
    o_BxSxNxH = jax.nn.dot_product_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, is_causal=is_causal,
                                             implementation=implementation)
    return checkpoint_name(o_BxSxNxH, "attention_out")


def context_attention(q_BxSxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, positions_S: jax.Array,
                      coll: Collectives, prefix_len: int, implementation: str) -> jax.Array:
    """This cp rank's queries (at `positions_S`) against the whole sequence. `ulysses`: the heads trade places
    with the sequence over cp (jaxpar.layers.ulysses) and attention runs as on one device. Otherwise, with no
    mask buffer: causal blocks over cp (Collectives.context_attention), and with a prefix-LM's `prefix_len`
    the prefix's queries answered apart. A query inside the prefix sees exactly the prefix's keys (causal or not, every
    key it sees lies there), so its row is one unmasked attention against them; a query after it sees
    what causal attention gives. Both are computed for the rank's queries (it cannot know statically
    which of them lie in the prefix) and each row takes its own: the prefix's attention costs 2 c x P
    more, and no kernel ever gets a mask. A prefix that is the whole sequence (action chunks) is that one
    unmasked call alone: no causal block is computed."""
    if coll.context_strategy == "ulysses":  # the whole sequence for 1/cp of the heads: attention as on one device
        q, k, v = ulysses.heads_from_sequence(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, coll.context_axis)
        whole = prefix_len >= q.shape[1]  # the whole sequence is the prefix (action chunks): no mask at all
        mask = prefix_lm_mask(q.shape[1], prefix_len) if prefix_len and not whole else None
        o_BxSxNxH = core_attention(q, k, v, implementation, mask=mask, is_causal=mask is None and not whole)
        return ulysses.sequence_from_heads(o_BxSxNxH, coll.context_axis)
    causal_BxSxNxH, prefix = coll.context_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, prefix_len, implementation)
    if prefix is None:
        return causal_BxSxNxH
    prefix_BxSxNxH = core_attention(q_BxSxNxH, *prefix, implementation)
    if causal_BxSxNxH is None:  # the whole sequence is the prefix: one unmasked call, no causal block computed
        return prefix_BxSxNxH
    in_prefix = (positions_S < prefix_len)[None, :, None, None]
    return jnp.where(in_prefix, prefix_BxSxNxH, causal_BxSxNxH)


def attention(x_BxSxD: jax.Array, p: dict, rope_theta: float, coll: Collectives, prefix_len: int = 0,
              implementation: str = "xla", rope_scaling: tuple | None = None) -> jax.Array:
    """p: wq [D, N, H], wk / wv [D, K, H], wo [N, H, D] (N, K: this tp rank's heads). `x_BxSxD` is the
    block's input from Collectives.enter_block (with collective matmul still the sequence shard, which
    the projections gather chunk by chunk: Collectives.column_linears).

    Causal; with `prefix_len` > 0 the prefix (e.g. image + instruction) attends bidirectionally.
    `implementation`: "xla" or "cudnn" (module docstring).
    """
    impl = kernel(implementation)
    q_BxSxNxH, k_BxSxKxH, v_BxSxKxH = coll.column_linears(
        x_BxSxD, [("bsd,dnh->bsnh", p["wq"]), ("bsd,dkh->bskh", p["wk"]), ("bsd,dkh->bskh", p["wv"])], kv=True)
    q_BxSxNxH = checkpoint_name(q_BxSxNxH, "query_proj")
    k_BxSxKxH = checkpoint_name(k_BxSxKxH, "key_proj")
    v_BxSxKxH = checkpoint_name(v_BxSxKxH, "value_proj")
    seq_len = q_BxSxNxH.shape[1]  # the whole sequence (x may be a sequence shard)
    positions_S = coll.context_positions(seq_len)  # None: 0..S-1
    q_BxSxNxH = rope(q_BxSxNxH, rope_theta, rope_scaling, positions_S)
    k_BxSxKxH = rope(k_BxSxKxH, rope_theta, rope_scaling, positions_S)
    if positions_S is not None:  # context parallelism: causal blocks over cp, the prefix beside them
        o_BxSxNxH = context_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, positions_S, coll, prefix_len, impl)
    elif prefix_len >= seq_len:  # the whole sequence is the prefix (a VLA's action chunks): no mask at all
        o_BxSxNxH = core_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, impl)
    elif prefix_len > 0:
        mask = prefix_lm_mask(seq_len, prefix_len)
        o_BxSxNxH = core_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, impl, mask=mask)
    else:
        o_BxSxNxH = core_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, impl, is_causal=True)
    return checkpoint_name(coll.row_linear("bsnh,nhd->bsd", o_BxSxNxH, p["wo"]), "attention_proj")
