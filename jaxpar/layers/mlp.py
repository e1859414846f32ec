"""SwiGLU MLP, Megatron layout: gate/up column-parallel (no collective), down row-parallel (one all-reduce)."""

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers.collectives import Collectives


def swiglu_mlp(x_BxSxD: jax.Array, p: dict, coll: Collectives) -> jax.Array:
    """p: w_gate / w_up [D, F], w_down [F, D] (F: this tp rank's slice of d_ff)."""
    gate_BxSxF = checkpoint_name(coll.linear("bsd,df->bsf", x_BxSxD, p["w_gate"]), "mlp_gate")
    up_BxSxF = checkpoint_name(coll.linear("bsd,df->bsf", x_BxSxD, p["w_up"]), "mlp_up")
    hidden_BxSxF = jax.nn.silu(gate_BxSxF) * up_BxSxF
    out_BxSxD = coll.linear("bsf,fd->bsd", hidden_BxSxF, p["w_down"])
    return checkpoint_name(coll.row_parallel_sum(out_BxSxD), "mlp_out")
