"""Typed configuration: the schema, reading `configs/NAME.py` and `--config.KEY=VALUE` overrides.

Configs follow the Flax/big_vision convention: a Python file whose `get_config()` returns an
`ml_collections.ConfigDict` (or a plain dict). Inside the library the config is a tree of frozen
dataclasses, so a typo is an error at start, not a silently ignored key. The key names below are
part of jaxpar's interface (tests/test_config.py freezes them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import typing
from collections.abc import Mapping
from typing import Any

from jaxpar.errors import ConfigError

REPO_CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    # Megatron sequence parallelism: outside the tensor-parallel regions (norms, residual stream, layer
    # boundaries, pipeline sends) activations are split over tp along the sequence; each layer's two
    # tp all-reduces become reduce-scatter + all-gather pairs (same bytes, 1/tp of the activations).
    sequence_parallel: bool = False
    # Context parallelism: the sequence split over cp for the whole layer, attention over the whole
    # sequence by `cp_strategy` (all_gather: K / V gathered over cp; ring: passed around it; ulysses: heads
    # all-to-all over cp). Devices = dp x pp x cp x tp.
    cp: int = 1
    cp_strategy: str = "all_gather"
    # Under sequence parallelism, each block's all-gather / reduce-scatter decomposed into tp ppermute steps
    # under the GEMMs they feed (jaxpar.layers.collective_matmul): "auto" (on for GPU runs with at least 1024
    # tokens per chunk whose layers run no dp collectives of their own, off on XLA:CPU's emulated meshes),
    # "on" or "off"
    collective_matmul: str = "auto"

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


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
    # How a skipped step keeps the old optimizer state: `cond` (the update inside a lax.cond: in place on
    # XLA:CPU, but XLA's GPU conditional writes the whole new state to fresh buffers), `select` (a
    # per-element where fused into each leaf's update: in place on GPUs), or `auto`: the in-place one for
    # the devices the step is compiled for (nan_guard_for). docs/design.md "The NaN guard".
    nan_guard: str = "auto"
    log_every: int = 1  # metrics are fetched (a host sync) and written every N steps and at the last


NAN_GUARDS = ("auto", "cond", "select")
ACTION_HEADS = ("tokens", "l1", "flow")  # ActionConfig.head


def nan_guard_for(train: TrainConfig, platform: str) -> str:
    """The NaN guard a step compiled for `platform` ("gpu", "cpu", ...) uses: train.nan_guard, with
    `auto` as the form each compiler updates in place: select for XLA's GPU compiler, cond elsewhere
    (a select over the whole state kept old and new alive at once on XLA:CPU)."""
    if train.nan_guard != "auto":
        return train.nan_guard
    return "select" if platform == "gpu" else "cond"


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
    # the run's devices at start (jaxpar.compiler.attention_choice), the ViT's too unless vision.attention is set
    attention: str = "auto"
    # Llama 3 RoPE scaling (HF rope_type "llama3"); factor 0 turns it off (Llama 2 and before)
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # positions the weights are meant for: a Hugging Face init's max_position_embeddings (0: this run's own
    # LLM sequence length); the export writes it back as max_position_embeddings
    max_position: int = 0

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
ATTENTION_KINDS = ("auto", "xla", "cudnn")  # jaxpar.compiler.attention_choice
FP8_RECIPES = ("current", "delayed")  # jaxpar.layers.fp8
FP8_BINS = 128  # delayed scaling's exponent bins per operand (jaxpar.layers.fp8.BINS)
FP8_GATHERS = ("fp8", "bf16")  # fp8.zero3_gather
# vision.resize: "area" (box down, bilinear up) or a PIL resampling filter (jaxpar.data.video.resize)
RESIZE_FILTERS = ("area", "nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


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
    # Pixel normalisation inside the encoder (jaxpar.models.vit.normalise): the model's images are x / 255
    # (uint8 pixels scaled to [0, 1]) and the encoder first computes (x / 255 - image_mean) / image_std
    # per channel (3 values, or one for every channel). Random init: mean 0, std 1 (the [0, 1] pixels
    # as they are, as before these keys existed). init.vision_from_hf: the directory's
    # preprocessor_config.json, else SigLIP's 0.5 / 0.5, i.e. [-1, 1] (jaxpar.interop.hf_siglip).
    image_mean: tuple[float, ...] = (0.0,)
    image_std: tuple[float, ...] = (1.0,)
    # How a LeRobot dataset's frames are resized to image_size (jaxpar.data.video.resize): "area" (box
    # filter down, bilinear up) or a PIL filter (bicubic, bilinear, ...); init.vision_from_hf sets the
    # processor's (SigLIP: bicubic)
    resize: str = "area"
    # Proprioceptive state (LeRobot's observation.state: joint angles, the end effector's pose, the gripper): its
    # dims (0: none), read as one more prefix token after the image patches, a linear projection of the state
    # normalised to [-1, 1] by [state_low, state_high] per dim (clipped; the data's q01 / q99 as the actions',
    # openpi's norm stats; () = [-1, 1]: the state is already in range). jaxpar.models.vit, "The state token".
    state_dims: int = 0
    state_low: tuple[float, ...] = ()
    state_high: tuple[float, ...] = ()

    def state_range(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(per-dim low, per-dim high) of the state that maps to [-1, 1]; a dim whose low == high reads as 0."""
        if self.state_low:
            return tuple(self.state_low), tuple(self.state_high)
        return (-1.0,) * self.state_dims, (1.0,) * self.state_dims


@dataclasses.dataclass(frozen=True)
class ActionConfig:
    """Continuous actions discretised into `bins` per dim, mapped to the last `bins` vocabulary ids.

    The bins split each dimension's range evenly. `normalization` picks the range: `bounds` is
    [low, high] for every dim (jaxpar's own episodes are in [-1, 1]); `quantile` is the data's
    per-dimension [q01, q99] (OpenVLA), read from a LeRobot dataset's meta/stats.json or computed
    from the actions, filled into q01 / q99 at start (jaxpar.data.normalization), written into
    WORKDIR/config.json and every checkpoint, and used again to decode; `auto` is quantile for a
    LeRobot dataset and bounds otherwise."""

    dims: int = 7  # e.g. 6-DoF end-effector delta + gripper
    # actions predicted per call (H): 1 decodes one step's tokens one by one (OpenVLA); H > 1 decodes the next H
    # steps' H x dims tokens at once from placeholder slots attending to each other (OpenVLA-OFT's parallel decoding)
    chunk: int = 1
    # steps of each predicted chunk a closed loop runs before it calls the policy again (evaluation rollouts and
    # `python -m jaxpar.rollout`; training does not read it): 0 = all H, open loop (OpenVLA-OFT, pi0); 1 <= K < H a
    # receding horizon (the rest of the chunk is dropped, and the next call sees the frame K steps on)
    execute: int = 0
    # what predicts the actions: tokens (the action bins' ids, cross-entropy: OpenVLA, or OFT's parallel decoding
    # when chunk > 1) or l1 (OpenVLA-OFT's continuous head: an MLP on each action slot's last hidden state regresses
    # its value, normalised to [-1, 1] by the bins' range, with an L1 loss; jaxpar.models.vla, "The l1 head") or flow
    # (flow matching: the same MLP, also reading the noised value and the time, predicts the velocity noise - value
    # along the straight path between them; `flow_steps` Euler steps from noise at inference; jaxpar.models.vla, "The
    # flow head")
    head: str = "tokens"
    flow_steps: int = 10  # the flow head's integration steps at inference (pi0's 10)
    bins: int = 256
    low: float = -1.0
    high: float = 1.0
    instruction_len: int = 8  # instruction ids per example: UTF-8 bytes, or a tokenizer's ids (padded)
    # how the LLM reads the instruction (jaxpar.data.instructions): auto (the LLM's HF tokenizer.json with
    # init.llm_from_hf, else bytes; resolved when the run is assembled), bytes, or a tokenizer.json file
    instruction_tokenizer: str = "auto"
    normalization: str = "auto"  # auto | bounds | quantile
    q01: tuple[float, ...] = ()  # quantile mode: per-dim range; () = from the data at start
    q99: tuple[float, ...] = ()

    @property
    def parallel_slots(self) -> bool:
        """Whether the LLM reads placeholder slots, one per action value, all decoded in one call (a chunk, or a
        continuous head, which has no token to feed back), rather than one step's tokens one by one."""
        return self.chunk > 1 or self.head != "tokens"

    @property
    def steps_per_call(self) -> int:
        """Steps a closed loop runs from each policy call: `execute`, or the whole chunk."""
        return self.execute or self.chunk

    @property
    def continuous(self) -> bool:
        """Whether a head regresses or samples the values themselves (l1, flow): no action tokens."""
        return self.head != "tokens"

    def bin_range(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(per-dim low, per-dim high) that the bins split; a dim whose low == high never varies."""
        if self.q01:
            return tuple(self.q01), tuple(self.q99)
        return (self.low,) * self.dims, (self.high,) * self.dims


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in WORKDIR/checkpoints every `every` steps (0: only at the end / on preemption)."""

    every: int = 0
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where a fresh run's weights come from (a checkpoint in the workdir always wins)."""

    # a Hugging Face Llama directory (config.json + safetensors): the LLM starts from its weights, and
    # model.* comes from its config.json (jaxpar.interop.hf_llama); "" = random init
    from_hf: str = ""
    llm_from_hf: str = ""  # the same, spelled for a VLA's LLM (set one of the two)
    # a VLA's encoder from a Hugging Face SigLIP vision tower; vision.* comes from its config.json and
    # the projector starts fresh (jaxpar.interop.hf_siglip)
    vision_from_hf: str = ""

    @property
    def llm_dir(self) -> str:
        return self.from_hf or self.llm_from_hf


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where batches come from (jaxpar.data). An empty `train` means synthetic data; otherwise a
    directory of token shards (scripts/prepare_text.py; model.kind=llama) or of episodes
    (scripts/make_vla_data.py; model.kind=vla), or a LeRobot dataset (a directory with meta/info.json,
    codebase_version v2.1 or v3.0; jaxpar.data.lerobot). Relative paths are relative to the working
    directory."""

    train: str = ""
    eval: str = ""  # held-out directory of the same kind; "" = no evaluation
    generate: bool = False  # make the demo data (llama: Python's stdlib sources; vla: the procedural task) if absent
    demo_format: str = "npz"  # vla: what data.generate writes: npz (jaxpar's episodes) or lerobot (a v3.0 dataset)
    workers: int = 0  # grain worker processes per JAX process (0: read in the training process); they decode
    prefetch: int = 4  # batches read ahead of the step: per worker (workers > 0) or by the in-process reader threads
    frame_cache_mb: int = 256  # LeRobot: decoded frames kept per reading process (each worker has its own), MiB
    cameras: tuple[str, ...] = ()  # LeRobot: the camera keys the model sees, in order; () = all, in info.json order
    eval_episodes: int = 0  # LeRobot without data.eval: hold out this many episodes of data.train (by seed)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation on data.eval every `every` steps (0: only at the end) over `batches` global batches
    (0: the whole held-out split)."""

    every: int = 0
    batches: int = 0
    rollouts: int = 0  # closed-loop episodes of the procedural task per evaluation (jaxpar.robot.rollout); 0 = none


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    nan_at_step: int = 0  # inject a NaN into this step's gradients (tests the NaN guard); 0 = never


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Host (pinned CPU) memory for state the step does not need on the device all the time.

    - `optimizer`: the optimizer state (and, with `master_weights`, the fp32 master weights) lives in
      host memory between steps. With `update=device` it is moved to the device for the update and
      back (it saves memory between steps, not during the update); with `update=host` the AdamW update
      runs on the host where the state lives (DeepSpeed's CPU Adam), and only the gradients travel.
    - `params` (ZeRO-3, remat full): the compute-dtype parameter shards live in host memory; each
      layer's shard is copied to the device one layer ahead inside the layer scan, forward and backward
      (jaxpar.parallel.zero.prefetching_layer_scan), so only the layers being gathered are on the device;
      the gradients stay on the device (docs/design.md "Host memory").
    """

    optimizer: bool = False
    master_weights: bool = True  # with optimizer=true and precision=bf16: the fp32 master goes to host too
    params: bool = False
    update: str = "device"  # device | host: where the optimizer update of offloaded state runs


OFFLOAD_UPDATES = ("device", "host")


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """`peak_tflops`: peak dense bf16 FLOP/s for MFU, overriding the GPU profiles (jaxpar.compiler.hardware).
    `memory_gb`: the memory budget per device in GB (1e9 bytes) that the trainer's preflight holds the
    compiled step to (jaxpar.training.preflight); 0: the allocator's limit on GPUs (the device's memory x
    jaxpar.compiler.hardware.USABLE_FRACTION unless the user set the fraction), no preflight on CPUs."""

    peak_tflops: float = 0.0
    memory_gb: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of training steps START..END (1-based, inclusive) into WORKDIR/profile.
    A string, so the CLI's `--config.profile.steps=5,7` override sets it as it sets every other key."""

    steps: str = ""  # "START,END"; "" = no trace


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """JAX's persistent compilation cache (jaxpar.train.enable_compilation_cache): a restarted or resumed
    run loads its compiled programs instead of compiling them again. `cache_dir` is the directory
    ("~" is expanded; a relative path is relative to the working directory); "" turns the cache off.
    Training only (a --dry_run always compiles: it measures the compilation). A JAX_COMPILATION_CACHE_DIR
    set in the environment wins over this key. With several processes every process reads the
    directory and only JAX process 0 writes it, so a multi-node job needs a directory every node sees
    (a shared filesystem); on a node-local directory only process 0's restarts are faster."""

    cache_dir: str = "~/.cache/jaxpar/xla"  # per user; delete it at any time, it only costs a recompile


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """precision=fp8 (jaxpar.layers.fp8): how the FP8 GEMMs scale their operands. `current`: each
    operand's own amax in each GEMM, a power-of-two scale (Megatron's current scaling; no state).
    `delayed` (Transformer Engine's and Flax's recipe): the linears (the LLM's, and a VLA's encoder's and
    projector's) scale their inputs and output gradients by the largest amax of the last `amax_history` steps,
    kept as per-exponent counters in the train state and the checkpoint (jaxpar.models.llama.FP8_LIVES,
    jaxpar.models.vit.fp8_lives_shapes); the weights keep current scaling (fp8.py says why).
    `zero3_gather`: how ZeRO-3 gathers the linear layers' weights, `fp8` (as E4M3 with the whole weight's
    scale: half of bf16's bytes, and the GEMMs get the same FP8 weights, bit for bit) or `bf16`."""

    recipe: str = "current"
    amax_history: int = 1024  # delayed: the steps an amax is remembered (Transformer Engine's and Flax's default)
    zero3_gather: str = "fp8"


@dataclasses.dataclass(frozen=True)
class Config:
    mesh: MeshConfig = MeshConfig()
    zero: ZeroConfig = ZeroConfig()
    # fp32 | bf16 (fp32 master + optimizer state, bf16 compute) | fp8 (bf16's state and compute, and the
    # linear layers' GEMMs in FP8: jaxpar.layers.fp8, `fp8`)
    precision: str = "fp32"
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
    compile: CompileConfig = CompileConfig()
    fp8: Fp8Config = Fp8Config()

    @property
    def bf16_compute(self) -> bool:
        """bf16 compute copies over fp32 master weights (precision=bf16, and fp8, whose state is bf16's)."""
        return self.precision in ("bf16", "fp8")

    @property
    def fp8_delayed(self) -> bool:
        """FP8 GEMMs with delayed scaling: the linears carry their counters (jaxpar.models.llama.FP8_LIVES)."""
        return self.precision == "fp8" and self.fp8.recipe == "delayed"


# ----------------------------------------------------------------------------- loading


def patches_per_image(vision: VisionConfig) -> int:
    return (vision.image_size // vision.patch_size) ** 2


def image_tokens(vision: VisionConfig) -> int:
    """The prefix tokens a VLA's vision component gives the LLM: patches per image x cameras, and the
    proprioceptive state's one token after them when vision.state_dims > 0."""
    return vision.cameras * patches_per_image(vision) + (1 if vision.state_dims else 0)


def image_split_ways(config: Config) -> int:
    """Slices a VLA's encoder splits each dp shard's images into: every device of the shard outside its
    vision tp group encodes its own (jaxpar.parallel.vision)."""
    return config.mesh.size // (config.mesh.dp * config.mesh.cp * config.vision.tp)


def sums_own_images(config: Config) -> bool:
    """Whether a VLA's first input sums each rank's own images' tokens (jaxpar.models.vla.llm_inputs_summed)
    where an all-gather would first give every rank every image's: with a pipeline the first input is a
    sum over pp x tp anyway (its vocabulary split), which the encoder's slices (over pp and tp) lie in;
    not under context parallelism (a cp rank's chunks are not one slice of the sequence)."""
    return (config.model.kind == "vla" and config.mesh.pp > 1 and config.mesh.cp == 1
            and image_split_ways(config) > 1)


def vla_sequence_layout(config: Config) -> tuple[int, int, int]:
    """(image tokens, prefix length = image + instruction tokens, LLM sequence length) of a VLA.

    One step (chunk 1) is decoded token by token: the LLM reads the actions but the last (teacher
    forcing). A chunk of H > 1 steps, or the l1 head's values, are decoded at once: the LLM reads H x dims
    placeholder slots, each of which predicts its own action value (jaxpar.models.vla.make_batch)."""
    n_image = image_tokens(config.vision)
    act = config.actions
    prefix = n_image + act.instruction_len
    return n_image, prefix, prefix + (act.chunk * act.dims if act.parallel_slots else act.dims - 1)


def instruction_tokenizer_file(config: Config) -> str | None:
    """The tokenizer file a VLA's LLM reads its instruction with (None: UTF-8 bytes; an unresolved
    `auto` too, which jaxpar.interop.pretrained resolves where a pretrained LLM is read)."""
    value = config.actions.instruction_tokenizer
    return None if value in ("auto", "bytes") else value


def carries_instruction_bytes(config: Config) -> bool:
    """Whether a VLA's batches carry the instruction's UTF-8 bytes beside the LLM's ids: FiLM reads
    bytes, so it needs them when the LLM reads a tokenizer's ids (jaxpar.data.instructions)."""
    return config.model.kind == "vla" and config.vision.film and instruction_tokenizer_file(config) is not None


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
    """The settings in `name`: a config file (get_config() in Python) or a run's config.json (the whole
    config as the trainer recorded it, so `--config RUN/config.json` plans or repeats that run)."""
    path = resolve_config_path(name)
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: not a readable config.json ({error}); pass a config .py or a run's config.json")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: holds {type(raw).__name__}, not a config; pass a config .py or a run's config.json")
        return raw
    if path.suffix != ".py":
        raise ConfigError(f"config file '{path}' is neither a .py config nor a run's config.json")
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


def read_config(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """`name` with its `KEY=VALUE` overrides (keys like `mesh.tp`) applied, as written: not validated,
    and a pretrained init's fields not yet read (jaxpar.config.load_config validates; a run that starts
    from Hugging Face weights is assembled by jaxpar.interop.pretrained.load_run_config)."""
    tree = load_config_dict(name)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' has no value; write --config.{item}=VALUE")
        set_by_path(tree, key, value)
    return from_dict(Config, tree)


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
        if typing.get_origin(field_type) is tuple:  # comma-separated; "" is the empty tuple
            item_type = typing.get_args(field_type)[0]
            return tuple(parse_value(item.strip(), item_type, key) for item in text.split(",") if item.strip())
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


ONE_FOR_ALL = ("vision.image_mean", "vision.image_std")  # per-channel lists that also take one number


def coerce(value: Any, field_type: type, key: str) -> Any:
    if typing.get_origin(field_type) is tuple:
        item_type = typing.get_args(field_type)[0]
        if key in ONE_FOR_ALL and isinstance(value, (int, float)) and not isinstance(value, bool):
            return (float(value),)  # e.g. vision.image_mean = 0.5 in a config file: every channel's
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list of {item_type.__name__}s, got {value!r}")
        return tuple(coerce(item, item_type, key) for item in value)
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
    if typing.get_origin(field_type) is tuple:
        return f"a comma-separated list of {typing.get_args(field_type)[0].__name__}s"
    name = getattr(field_type, "__name__", str(field_type))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)
