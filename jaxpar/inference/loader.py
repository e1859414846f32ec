"""A trained run, read back: its weights on one device (whatever layout wrote them), its tokenizer
and the ids its sequences end with. Shared by generation (jaxpar.inference.generate), rollouts
(jaxpar.robot.rollout) and the Hugging Face export (jaxpar.export).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxpar.errors import ConfigError


def single_device(config):
    """`config` on one device: the checkpoint reshards onto it whatever layout wrote it."""
    from jaxpar.config import MeshConfig, PipelineConfig, ZeroConfig

    return dataclasses.replace(config, mesh=MeshConfig(), zero=ZeroConfig(), pipeline=PipelineConfig(),
                               offload=dataclasses.replace(config.offload, optimizer=False))


def restore_weights(workdir: pathlib.Path, step: int | None = None):
    """(the run's Config, its step, its weights as host numpy, the LLM's in model layer order; a VLA's
    include "vit" and "projector") from `workdir`'s checkpoint of `step` (default: the latest),
    whatever layout wrote it."""
    if not (workdir / "config.json").is_file():
        raise ConfigError(f"{workdir}/config.json not found; --workdir must be a jaxpar run's directory")
    from jaxpar.config import Config, from_dict

    config = from_dict(Config, json.loads((workdir / "config.json").read_text()))
    single = single_device(config)

    import jax

    from jaxpar.models import llama, vit
    from jaxpar.parallel.checkpoint import Checkpointer
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    builder = StepBuilder(single, Layout.for_config(single).make_mesh())
    checkpoints = Checkpointer(workdir, single)
    steps = checkpoints.all_steps()
    if not steps:
        raise ConfigError(f"{checkpoints.directory} has no checkpoint")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step} is not among the checkpoints {sorted(steps)}")
    abstract = builder.abstract_state()
    field = "master" if abstract.master is not None else "params"
    weights, step = checkpoints.restore_weights(field, getattr(abstract, field), step)
    checkpoints.close()
    weights = builder.to_model_order(jax.device_get(weights))
    weights["layers"].pop(llama.FP8_LIVES, None)  # fp8.recipe=delayed's counters: training state, not weights
    weights = vit.without_fp8_lives(weights)  # (a VLA's encoder's and projector's)
    return config, step, weights


def run_tokenizer_file(config) -> pathlib.Path | None:
    """The tokenizer file the run's training data was made with (None: bytes, or synthetic data)."""
    meta = pathlib.Path(config.data.train) / "meta.json" if config.data.train else None
    if meta is None or not meta.is_file():
        return None
    spec = json.loads(meta.read_text()).get("tokenizer", "byte")
    return None if spec == "byte" else pathlib.Path(spec)


def run_tokenizer(config):
    """The run's tokenizer, encoding as its training text was encoded (jaxpar.data.text.split_tokenizer);
    bytes for a text run whose split holds no meta.json; None for synthetic data."""
    from jaxpar.data.text import ByteTokenizer, split_tokenizer

    if not config.data.train:
        return None
    return split_tokenizer(pathlib.Path(config.data.train)) or ByteTokenizer()


def hf_eos_ids(directory) -> list[int]:
    """A Hugging Face directory's end-of-sequence ids as transformers' generate reads them:
    generation_config.json's `eos_token_id` when that file exists (one id or a list, e.g.
    Llama-3-Instruct's <|end_of_text|> and <|eot_id|>), else config.json's."""
    directory = pathlib.Path(directory)
    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            eos = json.loads((directory / name).read_text()).get("eos_token_id")
            return [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
    return []


def run_eos_ids(config, tokenizer) -> list[int]:
    """The ids a run's sequences end with: the end-of-document id its text was separated by, then,
    when its text was tokenized with the tokenizer of the Hugging Face model it started from
    (init.from_hf), that model's own ids (an Instruct model still ends its turns with them). With any
    other tokenizer those ids would name other tokens, so they are left out."""
    ids = [int(tokenizer.eos_id)] if getattr(tokenizer, "eos_id", None) is not None else []
    init = pathlib.Path(config.init.llm_dir) if config.init.llm_dir else None
    file = run_tokenizer_file(config)
    if init is not None and file is not None and file.is_file() and (init / "tokenizer.json").is_file():
        if file.read_bytes() == (init / "tokenizer.json").read_bytes():
            ids += [i for i in hf_eos_ids(init) if i not in ids]
    return ids
