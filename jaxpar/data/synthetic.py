"""Deterministic synthetic token batches that a model can learn from.

Each sequence is an arithmetic progression modulo the vocabulary with a random start and stride:
predicting the next token needs the stride, which the model must infer in context, so the loss
falls well below log(vocab) within a few dozen steps. Batch `step` depends only on (seed, step),
so every layout and every resume sees the same data.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.errors import ConfigError

MAX_STRIDE = 8


def synthetic_tokens(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int) -> np.ndarray:
    """[batch_size, seq_len + 1] int32 tokens for optimizer step `step`."""
    rng = np.random.default_rng([seed, step])
    start_B1 = rng.integers(0, vocab_size, (batch_size, 1))
    stride_B1 = rng.integers(1, MAX_STRIDE + 1, (batch_size, 1))
    positions_1xT = np.arange(seq_len + 1)[None, :]
    return ((start_B1 + stride_B1 * positions_1xT) % vocab_size).astype(np.int32)


def synthetic_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    tokens = synthetic_tokens(seed, step, batch_size, seq_len, vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": np.ones((batch_size, seq_len), np.float32)}


class SyntheticData:
    """Yields global batches placed in the mesh's batch layout. Every process builds the (small,
    synthetic) global batch on the host and hands JAX only the rows its devices hold. Same interface
    as jaxpar.data.pipeline.GrainData; the state is the next step's index."""

    def __init__(self, config, sharding):
        self.config, self.sharding, self.step = config, sharding, 0

    def host_batch(self, step: int) -> dict:
        train, model = self.config.train, self.config.model
        if model.kind == "vla":
            from jaxpar.models import vla

            return vla.synthetic_batch(self.config, step, train.global_batch_size)
        return synthetic_batch(train.seed, step, train.global_batch_size, train.seq_len, model.vocab_size)

    def batch(self, step: int) -> dict:
        return {k: jax.make_array_from_callback(v.shape, self.sharding, lambda idx, v=v: v[idx])
                for k, v in self.host_batch(step).items()}

    def check_agreement(self) -> None:
        """Nothing to compare across processes: a batch is a function of (seed, step) in this code."""

    def next_batch(self) -> dict:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"synthetic_step": self.step}

    def set_state(self, state: dict) -> None:
        if "synthetic_step" not in state:
            raise ConfigError("the checkpoint was written with data.train set (grain data); resume with the "
                              "original data.train or use a fresh --workdir")
        self.step = state["synthetic_step"]
