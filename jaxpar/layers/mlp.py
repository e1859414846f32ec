"""SwiGLU MLP, Megatron layout: gate/up column-parallel (no collective), down row-parallel (one all-reduce).

Under sequence parallelism the input's all-gather and the output's reduce-scatter are Collectives'
(column_linears, row_linear), collective matmuls where it says so (jaxpar.layers.collective_matmul)."""

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers.collectives import Collectives


def swiglu_mlp(x_BxSxD: jax.Array, p: dict, coll: Collectives) -> jax.Array:
    """p: w_gate / w_up [D, F], w_down [F, D] (F: this tp rank's slice of d_ff). `x_BxSxD` from
    Collectives.enter_block (with collective matmul still the sequence shard: column_linears gathers it)."""
    gate_BxSxF, up_BxSxF = coll.column_linears(x_BxSxD, [("bsd,df->bsf", p["w_gate"]), ("bsd,df->bsf", p["w_up"])])
    gate_BxSxF, up_BxSxF = checkpoint_name(gate_BxSxF, "mlp_gate"), checkpoint_name(up_BxSxF, "mlp_up")
    hidden_BxSxF = jax.nn.silu(gate_BxSxF) * up_BxSxF
    return checkpoint_name(coll.row_linear("bsf,fd->bsd", hidden_BxSxF, p["w_down"]), "mlp_out")
