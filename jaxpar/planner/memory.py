"""Analytic per-device memory of one train step: model states by ZeRO stage, activations by remat
policy and pipeline schedule, gradients, the largest temporaries, and a peak.

Not a call to the compiler: formulas from the ZeRO paper (states), Korthikanti et al. (activations,
counted for jaxpar's own layers: RMSNorm and RoPE in fp32, XLA attention with fp32 [b, h, s, s]
scores and probabilities, SwiGLU), and the 1F1B stash of in-flight microbatches' residuals. The peak is
the state plus the larger of two phases XLA cannot overlap: the backward (gradients, saved
activations, one layer's recompute + backward working set) and the optimizer update (reduced and
clipped fp32 gradients, Adam's new moments of one leaf, net of the dead bf16 parameters' buffers).
docs/planner.md has the derivation and the comparison with the compiled program.

`target="gpu"` follows what XLA's GPU compiler allocates (the attention kernel `auto` picks, the
optimizer update's conditional copying the state, the pipeline stash allocated whole; docs/planner.md,
"Fit to the GPU compiler"). `target="cpu"` adds what XLA:CPU does and a GPU does not (found in the compiled memory report of the
dry run, docs/planner.md): it widens bf16 to f32, so the bf16 weights get an f32 copy for the
matmuls and the bf16 residual stacks of the layer scan an f32 twin; and its memory analysis counts
host (offloaded) bytes as device bytes. Only used to compare with dry runs on this CPU host.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.config import Config, image_split_ways, image_tokens, nan_guard_for, patches_per_image, sums_own_images
from jaxpar.models import llama, vit, vla
from jaxpar.parallel.schedule import pipeline_table
from jaxpar.parallel.zero import ZeroPlan
from jaxpar.planner import kernels
from jaxpar.sharding import RULES, kv_head_ways, tp_split

SAVE_LINEAR = ("selective", "offload", "dots", "none")  # policies that keep the linear-layer outputs


def seq_len(config: Config) -> int:
    return vla.sequence_layout(config)[2] if config.model.kind == "vla" else config.train.seq_len


def local_seq(config: Config) -> int:
    """Tokens of a sequence on one device: all of them, or 1/cp with context parallelism."""
    return seq_len(config) // config.mesh.cp


def head_positions(config: Config) -> int:
    """Positions of a sequence on one device the LM head runs on: the VLA's action positions when its
    loss reads only those (jaxpar.models.vla.loss_positions: a static slice before the head), else
    every local position."""
    last = vla.loss_positions(config) if config.model.kind == "vla" else None
    return last or local_seq(config)


def head_width(config: Config) -> int:
    """Columns per position of the head's matmuls: the vocabulary (LM head), or the l1 / flow action head's
    D -> D -> D -> dims (jaxpar.models.vla.ACTION_HEAD; the LM head then runs nowhere), split over pp x tp (all
    but the small readout to the dims). The flow head's conditioning (17 -> D, replicated) is left out: 17 / (2 D +
    dims) of it, 0.1% at vla70b's width, 6.5% at vla_metaworld's."""
    if config.model.kind == "vla" and config.actions.continuous:
        return 2 * config.model.d_model + config.actions.dims
    return config.model.vocab_size


def data_ways(config: Config) -> int:
    """Devices holding the same LLM weights with other data, over which gradients are summed and ZeRO
    shards: dp, times cp (context parallelism: other tokens of the same sequences)."""
    return config.mesh.dp * config.mesh.cp


# ----------------------------------------------------------------------------- parameters


def _local_count(shapes: dict, axes: dict, divisors: dict) -> int:
    """Parameters of one shard: each dim divided by the mesh size its logical axis maps to."""
    total = 0
    for name, shape in shapes.items():
        if isinstance(shape, dict):
            total += _local_count(shape, axes[name], divisors)
            continue
        total += math.prod(size // divisors.get(axis, 1) for size, axis in zip(shape, axes[name]))
    return total


def local_params(config: Config) -> dict[str, int]:
    """Parameter counts per device before ZeRO: LLM layers (split over pp and tp), LLM embedding and
    head (vocabulary-parallel: split over tp, and with a pipeline over pp x tp, as jaxpar.sharding's
    llm_rules), vision encoder + projector (split over vision.tp)."""
    mesh = config.mesh
    sizes = {"tp": mesh.tp, "pp": mesh.pp}
    llm_div = {axis: sizes[rule] for axis, rule in RULES.items() if rule in sizes}
    llm_div["vocab"] = mesh.pp * mesh.tp
    n_kv, vision_tp = config.model.n_kv_heads, config.vision.tp if config.model.kind == "vla" else 1
    llm_div["kv_heads"] = kv_head_ways(n_kv, mesh.tp, tp_split(mesh.tp, n_kv, vision_tp))
    shapes, axes = llama.param_shapes(config.model), llama.param_axes()
    out = {"llm_layers": _local_count({"layers": shapes["layers"]}, axes, llm_div),
           "llm_rest": _local_count({k: v for k, v in shapes.items() if k != "layers"}, axes, llm_div),
           "llm_head": _local_count({k: shapes[k] for k in llama.HEAD_AXES}, axes, llm_div),  # of llm_rest
           "vision": 0}
    if config.model.kind == "vla":
        vdiv = {"vit_heads": config.vision.tp, "vit_mlp": config.vision.tp, "proj_mlp": config.vision.tp}
        out["vision"] = _local_count(vit.param_shapes(config.vision, config.model.d_model), vit.param_axes(config.vision), vdiv)
        if config.actions.continuous:  # the l1 / flow head's MLP beside the LM head (split like the vocabulary)
            mlp = _local_count({vla.ACTION_HEAD: vla.action_head_shapes(config)},
                               {vla.ACTION_HEAD: vla.action_head_axes(config)},
                               {"action_mlp": mesh.pp * mesh.tp})
            out["llm_rest"] += mlp
            out["llm_head"] += mlp
    return out


def linear_params(config: Config) -> int:
    """The LLM layers' linear weights on one device (local_params' llm_layers less the two norms of each
    layer, which tp does not split): what precision=fp8 multiplies in FP8."""
    return local_params(config)["llm_layers"] - config.model.n_layers // config.mesh.pp * 2 * config.model.d_model


def fp8_gathers(config: Config) -> bool:
    """Whether ZeRO-3 gathers the linears' weights as E4M3 (fp8.zero3_gather; jaxpar.layers.fp8.all_gather_fp8)."""
    return (config.precision == "fp8" and config.fp8.zero3_gather == "fp8" and config.zero.stage >= 3
            and data_ways(config) > 1)


def vision_data_ways(config: Config) -> int:
    """Devices that split the VLA's images (the encoder's data-parallel and ZeRO degree)."""
    return config.mesh.size // config.vision.tp


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True)
class Block:
    """One transformer layer's local dims as the activation formulas need them."""

    d: int  # model width
    q: int  # local query heads x head_dim
    kv: int  # local kv heads x head_dim
    f: int  # local MLP width
    heads: int  # local query heads
    gated: bool  # SwiGLU (two up projections) or GELU (one)
    seq_split: int = 1  # sequence parallelism: the residual stream is split over tp along S
    cudnn: bool = False  # cuDNN flash attention: no [b, h, s, s] tensor in memory (planner/kernels.py)
    gpu: bool = False  # XLA's GPU compiler (fuses the softmax: fewer [b, h, s, s] buffers than XLA:CPU)
    context: int = 1  # context parallelism: s is this rank's 1/cp of the sequence, its keys all cp s
    gathers_context: bool = False  # cp_strategy=all_gather: the whole sequence's K / V gathered on each rank
    # the share of the s x (context s) query-key pairs the attention kernels compute (attention_share): all of
    # them on XLA; cuDNN's causal kernel skips half; under context parallelism jaxpar.layers.ring's blocks
    # (cuDNN 1/2, XLA's block math (cp + 1) / 2 cp: its causal diagonal block whole) plus a VLA prefix's P / S
    attention_share: float = 1.0
    trades_heads: bool = False  # cp_strategy=ulysses: the whole sequence for 1/cp of the heads (jaxpar.layers.ulysses)
    regathers: bool = False  # ZeRO-3 over > 1 device: no all-gathered tensor is kept (parallel.zero.never_keep_gathered)

    def saved_scores(self, b: int, s: int) -> int:
        """Score elements a layer keeps for its backward: XLA's [b, h, s, s]; none with cuDNN (its fp32 [b, h, s]
        statistics) or under context parallelism (jaxpar.layers.ring's custom_vjps keep q, k, v, the output and
        the statistics; a block's scores live only while it is computed)."""
        if self.cudnn or (self.context > 1 and not self.trades_heads):
            return 0
        return b * self.heads * s * s * self.context  # ulysses: heads / cp of them over S x S = heads x s x S

    def block_scores(self, b: int, s: int) -> int:
        """Score elements of the largest attention call's scores while it runs: XLA's [b, h, s, s] (under cp
        the own block, 2 c x 2 c = the rank's s x s; the others are half); none with cuDNN (in the kernel)."""
        return 0 if self.cudnn else b * self.heads * s * s * (self.context if self.trades_heads else 1)


def attention_share(config: Config) -> float:
    """Block.attention_share of the LLM: the share of its query-key pairs the kernels compute. cuDNN's causal
    mask type skips the masked half (jaxpar.compiler.hlo_flops.fmha_flops counts the compiled calls so); XLA
    computes every pair, as cuDNN does under a prefix-LM's dense bias. Under cp, jaxpar.layers.ring's blocks."""
    cp, model = config.mesh.cp, config.model
    prefix = model.kind == "vla" and model.prefix_lm
    cudnn = model.attention == "cudnn"
    if model.kind == "vla" and vla.prefix_len(config) >= seq_len(config):  # action chunks: one unmasked call, also
        return 1.0  # under cp (against the gathered keys: jaxpar.layers.collectives.context_attention), no block
    if cp <= 1 or config.mesh.cp_strategy == "ulysses":  # (ulysses: one device's kernel on 1/cp of the heads)
        return 0.5 if cudnn and not prefix else 1.0
    share = 0.5 if cudnn else (cp + 1) / (2 * cp)
    if prefix:  # the prefix's rows: one unmasked call against its keys
        share += vla.prefix_len(config) / seq_len(config)
    return share


def llm_block(config: Config, target: str = "cpu") -> Block:
    m, tp = config.model, config.mesh.tp
    return Block(m.d_model, m.n_heads // tp * m.head_dim, max(m.n_kv_heads // tp, 1) * m.head_dim, m.d_ff // tp,
                 m.n_heads // tp, True, tp if config.mesh.sequence_parallel else 1, m.attention == "cudnn",
                 target == "gpu", config.mesh.cp, config.mesh.cp > 1 and config.mesh.cp_strategy == "all_gather",
                 attention_share(config), config.mesh.cp > 1 and config.mesh.cp_strategy == "ulysses",
                 config.zero.stage >= 3 and data_ways(config) > 1)


def vit_block(config: Config, target: str = "cpu") -> Block:
    v, tp = config.vision, config.vision.tp
    return Block(v.width, v.width // tp, v.width // tp, v.mlp_dim // tp, v.n_heads // tp, False,
                 cudnn=(v.attention or config.model.attention) == "cudnn", gpu=target == "gpu")


def saved_per_layer(policy: str, blk: Block, b: int, s: int, c: int) -> tuple[float, float]:
    """(bytes kept on device, bytes kept in host memory) per layer for the backward, `c` = compute
    dtype bytes, b sequences of s tokens. Names are jaxpar's checkpoint_name tags (parallel/remat.py)."""
    t = b * s
    ups = 2 if blk.gated else 1
    layer_input = c * t * blk.d / blk.seq_split  # sequence parallel: residual-stream tensors are S / tp long
    linear = c * t * (2 * blk.q + 2 * blk.kv + 2 * blk.d / blk.seq_split + ups * blk.f)  # q k v attn_out, attn_proj mlp_out, up(s)
    scores = blk.saved_scores(b, s)  # cuDNN keeps only fp32 [b, h, s] softmax statistics
    # context parallelism's all_gather: the other ranks' K and V, kept by the policies that keep everything
    # (the others save the named local projections and gather again in the backward; the ring keeps none)
    gathered = c * t * 2 * blk.kv * (blk.context - 1) if blk.gathers_context else 0
    if policy == "full":
        return layer_input, 0.0
    if policy == "offload":  # what the GPU-compiled program copies to the host: the named outputs the
        # backward reads (mlp_out, added to the residual stream, is none: JAX keeps only residuals) and
        # cuDNN's fp32 softmax statistics [b, h, s]
        offloaded = linear - c * t * blk.d / blk.seq_split + (4 * b * blk.heads * s if blk.cudnn else 0)
        return layer_input, offloaded
    if policy == "selective":  # the GPU program keeps no mlp_out (JAX keeps only residuals, as for offload)
        return layer_input + linear - (c * t * blk.d / blk.seq_split if blk.gpu else 0), 0.0
    if policy == "dots":  # + the fp32 attention scores matmul output and the MLP hidden
        return layer_input + linear + gathered + 4 * scores + c * t * blk.f, 0.0
    if blk.gpu and blk.gated:  # a Llama layer on the GPU: the compiled program's residual stacks
        return _kept_without_remat_on_gpu(blk, b, s, c) + (0 if blk.regathers else gathered), 0.0
    # none: + norm outputs (sequence parallel: the all-gathered ones the projections keep, full length), fp32
    # RoPE'd q / k, the MLP's hidden (SwiGLU's rule keeps gate and up, counted in `linear`, and the down
    # projection its input; a GELU MLP two [t, f]), and per score element 10 bytes: what the compiled program
    # keeps of XLA attention beyond them (JAX's own residuals are the fp32 and compute-dtype probabilities).
    # XLA:CPU kept 14 while the norms kept their fp32 normalised values; with the norms' and SwiGLU's own
    # backward rules (jaxpar.layers.norm, mlp) it keeps 10, the GPU compiler's figure (docs/planner.md)
    extra = c * t * (2 * blk.d + (1 if blk.gated else 2) * blk.f) + 4 * t * (blk.q + blk.kv) + 10 * scores
    return layer_input + linear + gathered + extra, 0.0


def _kept_without_remat_on_gpu(blk: Block, b: int, s: int, c: int) -> float:
    """remat none, a Llama layer on XLA's GPU compiler: the forward scan's residual stacks, which are
    JAX's residuals (docs/planner.md, "remat none on the GPU"). Each RMSNorm keeps its input in the
    compute dtype (its own backward rule, jaxpar.layers.norm), [t, d] with
    sequence parallelism split over tp; the norm outputs feed the projections (the all-gathered ones
    with sequence parallelism, unless ZeRO-3's policy drops every all-gather: then the local shard); q,
    k, v (RoPE'd) and the attention output in the compute dtype; SwiGLU keeps gate and up (its rule,
    jaxpar.layers.mlp.swiglu) and the down projection its input, three [t, f]; no projection output
    (attn_proj, mlp_out: JAX keeps only residuals). Attention: cuDNN's fp32 statistics, or XLA's fp32
    scores and compute-dtype probabilities (the stacks JAX keeps) and 4 bytes per score element more
    that the GPU program holds (10 in all, the earlier fit's figure). Context parallelism's gathered K
    and V are the caller's, kept unless ZeRO-3 drops all-gathers."""
    t = b * s
    norm_inputs = 2 * c * t * blk.d / blk.seq_split
    norm_outputs = 2 * c * t * blk.d / (blk.seq_split if blk.regathers else 1)
    projections = c * t * (2 * blk.q + 2 * blk.kv)
    swiglu = 3 * c * t * blk.f
    kept = blk.saved_scores(b, s)
    attention = (4 + 4 + c) * kept if kept else 4 * b * blk.heads * s
    return norm_inputs + norm_outputs + projections + swiglu + attention


def layer_working_set(policy: str, blk: Block, b: int, s: int, c: int) -> float:
    """Bytes live while one layer runs its backward: recomputed fp32 scores / probabilities (unless
    kept), their fp32 cotangents, and fp32 cotangents of the layer's activations. cuDNN attention
    recomputes its scores block by block inside the kernel: none of them is in memory."""
    t, scores = b * s, blk.block_scores(b, s)
    recompute = 0 if policy == "none" else (4 + 4 + c) * scores  # scores, probs fp32, probs compute dtype
    cotangents = 8 * scores
    if blk.gpu:  # the GPU compiler fuses the softmax: fp32 scores and compute-dtype probabilities, one fp32 cotangent
        recompute, cotangents = (0 if policy == "none" else (4 + c) * scores), 4 * scores
    return recompute + cotangents + 4 * t * (2 * blk.d + 2 * blk.f) + context_backward(blk, t, c, policy)


def context_backward(blk: Block, t: int, c: int, policy: str = "selective") -> float:
    """Context parallelism's attention backward (jaxpar.layers.ring), beside the block kernels' own: the
    running dq in fp32, one block's dq, dk, dv out of the kernel and in fp32, and the K / V it visits: the
    ring's block and the next one with the travelling dK / dV in fp32 (the running and the sent), or
    all_gather's whole gathered K / V with their gradients in the compute dtype; ulysses' head-sharded copies of
    q, k, v and the output. 0 without cp."""
    if blk.context <= 1:
        return 0.0
    if blk.trades_heads:  # ulysses: q, k, v and the output for 1/cp of the heads, beside the local ones
        return c * t * (2 * blk.q + 2 * blk.kv)
    kv = c * t * 2 * blk.kv  # one rank's K and V
    block = 4 * t * blk.q + (c + 4) * t * (blk.q + 2 * blk.kv)
    if blk.gathers_context:  # the gathered K / V (already among the saved activations where the policy keeps them)
        return block + (1 if policy in ("none", "dots") else 2) * blk.context * kv
    return block + 2 * kv + 2 * 4 * t * 2 * blk.kv


def head_working_set(config: Config, blk: Block, t: int, c: int) -> float:
    """The LM head's fp32 logits slice [t, V/(pp tp)] (the vocabulary is split over pp x tp), its exp
    and its cotangent, plus the final norm. The GPU compiler fuses the exp into its reductions: two
    logits-sized fp32 buffers in every program read (llama1b on one H200, the 3B shape at dp 8 and at
    dp 2 x tp 4); with ZeRO-3 the head's weight is gathered whole and its fp32 gradient is the whole
    [d, V/(pp tp)] until the reduce-scatter (the 3B shape at dp 8: bf16 [3072, 32000] and f32 buffers
    of that shape beside the logits)."""
    vocab = config.model.vocab_size / (config.mesh.pp * config.mesh.tp)
    if not blk.gpu:
        return 3 * 4 * t * vocab + 4 * t * config.model.d_model
    gathered = (c + 4) * vocab * config.model.d_model if blk.regathers else 0
    return 2 * 4 * t * vocab + 4 * t * config.model.d_model + gathered


def logits_cotangent_kept(config: Config, blk: Block, t: int) -> float:
    """The loss's fp32 logits cotangent [t, V/tp], live through the layers' backward on a GPU without a
    pipeline: XLA's GPU schedule computes the head's input gradient before the layer scan's backward and its
    weight gradient (h^T d_logits) after it, so d_logits waits there (llama7b's GPU program, at 4,096 and at
    131,072 tokens under cp: `input_scatter_fusion` at the peak; docs/planner.md "Fit to the GPU compiler").
    XLA:CPU orders the weight gradient first (jaxpar.layers.order's use_weights); with a pipeline the head
    runs inside the last stage's tick."""
    if not blk.gpu or config.mesh.pp > 1:
        return 0.0
    return 4 * t * config.model.vocab_size / config.mesh.tp


# ----------------------------------------------------------------------------- the estimate


def microbatch(config: Config) -> int:
    """Sequences per device in one forward/backward pass of the LLM."""
    mesh, train = config.mesh, config.train
    splits = config.pipeline.microbatches if mesh.pp > 1 else train.grad_accum
    return train.global_batch_size // mesh.dp // splits


def optimizer_params(config: Config, counts: dict) -> float:
    """Parameters one device's optimizer updates: its ZeRO 1-3 shard (1/dp of the LLM, 1/(devices /
    vision.tp) of the encoder), or all it holds at ZeRO-0."""
    dp, z, vz = data_ways(config), config.zero.stage, config.vision.zero.stage
    dv = vision_data_ways(config) if config.model.kind == "vla" else 1
    llm = counts["llm_layers"] + counts["llm_rest"]
    return llm / (dp if z >= 1 else 1) + counts["vision"] / (dv if vz >= 1 else 1)


def offloaded_params(config: Config, counts: dict, c: int) -> dict[str, float]:
    """offload.params (ZeRO-3, full remat, prefetch): the LLM's compute-dtype shards (every LLM leaf,
    jaxpar.parallel.step's offloaded_params; the encoder stays) live in host memory. The device keeps
    only the shards in flight: the layer computing and the one copied in ahead of it (their gathered
    full weights are the backward's prefetch term, _gradients, as without offload)."""
    if not config.offload.params:
        return {"host": 0.0, "in_flight": 0.0}
    dp = data_ways(config)
    per_layer = counts["llm_layers"] / (config.model.n_layers // config.mesh.pp)
    return {"host": c * (counts["llm_layers"] + counts["llm_rest"]) / dp, "in_flight": 2 * c * per_layer / dp}


def _states(config: Config, counts: dict, c: int, target: str) -> dict:
    """Model-state bytes per device (ZeRO table) and where the optimizer state and (offload.params) the
    parameters live. `params` is every compute-dtype byte one device owns, wherever it lives;
    `params_device` what of it is in device memory (on the CPU target all of it: XLA:CPU's memory
    analysis counts host bytes as device bytes)."""
    z = config.zero.stage
    llm = counts["llm_layers"] + counts["llm_rest"]
    opt_params = optimizer_params(config, counts)
    master = 4 * opt_params if config.bf16_compute else 0.0
    adam = 8 * opt_params
    off = config.offload
    host = (adam if off.optimizer else 0.0) + (master if off.optimizer and off.master_weights else 0.0)
    moved = offloaded_params(config, counts, c)
    params = c * (llm / (data_ways(config) if z >= 3 else 1) + counts["vision"])
    params_device = params if target == "cpu" else params - moved["host"] + moved["in_flight"]
    out = {"params": params, "params_device": params_device, "params_on_host": moved["host"], "master": master,
           "optimizer": adam, "opt_on_host": host, "opt_params": opt_params}
    out["device_state"] = params_device + master + adam - (0.0 if target == "cpu" else host)
    return out


def host_update(config: Config) -> bool:
    """offload.update=host: AdamW runs on the host CPU where the offloaded state lives."""
    return config.offload.optimizer and config.offload.update == "host"


def grad_bytes(config: Config) -> int:
    """Bytes per element of the reduced gradients (grad_reduce's dtype; fp32 runs reduce fp32)."""
    return 4 if config.grad_reduce == "fp32" or not config.bf16_compute else 2


def host_memory(config: Config, st: dict) -> dict[str, float]:
    """Pinned host bytes one device's process holds: the offloaded optimizer state (and master), the
    offloaded parameter shards, and with the host update the gradient shard it receives (fp32 once
    widened for Adam: 4 bytes per optimizer-sharded element)."""
    grads = 4 * st["opt_params"] if host_update(config) else 0.0
    return {"optimizer": st["opt_on_host"], "params": st["params_on_host"], "gradients": grads,
            "total": st["opt_on_host"] + st["params_on_host"] + grads}


def _activations(config: Config, c: int, target: str) -> dict:
    """Saved activations (all layers / in-flight microbatches) and the largest working set."""
    m, pp, policy = config.model, config.mesh.pp, config.remat.policy
    b, s = microbatch(config), local_seq(config)
    blk, layers = llm_block(config, target), m.n_layers // pp
    dev, host = saved_per_layer(policy, blk, b, s, c)
    live_mb, ring = _pipeline_live(config, c * b * s * m.d_model / blk.seq_split, target)
    saved = live_mb * layers * dev
    if target == "gpu" and pp == 1 and config.train.grad_accum > 1:
        # XLA's while-loop double buffering unrolls the accumulation loop by two, and the program keeps both
        # halves' saved activations (docs/design.md, "Gradient accumulation scans every microbatch")
        saved *= 2
    host_saved = live_mb * layers * host
    head_tokens = b * head_positions(config)
    layer_work = layer_working_set(policy, blk, b, s, c) + logits_cotangent_kept(config, blk, head_tokens)
    work = max(layer_work, head_working_set(config, blk, head_tokens, c))
    out = {"saved": saved, "saved_host": host_saved, "pipeline_buffers": ring, "working_set": work,
           "cpu_f32_twins": 0.0}
    if target == "cpu":  # the host bytes count, and bf16 residual stacks get an f32 twin
        out["saved"] += host_saved
        if config.bf16_compute:  # the layer-input stack is held in f32: 4 - c more bytes per element
            out["cpu_f32_twins"] = (4 - c) * live_mb * layers * b * s * m.d_model / blk.seq_split
    if pp > 1 and config.pipeline.schedule == "zb":
        out["saved"] += _zero_bubble_kept(config, blk, b * s, c, target) * layers
    if m.kind == "vla":
        out.update(_vision_activations(config, c, target))
    return out


def _zero_bubble_kept(config: Config, blk: Block, tokens: int, c: int, target: str) -> float:
    """Bytes per layer zb keeps beside the residuals for its W slots (jaxpar.parallel.split_backward):
    each linear's distinct input (the attention's and the MLP's normed inputs, the attention output,
    the MLP's hidden) for every stash entry, and each linear's output gradient (q, k, v, out, the up
    projections, down) for every entry but the spare. XLA:CPU reuses dead entries' bytes (the table's
    peak in flight); a GPU program holds them all."""
    table = pipeline_table(config)
    entries = table.stash_slots + 1 if target == "gpu" else int(max(table.in_flight()))
    ups = 2 if blk.gated else 1
    inputs = 2 * blk.d + blk.q + blk.f
    output_grads = blk.q + 2 * blk.kv + 2 * blk.d + ups * blk.f
    return c * tokens * entries * (inputs + output_grads)


def _pipeline_live(config: Config, activation: float, target: str = "cpu") -> tuple[float, float]:
    """(stages' worth of layer residuals alive at the backward's peak, bytes of stage inputs and receive
    buffers). GPipe keeps every tick's residuals (masked ones too); the 1F1B / zb runtime keeps each
    in-flight chunk's vjp residuals (the schedule table's in_flight(): up to 2p-1 microbatches on stage
    0, each 1/v of the stage); with pipeline.stage_recompute only stage inputs wait, and one stage's
    residuals exist at a time. Without pp: the one pass.

    On a GPU the stash is one buffer of stash_slots + 1 entries (the spare that idle slots write), all
    of it live through the tick loop (XLA:CPU's buffer assignment reuses the dead entries' bytes), and
    the running tick's chunk residuals are a further buffer beside it (the 3B-shaped pp 2 x tp 4 1F1B
    program: a [4 slots, 4 layers, ...] stash and [4 layers, ...] stacks of one microbatch)."""
    pp, m, kind = config.mesh.pp, config.pipeline.microbatches, config.pipeline.schedule
    if pp == 1:
        return 1.0, 0.0
    if kind == "gpipe":
        return float(m + pp - 1), 0.0
    table = pipeline_table(config)
    in_flight = int(max(table.in_flight()))
    if target == "gpu":
        in_flight = table.stash_slots + 1
    if config.pipeline.stage_recompute:
        return 1.0, (in_flight + 2) * activation
    fresh = 1 if target == "gpu" else 0  # the tick's own chunk residuals, written beside the stash before
    # their copy into it; the m first-input gradients summed over pp in the ticks' G slots wait in an [m, ...]
    # buffer for the first input's backward after the ticks (jaxpar.parallel.first_input, issue 46)
    return (in_flight + fresh) / config.pipeline.virtual_stages, (2 + m) * activation


def _vision_activations(config: Config, c: int, target: str) -> dict:
    """The encoder's saved activations and working set, plus the image tokens and their cotangent."""
    v = config.vision
    images = config.train.global_batch_size // vision_data_ways(config) * v.cameras
    n = patches_per_image(v)
    blk = vit_block(config, target)
    dev, host = saved_per_layer(v.remat.policy, blk, images, n, c)
    if target == "cpu":
        dev += host
    tokens = config.train.global_batch_size // config.mesh.dp * image_tokens(v) * config.model.d_model
    if sums_own_images(config):  # a rank holds its own images' tokens only
        tokens //= image_split_ways(config)
    return {"vision_saved": v.depth * dev, "vision_working_set": layer_working_set(v.remat.policy, blk, images, n, c),
            "image_tokens": (c + 4) * tokens}  # the assembled tokens and their fp32 cotangent accumulator


def _gradients(config: Config, counts: dict, c: int, target: str = "cpu") -> dict:
    """Gradient bytes while the backward runs, and during the optimizer update."""
    mesh, z = config.mesh, config.zero.stage
    dp, pp = data_ways(config), mesh.pp
    llm = counts["llm_layers"] + counts["llm_rest"]
    plan = ZeroPlan(z, dp, pp > 1, config.remat.policy, config.zero.prefetch, config.train.grad_accum)
    # reduce-scattered layer by layer in the backward (ZeRO 1-2's taps: grad_reduce's dtype; ZeRO-3's gathers)
    scatter = dp if (plan.taps_grads or plan.gathers_weights) and pp == 1 else 1
    # ZeRO-3's gathers widen the cotangent to grad_reduce's dtype before their reduce-scatter, and the
    # layer scan stacks the reduced shards so (jaxpar.parallel.zero: the gradient sinks)
    tapped = grad_bytes(config) if plan.taps_grads or plan.gathers_weights else c
    if pp > 1:  # fp32 accumulators over microbatches + the gradients of the chunk one tick runs (the
        # whole stage with v = 1; with interleaving a tick differentiates 1/v of the stage's layers)
        backward = 4 * llm + c * counts["llm_layers"] / config.pipeline.virtual_stages
        # The GPU program holds the layers' accumulators twice at the backward's peak (the tick loop's
        # carry and its copy), but not with interleaved chunks taken whole after the last tick (v > 1,
        # no early dp reduction cutting them: vla70b, docs/planner.md "Known gaps")
        if target == "gpu" and (config.pipeline.virtual_stages == 1 or plan.reduces_after_backward):
            backward += 4 * counts["llm_layers"]
    elif config.train.grad_accum > 1:
        backward = (4 + tapped) * llm / scatter
    else:
        backward = tapped * llm / scatter
    dv = vision_data_ways(config) if config.model.kind == "vla" else 1
    backward += c * counts["vision"] / (dv if config.vision.zero.stage >= 2 else 1)
    if plan.prefetches:  # one more layer's gathered weights and one more full layer gradient in flight
        # (the gradient widened to grad_reduce's dtype for its reduce-scatter)
        backward += (c + grad_bytes(config)) * counts["llm_layers"] / (config.model.n_layers // pp)
    # the reduced gradients: ZeRO 1-2 leave their sums in grad_reduce's dtype, in the optimizer's shard
    reduced = c * llm if z == 0 or dp == 1 else (grad_bytes(config) if z <= 2 else c) * llm / dp
    return {"backward": backward, "reduced": reduced}


def _largest_offloaded_leaf(config: Config, counts: dict, st: dict) -> float:
    """Offloaded state visits the device for the update; Adam is elementwise, so XLA can stream it
    leaf by leaf: count the largest stacked leaf (an MLP matrix of every local layer), not the whole
    state. Not validated: XLA:CPU's memory analysis does not separate host from device bytes."""
    if not st["opt_on_host"]:
        return 0.0
    return st["opt_on_host"] * _mlp_leaf(config) / max(st["opt_params"], 1.0)


def _mlp_leaf(config: Config) -> int:
    """Parameters of the largest stacked leaf one device holds before ZeRO: an MLP matrix of every
    local layer."""
    m, mesh = config.model, config.mesh
    return m.n_layers // mesh.pp * m.d_model * (m.d_ff // mesh.tp)


def _largest_leaf(config: Config) -> float:
    """Parameters of the largest optimizer-sharded leaf (_mlp_leaf, split over dp by ZeRO 1-3)."""
    return _mlp_leaf(config) / (data_ways(config) if config.zero.stage >= 1 else 1)


def _dp_reduction(config: Config, gradients: float) -> float:
    """GPU bytes while ZeRO 0-1 reduce the whole gradient over dp after the backward (with a pipeline
    or accumulation; otherwise each layer's is reduced inside the backward, zero's taps): the
    compute-dtype gradients, and grad_reduce's copy of two leaves in flight (the async all-reduce or
    reduce-scatter of one beside the conversion of the next), the largest leaf counting twice."""
    mesh = config.mesh
    if data_ways(config) == 1 or config.zero.stage >= 2 or (mesh.pp == 1 and config.train.grad_accum == 1):
        return 0.0
    g = 4 if config.grad_reduce == "fp32" or not config.bf16_compute else 2
    return gradients + 2 * g * _mlp_leaf(config)


def estimate(config: Config, target: str = "gpu", compute_capability: float = 9.0) -> dict:
    """Per-device bytes of one train step of `config`: every term, the two phases and the peak.
    Attention is priced as the kernel a run on the target would use (planner/kernels.py)."""
    config = kernels.resolve(config, target, compute_capability)
    c = 2 if config.bf16_compute else 4
    bf16 = config.bf16_compute
    counts = local_params(config)
    st = _states(config, counts, c, target)
    act = _activations(config, c, target)
    gr = _gradients(config, counts, c, target)
    dp, z = data_ways(config), config.zero.stage
    llm = counts["llm_layers"] + counts["llm_rest"]
    # XLA:CPU widens the bf16 weights to an f32 copy (4 bytes per parameter held) hoisted out of the
    # layer scan; the bf16 parameters are then dead and their donated buffers (same shapes, same
    # dtype) hold the compute-dtype gradients.
    cpu_weights = 2 * st["params"] if target == "cpu" and bf16 else 0.0
    grads_backward = gr["backward"] - (min(gr["backward"], st["params"]) if cpu_weights else 0.0)
    vision_work = act.get("vision_working_set", 0.0)
    backward = (grads_backward + act["saved"] + act["pipeline_buffers"] + act["cpu_f32_twins"]
                + act.get("vision_saved", 0.0) + act.get("image_tokens", 0.0)
                + max(act["working_set"], vision_work) + cpu_weights)
    # The update (inside the NaN guard's lax.cond): the reduced gradients (XLA:CPU all-reduces bf16 as
    # f32), the clipped fp32 gradients of every leaf (materialised before Adam), the new m and v of the
    # leaf being updated, and (pp) the fp32 accumulators. With bf16 the compute-dtype parameters are
    # dead from the end of the backward until they are rebuilt from the master after the cond (the
    # ZeRO 1-2 all-gather writes into their donated buffer), so their bytes are free for these.
    reduced = (4 * llm / (dp if z >= 1 else 1)) if target == "cpu" and bf16 else gr["reduced"]
    clipped = 4 * st["opt_params"] if config.train.grad_clip > 0 else 0.0
    moved_in = _largest_offloaded_leaf(config, counts, st) if target == "gpu" else 0.0
    adam_work = 8 * _largest_leaf(config) + moved_in
    if host_update(config):  # Adam runs on the host: the device only holds the gradients it sends there
        adam_work = 0.0
    update = reduced + clipped + adam_work
    if config.mesh.pp > 1:
        update += 4 * llm  # the fp32 accumulators are still live when the reduction starts
    freed = st["params_device"] if bf16 else 0.0
    update = max(update - freed, 0.0)
    if target == "gpu" and not st["opt_on_host"] and nan_guard_for(config.train, target) == "select":
        # the guard fused into each leaf's update: Adam in place, beside the gradients it reads (the
        # reduced ones, their fp32 widening and the clipped copy; docs/design.md "The NaN guard")
        update = max(reduced + 4 * st["opt_params"] + clipped + adam_work - freed, 0.0)
        update = max(update, _dp_reduction(config, gr["reduced"]))
    elif target == "gpu" and not st["opt_on_host"]:  # XLA's GPU conditional writes the whole new optimizer
        # state (master, m, v) to fresh buffers, copied into the donated ones after it; each leaf's gradient
        # dies once its Adam has run, so the conditional peaks at its end: the new state and the last leaf's
        # Adam temporaries. (Offloaded state keeps the terms above: without a device the GPU compiler has no
        # pinned host memory, so no GPU program has checked them.)
        update = st["device_state"] - st["params_device"] + 8 * _largest_leaf(config)
        update = max(update, _dp_reduction(config, gr["reduced"]))
    temp = max(backward, update)
    host = host_memory(config, st)
    per_device = {"params": st["params"], "params_on_host": st["params_on_host"] if target == "gpu" else 0.0,
                  "master": st["master"], "optimizer": st["optimizer"],
                  "optimizer_on_host": st["opt_on_host"], "gradients": gr["backward"],
                  "activations": act["saved"] + act.get("vision_saved", 0.0) + act["pipeline_buffers"],
                  "activations_on_host": act["saved_host"] if target == "gpu" else 0.0,
                  "working_set": max(act["working_set"], vision_work),
                  "cpu_widening": cpu_weights + act["cpu_f32_twins"],
                  "backward_phase": backward, "update_phase": update,
                  "state": st["device_state"], "temp": temp, "peak": st["device_state"] + temp,
                  "host_gradients": host["gradients"], "host_total": host["total"]}
    return {"per_device_bytes": per_device, "param_counts": counts, "microbatch": microbatch(config),
            "seq_len": seq_len(config), "target": target, "phase": "backward" if backward >= update else "update"}
