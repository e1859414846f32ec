"""The MLP block on its tokens as one row (jaxpar.models.llama.per_token_block, issue 46).

Why it matters: under sequence parallelism a tp all-gather of [B, S/tp, D] along S lands [S, B, D] on
GPUs and XLA transposes it (and the output back before the reduce-scatter): on vla70b ~0.02 s of a 1.19 s
step (docs/design.md, "Where vla70b's GPU step goes"). As one row [1, B S/tp, D] the gather and scatter
move whole rows. Equality with one device is the sequence-parallel tests' (tests/test_sequence_parallel.py);
here: the reshape is exact for a per-token block, and the compiled step's MLP gathers are rows.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from conftest import builder_for, make_config
from jaxpar.compiler.dry_run import compile_step
from jaxpar.models import llama
from test_sequence_parallel import with_sp


def test_a_per_token_block_sees_the_same_tokens_and_returns_them_in_place():
    x = jax.random.normal(jax.random.key(0), (3, 5, 4))
    w = jax.random.normal(jax.random.key(1), (4, 4))
    seen = []

    def block(h):
        seen.append(h.shape)
        return jnp.tanh(h @ w) * jnp.arange(h.shape[1])[None, :, None]  # the position in the row marks each token

    out = llama.per_token_block(block, x)
    assert seen == [(1, 15, 4)]
    rows = np.arange(15).reshape(3, 5)[:, :, None]  # the row position of token (b, s): b * S + s
    np.testing.assert_allclose(out, jnp.tanh(x @ w) * rows, rtol=1e-6)


def test_under_sequence_parallelism_the_mlp_gathers_and_scatters_whole_rows():
    """tp 4, B = 8, S = 64: the MLP gathers [1, B S/tp, D] into [1, B S, D] and its row linear
    reduce-scatters into [1, B S/tp, D] (forward and backward); the attention block's stay
    [B, S/tp, D] <-> [B, S, D] (RoPE and the scores need [B, S]). The layers are a scan: each collective
    appears once in the text whatever the layer count."""
    config = with_sp(make_config(tp=4, seq_len=64, global_batch_size=8))
    builder = builder_for(config)
    lowered, _, _ = compile_step(builder, builder.abstract_state())
    text = lowered.as_text(dialect="hlo")
    d, b, s, tp = config.model.d_model, 8, 64, 4
    gathered = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather\(", text)
    scattered = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} reduce-scatter\(", text)
    assert gathered.count(f"1,{b * s},{d}") == 2, gathered  # the MLP's input, forward and backward
    assert scattered.count(f"1,{b * s // tp},{d}") == 2, scattered  # its output and its input's gradient
    assert f"{b},{s},{d}" in gathered, gathered  # the attention block's
