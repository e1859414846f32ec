"""Config schema, loading, overrides and validation (in-process; no JAX compilation)."""

import dataclasses
import json
import pathlib
import textwrap
import typing

import pytest

from jaxpar import config as C
from jaxpar.config import (Config, ConfigError, MeshConfig, ModelConfig, TrainConfig, ZeroConfig, from_dict, pipeline_warning,
                           load_config, load_config_dict, parse_value, resolve_config_path, to_dict, validate)

# The CLI surface the issue requires, frozen (as torchtitan freezes its flags): renaming or retyping any of
# these breaks every user's command line and config file.
REQUIRED_KEYS = {
    "mesh.dp": int, "mesh.pp": int, "mesh.tp": int, "zero.stage": int, "precision": str,
    "train.steps": int, "train.global_batch_size": int, "train.seq_len": int, "train.seed": int, "train.lr": float,
    "model.vocab_size": int, "model.d_model": int, "model.n_layers": int, "model.n_heads": int,
    "model.n_kv_heads": int, "model.d_ff": int,
}
# Every other key of today's schema; changing this set is an interface change: update it deliberately.
OTHER_KEYS = {
    "train.warmup_steps": int, "train.min_lr_ratio": float, "train.weight_decay": float, "train.b1": float,
    "train.b2": float, "train.eps": float, "train.grad_clip": float, "train.grad_accum": int, "train.log_every": int,
    "model.rope_theta": float, "model.norm_eps": float, "model.init_std": float, "remat.policy": str,
    "hardware.peak_tflops": float, "hardware.memory_gb": float, "pipeline.schedule": str, "pipeline.microbatches": int,
    "pipeline.virtual_stages": int, "pipeline.stage_recompute": bool,
    "offload.optimizer": bool, "offload.master_weights": bool, "offload.params": bool, "offload.update": str,
    "model.kind": str, "model.prefix_lm": bool, "model.text_loss": bool,
    "vision.image_size": int, "vision.patch_size": int, "vision.channels": int, "vision.cameras": int,
    "vision.width": int, "vision.depth": int, "vision.n_heads": int, "vision.mlp_dim": int,
    "vision.projector_dim": int, "vision.pos_init": str, "vision.film": bool, "vision.tp": int, "vision.zero.stage": int, "vision.remat.policy": str,
    "actions.dims": int, "actions.chunk": int, "actions.execute": int, "actions.head": str, "actions.flow_steps": int, "actions.bins": int, "actions.low": float, "actions.high": float,
    "actions.instruction_len": int, "actions.instruction_tokenizer": str, "checkpoint.every": int, "checkpoint.keep": int, "debug.nan_at_step": int,
    "train.on_nan": str, "train.nan_guard": str, "data.train": str, "data.eval": str, "data.generate": bool, "data.workers": int,
    "eval.every": int, "eval.batches": int,
    "mesh.sequence_parallel": bool, "mesh.cp": int, "mesh.cp_strategy": str, "mesh.collective_matmul": str, "grad_reduce": str, "zero.prefetch": bool, "init.from_hf": str, "init.llm_from_hf": str, "init.vision_from_hf": str,
    "model.rope_scaling_factor": float, "model.rope_low_freq_factor": float, "model.rope_high_freq_factor": float,
    "model.rope_original_max_len": int, "model.max_position": int, "vision.bias": bool,
    "model.attention": str, "vision.attention": str, "profile.steps": str,
    "actions.normalization": str, "actions.q01": tuple[float, ...], "actions.q99": tuple[float, ...],
    "data.cameras": tuple[str, ...], "data.eval_episodes": int, "eval.rollouts": int, "data.demo_format": str,
    "data.prefetch": int, "data.frame_cache_mb": int,
    "compile.cache_dir": str, "fp8.recipe": str, "fp8.amax_history": int, "fp8.zero3_gather": str,
    "vision.image_mean": tuple[float, ...], "vision.image_std": tuple[float, ...], "vision.resize": str,
    "vision.state_dims": int, "vision.state_low": tuple[float, ...], "vision.state_high": tuple[float, ...],
}


def schema_keys(cls=Config, prefix=""):
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out.update(schema_keys(hint, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = hint
    return out


def with_values(config: Config, **dotted) -> Config:
    """`config` with `group__key=value` replaced (e.g. model__d_ff=250) or a top-level key (precision=...)."""
    for key, value in dotted.items():
        if "__" in key:
            group, leaf = key.split("__")
            config = dataclasses.replace(config, **{group: dataclasses.replace(getattr(config, group), **{leaf: value})})
        else:
            config = dataclasses.replace(config, **{key: value})
    return config


# A valid layout shaped like configs/llama_tiny.py: dp=2 x tp=4.
BASE = Config(mesh=MeshConfig(dp=2, pp=1, tp=4), zero=ZeroConfig(stage=0),
              train=TrainConfig(global_batch_size=16, seq_len=64),
              model=ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256))


# ----------------------------------------------------------------------------- the frozen key surface


def test_required_keys_exist_with_their_types():
    keys = schema_keys()
    assert {k: keys.get(k) for k in REQUIRED_KEYS} == REQUIRED_KEYS


def test_whole_key_surface_is_frozen():
    assert schema_keys() == {**REQUIRED_KEYS, **OTHER_KEYS}


def test_every_required_key_is_settable_by_override_and_typed_by_the_schema():
    values = {"mesh.dp": "1", "mesh.pp": "1", "mesh.tp": "2", "zero.stage": "2", "precision": "bf16",
              "train.steps": "7", "train.global_batch_size": "32", "train.seq_len": "32", "train.seed": "3",
              "train.lr": "1", "model.vocab_size": "512", "model.d_model": "128", "model.n_layers": "4",
              "model.n_heads": "8", "model.n_kv_heads": "2", "model.d_ff": "512"}
    assert set(values) == set(REQUIRED_KEYS)
    config = load_config("llama_tiny", [f"{k}={v}" for k, v in values.items()])
    for key, text in values.items():
        group, _, leaf = key.rpartition(".")
        value = getattr(getattr(config, group) if group else config, leaf)
        assert type(value) is REQUIRED_KEYS[key], key
        assert value == REQUIRED_KEYS[key](text), key
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)  # "1" for a float key is a float


def test_overrides_leave_other_keys_from_the_file():
    config = load_config("llama_tiny.py", ["mesh.tp=2", "train.lr=1e-2"])
    assert (config.mesh.dp, config.mesh.tp, config.train.lr) == (2, 2, 0.01)
    assert config.model.d_ff == 256 and config.zero.stage == 1 and config.train.warmup_steps == 30


def test_later_override_wins():
    assert load_config("llama_tiny", ["train.steps=3", "train.steps=4"]).train.steps == 4


def test_compile_cache_dir_defaults_per_user_and_empty_turns_it_off(tmp_path):
    """compile.cache_dir (jaxpar.train.enable_compilation_cache): "~" is kept in the config (and config.json)
    and expanded at start; "" from the command line or a config file is the empty string, not a missing value."""
    assert load_config("llama_tiny").compile.cache_dir == "~/.cache/jaxpar/xla"
    assert load_config("llama_tiny", ["compile.cache_dir="]).compile.cache_dir == ""
    assert load_config("llama_tiny", ["compile.cache_dir=/scratch/xla"]).compile.cache_dir == "/scratch/xla"
    path = tmp_path / "no_cache.py"
    path.write_text("def get_config():\n    return {'compile': {'cache_dir': ''}}\n")
    assert load_config(str(path)).compile.cache_dir == ""
    path.write_text("def get_config():\n    return {'compile': {'cache_dir': None}}\n")
    with pytest.raises(ConfigError, match="config key 'compile.cache_dir' must be a str"):
        load_config(str(path))


# ----------------------------------------------------------------------------- parsing single values


@pytest.mark.parametrize("text,field_type,expected", [
    ("12", int, 12), ("-3", int, -3), ("1e-3", float, 1e-3), ("2", float, 2.0), ("bf16", str, "bf16"),
    ("true", bool, True), ("False", bool, False), ("1", bool, True), ("0", bool, False),
])
def test_parse_value_types(text, field_type, expected):
    value = parse_value(text, field_type, "some.key")
    assert value == expected and type(value) is field_type


def test_list_keys_take_comma_separated_values_and_lists_from_a_file():
    assert parse_value("-1.5, 2,3e-1", tuple[float, ...], "actions.q01") == (-1.5, 2.0, 0.3)
    assert parse_value("", tuple[str, ...], "data.cameras") == ()
    config = load_config("vla_tiny", ["data.cameras=observation.images.top,observation.images.wrist"])
    assert config.data.cameras == ("observation.images.top", "observation.images.wrist")
    with pytest.raises(ConfigError, match="actions.q01=one: expected a comma-separated list of floats"):
        parse_value("one", tuple[float, ...], "actions.q01")
    with pytest.raises(ConfigError, match="'actions.q01' must be a list of floats"):
        from_dict(Config, {"actions": {"q01": 0.5}})


@pytest.mark.parametrize("overrides,message", [
    (["actions.normalization=minmax"], "actions.normalization='minmax' is unknown"),
    (["actions.normalization=quantile", "actions.q01=0,0,0"], "3 / 0 values for actions.dims=7"),
    (["actions.normalization=bounds", "actions.q01=0,0,0,0,0,0,0", "actions.q99=1,1,1,1,1,1,1"],
     "normalization=bounds"),
    (["actions.q01=0,0,0,0,0,0,2", "actions.q99=1,1,1,1,1,1,1"], "q01 must be <= actions.q99"),
    (["data.eval_episodes=5"], "both name held-out data"),
    (["data.eval_episodes=-1"], "must be >= 0"),
])
def test_action_range_and_held_out_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vla_tiny", overrides)


def test_rollouts_and_cameras_need_a_vla():
    with pytest.raises(ConfigError, match="eval.rollouts runs the VLA"):
        load_config("llama_tiny", ["eval.rollouts=4"])
    with pytest.raises(ConfigError, match="data.cameras picks a VLA's cameras"):
        load_config("llama_tiny", ["data.cameras=a"])


@pytest.mark.parametrize("text,field_type,type_word", [
    ("2.5", int, "an int"), ("two", int, "an int"), ("", int, "an int"), ("fast", float, "a float"),
    ("yes", bool, "a bool"),
])
def test_parse_value_rejects_with_the_key(text, field_type, type_word):
    with pytest.raises(ConfigError) as err:
        parse_value(text, field_type, "mesh.tp")
    assert f"--config.mesh.tp={text}" in str(err.value) and type_word in str(err.value)


@pytest.mark.parametrize("override,expected", [
    ("model.d_modle=64", "'model.d_modle'"),
    ("optim.lr=1", "'optim.lr'"),
    ("mesh.tp.x=1", "'mesh.tp.x'"),
    ("precision.x=1", "'precision.x'"),
    ("mesh.tp", "--config.mesh.tp=VALUE"),
    ("mesh=3", "--config.mesh.KEY=VALUE"),
    ("mesh.tp=four", "an int"),
])
def test_bad_overrides(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("llama_tiny", [override])
    assert expected in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- from_dict


@pytest.mark.parametrize("tree,key", [
    ({"model": {"d_modle": 64}}, "'model.d_modle'"),
    ({"optimizer": {"lr": 1.0}}, "'optimizer'"),
    ({"train": {"steps": 5, "learning_rate": 1.0}}, "'train.learning_rate'"),
    ({"prcision": "bf16"}, "'prcision'"),
])
def test_from_dict_rejects_unknown_keys_with_the_dotted_key(tree, key):
    with pytest.raises(ConfigError, match="unknown config key") as err:
        from_dict(Config, tree)
    assert key in str(err.value)


@pytest.mark.parametrize("tree,key", [
    ({"train": {"steps": 1.5}}, "train.steps"),
    ({"train": {"steps": "10"}}, "train.steps"),
    ({"mesh": {"tp": True}}, "mesh.tp"),
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"precision": 16}, "precision"),
    ({"mesh": 4}, "mesh"),
])
def test_from_dict_rejects_wrong_types_with_the_key(tree, key):
    with pytest.raises(ConfigError) as err:
        from_dict(Config, tree)
    assert f"'{key}'" in str(err.value)


def test_from_dict_types_and_round_trip():
    config = from_dict(Config, {"mesh": {"tp": 2}, "train": {"lr": 1}, "precision": "bf16"})
    assert config.mesh == MeshConfig(dp=1, pp=1, tp=2) and config.precision == "bf16"
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert from_dict(Config, to_dict(BASE)) == BASE


# ----------------------------------------------------------------------------- validate


def test_base_layout_is_valid():
    validate(BASE)  # so each case below fails for its own reason


@pytest.mark.parametrize("mesh,stage", [((1, 1, 4), 0), ((8, 1, 1), 3), ((2, 1, 4), 1), ((4, 1, 2), 2)])
def test_valid_layouts_pass(mesh, stage):
    dp, pp, tp = mesh
    validate(with_values(BASE, mesh__dp=dp, mesh__pp=pp, mesh__tp=tp, zero__stage=stage))


LAYOUT_MISTAKES = {
    # id: (changes, substrings the one-line message must contain: the key(s) and the fix)
    "tp_n_heads": (dict(mesh__tp=3), ["mesh.tp=3", "model.n_heads=4", "choose a tp"]),
    "tp_n_kv_heads": (dict(model__d_model=96, model__n_heads=12, model__n_kv_heads=6),
                      ["mesh.tp=4", "model.n_kv_heads=6", "one must divide the other"]),
    "tp_d_ff": (dict(model__d_ff=250), ["mesh.tp=4", "model.d_ff=250", "choose a tp"]),
    "tp_vocab": (dict(model__vocab_size=250), ["mesh.tp=4", "model.vocab_size=250", "choose a tp"]),
    "batch_dp": (dict(train__global_batch_size=15), ["train.global_batch_size=15", "mesh.dp", "multiple of 2"]),
    "batch_accum": (dict(train__grad_accum=3), ["train.global_batch_size=16", "train.grad_accum", "multiple of 6"]),
    "zero_stage_4": (dict(zero__stage=4), ["zero.stage=4", "0, 1, 2 or 3"]),
    "zero_stage_neg": (dict(zero__stage=-1), ["zero.stage=-1", "0, 1, 2 or 3"]),
    "pp_n_layers": (dict(mesh__pp=3), ["mesh.pp=3", "model.n_layers=2", "divides"]),
    "precision": (dict(precision="fp16"), ["precision='fp16'", "fp32, bf16 or fp8"]),
    "remat": (dict(remat=C.RematConfig(policy="some")), ["remat.policy='some'", "none"]),
    "dp_zero": (dict(mesh__dp=0), ["mesh.dp=0", ">= 1"]),
    "heads_d_model": (dict(model__d_model=66), ["model.d_model=66", "model.n_heads=4"]),
    "odd_head_dim": (dict(model__d_model=60), ["model.d_model", "even head_dim"]),
    "gqa_groups": (dict(model__n_heads=8, model__n_kv_heads=3, mesh__tp=1), ["model.n_heads=8", "model.n_kv_heads=3"]),
    "zero_dp_d_model": (dict(zero__stage=1, mesh__dp=3, train__global_batch_size=24),
                        ["zero.stage=1", "mesh.dp=3", "model.d_model=64"]),
    # Zero/negative sizes must be refused before any check divides by them (they used to raise ZeroDivisionError).
    "grad_accum_0": (dict(train__grad_accum=0), ["train.grad_accum=0", ">= 1"]),
    "n_kv_heads_0": (dict(model__n_kv_heads=0), ["model.n_kv_heads=0", ">= 1"]),
    "n_heads_0": (dict(model__n_heads=0), ["model.n_heads=0", ">= 1"]),
    "batch_0": (dict(train__global_batch_size=0), ["train.global_batch_size=0", ">= 1"]),
    "vocab_neg": (dict(model__vocab_size=-4), ["model.vocab_size=-4", ">= 1"]),
    "steps_0": (dict(train__steps=0), ["train.steps=0", ">= 1"]),
    "seq_len_1": (dict(train__seq_len=1), ["train.seq_len=1", ">= 2"]),
}


@pytest.mark.parametrize("changes,expected", LAYOUT_MISTAKES.values(), ids=LAYOUT_MISTAKES.keys())
def test_validate_catches_layout_mistakes(changes, expected):
    with pytest.raises(ConfigError) as err:
        validate(with_values(BASE, **changes))
    message = str(err.value)
    assert "\n" not in message
    for fragment in expected:
        assert fragment in message


PIPELINE_MISTAKES = {
    "unknown schedule": (dict(mesh__pp=2, pipeline__schedule="interleaved"), "pipeline.schedule='interleaved'"),
    "batch vs dp x m": (dict(mesh__pp=2, pipeline__microbatches=3), "mesh.dp x pipeline.microbatches = 2 x 3"),
    "zero-3 with pp": (dict(mesh__pp=2, zero__stage=3), "zero.stage=3 with mesh.pp=2 is refused"),
    "grad_accum with pp": (dict(mesh__pp=2, train__grad_accum=2), "set pipeline.microbatches instead"),
    "microbatches without pp": (dict(pipeline__microbatches=2), "needs mesh.pp > 1"),
    "layers vs pp": (dict(mesh__pp=4, model__n_layers=6), "mesh.pp=4 does not divide model.n_layers=6"),
    "virtual stages vs layers": (dict(mesh__pp=2, pipeline__virtual_stages=2),
                                 "pipeline.virtual_stages=2 does not divide the 1 layers per stage"),
    "interleaving needs m % p": (dict(mesh__pp=4, model__n_layers=8, pipeline__microbatches=2, pipeline__virtual_stages=2),
                                 "pipeline.microbatches=2 is not a multiple of mesh.pp=4"),
    "gpipe does not interleave": (dict(mesh__pp=2, model__n_layers=4, pipeline__schedule="gpipe", pipeline__virtual_stages=2),
                                  "needs pipeline.schedule=1f1b ('gpipe' does not interleave)"),
    "zb with stage recompute": (dict(mesh__pp=2, pipeline__schedule="zb", pipeline__stage_recompute=True),
                                "set pipeline.stage_recompute=false"),
    "vocabulary over pp x tp": (dict(mesh__pp=2, model__vocab_size=260),
                                "model.vocab_size=260 is not divisible by mesh.pp x mesh.tp = 8"),
    "virtual stages without pp": (dict(pipeline__virtual_stages=2), "pipeline.virtual_stages=2 needs mesh.pp > 1"),
}


@pytest.mark.parametrize("changes,expected", PIPELINE_MISTAKES.values(), ids=PIPELINE_MISTAKES.keys())
def test_validate_catches_pipeline_mistakes(changes, expected):
    with pytest.raises(ConfigError) as err:
        validate(with_values(BASE, **changes))
    assert "\n" not in str(err.value) and expected in str(err.value)


def test_fewer_microbatches_than_stages_only_warns():
    config = with_values(BASE, mesh__pp=2, mesh__dp=1, pipeline__microbatches=1)
    validate(config)
    assert "bubble fraction (p-1)/(m+p-1) = 50%" in pipeline_warning(config)
    assert pipeline_warning(with_values(config, pipeline__microbatches=8)) is None


# ----------------------------------------------------------------------------- finding and loading config files


@pytest.mark.parametrize("name", ["llama_tiny", "llama_tiny.py"])
def test_bare_names_resolve_to_the_repo_configs_from_any_cwd(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(name) == C.REPO_CONFIG_DIR / "llama_tiny.py"


def test_local_configs_dir_and_explicit_paths(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    local = tmp_path / "configs" / "mine.py"
    local.write_text("def get_config():\n    return {'mesh': {'tp': 2}}\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("mine").resolve() == local
    assert resolve_config_path(str(local)) == local
    assert load_config(str(local)).mesh.tp == 2


def test_a_runs_config_json_loads_as_the_run_was_configured(tmp_path):
    """`--config RUN/config.json` (to plan or repeat a run): the dict train.py records, read back whole."""
    config = load_config("llama7b", ["mesh.dp=4", "mesh.tp=2", "remat.policy=none", "zero.stage=2"])
    recorded = tmp_path / "config.json"
    recorded.write_text(json.dumps(C.to_dict(config), indent=2))
    assert load_config(str(recorded)) == config
    recorded.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds list, not a config"):
        load_config(str(recorded))
    other = tmp_path / "cfg.yaml"
    other.write_text("mesh: {}")
    with pytest.raises(ConfigError, match="neither a .py config nor a run's config.json"):
        load_config(str(other))


def test_missing_config_lists_the_known_ones():
    with pytest.raises(ConfigError) as err:
        resolve_config_path("no_such_config")
    assert "'no_such_config' not found" in str(err.value) and "llama_tiny.py" in str(err.value)


@pytest.mark.parametrize("name", ["llama_tiny", "llama7b"])
def test_shipped_configs_load_and_validate(name):
    assert isinstance(load_config(name), Config)


def write_config(tmp_path: pathlib.Path, body: str) -> str:
    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_unknown_key_inside_a_config_file(tmp_path):
    path = write_config(tmp_path, """\
        import ml_collections

        def get_config():
            c = ml_collections.ConfigDict()
            c.model = dict(vocab_size=256, d_modle=64)
            return c
        """)
    assert load_config_dict(path) == {"model": {"vocab_size": 256, "d_modle": 64}}
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.d_modle'"):
        load_config(path)


def test_config_file_without_get_config(tmp_path):
    with pytest.raises(ConfigError, match="get_config"):
        load_config(write_config(tmp_path, "CONFIG = {}\n"))


def test_config_file_returning_a_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="get_config"):
        load_config(write_config(tmp_path, "def get_config():\n    return [1, 2]\n"))


def test_override_below_a_scalar_in_the_file_is_a_config_error(tmp_path):
    path = write_config(tmp_path, "def get_config():\n    return {'mesh': 4}\n")
    with pytest.raises(ConfigError, match="'mesh'"):
        load_config(path, ["mesh.tp=2"])


def test_config_name_lists_match_the_implementations():
    """config.py keeps its own lists so a config mistake is caught before JAX is imported."""
    from jaxpar.config import PIPELINE_SCHEDULES, REMAT_POLICIES
    from jaxpar.parallel.remat import POLICIES
    from jaxpar.parallel.schedule import SCHEDULES

    assert REMAT_POLICIES == POLICIES and PIPELINE_SCHEDULES == SCHEDULES
