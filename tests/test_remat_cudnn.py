"""Remat with cuDNN attention (issue 28 item 5): the layer's cuDNN call (jaxpar.layers.attention.cudnn_attention)
binds jax's own kernel exactly as jax.nn.dot_product_attention(implementation="cudnn") does, and names the
residuals its backward reads, "attention_out" and "attention_stats", so the policies that keep the output keep
the statistics too, each once (jaxpar.parallel.remat). cuDNN cannot run on CPU, but it traces: these tests
read jaxprs only, with the cuDNN version check stubbed. The compiled GPU program's fMHA call counts are in
tests/test_gpu_dry_run.py (test_remat_keeps_cudnn_attentions_residuals_and_its_flops_are_counted)."""

import jax
import jax.numpy as jnp
import pytest
from jax._src import core
from jax._src.ad_checkpoint import saved_residuals

from jaxpar.layers import attention as attention_layer
from jaxpar.layers import cudnn as cudnn_layer
from jaxpar.layers.collectives import Collectives
from jaxpar.parallel import remat

B, S, D, N, K, H = 2, 16, 64, 4, 2, 16  # GQA: 4 query heads over 2 KV heads


@pytest.fixture(autouse=True)
def cudnn_traces(monkeypatch):
    """Tracing needs only the version jax's checks compare against (cuDNN 9.8); nothing is lowered."""
    monkeypatch.setattr(cudnn_layer._fmha, "check_cudnn_version", lambda: 90800)


def qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k, shape in zip(keys, [(B, S, N, H), (B, S, K, H),
                                                                                      (B, S, K, H)]))


def fmha_binds(jaxpr) -> list[tuple]:
    """(primitive, input avals, params) of every cuDNN attention bind in `jaxpr` and the jaxprs it calls."""
    out = []
    for eqn in jaxpr.eqns:
        if "dot_product_attention" in eqn.primitive.name:
            out.append((eqn.primitive.name, tuple(str(v.aval) for v in eqn.invars),
                        tuple(sorted((k, str(v)) for k, v in eqn.params.items()))))
        for sub in core.jaxprs_in_params(eqn.params):
            out += fmha_binds(sub)
    return out


@pytest.mark.parametrize("masking", ["causal", "prefix"])
def test_cudnn_attention_binds_jaxs_kernel_as_jax_does(masking):
    """Forward alone and forward + backward: the same fMHA primitives with the same operands and parameters
    (scale, mask type, layout, bias from the prefix-LM mask) as jax.nn.dot_product_attention's."""
    kwargs = dict(is_causal=True) if masking == "causal" else dict(mask=attention_layer.prefix_lm_mask(S, 5))
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kwargs)  # noqa: E731
    ours = lambda q, k, v: attention_layer.cudnn_attention(q, k, v, **kwargs)  # noqa: E731
    for transform in (lambda f: f, lambda f: jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))):
        want, got = (fmha_binds(jax.make_jaxpr(transform(f))(*qkv()).jaxpr) for f in (theirs, ours))
        assert got == want and len(got) in (1, 2)


def saved(policy_name: str) -> list[tuple[str, str]]:
    """(aval, what) of the residuals one cuDNN attention layer keeps for its backward under the policy."""
    p = {"wq": jnp.ones((D, N, H), jnp.bfloat16), "wk": jnp.ones((D, K, H), jnp.bfloat16),
         "wv": jnp.ones((D, K, H), jnp.bfloat16), "wo": jnp.ones((N, H, D), jnp.bfloat16)}
    x = jnp.ones((B, S, D), jnp.bfloat16)

    def layer(x, p):
        return attention_layer.attention(x, p, 1e4, Collectives(), implementation="cudnn").astype(jnp.float32).sum()

    policy = remat.base_policy(policy_name)
    return [(str(aval), what) for aval, what in saved_residuals(jax.checkpoint(layer, policy=policy), x, p)]


@pytest.mark.parametrize("policy", ["selective", "dots"])
def test_policies_that_keep_the_attention_output_keep_its_statistics_once(policy):
    """Kept: the output and the f32 [B, N, S] softmax statistics, once each (so the backward never runs the
    flash forward again). Without the statistics' name the policy keeps the output alone and the backward
    recomputes both; with the output named twice (inside the custom_vjp and again in the layer) it was kept
    twice."""
    kept = saved(policy)
    named = [(aval, what.split("'")[1]) for aval, what in kept if what.startswith("named 'attention_")]
    assert named == [(f"bfloat16[{B},{S},{N},{H}]", "attention_out"), (f"float32[{B},{N},{S}]", "attention_stats")]


def test_offload_moves_both_residuals_to_the_host_and_full_keeps_neither():
    """offload keeps what selective keeps, on the host: the q, k, v projections, the output and the statistics."""
    host = sorted(aval for aval, _ in saved("offload") if "<host>" in aval)
    q, kv = f"bfloat16<host>[{B},{S},{N},{H}]", f"bfloat16<host>[{B},{S},{K},{H}]"
    assert host == sorted([q, kv, kv, q, f"float32<host>[{B},{N},{S}]"])
    assert not [what for _, what in saved("full") if "attention_" in what]
