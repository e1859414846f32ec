"""How the VLA's image tokens reach the LLM (issue 46 item 4).

Each device encodes its slice of its dp shard's images (jaxpar.parallel.vision). Without a pipeline the
tokens are assembled on every tp rank by one all-gather (summing zero-padded copies moved an
all-reduce's bytes, twice an all-gather's). With a pipeline the first input is already a sum over the
vocabulary split (pp x tp): each rank adds its own images' tokens to that sum (vla.llm_inputs_summed),
so no rank ever holds the whole batch's tokens and nothing is gathered before the first tick; under
sequence parallelism the sum is a reduce-scatter over tp, then an all-reduce over pp of one shard.
The equivalence with one device is tests/test_vla.py's.
"""

import jax.numpy as jnp
import numpy as np

from jaxpar.compiler import hlo_collectives
from jaxpar.config import image_tokens, vla_sequence_layout
from jaxpar.parallel.mesh import Layout
from jaxpar.parallel.step import StepBuilder
from test_vla import BASE, with_values


def _collectives(config):
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    assert builder.vision.split_axes  # the encoder's batch is split inside the dp shard: tokens to assemble
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    return builder, hlo_collectives.collectives(lowered.as_text(dialect="hlo"), builder.mesh, by_size=True)


def test_without_a_pipeline_image_tokens_are_all_gathered_once_and_never_summed():
    config = with_values(BASE, mesh=dict(dp=2, pp=1, tp=4), vision=dict(tp=2), pipeline=dict(microbatches=1))
    builder, rows = _collectives(config)
    assert not builder.sums_own_images
    tokens_bytes = (config.train.global_batch_size // 2 * image_tokens(config.vision) * config.model.d_model
                    * jnp.dtype(builder.compute_dtype).itemsize)
    split = "+".join(builder.vision.split_axes)  # (ZeRO's dp gathers of weights may have the same size)
    sized = [row for row in rows if row["bytes_each"] == tokens_bytes and row["axis"] == split]
    assert [(row["op"], row["count"]) for row in sized] == [("all-gather", 1)], rows


def test_a_pipeline_sums_each_ranks_own_image_tokens_into_the_first_input(monkeypatch):
    """The program against the same step with the tokens all-gathered first (sums_own_images off): exactly
    these collectives differ, for m microbatches of b sequences of S = I image + T text tokens, width D."""
    config = with_values(BASE, mesh=dict(dp=1, pp=2, tp=4, sequence_parallel=True), vision=dict(tp=4),
                         actions=dict(instruction_len=14))
    builder, own = _collectives(config)
    assert builder.sums_own_images
    monkeypatch.setattr(StepBuilder, "sums_own_images", property(lambda self: False))
    _, gathered = _collectives(config)
    m, (n_image, _, seq) = config.pipeline.microbatches, vla_sequence_layout(config)
    n_text = seq - n_image  # instruction and action tokens
    ways = int(np.prod(builder.vision.split_sizes))  # the images' split inside the dp shard
    size = jnp.dtype(builder.compute_dtype).itemsize * config.model.d_model
    b = config.train.global_batch_size // m
    counts = lambda rows: {(r["op"], r["axis"], r["bytes_each"]): r["count"] for r in rows}  # noqa: E731
    own, gathered = counts(own), counts(gathered)
    diff = {k: own.get(k, 0) - gathered.get(k, 0) for k in set(own) | set(gathered) if own.get(k) != gathered.get(k)}
    assert diff == {
        ("all-gather", "pp", m * b * n_image * size): -1,  # every image's tokens to every stage: gone
        ("all-reduce", "pp+tp", b * n_text * size): -m,  # the text's vocabulary sum: now part of ...
        ("reduce-scatter", "tp", b * seq * size): m,  # ... the whole sequence's, scattered over tp
        ("all-reduce", "pp", b * seq * size // 4): m,  # then one shard summed over the stages
        ("all-gather", "tp", b * seq * size): m,  # backward: the scatter's transpose
        ("all-reduce", "tp", b * seq * size): -m,  # which replaces the sequence shard's
        # the image part's cotangent from the tp rank that added it: once, for this rank's own images
        ("all-reduce", "tp", m * b // ways * n_image * size): 1,
    }, diff
