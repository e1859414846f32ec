"""The VLA's image tokens reach the LLM's layout by one all-gather (issue 46 item 4).

Each device encodes its slice of its dp shard's images (jaxpar.parallel.vision); the tokens are then
assembled on every pp / tp rank. Summing zero-padded copies moved an all-reduce's bytes (twice an
all-gather's); the all-gather's transpose is the slice each encoder's backward needs, with no
collective at all. The equivalence with one device is tests/test_vla.py's.
"""

import jax.numpy as jnp

from jaxpar.compiler import hlo_collectives
from jaxpar.config import image_tokens
from jaxpar.parallel.mesh import Layout
from jaxpar.parallel.step import StepBuilder
from test_vla import BASE, with_values


def test_image_tokens_are_all_gathered_once_and_never_summed():
    config = with_values(BASE, mesh=dict(dp=1, pp=2, tp=4), vision=dict(tp=2))
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    assert builder.vision.split_axes  # the encoder's batch is split inside the dp shard: tokens to assemble
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    tokens_bytes = (config.train.global_batch_size * image_tokens(config.vision) * config.model.d_model
                    * jnp.dtype(builder.compute_dtype).itemsize)
    rows = hlo_collectives.collectives(lowered.as_text(dialect="hlo"), builder.mesh, by_size=True)
    sized = [row for row in rows if row["bytes_each"] == tokens_bytes]
    assert [(row["op"], row["count"]) for row in sized] == [("all-gather", 1)], rows

