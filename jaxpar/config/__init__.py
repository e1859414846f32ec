"""jaxpar's configuration, plain data: the schema and its reading (jaxpar.config.schema) and the
validation (jaxpar.config.checks). Nothing here reads model code, JAX or a Hugging Face directory;
a run whose weights start from Hugging Face is assembled by jaxpar.interop.pretrained.load_run_config.
"""

from jaxpar.config.checks import has_evaluation, pipeline_warning, profile_steps, validate
from jaxpar.config.schema import (ATTENTION_KINDS, NAN_GUARDS, ONE_FOR_ALL, PIPELINE_SCHEDULES, REMAT_POLICIES,
                                  REPO_CONFIG_DIR, RESIZE_FILTERS, ActionConfig, CheckpointConfig, CompileConfig, Config,
                                  DataConfig, DebugConfig, EvalConfig, Fp8Config, HardwareConfig, InitConfig, MeshConfig,
                                  ModelConfig, OffloadConfig, PipelineConfig, ProfileConfig, RematConfig,
                                  TrainConfig, VisionConfig, VisionZeroConfig, ZeroConfig, carries_instruction_bytes,
                                  coerce, from_dict, image_split_ways, image_tokens, instruction_tokenizer_file,
                                  load_config_dict,
                                  nan_guard_for, parse_value, patches_per_image, read_config, resolve_config_path, schema_type,
                                  set_by_path, sums_own_images, to_dict, vla_sequence_layout)
from jaxpar.errors import ConfigError


def load_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """`name` with its overrides, validated. A pretrained init (init.from_hf / llm_from_hf /
    vision_from_hf) fills model and vision fields from its directory: load_run_config does that."""
    config = read_config(name, overrides)
    if config.init.llm_dir or config.init.vision_from_hf:
        raise ConfigError("init.*from_hf reads the Hugging Face directory's config.json; load this config with "
                          "jaxpar.interop.pretrained.load_run_config")
    validate(config)
    return config


def override_text(value) -> str:
    """`value` as `--config.KEY=VALUE` writes it for parse_value to read back: true / false, repr of a float
    (exact round trip), comma-separated tuples."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(override_text(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def differences(before: Config, after: Config) -> list[tuple[str, str]]:
    """(dotted key, override_text of its value) for every setting of `after` that differs from `before`:
    the overrides that turn one config into the other (the planner's and the preflight's suggestions)."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    old, new = flat(to_dict(before)), flat(to_dict(after))
    return [(key, override_text(value)) for key, value in new.items() if old.get(key) != value]


__all__ = [name for name in dir() if not name.startswith("_")]
