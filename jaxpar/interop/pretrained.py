"""Assemble a run's config when its weights start from Hugging Face: the model's and the vision
tower's fields are read from the directories' config.json (and preprocessor_config.json) here, where
the run is put together, so that jaxpar.config stays plain data that imports no interop code. A VLA's
actions.instruction_tokenizer=auto is resolved here too (the LLM's tokenizer.json, or bytes).
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxpar.config import Config, ConfigError, read_config, validate


def with_pretrained_fields(config: Config) -> Config:
    """`config` with model.* from init.from_hf's (or llm_from_hf's) config.json and vision.* from
    init.vision_from_hf's; unchanged without a pretrained init. Not validated."""
    if config.init.from_hf and config.init.llm_from_hf:
        raise ConfigError("init.from_hf and init.llm_from_hf are the same setting; set one of them")
    # (imported here: the readers import model code and JAX, which a run without a pretrained init, or
    # one whose flags are wrong, never needs to start)
    if config.init.llm_dir:
        from jaxpar.interop.hf_llama import with_model_from_hf

        config = with_model_from_hf(config)
    if config.init.vision_from_hf:
        if config.model.kind != "vla":
            raise ConfigError("init.vision_from_hf needs model.kind=vla (the encoder is the VLA's)")
        from jaxpar.interop.hf_siglip import with_vision_from_hf

        config = with_vision_from_hf(config)
    if config.model.kind == "vla" and config.actions.instruction_tokenizer == "auto":
        config = dataclasses.replace(config, actions=dataclasses.replace(
            config.actions, instruction_tokenizer=instruction_tokenizer(config.init.llm_dir)))
    return config


def instruction_tokenizer(llm_dir: str) -> str:
    """actions.instruction_tokenizer=auto made concrete (jaxpar.data.instructions): the pretrained LLM's
    tokenizer.json when it has one (its instruction then means to it what text meant in pretraining),
    else UTF-8 bytes. Recorded so in config.json: rollouts and generate encode as training did."""
    path = pathlib.Path(llm_dir) / "tokenizer.json" if llm_dir else None
    return str(path.resolve()) if path is not None and path.is_file() else "bytes"


def load_run_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config of a run: `name` with its overrides and its pretrained init's fields."""
    config = with_pretrained_fields(read_config(name, overrides))
    validate(config)
    return config
