"""Typed configuration: loading `configs/NAME.py`, `--config.KEY=VALUE` overrides, validation.

Configs follow the Flax/big_vision convention: a Python file whose `get_config()` returns an
`ml_collections.ConfigDict` (or a plain dict). Inside the library the config is a tree of frozen
dataclasses, so a typo is an error at start, not a silently ignored key. The key names below are
part of jaxpar's interface (tests/test_config.py freezes them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import typing
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import ConfigError

REPO_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    # Megatron sequence parallelism: outside the tensor-parallel regions (norms, residual stream, layer
    # boundaries, pipeline sends) activations are split over tp along the sequence; each layer's two
    # tp all-reduces become reduce-scatter + all-gather pairs (same bytes, 1/tp of the activations).
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp


@dataclasses.dataclass(frozen=True)
class VisionZeroConfig:
    stage: int = 0  # DeepSpeed semantics: 0 plain DP, 1 opt state, 2 + grads, 3 + params sharded over dp


@dataclasses.dataclass(frozen=True)
class ZeroConfig(VisionZeroConfig):
    # ZeRO-3 with remat.policy=full: all-gather layer i+1's weights while layer i computes, forward and
    # backward (jaxpar.parallel.zero.prefetching_layer_scan); other policies gather each layer on use.
    prefetch: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 10
    global_batch_size: int = 8
    seq_len: int = 64  # LLM tokens per example (a VLA derives its own: image + instruction + action tokens)
    seed: int = 0
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at `steps`
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # by the global norm over all shards; 0 disables
    grad_accum: int = 1  # microsteps per optimizer step (gradient accumulation)
    on_nan: str = "skip"  # a step with non-finite loss or gradients: skip (not applied) or stop
    log_every: int = 1  # metrics are fetched (a host sync) and written every N steps and at the last


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    kind: str = "llama"  # llama | vla (ViT + projector + this LLM; groups vision, projector, actions)
    prefix_lm: bool = True  # vla: image + instruction attend bidirectionally, actions causally
    text_loss: bool = False  # vla: also train on the instruction tokens, not only the actions
    # attention kernel: auto (cuDNN flash attention where it can run, else XLA), xla, cudnn; resolved for
    # the run's devices at start (jaxpar.attention_choice), the ViT's too unless vision.attention is set
    attention: str = "auto"
    # Llama 3 RoPE scaling (HF rope_type "llama3"); factor 0 turns it off (Llama 2 and before)
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_scaling(self) -> tuple | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len), or None without scaling."""
        if not self.rope_scaling_factor:
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_len)


@dataclasses.dataclass(frozen=True)
class RematConfig:
    """Activation checkpointing per layer (none, dots, selective, offload, full; see jaxpar.parallel.remat)."""

    policy: str = "none"


REMAT_POLICIES = ("none", "dots", "selective", "offload", "full")  # jaxpar.parallel.remat
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zb")
ATTENTION_KINDS = ("auto", "xla", "cudnn")  # jaxpar.attention_choice


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over mesh.pp: schedule `1f1b` (default), `gpipe` or `zb`, m microbatches per
    step; `virtual_stages` layer chunks per device (Megatron's interleaved 1F1B); `stage_recompute`
    re-runs each stage forward in its backward slot instead of keeping its residuals (least memory)."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    stage_recompute: bool = False


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """ViT encoder + projector of a VLA; data-parallel over every device, tensor-parallel over `tp`."""

    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    cameras: int = 1
    width: int = 64
    depth: int = 2
    n_heads: int = 4
    mlp_dim: int = 256
    projector_dim: int = 128
    pos_init: str = "sincos2d"  # the trained position embedding starts as 2-D sin-cos, or "normal" (random)
    film: bool = False  # condition every block on the instruction (FiLM, as RT-1); see jaxpar.models.vit
    bias: bool = False  # biases in the patch embedding, attention and MLP projections (SigLIP)
    tp: int = 1  # a divisor of mesh.tp: the encoder's tensor-parallel group (1: pure data parallel)
    zero: VisionZeroConfig = VisionZeroConfig()  # 0-2, over all devices not used by the vision tp
    remat: RematConfig = RematConfig()
    attention: str = ""  # the encoder's attention kernel (auto, xla, cudnn); "" = as model.attention


@dataclasses.dataclass(frozen=True)
class ActionConfig:
    """Continuous actions discretised into `bins` per dim, mapped to the last `bins` vocabulary ids."""

    dims: int = 7  # e.g. 6-DoF end-effector delta + gripper
    bins: int = 256
    low: float = -1.0
    high: float = 1.0
    instruction_len: int = 8  # instruction tokens per example (padded / truncated)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in WORKDIR/checkpoints every `every` steps (0: only at the end / on preemption)."""

    every: int = 0
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where a fresh run's weights come from (a checkpoint in the workdir always wins)."""

    # a Hugging Face Llama directory (config.json + safetensors): the LLM starts from its weights, and
    # model.* comes from its config.json (jaxpar.hf_llama); "" = random init
    from_hf: str = ""
    llm_from_hf: str = ""  # the same, spelled for a VLA's LLM (set one of the two)
    # a VLA's encoder from a Hugging Face SigLIP vision tower; vision.* comes from its config.json and
    # the projector starts fresh (jaxpar.hf_siglip)
    vision_from_hf: str = ""

    @property
    def llm_dir(self) -> str:
        return self.from_hf or self.llm_from_hf


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where batches come from (jaxpar.data). An empty `train` means synthetic data; otherwise a
    directory of token shards (scripts/prepare_text.py; model.kind=llama) or of episodes
    (scripts/make_vla_data.py; model.kind=vla). Relative paths are relative to the working directory."""

    train: str = ""
    eval: str = ""  # held-out directory of the same kind; "" = no evaluation
    generate: bool = False  # make the demo data (llama: Python's stdlib sources; vla: the procedural task) if absent
    workers: int = 0  # grain worker processes per JAX process (0: read in the training process)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation on data.eval every `every` steps (0: only at the end) over `batches` global batches
    (0: the whole held-out split)."""

    every: int = 0
    batches: int = 0


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    nan_at_step: int = 0  # inject a NaN into this step's gradients (tests the NaN guard); 0 = never


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Optimizer-state offload: keep the optimizer state (and the fp32 master weights) in pinned host
    memory between steps. Unlike DeepSpeed's ZeRO-Offload, the Adam step does not run on the CPU: the
    state is moved to the device for the update and back (it saves memory between steps, not during the
    update)."""

    optimizer: bool = False
    master_weights: bool = True  # with optimizer=true and precision=bf16: the fp32 master goes to host too


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """Peak dense bf16 FLOP/s for MFU; `peak_tflops` overrides the table in jaxpar.metrics."""

    peak_tflops: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of training steps START..END (1-based, inclusive) into WORKDIR/profile.
    A string, so the CLI's `--config.profile.steps=5,7` override sets it as it sets every other key."""

    steps: str = ""  # "START,END"; "" = no trace


@dataclasses.dataclass(frozen=True)
class Config:
    mesh: MeshConfig = MeshConfig()
    zero: ZeroConfig = ZeroConfig()
    precision: str = "fp32"  # fp32 | bf16 (fp32 master + optimizer state, bf16 compute)
    # dtype of the gradient reduction over dp under precision=bf16 (Megatron's default is fp32: the local
    # gradients are widened before the all-reduce / reduce-scatter; bf16 halves the bytes)
    grad_reduce: str = "fp32"
    train: TrainConfig = TrainConfig()
    model: ModelConfig = ModelConfig()
    remat: RematConfig = RematConfig()
    pipeline: PipelineConfig = PipelineConfig()
    offload: OffloadConfig = OffloadConfig()
    vision: VisionConfig = VisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    debug: DebugConfig = DebugConfig()
    actions: ActionConfig = ActionConfig()
    hardware: HardwareConfig = HardwareConfig()
    profile: ProfileConfig = ProfileConfig()
    init: InitConfig = InitConfig()


# ----------------------------------------------------------------------------- loading


def resolve_config_path(name: str) -> pathlib.Path:
    """A path as given, else `configs/NAME` (with or without .py) in the cwd or the repo."""
    candidates = [pathlib.Path(name)]
    for base in (pathlib.Path.cwd() / "configs", REPO_CONFIG_DIR):
        candidates += [base / name, base / f"{name}.py"]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.name for p in REPO_CONFIG_DIR.glob("*.py"))
    raise ConfigError(f"config file '{name}' not found; pass a path or one of configs/: {', '.join(known)}")


def load_config_dict(name: str) -> dict:
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"jaxpar_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(); a config file must return its settings from get_config()")
    raw = module.get_config()
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    elif isinstance(raw, Mapping):
        raw = dict(raw)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: get_config() returned {type(raw).__name__}; return a dict or ConfigDict")
    return raw


def load_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `name`, apply `KEY=VALUE` overrides (keys like `mesh.tp`), return a validated Config."""
    tree = load_config_dict(name)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' has no value; write --config.{item}=VALUE")
        set_by_path(tree, key, value)
    config = from_dict(Config, tree)
    _require(not (config.init.from_hf and config.init.llm_from_hf),
             "init.from_hf and init.llm_from_hf are the same setting; set one of them")
    if config.init.llm_dir:
        from jaxpar.hf_llama import with_model_from_hf

        config = with_model_from_hf(config)
    if config.init.vision_from_hf:
        _require(config.model.kind == "vla", "init.vision_from_hf needs model.kind=vla (the encoder is the VLA's)")
        from jaxpar.hf_siglip import with_vision_from_hf

        config = with_vision_from_hf(config)
    validate(config)
    return config


def set_by_path(tree: dict, dotted_key: str, text: str) -> None:
    """Set `a.b.c` in a nested dict, parsing `text` by the schema's type for that key."""
    field_type = schema_type(Config, dotted_key.split("."), dotted_key)
    if dataclasses.is_dataclass(field_type):
        keys = ", ".join(f.name for f in dataclasses.fields(field_type))
        raise ConfigError(f"--config.{dotted_key} is a group, not a value; set one of its keys ({keys}) "
                          f"as --config.{dotted_key}.KEY=VALUE")
    *parents, leaf = dotted_key.split(".")
    node = tree
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            group = ".".join(parents[: depth + 1])
            raise ConfigError(f"config key '{group}' must be a group of keys in the config file, got {node!r}")
    node[leaf] = parse_value(text, field_type, dotted_key)


def schema_type(cls: type, parts: list[str], full_key: str) -> type:
    hints = typing.get_type_hints(cls)
    head = parts[0]
    if head not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"unknown config key '{full_key}'; valid keys here are: {known}")
    if len(parts) == 1:
        return hints[head]
    if not dataclasses.is_dataclass(hints[head]):
        raise ConfigError(f"config key '{full_key}': '{head}' is a value, not a group")
    return schema_type(hints[head], parts[1:], full_key)


def parse_value(text: str, field_type: type, key: str) -> Any:
    try:
        if field_type is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if field_type is int:
            return int(text)
        if field_type is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"--config.{key}={text}: expected {_a_type(field_type)}") from None


def from_dict(cls: type, tree: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys are errors that name the key."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in tree.items():
        full_key = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"unknown config key '{full_key}'; valid keys here are: {known}")
        field_type = hints[key]
        if dataclasses.is_dataclass(field_type):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{full_key}' must be a group of keys, got {value!r}")
            kwargs[key] = from_dict(field_type, value, f"{full_key}.")
        else:
            kwargs[key] = coerce(value, field_type, full_key)
    return cls(**kwargs)


def coerce(value: Any, field_type: type, key: str) -> Any:
    if field_type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if field_type in (int, float, str, bool) and not isinstance(value, field_type):
        raise ConfigError(f"config key '{key}' must be {_a_type(field_type)}, got {value!r}")
    if field_type is int and isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be an int, got {value!r}")
    return value


def _a_type(field_type: type) -> str:
    """'an int', 'a float', 'a str', 'a bool' (and true/false spelled out for bools)."""
    if field_type is bool:
        return "a bool (true or false)"
    name = getattr(field_type, "__name__", str(field_type))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


# ----------------------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Every impossible layout fails here, before any compilation, with the key and the fix."""
    _validate_ranges(config)
    _validate_layout(config)


def _validate_ranges(config: Config) -> None:
    """Values out of range on their own; checked first so the layout checks never divide by zero."""
    for axis in ("dp", "pp", "tp"):
        value = getattr(config.mesh, axis)
        _require(value >= 1, f"mesh.{axis}={value} must be >= 1")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        value = getattr(config.model, key)
        _require(value >= 1, f"model.{key}={value} must be >= 1")
    train = config.train
    for key in ("steps", "global_batch_size", "grad_accum", "log_every"):
        value = getattr(train, key)
        _require(value >= 1, f"train.{key}={value} must be >= 1")
    _require(train.seq_len >= 2, f"train.seq_len={train.seq_len} must be >= 2")
    _require(train.on_nan in ("skip", "stop"), f"train.on_nan='{train.on_nan}' is unknown; use skip or stop")
    _require(config.checkpoint.every >= 0 and config.checkpoint.keep >= 1,
             "checkpoint.every must be >= 0 (0: at the end only) and checkpoint.keep >= 1")
    for key, value in (("eval.every", config.eval.every), ("eval.batches", config.eval.batches),
                       ("data.workers", config.data.workers)):
        _require(value >= 0, f"{key}={value} must be >= 0")
    _require(not config.data.eval or config.data.train, f"data.eval='{config.data.eval}' needs data.train: "
                                                        f"evaluation runs on real data; set data.train too")
    _require(train.warmup_steps >= 0, f"train.warmup_steps={train.warmup_steps} must be >= 0")
    _require(config.zero.stage in (0, 1, 2, 3), f"zero.stage={config.zero.stage} is out of range; use 0, 1, 2 or 3")
    _require(config.remat.policy in REMAT_POLICIES,
             f"remat.policy='{config.remat.policy}' is unknown; use one of {', '.join(REMAT_POLICIES)}")
    _require(config.precision in ("fp32", "bf16"), f"precision='{config.precision}' is unknown; use fp32 or bf16")
    _require(config.grad_reduce in ("fp32", "bf16"),
             f"grad_reduce='{config.grad_reduce}' is unknown; use fp32 or bf16")
    for key, value, allowed in (("model.attention", config.model.attention, ATTENTION_KINDS),
                                ("vision.attention", config.vision.attention, ("",) + ATTENTION_KINDS)):
        _require(value in allowed, f"{key}='{value}' is unknown; use one of {', '.join(ATTENTION_KINDS)}")
    profile_steps(config)  # raises on a malformed or out-of-range range


def profile_steps(config: Config) -> tuple[int, int] | None:
    """profile.steps as (START, END), or None when no trace is asked for; a bad value is a ConfigError."""
    text = config.profile.steps.strip()
    if not text:
        return None
    start, sep, end = text.partition(",")
    try:
        first, last = int(start), int(end)
    except ValueError:
        raise ConfigError(f"profile.steps='{text}' is not START,END; write e.g. --config.profile.steps=5,7 "
                          f"(1-based training steps, inclusive)") from None
    _require(first >= 1 and last >= 1, f"profile.steps={text}: steps are 1-based, so START and END must be >= 1")
    _require(last >= first, f"profile.steps={text}: END={last} is before START={first}; give END >= START")
    _require(last <= config.train.steps, f"profile.steps={text} ends after train.steps={config.train.steps}; "
                                         f"pick END <= {config.train.steps}")
    return first, last


def _validate_layout(config: Config) -> None:
    mesh, model, train = config.mesh, config.model, config.train
    _require(model.d_model % model.n_heads == 0,
             f"model.d_model={model.d_model} is not divisible by model.n_heads={model.n_heads}; "
             f"make model.d_model a multiple of model.n_heads")
    _require(model.head_dim % 2 == 0,
             f"model.d_model / model.n_heads = {model.head_dim} is odd; rotary embeddings need an even head_dim, "
             f"so make model.d_model a multiple of 2 x model.n_heads = {2 * model.n_heads}")
    _require(model.n_heads % model.n_kv_heads == 0,
             f"model.n_heads={model.n_heads} is not a multiple of model.n_kv_heads={model.n_kv_heads}; "
             f"use a model.n_kv_heads that divides model.n_heads")
    tp = mesh.tp
    for key in ("n_heads", "d_ff", "vocab_size"):
        value = getattr(model, key)
        _require(value % tp == 0, f"mesh.tp={tp} does not divide model.{key}={value}; "
                                  f"choose a tp that divides {value} (tensor parallel splits it over tp)")
    _require(model.n_kv_heads % tp == 0 or tp % model.n_kv_heads == 0,
             f"mesh.tp={tp} and model.n_kv_heads={model.n_kv_heads}: one must divide the other (KV heads are "
             f"split over tp, or replicated when tp is a multiple of them)")
    _require(model.n_layers % mesh.pp == 0,
             f"mesh.pp={mesh.pp} does not divide model.n_layers={model.n_layers}; use a pp that divides it")
    _validate_pipeline(config)
    _validate_vla(config)  # before the sequence check: a VLA's sequence needs valid vision sizes
    _validate_sequence_parallel(config)
    splits = ("mesh.dp x pipeline.microbatches", config.pipeline.microbatches) if mesh.pp > 1 else \
        ("mesh.dp x train.grad_accum", train.grad_accum)
    per_step = mesh.dp * splits[1]
    _require(train.global_batch_size % per_step == 0,
             f"train.global_batch_size={train.global_batch_size} is not divisible by {splits[0]} "
             f"= {mesh.dp} x {splits[1]}; use a multiple of {per_step}")
    if config.zero.stage >= 1:
        _require(model.d_model % mesh.dp == 0,
                 f"zero.stage={config.zero.stage} shards states over dp on the d_model dim, but mesh.dp={mesh.dp} "
                 f"does not divide model.d_model={model.d_model}; pick a dp that divides it or zero.stage=0")


def _validate_sequence_parallel(config: Config) -> None:
    """Sequence parallelism splits the LLM's sequence (a VLA's: image + instruction + action tokens) over tp."""
    tp = config.mesh.tp
    if not config.mesh.sequence_parallel:
        return
    _require(tp > 1, "mesh.sequence_parallel=true needs mesh.tp > 1 (it splits the sequence over tp); "
                     "set mesh.tp > 1 or turn it off")
    seq, name = config.train.seq_len, "train.seq_len"
    if config.model.kind == "vla":
        from jaxpar.models.vla import sequence_layout  # the models import this module
        seq, name = sequence_layout(config)[2], "VLA sequence (image + instruction + action tokens)"
    _require(seq % tp == 0, f"mesh.sequence_parallel=true splits the {name}={seq} over mesh.tp={tp}, which "
                            f"does not divide it; make it a multiple of {tp}")


def _validate_vla(config: Config) -> None:
    model, vis, act, mesh = config.model, config.vision, config.actions, config.mesh
    _require(model.kind in ("llama", "vla"), f"model.kind='{model.kind}' is unknown; use llama or vla")
    if model.kind != "vla":
        return
    for key in ("image_size", "patch_size", "channels", "cameras", "width", "depth", "n_heads", "mlp_dim",
                "projector_dim", "tp"):
        _require(getattr(vis, key) >= 1, f"vision.{key}={getattr(vis, key)} must be >= 1")
    _require(vis.image_size % vis.patch_size == 0, f"vision.image_size={vis.image_size} is not divisible by "
                                                   f"vision.patch_size={vis.patch_size}; pick sizes that tile")
    _require(vis.width % vis.n_heads == 0, f"vision.width={vis.width} is not divisible by "
                                           f"vision.n_heads={vis.n_heads}")
    _require(vis.tp >= 1 and mesh.tp % vis.tp == 0,
             f"vision.tp={vis.tp} does not divide mesh.tp={mesh.tp}; the vision encoder's tensor-parallel group "
             f"is part of the LLM's, so pick a divisor of {mesh.tp}")
    for key in ("n_heads", "mlp_dim"):
        _require(getattr(vis, key) % vis.tp == 0, f"vision.tp={vis.tp} does not divide vision.{key}="
                                                  f"{getattr(vis, key)}; choose a vision.tp that divides it")
    _require(config.train.grad_accum == 1, f"train.grad_accum={config.train.grad_accum}: a VLA encodes the whole "
                                           f"batch once per step; accumulate with mesh.pp > 1 and "
                                           f"pipeline.microbatches instead, or use train.grad_accum=1")
    _require(vis.zero.stage in (0, 1, 2), f"vision.zero.stage={vis.zero.stage}: the vision encoder supports "
                                          f"ZeRO 0, 1 or 2")
    _validate_vla_inits(config)
    _require(vis.remat.policy in REMAT_POLICIES, f"vision.remat.policy='{vis.remat.policy}' is unknown; "
                                                 f"use one of {', '.join(REMAT_POLICIES)}")
    text_vocab = model.vocab_size - act.bins
    _require(act.bins >= 2 and text_vocab >= 2,
             f"actions.bins={act.bins} reserves the last {act.bins} of model.vocab_size={model.vocab_size} ids "
             f"for actions and leaves {text_vocab} for text; raise model.vocab_size or lower actions.bins")
    _require(act.dims >= 1 and act.instruction_len >= 1 and act.high > act.low,
             "actions.dims and actions.instruction_len must be >= 1 and actions.high > actions.low")
    data_ways = mesh.size // vis.tp  # devices that split the images
    per_dp = config.train.global_batch_size // mesh.dp
    _require(per_dp % (data_ways // mesh.dp) == 0,
             f"train.global_batch_size={config.train.global_batch_size}: the vision encoder splits each dp "
             f"shard's {per_dp} examples over {data_ways // mesh.dp} devices (mesh.pp x mesh.tp / vision.tp); "
             f"use a global batch divisible by {data_ways}")
    if vis.zero.stage >= 1:
        _require(vis.width % data_ways == 0 and model.d_model % data_ways == 0,
                 f"vision.zero.stage={vis.zero.stage} shards the vision weights over {data_ways} devices, which "
                 f"must divide vision.width={vis.width} and model.d_model={model.d_model}")


def _validate_vla_inits(config: Config) -> None:
    vis, model = config.vision, config.model
    _require(vis.pos_init in ("sincos2d", "normal"),
             f"vision.pos_init='{vis.pos_init}' is unknown; use sincos2d or normal")
    _require(vis.pos_init != "sincos2d" or vis.width % 4 == 0,
             f"vision.pos_init=sincos2d needs vision.width divisible by 4 (got {vis.width}); "
             f"pick such a width or vision.pos_init=normal")
    _require(not (model.text_loss and model.prefix_lm),
             "model.text_loss=true with model.prefix_lm=true: the bidirectional prefix lets each instruction "
             "token see the one it predicts; set model.prefix_lm=false to train on the instruction")


def _validate_pipeline(config: Config) -> None:
    pipe, mesh = config.pipeline, config.mesh
    _require(pipe.schedule in PIPELINE_SCHEDULES,
             f"pipeline.schedule='{pipe.schedule}' is unknown; use one of {', '.join(PIPELINE_SCHEDULES)}")
    _require(pipe.microbatches >= 1, f"pipeline.microbatches={pipe.microbatches} must be >= 1")
    if mesh.pp == 1:
        _require(pipe.virtual_stages == 1, f"pipeline.virtual_stages={pipe.virtual_stages} needs mesh.pp > 1")
        _require(pipe.microbatches == 1, f"pipeline.microbatches={pipe.microbatches} needs mesh.pp > 1; "
                                         f"without a pipeline use train.grad_accum for gradient accumulation")
        return
    _require(config.train.grad_accum == 1, f"train.grad_accum={config.train.grad_accum} with mesh.pp={mesh.pp}: "
                                           f"the pipeline's microbatches accumulate gradients; set "
                                           f"pipeline.microbatches instead and train.grad_accum=1")
    if config.zero.stage >= 3:  # (imported here: config is checked before JAX is imported)
        from jaxpar.parallel.zero import pipeline_refusal

        refusal = pipeline_refusal(config.zero.stage, mesh.pp)
        _require(refusal is None, refusal)
    _validate_virtual_stages(config)
    _require(not (pipe.schedule == "zb" and pipe.stage_recompute),
             "pipeline.schedule=zb keeps each chunk's residuals for its weight-gradient (W) slot; "
             "set pipeline.stage_recompute=false or use schedule=1f1b")
    tp_pp = mesh.pp * mesh.tp
    _require(config.model.vocab_size % tp_pp == 0,
             f"model.vocab_size={config.model.vocab_size} is not divisible by mesh.pp x mesh.tp = {tp_pp}: with a "
             f"pipeline the vocabulary is split over pp x tp; pad the vocabulary to a multiple of {tp_pp}")


def _validate_virtual_stages(config: Config) -> None:
    pipe, mesh, layers = config.pipeline, config.mesh, config.model.n_layers
    v, m = pipe.virtual_stages, pipe.microbatches
    _require(v >= 1, f"pipeline.virtual_stages={v} must be >= 1")
    per_stage = layers // mesh.pp
    _require(per_stage % v == 0, f"pipeline.virtual_stages={v} does not divide the {per_stage} layers per stage "
                                 f"(model.n_layers={layers} / mesh.pp={mesh.pp}); use a divisor of {per_stage}")
    if v > 1:
        _require(pipe.schedule == "1f1b", f"pipeline.virtual_stages={v} needs pipeline.schedule=1f1b "
                                          f"('{pipe.schedule}' does not interleave); set virtual_stages=1")
        _require(m % mesh.pp == 0, f"pipeline.microbatches={m} is not a multiple of mesh.pp={mesh.pp}, which "
                                   f"interleaving (virtual_stages={v}) needs; use a multiple of {mesh.pp}")


def pipeline_warning(config: Config) -> str | None:
    """m < p is allowed but wasteful: say how much of the step is bubble."""
    p, m = config.mesh.pp, config.pipeline.microbatches
    if p > 1 and m < p:
        return (f"warning: pipeline.microbatches={m} < mesh.pp={p}: bubble fraction (p-1)/(m+p-1) = "
                f"{(p - 1) / (m + p - 1):.0%}; use m >= 4p to keep it under 20%")
    return None
