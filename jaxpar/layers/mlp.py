"""SwiGLU MLP, Megatron layout: gate/up column-parallel (no collective), down row-parallel (one all-reduce).

Under sequence parallelism the input's all-gather and the output's reduce-scatter are Collectives'
(column_linears, row_linear), collective matmuls where it says so (jaxpar.layers.collective_matmul).

The activation silu(gate) * up has its own backward (`swiglu`): it keeps gate and up, the two GEMM
outputs, and recomputes the sigmoid in the backward, as a fused SwiGLU kernel does (Transformer
Engine's). JAX's autodiff of the same formula keeps the sigmoid, the SiLU and their products too: without
remat the GPU-compiled llama7b kept six [tokens, d_ff / tp] tensors per layer where gate, up and the
down projection's input (the hidden, its weight gradient's operand) suffice (docs/design.md, "Fused
backward rules")."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers.collectives import Collectives


def swiglu_mlp(x_BxSxD: jax.Array, p: dict, coll: Collectives) -> jax.Array:
    """p: w_gate / w_up [D, F], w_down [F, D] (F: this tp rank's slice of d_ff). `x_BxSxD` from
    Collectives.enter_block (with collective matmul still the sequence shard: column_linears gathers it)."""
    gate_BxSxF, up_BxSxF = coll.column_linears(x_BxSxD, [("bsd,df->bsf", p["w_gate"]), ("bsd,df->bsf", p["w_up"])])
    gate_BxSxF, up_BxSxF = checkpoint_name(gate_BxSxF, "mlp_gate"), checkpoint_name(up_BxSxF, "mlp_up")
    hidden_BxSxF = swiglu(gate_BxSxF, up_BxSxF)
    return checkpoint_name(coll.row_linear("bsf,fd->bsd", hidden_BxSxF, p["w_down"]), "mlp_out")


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in the inputs' dtype (the forward is jax.nn.silu's, to the bit)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(residuals, d_hidden):
    """d up = dh silu(g); d gate = dh up s (1 + g (1 - s)), s = sigmoid(g): in fp32, cast back."""
    gate, up = residuals
    g32, u32, dh32 = (t.astype(jnp.float32) for t in (gate, up, d_hidden))
    sig = jax.nn.sigmoid(g32)
    d_gate = dh32 * u32 * sig * (1 + g32 * (1 - sig))
    return d_gate.astype(gate.dtype), (dh32 * g32 * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
