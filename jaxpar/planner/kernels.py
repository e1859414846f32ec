"""Which attention kernel the planner prices: what `attention=auto` picks on the target GPU.

Why it matters: cuDNN flash attention never writes the [b, h, s, s] scores to memory. With XLA's
attention they are the largest temporaries of a layer's backward (fp32 scores, probabilities and
their cotangents) and, without remat, the largest saved activations; at a few thousand tokens they
decide whether a layout fits and make the step memory-bound. The planner asks the same question the
trainer does (jaxpar.compiler.attention_choice, for the profile's compute capability and a cuDNN of at least
9.8, which jax's CUDA plugin ships), so a planned layout prices the kernel a run would get.
XLA:CPU has no cuDNN: `target="cpu"` prices XLA's attention everywhere.
"""

from __future__ import annotations

import dataclasses

from jaxpar.compiler.attention_choice import Accelerator, choose_attention
from jaxpar.config import Config

CUDNN_VERSION = 90800  # the oldest cuDNN jax 0.10's CUDA plugin accepts


def resolve(config: Config, target: str = "gpu", compute_capability: float = 9.0) -> Config:
    """`config` with model.attention (and vision.attention) set to the kernel a run on the target
    would use: "xla" everywhere on XLA:CPU, what `auto` picks on a GPU of `compute_capability`
    (8.0 A100, 9.0 H100 / H200). A kernel already chosen stays; an impossible explicit cudnn is a
    ConfigError, as at training time."""
    if target == "cpu":
        return dataclasses.replace(config, model=dataclasses.replace(config.model, attention="xla"),
                                   vision=dataclasses.replace(config.vision, attention="xla"))
    major, minor = int(compute_capability), int(round(compute_capability * 10)) % 10
    return choose_attention(config, Accelerator("gpu", f"sm{major}{minor}", (major, minor), CUDNN_VERSION))[0]
