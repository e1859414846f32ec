"""Vision-language-action model: ViT + projector + the Llama decoder, discretised action tokens.

Sequence: [image tokens | instruction tokens | action tokens]. Continuous actions are discretised
into `bins` uniform bins per dimension and mapped to the last `bins` vocabulary ids (OpenVLA,
RT-2). The loss is on the action tokens (and optionally the instruction). With `prefix_lm` the image
+ instruction prefix attends bidirectionally and the actions causally (PaliGemma).

Action chunks (actions.chunk = H > 1, OpenVLA-OFT's parallel decoding): the next H steps' H x dims
tokens are predicted in one call. The LLM reads H x dims placeholder slots (PLACEHOLDER_ID) after the
instruction, and each slot's output predicts its own action token. So nothing is teacher-forced, and the
slots may see each other: the whole sequence attends bidirectionally (prefix_len). The placeholders carry
no answer, only their positions. Steps past an episode's end are padded and left out of the loss (their
mask is 0).

The l1 head (actions.head = l1, OpenVLA-OFT's continuous head): the same slots, but each slot's last hidden
state goes through a small MLP (ACTION_HEAD: D -> D, gelu, -> dims, the slot's own dim kept) that regresses the action
value, normalised to [-1, 1] by the bins' range (the data's q01 / q99 with quantile normalisation, stored in the
config and so in every checkpoint), with an L1 loss. No bins: a value is not rounded to a bin's centre. The MLP
sits beside the LM head (after the final norm, on the pipeline's head part) and is split like it: its hidden dim
over the vocabulary's axes (tp, and pp x tp with a pipeline) and its output summed over them (Megatron's column / row
pair; the sum last, as the LM head's cross-entropy ends in one, so the loss is the same on every rank). Its input is
the slots' positions only, as the token head's (loss_positions).

The flow head (actions.head = flow, flow matching as pi0's action expert trains, on each slot): the same MLP, whose
input also reads the slot's noised value x_t = t * noise + (1 - t) * value and the time t (W_COND: [x_t, sin and cos
of pi 2^k t] -> D, added to the normed hidden state before the tensor-parallel split, so it is replicated and summed
like the final norm), predicts the velocity noise - value; the loss is its squared error. t ~ 0.001 + 0.999 Beta(1.5,
1) per example (openpi's, weighted toward noise) and the noise are drawn on the device from train.seed and the step
(flow_noise: threefry's values do not depend on the sharding, so every layout draws the same). Inference integrates
from noise at t = 1 to t = 0 in actions.flow_steps Euler steps (flow_sample), the LLM run once. Unlike pi0's action
expert (its own transformer attending to every layer's keys and values), the head reads each slot's last hidden state,
which attended to the whole prefix; a value's distribution is modelled per slot, the slots' joint one through their
shared hidden states only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ActionConfig, Config
from jaxpar.config import vla_sequence_layout as sequence_layout  # (derived from the config alone)
from jaxpar.layers import vocab_parallel
from jaxpar.layers.collectives import Collectives
from jaxpar.layers.norm import rms_norm
from jaxpar.layers.order import after
from jaxpar.layers.vma import typed_like
from jaxpar.models import llama, vit

PLACEHOLDER_ID = 0  # an action slot's input under chunking: a fixed token (the instruction's padding byte)
ACTION_HEAD = "action_head"  # the l1 / flow head's MLP in the parameter tree
# D -> F (gelu; F split like the vocabulary) -> dims, the output layer factored F -> D -> dims so that every weight has
# ZeRO's "embed" dim (jaxpar.sharding: the LLM's ZeRO shards each weight on it); summed over F's split at the end
ACTION_HEAD_AXES = {"w1": ("embed", "action_mlp"), "w2": ("action_mlp", "embed"), "w_out": ("embed", "action_dims")}
L1_HEAD_AXES = {"final_norm": llama.HEAD_AXES["final_norm"], ACTION_HEAD: ACTION_HEAD_AXES}  # what the l1 head reads
W_COND = "w_cond"  # the flow head's conditioning [x_t, sin / cos of pi 2^k t] -> D
FLOW_TIME_FREQUENCIES = 8
FLOW_HEAD_AXES = {**ACTION_HEAD_AXES, W_COND: ("flow_cond", "embed")}
FLOW_READS = {"final_norm": llama.HEAD_AXES["final_norm"], ACTION_HEAD: FLOW_HEAD_AXES}
FLOW_SALT = 4949  # flow_noise's key: train.seed's, folded with this, then the step
EVAL_DRAWS = 2 ** 31 - 1  # the "step" whose draws every evaluation batch takes


class ActionTokenizer:
    """bins <-> vocabulary ids, and continuous values [..., dims] <-> bins (bin centres on decode).

    Each dim's range (ActionConfig.bin_range: [low, high], or the data's [q01, q99]) is split into
    `bins` even bins; values outside it land in the end bins. A dim that never varies (low == high,
    e.g. a padded action dim) always takes the middle bin and decodes to its one value."""

    def __init__(self, cfg: ActionConfig, vocab_size: int):
        self.cfg, self.first_id = cfg, vocab_size - cfg.bins
        low, high = cfg.bin_range()
        self.low, self.high = np.asarray(low, np.float64), np.asarray(high, np.float64)
        self.fixed = self.high <= self.low
        self.width = np.where(self.fixed, 0.0, (self.high - self.low) / cfg.bins)

    def to_bins(self, actions: np.ndarray) -> np.ndarray:
        scaled = (np.clip(actions, self.low, self.high) - self.low) / np.where(self.fixed, 1.0, self.high - self.low)
        bins = np.minimum((scaled * self.cfg.bins).astype(np.int32), self.cfg.bins - 1)
        return np.where(self.fixed, self.cfg.bins // 2, bins).astype(np.int32)

    def from_bins(self, bins: np.ndarray) -> np.ndarray:
        return self.low + (np.asarray(bins) + 0.5) * self.width  # a fixed dim: width 0, its one value

    def bins_to_tokens(self, bins: np.ndarray) -> np.ndarray:
        return (np.asarray(bins) + self.first_id).astype(np.int32)

    def tokens_to_bins(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(tokens) - self.first_id

    def is_action(self, tokens) -> np.ndarray:
        return np.asarray(tokens) >= self.first_id


def action_targets(config: Config) -> int:
    """How many positions at the end of the sequence are action targets: the chunk's H x dims tokens."""
    return config.actions.chunk * config.actions.dims


def make_batch(config: Config, images: np.ndarray, instructions: np.ndarray, actions: np.ndarray,
               instruction_bytes: np.ndarray | None = None, valid: np.ndarray | None = None,
               state: np.ndarray | None = None) -> dict:
    """Host batch: images uint8 [B, cams, H, W, C] (kept uint8: the encoder scales them on the device,
    jaxpar.models.vit.normalise), the LLM's instruction ids [B, T_text], actions [B, dims] in
    [low, high]; `instruction_bytes` [B, T_text]: what FiLM reads when the LLM reads a tokenizer's ids
    (jaxpar.data.instructions; without it FiLM reads the instruction ids, which are then bytes).

    The LLM sees [image tokens, instruction, actions[:-1]]; position j predicts element j+1, so the
    targets are [0 x (n_image-1), instruction, actions] and the mask selects the action targets: the
    last `dims` positions (by place, not by id: a tokenizer's instruction ids may fall among the
    action bins' ids, as OpenVLA's bins reuse a Llama's last 256 tokens).

    With actions.chunk = H > 1, `actions` is [B, H, dims] and `valid` [B, H] says which steps lie
    inside the episode (default all). The LLM sees [image tokens, instruction, H x dims placeholders];
    each placeholder's position predicts its own step's token (the position before the slots predicts
    nothing), and the mask keeps the valid steps' tokens.

    `state` [B, vision.state_dims]: the proprioceptive state the encoder reads with vision.state_dims > 0.
    """
    act = config.actions
    tokenizer = ActionTokenizer(act, config.model.vocab_size)
    batch_size = instructions.shape[0]
    steps = np.asarray(actions).reshape(batch_size, -1, act.dims)
    if steps.shape[1] != act.chunk:
        raise ValueError(f"make_batch got {steps.shape[1]} steps of actions per example for actions.chunk={act.chunk}"
                         f"; give [B, {act.dims}] for chunk 1, else [B, chunk, {act.dims}] (jaxpar.data.chunks)")
    action_ids = tokenizer.bins_to_tokens(tokenizer.to_bins(steps))
    action_ids = action_ids.reshape(batch_size, -1)  # [B, H x dims], step-major
    n_image, _, _ = sequence_layout(config)
    if not act.parallel_slots:
        tokens = np.concatenate([instructions.astype(np.int32), action_ids], axis=1)
        inputs, targets = tokens[:, :-1], np.concatenate([np.zeros((batch_size, n_image - 1), np.int32), tokens], 1)
    else:
        slots = np.full(action_ids.shape, PLACEHOLDER_ID, np.int32)
        inputs = np.concatenate([instructions.astype(np.int32), slots], axis=1)
        targets = np.concatenate([np.zeros((batch_size, n_image - 1), np.int32), instructions.astype(np.int32),
                                  np.zeros((batch_size, 1), np.int32), action_ids], axis=1)
    mask = np.zeros(targets.shape, np.float32)
    step_valid = np.ones((batch_size, act.chunk), np.float32) if valid is None else np.asarray(valid, np.float32)
    mask[:, -action_targets(config):] = np.repeat(step_valid, act.dims, axis=1)
    if config.model.text_loss:
        mask[:, n_image - 1:n_image - 1 + instructions.shape[1]] = 1.0
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise TypeError(f"make_batch takes uint8 pixels (the encoder scales them on the device), not {images.dtype}")
    batch = {"images": images, "inputs": inputs, "targets": targets, "mask": mask}
    if act.continuous:  # what the l1 head regresses, the flow head's targets
        batch["values"] = action_values(config, steps)
    if instruction_bytes is not None:
        batch["instruction_bytes"] = np.asarray(instruction_bytes, np.int32)
    if config.vision.state_dims:
        want = (batch_size, config.vision.state_dims)
        if state is None or np.shape(state) != want:
            raise ValueError(f"vision.state_dims={want[1]}: make_batch needs the state {list(want)}, got "
                             f"{None if state is None else np.shape(state)}")
        batch["state"] = np.asarray(state, np.float32)
    return batch


def action_values(config: Config, actions: np.ndarray) -> np.ndarray:
    """[B, T] continuous actions ([B, dims], or [B, H, dims] for a chunk) at the action-target positions
    (the last H x dims), zero elsewhere."""
    values = np.zeros((actions.shape[0], sequence_layout(config)[2]), np.float32)
    values[:, -action_targets(config):] = np.asarray(actions).reshape(actions.shape[0], -1)
    return values


def eval_sums(config: Config, token_loss_BxS: jax.Array, pred_BxS: jax.Array, batch: dict,
              positions_S: jax.Array | None = None) -> dict:
    """llama.eval_sums plus, over the action tokens: exact-token hits and the absolute error of the
    decoded continuous action (the predicted bin's centre) against the true value. `positions_S`: the
    sequence positions of the given tokens (context parallelism's chunks; None: all of them in order)."""
    act, first_id = config.actions, config.model.vocab_size - config.actions.bins
    targets = batch["targets"]
    if positions_S is None:
        positions_S = jnp.arange(targets.shape[1])
    slot_S = positions_S - (sequence_layout(config)[2] - action_targets(config))  # the targets: the last H x dims
    is_action_S = slot_S >= 0
    dim_S = jnp.where(is_action_S, slot_S % act.dims, -1)  # each step's tokens in dim order
    tokenizer = ActionTokenizer(act, config.model.vocab_size)
    low_S = jnp.asarray(tokenizer.low, jnp.float32)[jnp.clip(dim_S, 0)]
    width_S = jnp.where(is_action_S, jnp.asarray(tokenizer.width, jnp.float32)[jnp.clip(dim_S, 0)], 0.0)
    is_action_BxS = jnp.broadcast_to(is_action_S, targets.shape).astype(jnp.float32)
    decoded_BxS = low_S + (jnp.clip(pred_BxS - first_id, 0, act.bins - 1) + 0.5) * width_S
    is_action_BxS = is_action_BxS * batch["mask"]  # a chunk's steps past the episode's end are not scored
    correct_BxS = (pred_BxS == targets) * is_action_BxS
    by_dim_SxA = jax.nn.one_hot(dim_S, act.dims)  # all zeros off the action tokens
    return {**llama.eval_sums(token_loss_BxS, pred_BxS, batch), "action_tokens": jnp.sum(is_action_BxS),
            "action_correct": jnp.sum(correct_BxS),
            "action_abs_err": jnp.sum(jnp.abs(decoded_BxS - batch["values"]) * is_action_BxS),
            "action_correct_by_dim": jnp.sum(correct_BxS, axis=0) @ by_dim_SxA}


def synthetic_batch(config: Config, step: int, batch_size: int) -> dict:
    """Deterministic stand-in data (tests, dry runs): random scenes, instructions of random bytes (the
    text ids FiLM can read), and actions that are a fixed function of the image (learnable)."""
    vis, act = config.vision, config.actions
    rng = np.random.default_rng([config.train.seed, step, 7])
    images = rng.integers(0, 256, (batch_size, vis.cameras, vis.image_size, vis.image_size, vis.channels), np.uint8)
    text_vocab = config.model.vocab_size - act.bins
    instructions = rng.integers(0, min(text_vocab, vit.INSTRUCTION_VOCAB), (batch_size, act.instruction_len))
    means = images.reshape(batch_size, -1, vis.channels).mean(axis=1) / 255.0  # [B, C] in [0, 1]
    actions = np.tanh(4.0 * (np.resize(means, (batch_size, act.dims)) - 0.5))
    state = None
    if vis.state_dims:  # some of it out of [-1, 1] (clipped), and the actions depend on it too
        state = rng.normal(0.0, 0.8, (batch_size, vis.state_dims)).astype(np.float32)
        actions = np.clip(actions + 0.3 * np.resize(state, (batch_size, act.dims)), -1.0, 1.0)
    if act.chunk == 1:
        return make_batch(config, images, instructions, actions, state=state)
    later = np.linspace(1.0, 0.5, act.chunk)[None, :, None]  # each step of the chunk its own function
    valid = np.arange(act.chunk)[None, :] < rng.integers(1, act.chunk + 1, (batch_size, 1))  # episode ends
    return make_batch(config, images, instructions, actions[:, None, :] * later, valid=valid, state=state)


def instruction_ids(batch: dict, config: Config):
    """[B, instruction_len] the instruction's UTF-8 bytes, which FiLM reads: the batch's
    instruction_bytes beside a tokenizer's ids, else the first LLM inputs after the image tokens."""
    if "instruction_bytes" in batch:
        return batch["instruction_bytes"]
    return batch["inputs"][:, :config.actions.instruction_len]


def encode_images(params: dict, batch: dict, config: Config, coll: Collectives = Collectives(),
                  policy=None) -> jax.Array:
    """The batch's projected image tokens (the encoder reads the instruction too with vision.film, and the state
    with vision.state_dims)."""
    return vit.encode(params, batch["images"], config.vision, coll, policy, instruction_ids(batch, config),
                      batch.get("state"))


def llm_inputs(params: dict, image_tokens_BxIxD: jax.Array, inputs_BxT: jax.Array, coll: Collectives) -> jax.Array:
    """The first pipeline stage's input: projected image tokens followed by the embedded text/actions.
    The whole sequence is assembled, then each rank keeps its tokens: its cp chunks with context
    parallelism, then its shard of them with sequence parallelism (the text alone would split
    differently from image + text)."""
    text_BxTxD = llama.embed_tokens(params, inputs_BxT, coll.without_sequence_parallel())
    whole_BxSxD = jnp.concatenate([image_tokens_BxIxD.astype(text_BxTxD.dtype), text_BxTxD], axis=1)
    return coll.sequence_shard(coll.context_slice(whole_BxSxD))


def llm_inputs_summed(params: dict, image_part_BxIxD: jax.Array, inputs_BxT: jax.Array,
                      coll: Collectives) -> jax.Array:
    """`llm_inputs` where each rank holds only a share of the image tokens (`image_part`: its own images'
    tokens, zeros elsewhere, as jaxpar.parallel.vision.VisionComponent.owned_rows gives): this rank's
    image share and vocabulary share of the whole sequence, summed over the vocabulary split (`coll`'s
    tp axes; with sequence parallelism a reduce-scatter that leaves each rank its shard). Every element
    of the sum has one nonzero term, so it equals `llm_inputs` exactly, with no gather of the images
    beforehand. No context parallelism (its chunks are not contiguous)."""
    ids_BxT, table_VxD = coll.use_weights(inputs_BxT, params["embed"], llama.EMBED_AXES)
    text_BxTxD = vocab_parallel.embed_partial(table_VxD, ids_BxT, coll)
    whole_BxSxD = jnp.concatenate([image_part_BxIxD.astype(text_BxTxD.dtype), text_BxTxD], axis=1)
    return coll.row_parallel_sum(whole_BxSxD)


def prefix_len(config: Config) -> int:
    """The positions that attend bidirectionally: image + instruction with prefix_lm, and the whole
    sequence under chunking (the slots see each other; their inputs are placeholders, so nothing leaks)."""
    if config.actions.parallel_slots:
        return sequence_layout(config)[2]
    return sequence_layout(config)[1] if config.model.prefix_lm else 0


def loss_positions(config: Config) -> int | None:
    """How many positions at the end of each rank's sequence the LM head runs on: the action targets
    (the last H x dims: make_batch's mask), or None (every position) with the text loss. A static slice,
    so the head's FLOPs and fp32 logits, and a pipeline's broadcast of the last stage's output to the
    head and its cotangent, shrink by S / dims (vla70b: 296 / 7).

    Every rank slices the same range: under cp (balanced_order) the actions end cp rank 0's late
    chunk, and other ranks' last positions are masked ones (their head adds zero); under sequence
    parallelism they end the last tp rank's shard (head_logits keeps that rank's). None, today's head
    on every position, where a cp chunk or sp shard is shorter than the actions (they would straddle)."""
    if config.model.text_loss:
        return None
    targets, seq, mesh = action_targets(config), sequence_layout(config)[2], config.mesh
    local = seq // (2 * mesh.cp) if mesh.cp > 1 else seq  # the chunk that holds the actions
    if mesh.sequence_parallel and mesh.tp > 1:
        local = min(local, seq // mesh.cp // mesh.tp)  # the sp shard of a cp rank's tokens that does
    return targets if targets <= local else None


def llm_loss_sum(params: dict, image_tokens_BxIxD: jax.Array, batch: dict, config: Config,
                 coll: Collectives = Collectives(), policy=None) -> jax.Array:
    """The LLM part: masked sum of token losses given the projected image tokens (the head on the
    positions the loss reads only: loss_positions)."""
    x = llm_inputs(params, image_tokens_BxIxD, batch["inputs"], coll)
    x = llama.run_layers(x, params["layers"], config.model, coll, policy, prefix_len(config))
    return head_loss_sum(params, x, batch, config, coll, loss_positions(config))


def head_loss_sum(params: dict, x_BxSxD: jax.Array, batch: dict, config: Config, coll: Collectives,
                  last: int | None) -> jax.Array:
    """The masked loss sum of the configured action head on the LLM's output (the last pipeline stage's job):
    the LM head's token cross-entropies, the l1 head's absolute errors, or the flow head's squared velocity errors."""
    if config.actions.head == "l1":
        return l1_loss_sum(params, x_BxSxD, batch["values"], batch["mask"], config, coll, last)
    if config.actions.head == "flow":
        return flow_loss_sum(params, x_BxSxD, batch, config, coll, last)
    return llama.head_loss_sum(params, x_BxSxD, batch["targets"], batch["mask"], config.model, coll, last)


# ----------------------------------------------------------------------------- the continuous heads: l1, flow


def action_head_axes(config: Config) -> dict:
    """The action head's logical axes: the l1 head's MLP, and the flow head's conditioning beside it."""
    return FLOW_HEAD_AXES if config.actions.head == "flow" else ACTION_HEAD_AXES


def action_head_shapes(config: Config) -> dict:
    d = config.model.d_model
    shapes = {"w1": (d, d), "w2": (d, d), "w_out": (d, config.actions.dims)}
    if config.actions.head == "flow":
        shapes[W_COND] = (1 + 2 * FLOW_TIME_FREQUENCIES, d)
    return shapes


def init_action_head(config: Config, key: jax.Array) -> dict:
    """N(0, init_std) weights."""
    shapes, std = action_head_shapes(config), config.model.init_std
    return {name: std * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32)
            for index, (name, shape) in enumerate(sorted(shapes.items()))}


def slot_dims(config: Config, positions_S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(is an action slot, the action dim it holds: 0 off the slots) of each sequence position."""
    slot_S = positions_S - (sequence_layout(config)[2] - action_targets(config))  # the slots: the last H x dims
    return slot_S >= 0, jnp.where(slot_S >= 0, slot_S % config.actions.dims, 0)


def _range_at(config: Config, dim_S: jax.Array) -> tuple[jax.Array, jax.Array]:
    low, high = (jnp.asarray(np.asarray(bound, np.float32)) for bound in config.actions.bin_range())
    return low[dim_S], high[dim_S]


def normalise_values(config: Config, values_BxS: jax.Array, dim_S: jax.Array) -> jax.Array:
    """Actions -> [-1, 1] by their dim's range (clipped, as the bins clip; a dim that never varies: 0)."""
    return vit.to_unit_range(values_BxS, *_range_at(config, dim_S))


def denormalise_values(config: Config, unit_BxS: jax.Array, dim_S: jax.Array) -> jax.Array:
    """normalise_values' inverse on [-1, 1] (predictions outside it are clipped: the data's range)."""
    low_S, high_S = _range_at(config, dim_S)
    return low_S + (jnp.clip(unit_BxS, -1.0, 1.0) + 1.0) * 0.5 * (high_S - low_S)


def _head_positions(config: Config, coll: Collectives, length: int, last: int | None) -> jax.Array:
    """The sequence positions of a head's `length` outputs: the last `last`, else this rank's (its cp chunks')."""
    if last is not None:
        return jnp.arange(sequence_layout(config)[2] - last, sequence_layout(config)[2])
    positions_S = coll.context_positions(length)
    return jnp.arange(length) if positions_S is None else positions_S


def _slot_values(mlp: dict, z_BxSxD: jax.Array, config: Config, coll: Collectives,
                 last: int | None) -> tuple[jax.Array, jax.Array]:
    """The action MLP on the tensor-parallel input `z` (gelu, F split like the vocabulary, summed over it), each
    position's own action dim picked: ([B, S'] fp32, the positions S')."""
    hidden_BxSxF = jax.nn.gelu(jnp.einsum("bsd,df->bsf", z_BxSxD, mlp["w1"], preferred_element_type=jnp.float32))
    partial_BxSxD = jnp.einsum("bsf,fd->bsd", hidden_BxSxF.astype(z_BxSxD.dtype), mlp["w2"],
                               preferred_element_type=jnp.float32)
    out_BxSxA = coll.tp_sum(jnp.einsum("bsd,da->bsa", partial_BxSxD.astype(z_BxSxD.dtype), mlp["w_out"],
                                       preferred_element_type=jnp.float32))
    positions_S = _head_positions(config, coll, out_BxSxA.shape[1], last)
    _, dim_S = slot_dims(config, positions_S)
    picked_BxS = jnp.take_along_axis(out_BxSxA, jnp.broadcast_to(dim_S[None, :, None], out_BxSxA.shape[:2] + (1,)),
                                     axis=-1)[..., 0]
    return picked_BxS, positions_S


def l1_predictions(params: dict, x_BxSxD: jax.Array, config: Config, coll: Collectives,
                   last: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(the l1 head's normalised value at each position, for that position's action dim [B, S'] fp32, the
    positions S'): the final norm and the MLP on the last `last` positions (None: all of this rank's, its
    cp chunks' positions), sliced as llama.head_logits slices (sequence parallelism: the last shard's)."""
    x_BxSxD, head = coll.use_weights(x_BxSxD, {k: params[k] for k in L1_HEAD_AXES}, L1_HEAD_AXES)
    x_BxSxD = x_BxSxD if last is None else x_BxSxD[:, -last:]
    x_BxSxD = coll.enter_tensor_parallel(rms_norm(x_BxSxD, head["final_norm"], config.model.norm_eps))
    x_BxSxD = x_BxSxD if last is None else x_BxSxD[:, -last:]
    return _slot_values(head[ACTION_HEAD], x_BxSxD, config, coll, last)


def l1_loss_sum(params: dict, x_BxSxD: jax.Array, values_BxS: jax.Array, mask_BxS: jax.Array, config: Config,
                coll: Collectives, last: int | None = None) -> jax.Array:
    """Sum over the masked slots of |prediction - normalised action| (the mask is 0 off the slots)."""
    pred_BxS, positions_S = l1_predictions(params, x_BxSxD, config, coll, last)
    if last is not None:
        values_BxS, mask_BxS = values_BxS[:, -last:], mask_BxS[:, -last:]
    target_BxS = normalise_values(config, values_BxS, slot_dims(config, positions_S)[1])
    return jnp.sum(jnp.abs(pred_BxS - target_BxS) * mask_BxS.astype(jnp.float32))


def l1_eval_sums(params: dict, x_BxSxD: jax.Array, batch: dict, config: Config, coll: Collectives) -> dict:
    """eval_sums' keys for the l1 head: `loss` the L1 sum in normalised units, and continuous_eval_sums'."""
    pred_BxS, positions_S = l1_predictions(params, x_BxSxD, config, coll)
    target_BxS = normalise_values(config, batch["values"], slot_dims(config, positions_S)[1])
    loss = jnp.sum(jnp.abs(pred_BxS - target_BxS) * batch["mask"].astype(jnp.float32))
    return continuous_eval_sums(config, pred_BxS, positions_S, batch, loss)


def continuous_eval_sums(config: Config, pred_BxS: jax.Array, positions_S: jax.Array, batch: dict,
                         loss: jax.Array) -> dict:
    """eval_sums' keys for a head that gives values (`pred`: normalised, at `positions`): a slot `correct` when its
    value falls in the true value's bin (comparable with the token head's exact tokens), and the absolute error of
    the value in the action's own units."""
    is_action_S, dim_S = slot_dims(config, positions_S)
    mask_BxS = batch["mask"].astype(jnp.float32)
    scored_BxS = is_action_S.astype(jnp.float32) * mask_BxS
    target_BxS = normalise_values(config, batch["values"], dim_S)
    value_BxS = denormalise_values(config, pred_BxS, dim_S)
    bins = config.actions.bins

    def to_bin(unit_BxS):
        return jnp.minimum(jnp.floor((jnp.clip(unit_BxS, -1.0, 1.0) + 1.0) * 0.5 * bins), bins - 1)

    correct_BxS = (to_bin(pred_BxS) == to_bin(target_BxS)) * scored_BxS
    by_dim_SxA = jax.nn.one_hot(jnp.where(is_action_S, dim_S, -1), config.actions.dims)
    return {"loss": loss, "tokens": jnp.sum(mask_BxS),
            "correct": jnp.sum(correct_BxS), "action_tokens": jnp.sum(scored_BxS),
            "action_correct": jnp.sum(correct_BxS),
            "action_abs_err": jnp.sum(jnp.abs(value_BxS - batch["values"]) * scored_BxS),
            "action_correct_by_dim": jnp.sum(correct_BxS, axis=0) @ by_dim_SxA}


# ----------------------------------------------------------------------------- the flow head


def flow_noise(config: Config, batch: dict, step) -> dict:
    """`batch` with the flow head's draws for `step` (a traced int): `noise` N(0, 1) and `time` (one t per example,
    broadcast), [B, S] like the values. Drawn on the device for the global batch: threefry's values do not depend on
    how the arrays are sharded, so every layout trains on the same draws."""
    if config.actions.head != "flow":
        return batch
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.train.seed), FLOW_SALT), step)
    noise_key, time_key = jax.random.split(key)
    shape = batch["mask"].shape
    # Beta(1.5, 1) as u^(2/3), the inverse of its CDF t^1.5: jax.random.beta's rejection loop, partitioned over the
    # batch, would put an all-reduce in a while loop's condition, beside the step's collectives
    time_Bx1 = 0.001 + 0.999 * jax.random.uniform(time_key, (shape[0], 1), jnp.float32) ** (1.0 / 1.5)
    return {**batch, "noise": jax.random.normal(noise_key, shape, jnp.float32),
            "time": jnp.broadcast_to(time_Bx1, shape)}


def flow_features(xt_BxS: jax.Array, t_BxS: jax.Array) -> jax.Array:
    """[B, S, 1 + 2 x FLOW_TIME_FREQUENCIES]: the noised value, and sin / cos of pi 2^k t (t in [0, 1])."""
    angles = t_BxS[..., None] * (jnp.pi * 2.0 ** jnp.arange(FLOW_TIME_FREQUENCIES, dtype=jnp.float32))
    return jnp.concatenate([xt_BxS[..., None], jnp.sin(angles), jnp.cos(angles)], axis=-1)


def flow_head_input(params: dict, x_BxSxD: jax.Array, config: Config, coll: Collectives,
                    last: int | None = None) -> tuple[jax.Array, dict]:
    """(the normed hidden states of the positions the head reads, the head's weights), gathered once for a loss or
    for every step of a sampling."""
    x_BxSxD, head = coll.use_weights(x_BxSxD, {k: params[k] for k in FLOW_READS}, FLOW_READS)
    x_BxSxD = x_BxSxD if last is None else x_BxSxD[:, -last:]
    return rms_norm(x_BxSxD, head["final_norm"], config.model.norm_eps), head


def flow_velocity(head_input: tuple[jax.Array, dict], xt_BxS: jax.Array, t_BxS: jax.Array, config: Config,
                  coll: Collectives, last: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(the flow head's velocity at each position for its action dim [B, S'] fp32, the positions S'), given
    flow_head_input's output and the noised values and times at the same positions (whole, or already the last
    `last`). The conditioning joins the normed hidden state before the tensor-parallel split: on each
    sequence-parallel shard its own positions'."""
    normed_BxSxD, head = head_input
    cond_BxSxC = flow_features(xt_BxS, t_BxS)
    cond_BxSxC = coll.sequence_shard(cond_BxSxC) if last is None else cond_BxSxC[:, -last:]
    mlp = head[ACTION_HEAD]
    # typed as varying where x is (a pipeline's head: over pp) on the weight, not on the [B, S, D] product: JAX then
    # sums the weight's gradient, as a norm's, where use_weights orders it (an activation's sum would be unordered)
    cond_BxSxD = jnp.einsum("bsc,cd->bsd", typed_like(cond_BxSxC.astype(normed_BxSxD.dtype), normed_BxSxD),
                            typed_like(mlp[W_COND], normed_BxSxD), preferred_element_type=jnp.float32)
    z_BxSxD = coll.enter_tensor_parallel(normed_BxSxD + cond_BxSxD.astype(normed_BxSxD.dtype))
    return _slot_values(mlp, z_BxSxD if last is None else z_BxSxD[:, -last:], config, coll, last)


def flow_loss_sum(params: dict, x_BxSxD: jax.Array, batch: dict, config: Config, coll: Collectives,
                  last: int | None = None) -> jax.Array:
    """Sum over the masked slots of |velocity - (noise - normalised action)|^2 at x_t = t noise + (1 - t) action."""
    arrays = [batch[k] for k in ("values", "mask", "noise", "time")]
    values_BxS, mask_BxS, noise_BxS, t_BxS = arrays if last is None else [a[:, -last:] for a in arrays]
    dim_S = slot_dims(config, _head_positions(config, coll, values_BxS.shape[1], last))[1]
    target_BxS = normalise_values(config, values_BxS, dim_S)
    xt_BxS = t_BxS * noise_BxS + (1.0 - t_BxS) * target_BxS
    velocity_BxS, _ = flow_velocity(flow_head_input(params, x_BxSxD, config, coll, last), xt_BxS, t_BxS, config, coll,
                                    last)
    return jnp.sum(jnp.square(velocity_BxS - (noise_BxS - target_BxS)) * mask_BxS.astype(jnp.float32))


def flow_sample(params: dict, x_BxSxD: jax.Array, noise_BxS: jax.Array, config: Config, coll: Collectives,
                last: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(normalised values [B, S'], positions S'): from `noise` at t = 1, actions.flow_steps Euler steps of the
    velocity to t = 0 (the LLM's hidden states `x` computed once)."""
    steps, head_input = config.actions.flow_steps, flow_head_input(params, x_BxSxD, config, coll, last)
    xt_BxS = noise_BxS if last is None else noise_BxS[:, -last:]
    positions_S = None
    for k in range(steps):  # (unrolled: a handful of small MLP calls)
        t_BxS = jnp.full(xt_BxS.shape, 1.0 - k / steps, jnp.float32)
        velocity_BxS, positions_S = flow_velocity(head_input, xt_BxS, t_BxS, config, coll, last)
        xt_BxS = xt_BxS - velocity_BxS / steps
    return xt_BxS, positions_S


def flow_eval_sums(params: dict, x_BxSxD: jax.Array, batch: dict, config: Config, coll: Collectives) -> dict:
    """eval_sums' keys for the flow head: `loss` the flow-matching sum at the batch's draws, and
    continuous_eval_sums' of the values sampled from the batch's noise."""
    loss = flow_loss_sum(params, x_BxSxD, batch, config, coll)
    # (XLA:CPU: the sampling's sums after the loss's)
    pred_BxS, positions_S = flow_sample(params, after(x_BxSxD, loss), batch["noise"], config, coll)
    return continuous_eval_sums(config, pred_BxS, positions_S, batch, loss)


def loss_sum(params: dict, batch: dict, config: Config, llm_coll: Collectives = Collectives(),
             vision_coll: Collectives = Collectives(), llm_policy=None, vision_policy=None):
    """Single-program VLA loss (masked token sum, token count): what the parallel step must equal."""
    image_tokens = encode_images(params, batch, config, vision_coll, vision_policy)
    return llm_loss_sum(params, image_tokens, batch, config, llm_coll, llm_policy), jnp.sum(batch["mask"])
