"""cuDNN flash attention through jax's own kernel functions (jax._src.cudnn.fused_attention_stablehlo):
the whole-sequence call with its residuals named for remat (`cudnn_attention`, jaxpar.layers.attention
says why), and one ring block's forward and backward for context parallelism's ring
(jaxpar.layers.ring), whose backward is handed the merged output and log-sum-exp. Kept apart from
attention.py so that the ring (imported by the Collectives the attention layer takes) can use it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax._src.cudnn import fused_attention_stablehlo as _fmha

# ----------------------------------------------------------------------------- cuDNN, residuals named

# The arguments of jax's cuDNN custom_vjp (fused_attention_stablehlo._dot_product_attention) after the ten
# arrays: scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length,
# cudnn_version, return_residual. They are static (nondiff) here as there.
_STATIC = tuple(range(10, 19))


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _fmha_named(*args):
    """jax's cuDNN flash attention (same arguments as fused_attention_stablehlo._dot_product_attention)."""
    return _fmha._dot_product_attention_fwd(*args)


def _fmha_named_fwd(*args):
    """jax's forward rule, its residuals (the output and the softmax statistics) under checkpoint_name.

    The residual tuple is jax's: (q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k,
    page_table_v, stats, output). q, k, v come from the layer's named projections (RoPE is recomputed)."""
    out, res = _fmha._dot_product_attention_fwd_rule(*args)
    *inputs, stats, output = res
    if output is not out:
        raise AssertionError("jax's cuDNN forward rule no longer keeps its output as the last residual")
    out = checkpoint_name(out, "attention_out")
    return out, (*inputs, checkpoint_name(stats, "attention_stats"), out)


def _fmha_named_bwd(*static_res_g):
    return _fmha._dot_product_attention_bwd_rule(*static_res_g)


_fmha_named.defvjp(_fmha_named_fwd, _fmha_named_bwd)


def _exports_dbias(bias, mask, q_BxSxNxH, layout) -> bool:
    """Whether jax's call asks the backward for the bias gradient, as jax.nn.dot_product_attention decides it:
    jax <= 0.10 for any bias (`should_export_dbias`); later jax (0.11 took that function out) only for a bias
    something differentiable feeds, never for a boolean mask, the only bias jaxpar passes."""
    if hasattr(_fmha, "should_export_dbias"):
        return _fmha.should_export_dbias(bias.shape, q_BxSxNxH.shape, layout)
    return mask is not None and mask.dtype != np.dtype("bool")


def _cudnn_arguments(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, mask=None, is_causal=False) -> tuple:
    """The arguments of jax's cuDNN kernel call for q, k, v (scale 1/sqrt(H), the causal mask as cuDNN's
    mask type, a boolean mask as an additive bias, BTNH layout, no dropout), built from the same
    functions of jax._src.cudnn.fused_attention_stablehlo as jax.nn.dot_product_attention builds them;
    the last one, return_residual, False."""
    head_dim = q_BxSxNxH.shape[-1]
    if q_BxSxNxH.shape[-2] % k_BxSxKxH.shape[-2]:
        raise ValueError(f"{q_BxSxNxH.shape[-2]} query heads do not share {k_BxSxKxH.shape[-2]} KV heads evenly")
    cudnn_version = _fmha.check_cudnn_version()
    layout = _fmha._normalize_layout("BTNH")
    bias = _fmha.combine_bias_and_mask(None, mask, q_BxSxNxH.dtype)
    _fmha.check_layout(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, bias, None, None, None, None, None, None, layout)
    has_bias = bias is not None
    variadic_args = (has_bias, has_bias and _exports_dbias(bias, mask, q_BxSxNxH, layout))
    unused = jnp.zeros(0, dtype=q_BxSxNxH.dtype)
    mask_type = _fmha.MaskType.CAUSAL if is_causal else _fmha.MaskType.NO_MASK
    return (q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, bias if has_bias else unused, unused, unused, unused, unused, unused,
            unused, 1.0 / float(np.sqrt(head_dim)), 42, 0.0, variadic_args, mask_type, layout.value, None,
            cudnn_version, False)


def cudnn_attention(q_BxSxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                    mask: jax.Array | None = None, is_causal: bool = False) -> jax.Array:
    """jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, implementation="cudnn"), with
    the residuals of its backward named "attention_out" and "attention_stats" (module docstring): the
    same kernel call as jax's (_cudnn_arguments); only the custom_vjp around the kernel is ours."""
    return _fmha_named(*_cudnn_arguments(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH, mask, is_causal))


def cudnn_block_forward(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, causal: bool) -> tuple[jax.Array, jax.Array]:
    """One context-parallel block on cuDNN (jaxpar.layers.ring): (output in fp32, the kernel's softmax
    statistics, the log-sum-exp of the scaled scores [B, N, S] in fp32), as blockwise.block_attention
    gives them. `causal` is cuDNN's causal mask type (a diagonal block), else no mask: never a bias."""
    *arguments, _ = _cudnn_arguments(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=causal)
    out, stats = _fmha._dot_product_attention_fwd(*arguments, True)  # return_residual: the statistics too
    return out.astype(jnp.float32), stats


def cudnn_block_backward(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, causal, out_BxSxNxH, lse_BxNxS, d_out_BxSxNxH):
    """(dq, dk, dv) of one context-parallel block on cuDNN's backward kernel, handed the merged output and
    log-sum-exp in place of the block's own (blockwise.block_attention_grads says why that is exact)."""
    arguments = _cudnn_arguments(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=causal)
    dtype = q_BxSxNxH.dtype
    residuals = (*arguments[:10], lse_BxNxS, out_BxSxNxH.astype(dtype))
    grads = _fmha._dot_product_attention_bwd_rule(*arguments[10:], residuals, d_out_BxSxNxH.astype(dtype))
    return grads[0], grads[1], grads[2]
