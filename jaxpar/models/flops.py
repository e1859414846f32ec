"""The model FLOPs of one training step (6N + attention), what MFU divides by: analytic, from the
config, per model part (jaxpar.models.llama.flops_per_token, jaxpar.models.vit.flops_per_image_set).
The FLOPs a compiled program executes are counted from its HLO instead (jaxpar.compiler.hlo_flops).
"""

from __future__ import annotations

from jaxpar.models import llama, vit


def model_flops_per_step(config, seq_len: int) -> float:
    """Analytic training FLOPs of one step: the LLM over `seq_len` tokens per example, plus the
    vision encoder and projector of a VLA."""
    batch = config.train.global_batch_size
    flops = llama.flops_per_token(config.model, seq_len) * batch * seq_len
    if config.model.kind == "vla":
        flops += vit.flops_per_image_set(config.vision, config.model.d_model) * batch
    return flops
