"""FP8 GEMMs for the linear layers (`precision=fp8`, issue 47): E4M3 activations and weights in the
forward, E5M2 output gradients in the backward, one scale per tensor, bf16 everywhere else.

What and why:
- Which GEMMs: the linears the model sends through `Collectives.linear` (the LLM's q / k / v / o and
  MLP, the ViT's and the projector's). The embedding, the LM head, the norms and the attention core
  stay bf16, as NeMo, MaxText and torchtitan keep them. Master weights and optimizer state stay fp32.
- The pattern XLA knows: the FP8 operands converted to bf16, one dot with fp32 accumulation, the
  product of the two scales on its output. XLA's GPU compiler rewrites exactly this into one cuBLASLt
  FP8 GEMM with per-tensor scales (`__cublas$lt$matmul$f8`) on Hopper and newer, given a CUDA
  runtime in its target config (jaxpar.compiler.gpu_aot); XLA:CPU computes the same values by
  upcasting, so the numerics are testable here.
- `current` scaling (`fp8.recipe`, Megatron's current scaling): each operand's scale comes from its
  own amax in this GEMM, so there is no state to carry or checkpoint; the price is one more read of
  each operand for its amax (memory-bound time that delayed scaling, issue 47's other recipe, avoids).
- Power-of-two scales, 2^ceil(log2(amax / fp8_max)) (as MXFP8's E8M0 scales): dividing by a power
  of two is exact, so an element's FP8 value is round_fp8(x) * scale whatever the scale, as long as
  x / scale is a normal FP8 number. The scale a shard picks (a dp or tp shard, a microbatch, sees a
  smaller amax than the whole tensor on one device) therefore changes no element above
  2^-6 * scale (E4M3; 2^-14 for E5M2): a data-parallel layout agrees with one device to bf16
  rounding (tests/test_fp8.py, where the other layouts' tolerance is argued). No element saturates:
  amax / scale <= fp8_max by construction.
- The backward uses the FP8 values the forward used: dX = dY(E5M2) W(E4M3), dW = X(E4M3)^T dY(E5M2),
  the pairs cuBLASLt's FP8 GEMM accepts (never E5M2 x E5M2). Its residuals are the FP8 input (as its
  bits) and the bf16 weight, which it quantizes again (deterministic: the same scale and values): an
  FP8 copy of the weight would be a gathered copy per layer that ZeRO-3's remat never keeps (llama7b,
  dp 8, ZeRO-3, remat none on 8 x H100, GPU-compiled, no device: 35.90 GiB so, 31.29 as it is).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxpar.layers.collective_matmul import transposed_equations
from jaxpar.layers.order import after

FORWARD = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, max 448
BACKWARD = jnp.float8_e5m2  # output gradients: 2 mantissa bits, max 57344 (their range varies more)


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """The power-of-two scale that maps `amax` into `dtype`'s range: 2^ceil(log2(amax / max)), 1 for an
    all-zero tensor (fp32; any shape). Read from and built from exponent bits, so it is exactly a power
    of two (XLA:CPU's exp2 is not: exp2(-13.0) came out 1.2207025e-4, and FP8 values then depended on
    the scale) and an amax at an exact power of two times the max gets exactly that power (a log2 a hair
    above it would double the scale: the FP8 ZeRO-3 gather's dequantized weights hit such amaxes). The
    exponent is clamped so the scale stays a normal fp32 number."""
    top = float(jnp.finfo(dtype).max)
    bits = jax.lax.bitcast_convert_type(jnp.where(amax > 0, amax, top).astype(jnp.float32) / top, jnp.int32)
    exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)  # ceil(log2) of a positive float
    biased = jnp.clip(exponent, -120, 120) + 127  # fp32's exponent bias
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `dtype`, scale): per-tensor current scaling with a power-of-two scale. The clip
    only guards the rounding of log2 near an exact power of two (a value can never exceed the max)."""
    x32 = x.astype(jnp.float32)
    scale = scale_for(jnp.max(jnp.abs(x32)), dtype)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x32 / scale, -top, top).astype(dtype), scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A linear's weight with its FP8 values made ahead of its GEMMs, for `Collectives.linear`: as ZeRO-3
    gathered it in FP8 (fp8.zero3_gather=fp8, `all_gather_fp8`), or as a pipeline stage quantized its
    layers once per step (`quantize_stacked`). `bits` and `scale` are what the GEMMs use; `weight` is
    what the gradient is taken of (straight through the quantization, as the FP8 GEMM's own): the
    gathered weight dequantized, never computed where nothing reads it, or the stage's bf16 weight.
    `einsum` keeps `bits` for the backward, never `weight`: a remat policy that keeps no gathered weight
    (jaxpar.parallel.zero.never_keep_gathered) then regathers the bits, where a dequantized weight
    handed on as an array would be kept whole from the forward to the backward."""

    weight: jax.Array
    bits: jax.Array  # E4M3 values as uint8 (collectives on FP8 types are not supported everywhere)
    scale: jax.Array


def all_gather_fp8(shard: jax.Array, scale: jax.Array, axis, dim: int) -> Quantized:
    """all_gather(shard) over `axis` on `dim`, moved as E4M3 (one byte an element, half of bf16's) with
    `scale` (the whole weight's: `scale_for` of the max over `axis` of the shards' amaxes): ZeRO-3's
    gather of a linear's weight under fp8. The FP8 values are those `quantize` gives the whole weight,
    so the GEMMs compute what a bf16 gather gives them, bit for bit (tests/test_fp8.py); dequantized,
    the weight is its FP8 values times a power of two, exact in bf16. The shard's bits wait for the
    shard (jaxpar.layers.order.after): a remat policy may keep them for the backward (they are no
    gathered weight), and its regather then keeps the shard's place in the collective order on XLA:CPU."""
    top = float(jnp.finfo(FORWARD).max)
    q = jnp.clip(shard.astype(jnp.float32) / scale, -top, top).astype(FORWARD)
    shard_bits = after(jax.lax.bitcast_convert_type(q, jnp.uint8), shard)
    bits = jax.lax.all_gather(shard_bits, axis, axis=dim, tiled=True)
    weight = (jax.lax.bitcast_convert_type(bits, FORWARD).astype(jnp.float32) * scale).astype(shard.dtype)
    return Quantized(weight, bits, scale)


def quantize_stacked(w: jax.Array) -> Quantized:
    """The stacked layers' weight `w` ([layers, ...]) quantized once, each layer with its own scale, as
    `quantize` gives each layer's slice (the same bits: the scale is a per-layer power of two): what a
    pipeline stage's slots read in place of quantizing their chunk's weights again in every forward and
    backward slot (Transformer Engine quantizes a weight once per step likewise). `weight` is `w` itself,
    the array the gradient is taken of; slicing the result along the layers slices all three alike."""
    q, scale = jax.vmap(lambda layer: quantize(layer, FORWARD))(jax.lax.stop_gradient(w))
    return Quantized(w, jax.lax.bitcast_convert_type(q, jnp.uint8), scale)


def quantize_linears(layers: dict, names: frozenset) -> dict:
    """The stacked layer weights with those in `names` (the linears') as `quantize_stacked` makes them."""
    return {k: quantize_stacked(w) if k in names else w for k, w in layers.items()}


def weight_grads(grads: dict) -> dict:
    """The cotangent of `quantize_linears`' result as the stacked weights' (a `Quantized`'s is its weight's)."""
    return {k: g.weight if isinstance(g, Quantized) else g for k, g in grads.items()}


def amax(x: jax.Array) -> jax.Array:
    """max |x| in fp32, with no gradient (scales are chosen, not learned)."""
    return jnp.max(jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)))


def _scaled_dot(equation: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """einsum(equation, a, b) of FP8 operands in the form XLA's GPU compiler turns into one FP8 GEMM."""
    product = jnp.einsum(equation, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (product * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(equation: str, x: jax.Array, w: jax.Array, quantized_w: tuple | None = None) -> jax.Array:
    """einsum(equation, x, w) as an FP8 GEMM, in x's dtype; its backward two FP8 GEMMs (dX, dW), the
    weight gradient in w's dtype. `quantized_w`: w's FP8 (bits, scale) already made (a `Quantized`
    weight's), used in place of quantizing w, which is then read by nothing."""
    return _forward(equation, x, w, quantized_w)[0]


def _weight_fp8(w, quantized_w):
    if quantized_w is None:
        return quantize(w, FORWARD)
    bits, scale = quantized_w
    return jax.lax.bitcast_convert_type(bits, FORWARD), scale


def _forward(equation, x, w, quantized_w):
    qx, sx = quantize(x, FORWARD)
    qw, sw = _weight_fp8(w, quantized_w)
    # the FP8 residual kept as its bits: jax.checkpoint rounds float residuals with reduce_precision to
    # their finfo (jax 0.10.2, ad_checkpoint), whose IEEE semantics send E4M3FN's 256..448 to inf, then NaN.
    # With `quantized_w` the weight's bits are kept, not w (an empty array of w's dtype says the gradient's).
    kept_w = w if quantized_w is None else jnp.zeros((0,), w.dtype)
    residuals = (jax.lax.bitcast_convert_type(qx, jnp.uint8), sx, kept_w, quantized_w)
    return _scaled_dot(equation, qx, qw, sx * sw, x.dtype), residuals


def _backward(equation, residuals, d_out):
    """d_out has the output's dtype, which is x's. w is quantized again, to the same values."""
    qx_bits, sx, w, quantized_w = residuals
    qx = jax.lax.bitcast_convert_type(qx_bits, FORWARD)
    qw, sw = _weight_fp8(w, quantized_w)
    dx_eq, dw_eq = transposed_equations(equation)
    qd, sd = quantize(d_out, BACKWARD)
    return (_scaled_dot(dx_eq, qd, qw, sd * sw, d_out.dtype), _scaled_dot(dw_eq, qx, qd, sx * sd, w.dtype),
            None)


einsum.defvjp(_forward, _backward)
