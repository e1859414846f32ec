"""Config validation: every impossible setting fails at start, before JAX is imported, in one line
that names the key and the fix. Plain arithmetic on the config: no model or JAX code is imported, so
a mistake costs no JAX start-up. jaxpar.config re-exports `validate` and the helpers below."""

from __future__ import annotations

from jaxpar.config.schema import (ACTION_HEADS, ATTENTION_KINDS, FP8_BINS, FP8_GATHERS, FP8_RECIPES, NAN_GUARDS, OFFLOAD_UPDATES,
                                  PIPELINE_SCHEDULES, REMAT_POLICIES, RESIZE_FILTERS, ActionConfig, Config, VisionConfig,
                                  vla_sequence_layout)
from jaxpar.errors import ConfigError

def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Every impossible layout fails here, before any compilation, with the key and the fix."""
    _validate_ranges(config)
    _validate_layout(config)
    _validate_eval_sources(config)  # after the layout checks, which name an unknown model.kind first
    _validate_offload(config)


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
    _require(train.nan_guard in NAN_GUARDS,
             f"train.nan_guard='{train.nan_guard}' is unknown; use {', '.join(NAN_GUARDS)}")
    _require(config.checkpoint.every >= 0 and config.checkpoint.keep >= 1,
             "checkpoint.every must be >= 0 (0: at the end only) and checkpoint.keep >= 1")
    for key, value in (("eval.every", config.eval.every), ("eval.batches", config.eval.batches),
                       ("data.workers", config.data.workers), ("hardware.memory_gb", config.hardware.memory_gb)):
        _require(value >= 0, f"{key}={value} must be >= 0")
    _require(not config.data.eval or config.data.train, f"data.eval='{config.data.eval}' needs data.train: "
                                                        f"evaluation runs on real data; set data.train too")
    _require(train.warmup_steps >= 0, f"train.warmup_steps={train.warmup_steps} must be >= 0")
    _require(config.zero.stage in (0, 1, 2, 3), f"zero.stage={config.zero.stage} is out of range; use 0, 1, 2 or 3")
    _require(config.remat.policy in REMAT_POLICIES,
             f"remat.policy='{config.remat.policy}' is unknown; use one of {', '.join(REMAT_POLICIES)}")
    _require(config.precision in ("fp32", "bf16", "fp8"),
             f"precision='{config.precision}' is unknown; use fp32, bf16 or fp8")
    _require(config.fp8.recipe in FP8_RECIPES,
             f"fp8.recipe='{config.fp8.recipe}' is unknown; use {' or '.join(FP8_RECIPES)}")
    _require(config.fp8.amax_history >= 1,
             f"fp8.amax_history={config.fp8.amax_history} must be >= 1 (the steps whose amaxes delayed scaling keeps)")
    _require(config.fp8.zero3_gather in FP8_GATHERS,
             f"fp8.zero3_gather='{config.fp8.zero3_gather}' is unknown; use fp8 or bf16")
    _require(config.grad_reduce in ("fp32", "bf16"),
             f"grad_reduce='{config.grad_reduce}' is unknown; use fp32 or bf16")
    for key, value, allowed in (("model.attention", config.model.attention, ATTENTION_KINDS),
                                ("vision.attention", config.vision.attention, ("",) + ATTENTION_KINDS)):
        _require(value in allowed, f"{key}='{value}' is unknown; use one of {', '.join(ATTENTION_KINDS)}")
    profile_steps(config)  # raises on a malformed or out-of-range range


def _validate_offload(config: Config) -> None:
    """Parameter offload rides on ZeRO-3's per-layer gathers with full remat (the weights come in one
    layer ahead and leave again); the host update needs state that lives on the host."""
    off = config.offload
    _require(off.update in OFFLOAD_UPDATES, f"offload.update='{off.update}' is unknown; use device or host")
    if off.params:
        _require(config.zero.stage == 3 and config.remat.policy == "full" and config.zero.prefetch,
                 f"offload.params=true copies each layer's ZeRO-3 shard in one layer ahead, which needs zero.stage=3, "
                 f"remat.policy=full and zero.prefetch=true (here {config.zero.stage}, {config.remat.policy}, "
                 f"{str(config.zero.prefetch).lower()}); set them or turn offload.params off")
    if off.update == "host":
        _require(off.optimizer and (off.master_weights or config.precision == "fp32"),
                 "offload.update=host updates the optimizer state where it lives, on the host; set "
                 "offload.optimizer=true (and offload.master_weights=true with bf16) too, or offload.update=device")


def _validate_eval_sources(config: Config) -> None:
    data, rollouts = config.data, config.eval.rollouts
    _require(data.demo_format in ("npz", "lerobot"), f"data.demo_format='{data.demo_format}' is unknown; "
                                                        f"use npz or lerobot")
    _require(data.eval_episodes >= 0 and rollouts >= 0, "data.eval_episodes and eval.rollouts must be >= 0")
    _require(not (data.eval and data.eval_episodes), f"data.eval='{data.eval}' and data.eval_episodes="
                                                     f"{data.eval_episodes} both name held-out data; set one")
    _require(not data.eval_episodes or data.train, "data.eval_episodes holds episodes of data.train out; set data.train")
    _require(not rollouts or config.model.kind == "vla", "eval.rollouts runs the VLA in closed loop; it needs "
                                                         "model.kind=vla")
    _require(not data.cameras or config.model.kind == "vla", "data.cameras picks a VLA's cameras; it needs "
                                                             "model.kind=vla")


def has_evaluation(config: Config) -> bool:
    """Whether a run evaluates: held-out data (its own directory or episodes held out) or rollouts."""
    return bool(config.data.eval or config.data.eval_episodes or config.eval.rollouts)


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
    _validate_context_parallel(config)
    splits = ("mesh.dp x pipeline.microbatches", config.pipeline.microbatches) if mesh.pp > 1 else \
        ("mesh.dp x train.grad_accum", train.grad_accum)
    per_step = mesh.dp * splits[1]
    _require(train.global_batch_size % per_step == 0,
             f"train.global_batch_size={train.global_batch_size} is not divisible by {splits[0]} "
             f"= {mesh.dp} x {splits[1]}; use a multiple of {per_step}")
    if config.zero.stage >= 1:
        ways = mesh.dp * mesh.cp
        over = "dp" if mesh.cp == 1 else "dp x cp"
        _require(model.d_model % ways == 0,
                 f"zero.stage={config.zero.stage} shards states over {over} on the d_model dim, but mesh.{over.replace(' x ', ' x mesh.')}"
                 f"={ways} does not divide model.d_model={model.d_model}; pick a layout that divides it or zero.stage=0")
        _require(not config.fp8_delayed or FP8_BINS % ways == 0,
                 f"fp8.recipe=delayed keeps {FP8_BINS} exponent bins per operand, which zero.stage={config.zero.stage} "
                 f"shards over {over}={ways}; use a {over} that divides {FP8_BINS}, zero.stage=0 or fp8.recipe=current")


def _validate_context_parallel(config: Config) -> None:
    """Context parallelism splits the sequence over cp in 2 cp chunks (balanced causal work), for
    the Llama and the VLA's LLM (docs/design.md, "Context parallelism")."""
    mesh = config.mesh
    _require(mesh.cp >= 1, f"mesh.cp={mesh.cp} must be >= 1")
    _require(mesh.cp_strategy in ("all_gather", "ring", "ulysses"),
             f"mesh.cp_strategy='{mesh.cp_strategy}' is unknown; use all_gather, ring or ulysses")
    if mesh.cp == 1:
        return
    if mesh.cp_strategy == "ulysses":  # each cp rank takes 1/cp of its tp rank's heads (jaxpar.layers.ulysses)
        model = config.model
        _require(model.n_heads % (mesh.cp * mesh.tp) == 0,
                 f"mesh.cp_strategy=ulysses splits the {model.n_heads} query heads over cp x tp = {mesh.cp * mesh.tp}, "
                 f"which does not divide them; use a cp x tp that divides {model.n_heads}, or cp_strategy=all_gather or ring")
        kv = max(model.n_kv_heads // mesh.tp, 1)  # a tp rank's KV heads (one, shared, with more ranks than heads)
        _require(kv % mesh.cp == 0 or mesh.cp % kv == 0,
                 f"mesh.cp_strategy=ulysses splits each tp rank's {kv} KV heads over cp={mesh.cp} (or repeats them "
                 f"to cp), which neither divides; use a cp dividing or divisible by {kv}, or cp_strategy=all_gather or ring")
    seq, name = config.train.seq_len, "train.seq_len"
    if config.model.kind == "vla":
        seq, name = vla_sequence_layout(config)[2], "VLA sequence (image + instruction + action tokens)"
    _require(seq % (2 * mesh.cp * (mesh.tp if mesh.sequence_parallel else 1)) == 0,
             f"mesh.cp={mesh.cp} cuts the {name}={seq} into 2 x cp chunks"
             f"{' each split over tp' if mesh.sequence_parallel else ''}, which do not divide it; make it a "
             f"multiple of {2 * mesh.cp * (mesh.tp if mesh.sequence_parallel else 1)}")


def _validate_sequence_parallel(config: Config) -> None:
    """Sequence parallelism splits the LLM's sequence (a VLA's: image + instruction + action tokens) over tp."""
    tp, mode = config.mesh.tp, config.mesh.collective_matmul
    _require(mode in ("auto", "on", "off"), f"mesh.collective_matmul='{mode}' is unknown; use auto, on or off")
    _require(mode != "on" or config.mesh.sequence_parallel,
             "mesh.collective_matmul=on decomposes sequence parallelism's all-gather / reduce-scatter; set "
             "mesh.sequence_parallel=true or leave it auto")
    _require(mode != "on" or config.pipeline.schedule != "zb" or config.mesh.pp == 1,
             "mesh.collective_matmul=on does not run in a zb pipeline (its split backward defers each linear's "
             "weight gradient); use pipeline.schedule=1f1b or leave it auto")
    if not config.mesh.sequence_parallel:
        return
    _require(tp > 1, "mesh.sequence_parallel=true needs mesh.tp > 1 (it splits the sequence over tp); "
                     "set mesh.tp > 1 or turn it off")
    seq, name = config.train.seq_len, "train.seq_len"
    if config.model.kind == "vla":
        seq, name = vla_sequence_layout(config)[2], "VLA sequence (image + instruction + action tokens)"
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
    _require(act.head in ACTION_HEADS, f"actions.head={act.head!r} is unknown; use one of {', '.join(ACTION_HEADS)}")
    _require(act.head == "tokens" or not model.text_loss,
             f"model.text_loss needs the LM head's logits on the instruction, which actions.head={act.head} does not "
             f"compute; set model.text_loss=false, or actions.head=tokens")
    _validate_vla_inits(config)
    _validate_pixels(vis)
    _require(vis.remat.policy in REMAT_POLICIES, f"vision.remat.policy='{vis.remat.policy}' is unknown; "
                                                 f"use one of {', '.join(REMAT_POLICIES)}")
    text_vocab = model.vocab_size - act.bins
    _require(act.bins >= 2 and text_vocab >= 2,
             f"actions.bins={act.bins} reserves the last {act.bins} of model.vocab_size={model.vocab_size} ids "
             f"for actions and leaves {text_vocab} for text; raise model.vocab_size or lower actions.bins")
    _require(act.dims >= 1 and act.instruction_len >= 1 and act.high > act.low,
             "actions.dims and actions.instruction_len must be >= 1 and actions.high > actions.low")
    _require(act.chunk >= 1, f"actions.chunk={act.chunk}: predict at least 1 step per call")
    _require(0 <= act.execute <= act.chunk,
             f"actions.execute={act.execute}: run 1 to actions.chunk={act.chunk} steps of each chunk before the next "
             f"policy call, or 0 for all of them")
    _require(act.flow_steps >= 1, f"actions.flow_steps={act.flow_steps}: the flow head integrates from noise in at "
                                  f"least 1 step; use 10 (pi0's)")
    _require(not act.parallel_slots or model.prefix_lm,
             f"actions.chunk={act.chunk} with actions.head={act.head} decodes its slots at once, each seeing the others "
             f"(bidirectional), which needs model.prefix_lm=true; set it, or actions.chunk=1 with the tokens head")
    _validate_action_range(act)
    data_ways = mesh.size // vis.tp  # devices that split the images
    per_dp = config.train.global_batch_size // mesh.dp
    _require(per_dp % (data_ways // mesh.dp) == 0,
             f"train.global_batch_size={config.train.global_batch_size}: the vision encoder splits each dp "
             f"shard's {per_dp} examples over {data_ways // mesh.dp} devices (mesh.pp{' x mesh.cp' if mesh.cp > 1 else ''} x mesh.tp / vision.tp); "
             f"use a global batch divisible by {data_ways}")
    if vis.zero.stage >= 1:
        _require(vis.width % data_ways == 0 and model.d_model % data_ways == 0,
                 f"vision.zero.stage={vis.zero.stage} shards the vision weights over {data_ways} devices, which "
                 f"must divide vision.width={vis.width} and model.d_model={model.d_model}")


def _validate_action_range(act: ActionConfig) -> None:
    tokenizer = act.instruction_tokenizer
    _require(tokenizer in ("auto", "bytes") or tokenizer.endswith(".json"),
             f"actions.instruction_tokenizer='{tokenizer}' is unknown; use auto, bytes or a Hugging Face "
             f"tokenizer.json file")
    _require(act.normalization in ("auto", "bounds", "quantile"),
             f"actions.normalization='{act.normalization}' is unknown; use auto, bounds or quantile")
    _require(len(act.q01) == len(act.q99) and len(act.q01) in (0, act.dims),
             f"actions.q01 / actions.q99 have {len(act.q01)} / {len(act.q99)} values for actions.dims={act.dims}; "
             f"give one per dim or leave both empty (read from the data)")
    _require(not act.q01 or act.normalization != "bounds",
             "actions.q01 / q99 are set but actions.normalization=bounds; use quantile, or drop q01 / q99")
    _require(all(lo <= hi for lo, hi in zip(act.q01, act.q99)), "actions.q01 must be <= actions.q99 in every dim")


def _validate_pixels(vis: VisionConfig) -> None:
    for key in ("image_mean", "image_std"):
        values = getattr(vis, key)
        _require(len(values) in (1, vis.channels),
                 f"vision.{key}={list(values)}: give one value per channel (vision.channels={vis.channels}) "
                 f"or one for all")
    _require(all(s > 0 for s in vis.image_std), f"vision.image_std={list(vis.image_std)} must be > 0 in every channel")
    _require(vis.resize in RESIZE_FILTERS,
             f"vision.resize='{vis.resize}' is unknown; use one of {', '.join(RESIZE_FILTERS)}")
    _require(vis.state_dims >= 0, f"vision.state_dims={vis.state_dims} must be >= 0 (0: no proprioceptive state)")
    _require(len(vis.state_low) == len(vis.state_high) and len(vis.state_low) in (0, vis.state_dims),
             f"vision.state_low / state_high have {len(vis.state_low)} / {len(vis.state_high)} values for "
             f"vision.state_dims={vis.state_dims}; give one per dim in each, or neither ([-1, 1])")
    _require(all(lo <= hi for lo, hi in zip(vis.state_low, vis.state_high)),
             "vision.state_low must be <= vision.state_high in every dim")


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
    # ZeRO-3 would gather every stage's weights once per microbatch; DeepSpeed refuses it too
    _require(config.zero.stage < 3, f"zero.stage={config.zero.stage} with mesh.pp={mesh.pp} is refused (as in "
                                    f"DeepSpeed): use zero.stage 0, 1 or 2 with pipeline parallelism")
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
