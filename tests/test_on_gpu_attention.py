"""The GPU lane's attention checks (issue 45): cuDNN flash attention as the layers call it
(jaxpar.layers.cudnn.cudnn_attention) against XLA's attention, and the ring's cuDNN blocks merged by their softmax
statistics (jaxpar.layers.ring's block functions) against the whole attention, forward and gradients.

Tolerance, per output (the attention output and dq, dk, dv): the error of a bf16 kernel against an fp32 reference
computed from the same bf16 inputs, ||x - ref|| / ||ref||, is at most twice the error of XLA's own bf16 attention on
those inputs, plus 2e-3 (FlashAttention's own tests use this form: no worse than the framework's bf16 path). bf16
rounding puts both near 3e-3; a wrong convention (log2 for natural-log statistics, a mask's orientation, a prefix
that is not bidirectional, a KV head given to the wrong query heads) gives errors of order 0.1 to 1. Inputs are fresh
normal draws, never zeros.

The `gpu` tests run on an NVIDIA GPU (`make test-gpu`). The same comparisons run on CPU in every `make test` with
XLA in place of cuDNN: the fp32 reference (causal, prefix-LM, GQA) against a float64 oracle written out in numpy,
and the block merge through the ring's own block functions with XLA's blocks, so the references and the merge the
GPU checks rely on cannot rot unseen.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.layers import ring
from jaxpar.layers.attention import prefix_lm_mask
from jaxpar.layers.blockwise import balanced_order, merge_blocks
from jaxpar.layers.cudnn import cudnn_attention

B, S, N = 2, 256, 8  # batch, sequence, query heads
PREFIX = 40  # the prefix-LM mask's bidirectional prefix (a VLA's image + instruction)
WAYS = 4  # the ring's cp ranks, simulated on one device
SLACK = 2e-3  # the tolerance's absolute term (module docstring)


def draw(head_dim: int, kv_heads: int, seed: int, dtype=jnp.bfloat16) -> tuple:
    """Fresh normal q [B, S, N, H], k and v [B, S, K, H], and an output cotangent [B, S, N, H]."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, S, N, head_dim), (B, S, kv_heads, head_dim), (B, S, kv_heads, head_dim), (B, S, N, head_dim)]
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(keys, shapes))


def mask_kwargs(masking: str) -> dict:
    """The layer's mask arguments: cuDNN's causal mask type, or the prefix-LM mask as a boolean mask."""
    return {"is_causal": True} if masking == "causal" else {"mask": prefix_lm_mask(S, PREFIX)}


def out_and_grads(attend, q, k, v, cotangent) -> tuple:
    """(output, dq, dk, dv) of attend(q, k, v) for the output cotangent."""
    out, pullback = jax.vjp(attend, q, k, v)
    return (out, *pullback(cotangent.astype(out.dtype)))


@functools.partial(jax.jit, static_argnames="masking")
def reference(q, k, v, g, masking: str) -> tuple:
    """fp32 XLA attention of the (bf16) inputs and its gradients: what every kernel is compared with."""
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU: the reference is fp32
        f32 = [x.astype(jnp.float32) for x in (q, k, v, g)]
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla",  # noqa: E731
                                                               **mask_kwargs(masking))
        return out_and_grads(attend, *f32)


def relative_errors(got: tuple, want: tuple) -> list[float]:
    """||got - want|| / ||want|| per output, in float64."""
    errors = []
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errors.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    return errors


def kernel_errors(kernel: str, masking: str, head_dim: int, kv_heads: int, seed: int) -> list[float]:
    """The errors of `kernel` ("cudnn" or "xla", in bf16) against the fp32 reference, per output."""
    q, k, v, g = draw(head_dim, kv_heads, seed)
    if kernel == "cudnn":
        attend = lambda q, k, v: cudnn_attention(q, k, v, **mask_kwargs(masking))  # noqa: E731
    else:
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla",  # noqa: E731
                                                               **mask_kwargs(masking))
    got = jax.jit(lambda *a: out_and_grads(attend, *a))(q, k, v, g)
    return relative_errors(got, reference(q, k, v, g, masking))


def assert_within_xla_bf16(errors: list[float], xla_errors: list[float], record) -> None:
    for name, error, xla in zip(("out", "dq", "dk", "dv"), errors, xla_errors):
        record(f"{name}_error", f"{error:.2e} (xla bf16 {xla:.2e})")
    for name, error, xla in zip(("out", "dq", "dk", "dv"), errors, xla_errors):
        assert np.isfinite(error) and error <= 2 * xla + SLACK, (
            f"{name}: relative error {error:.3e} against fp32, XLA's bf16 path {xla:.3e}: over 2 x XLA + {SLACK}")


# ----------------------------------------------------------------------------- cuDNN against XLA, on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("masking,head_dim,kv_heads", [("causal", 64, 2), ("causal", 128, 2), ("prefix", 64, 2),
                                                       ("prefix", 128, 2), ("causal", 128, 8)])
def test_cudnn_attention_matches_xla(masking, head_dim, kv_heads, record_property):
    """Forward and gradients of the layers' cuDNN call, GQA (8 query heads over 2 KV heads) and MHA."""
    errors = kernel_errors("cudnn", masking, head_dim, kv_heads, seed=1)
    xla_errors = kernel_errors("xla", masking, head_dim, kv_heads, seed=1)
    assert_within_xla_bf16(errors, xla_errors, record_property)


# ----------------------------------------------------------------------------- the ring's blocks, merged

def ring_blocks(kernel: str, q, k, v, g, prefix_len: int) -> tuple:
    """(output, dq, dk, dv) of the whole sequence computed as context parallelism computes it, on one device:
    the sequence in balanced order over WAYS ranks; each rank's queries against each rank's K / V block by the
    block's kind (jaxpar.layers.ring._Blocks on `kernel`: causal, half or late rows, never a mask), merged by
    log-sum-exp (the output cast to the input dtype, as the ring does); then each block's backward handed the
    merged output and log-sum-exp, dK / dV summed per block. With `prefix_len`, the prefix's rows are one
    unmasked attention against the prefix's keys (jaxpar.layers.attention.context_attention), the causal
    blocks' cotangent zero there."""
    blocks = ring._Blocks(kernel, S // WAYS)
    order = balanced_order(S, WAYS)
    local = S // WAYS
    positions = [order[r * local:(r + 1) * local] for r in range(WAYS)]
    take = lambda x, r: x[:, positions[r]]  # noqa: E731
    unmasked = (lambda q, k, v: cudnn_attention(q, k, v)) if kernel == "cudnn" else \
        (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))  # noqa: E731
    outs, dqs = [], []
    dks = [jnp.zeros(take(k, 0).shape, jnp.float32) for _ in range(WAYS)]
    dvs = [jnp.zeros(take(v, 0).shape, jnp.float32) for _ in range(WAYS)]
    d_prefix_k = d_prefix_v = 0.0
    for r in range(WAYS):
        sources = [((r - step) % WAYS, ring.relation((r - step) % WAYS, r)) for step in range(WAYS)]
        out = lse = None
        for source, kind in sources:
            o, lse_block = blocks.forward(kind, take(q, r), take(k, source), take(v, source))
            out, lse = (o, lse_block) if out is None else merge_blocks(out, lse, o, lse_block)
        out = out.astype(q.dtype)
        in_prefix = (positions[r] < prefix_len)[None, :, None, None]
        g_causal = jnp.where(in_prefix, 0, take(g, r))
        dq = jnp.zeros(take(q, r).shape, jnp.float32)
        for source, kind in sources:
            dq, dk_b, dv_b = blocks.backward(kind, take(q, r), take(k, source), take(v, source), out, lse, g_causal, dq)
            dks[source] = dks[source] + dk_b
            dvs[source] = dvs[source] + dv_b
        if prefix_len:
            prefix_out, pullback = jax.vjp(unmasked, take(q, r), k[:, :prefix_len], v[:, :prefix_len])
            out = jnp.where(in_prefix, prefix_out, out)
            dq_p, dk_p, dv_p = pullback(jnp.where(in_prefix, take(g, r), 0).astype(prefix_out.dtype))
            dq = dq + dq_p.astype(jnp.float32)
            d_prefix_k, d_prefix_v = d_prefix_k + dk_p.astype(jnp.float32), d_prefix_v + dv_p.astype(jnp.float32)
        outs.append(out)
        dqs.append(dq)
    inverse = np.argsort(order)  # from balanced order back to 0..S-1
    whole = lambda parts: jnp.concatenate(parts, axis=1)[:, inverse]  # noqa: E731
    dk, dv = whole(dks), whole(dvs)
    if prefix_len:
        dk, dv = dk.at[:, :prefix_len].add(d_prefix_k), dv.at[:, :prefix_len].add(d_prefix_v)
    return whole(outs), whole(dqs), dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("masking", ["causal", "prefix"])
def test_ring_blocks_on_cudnn_merge_to_whole_attention(masking, record_property):
    """cuDNN blocks and their statistics, merged, against the whole attention: the statistics' convention
    (natural-log log-sum-exp of the scaled scores), the blocks' causal and unmasked kernels (no bias), the
    prefix's rows and the merged backward."""
    q, k, v, g = draw(128, 2, seed=2)
    prefix_len = PREFIX if masking == "prefix" else 0
    got = jax.jit(lambda *a: ring_blocks("cudnn", *a, prefix_len))(q, k, v, g)
    errors = relative_errors(got, reference(q, k, v, g, masking))
    assert_within_xla_bf16(errors, kernel_errors("xla", masking, 128, 2, seed=2), record_property)


# ----------------------------------------------------------------------------- the same comparisons on CPU

def oracle(q, k, v, g, masking: str) -> tuple:
    """Attention and its gradients in float64 numpy, written out from the definitions: scores q k^T / sqrt(H),
    query head n reading KV head n // (N / K), causal (or the prefix-LM mask), softmax, weighted values."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # [B, S, N, H]
    rows, cols = np.arange(S)[:, None], np.arange(S)[None, :]
    allowed = (cols <= rows) | ((cols < PREFIX) if masking == "prefix" else False)
    scores = np.where(allowed, np.einsum("bsnh,btnh->bnst", q, k) / np.sqrt(q.shape[-1]), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnst,btnh->bsnh", probs, v)
    d_probs = np.einsum("bsnh,btnh->bnst", g, v)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("bnst,btnh->bsnh", d_scores, k)
    fold = lambda x: x.reshape(*x.shape[:2], -1, group, x.shape[-1]).sum(3)  # noqa: E731 back to KV heads
    return out, dq, fold(np.einsum("bnst,bsnh->btnh", d_scores, q)), fold(np.einsum("bnst,bsnh->btnh", probs, g))


@pytest.mark.parametrize("masking", ["causal", "prefix"])
def test_the_gpu_checks_reference_is_the_float64_oracle(masking):
    """The fp32 reference the GPU checks compare with: its masks, prefix and GQA grouping are attention's."""
    q, k, v, g = draw(64, 2, seed=3)
    errors = relative_errors(reference(q, k, v, g, masking), oracle(q, k, v, g, masking))
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("masking", ["causal", "prefix"])
def test_ring_blocks_with_xla_blocks_merge_to_whole_attention(masking):
    """The GPU check's block merge with XLA's blocks in fp32: the whole attention to fp32 rounding."""
    q, k, v, g = draw(64, 2, seed=4, dtype=jnp.float32)
    prefix_len = PREFIX if masking == "prefix" else 0
    got = jax.jit(lambda *a: ring_blocks("xla", *a, prefix_len))(q, k, v, g)
    errors = relative_errors(got, reference(q, k, v, g, masking))
    assert max(errors) < 1e-5, errors
