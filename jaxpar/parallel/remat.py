"""Activation checkpointing policies, applied per layer inside the layer scan and pipeline stages.

A policy decides which intermediates of a layer's forward are kept for its backward; everything
else is recomputed. Policies are built from the `checkpoint_name` tags in the model
(jaxpar/layers/attention.py, mlp.py), so a new policy is a list of names:

| policy      | kept for backward                                                     | recomputed                      |
|-------------|-----------------------------------------------------------------------|---------------------------------|
| `none`      | everything                                                            | nothing                         |
| `dots`      | every matmul output (the attention scores QK^T and the weighted values too) | norms, RoPE, softmax probabilities, SwiGLU |
| `selective` | linear-layer outputs (Megatron's selective recompute)                 | core attention (QK^T, softmax, xV), norms, RoPE, SwiGLU |
| `offload`   | as `selective`, but the kept tensors wait in pinned host memory       | as `selective`                  |
| `full`      | only each layer's input                                               | the whole layer                 |

ZeRO-3's all-gathered weights are never kept, whatever the policy: they are gathered again.

cuDNN flash attention (model.attention=cudnn) is one kernel whose backward reads its output and its
softmax statistics (jaxpar.layers.attention.cudnn_attention names them "attention_out" and
"attention_stats"). Every policy that keeps "attention_out" keeps the statistics with it
(ATTENTION_RESIDUALS): the pair costs one [B, S, N, H] and one f32 [B, N, S] per layer and saves
re-running the flash forward in the backward, so with cuDNN `selective` and `offload` recompute no core
attention. `dots` keeps them too: the kernel's two matmuls are the attention's dots. `full` keeps
neither and re-runs the kernel's forward, as it re-runs the whole layer.
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxpar.parallel.zero import never_keep_gathered

# Outputs of the linear layers of one decoder layer (checkpoint_name tags in the model).
LINEAR_OUTPUTS = ("query_proj", "key_proj", "value_proj", "attention_out", "attention_proj",
                  "mlp_gate", "mlp_up", "mlp_out")
# What cuDNN attention's backward reads besides q, k, v: kept together or not at all (module docstring).
ATTENTION_RESIDUALS = ("attention_out", "attention_stats")
# What `selective` and `offload` keep: the linear outputs and the attention residuals.
SELECTIVE_KEEPS = tuple(dict.fromkeys(LINEAR_OUTPUTS + ATTENTION_RESIDUALS))
POLICIES = ("none", "dots", "selective", "offload", "full")


def base_policy(name: str) -> Callable | None:
    """The jax.checkpoint policy for `name`; None means no checkpointing at all."""
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return policies.nothing_saveable
    if name == "dots":
        return policies.save_from_both_policies(policies.checkpoint_dots,
                                                policies.save_only_these_names(*ATTENTION_RESIDUALS))
    if name == "selective":
        return policies.save_only_these_names(*SELECTIVE_KEEPS)
    if name == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(SELECTIVE_KEEPS),
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"unknown remat policy '{name}'; use one of {', '.join(POLICIES)}")


def layer_policy(name: str, regathers_weights: bool) -> Callable | None:
    """`name`'s policy; with ZeRO-3 weight gathers, additionally never keep a gathered weight."""
    base = base_policy(name)
    return never_keep_gathered(base) if regathers_weights else base
