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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ActionConfig, Config
from jaxpar.config import vla_sequence_layout as sequence_layout  # (derived from the config alone)
from jaxpar.layers import vocab_parallel
from jaxpar.layers.collectives import Collectives
from jaxpar.models import llama, vit

PLACEHOLDER_ID = 0  # an action slot's input under chunking: a fixed token (the instruction's padding byte)


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
               instruction_bytes: np.ndarray | None = None, valid: np.ndarray | None = None) -> dict:
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
    if act.chunk == 1:
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
    if instruction_bytes is not None:
        batch["instruction_bytes"] = np.asarray(instruction_bytes, np.int32)
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
    if act.chunk == 1:
        return make_batch(config, images, instructions, actions)
    later = np.linspace(1.0, 0.5, act.chunk)[None, :, None]  # each step of the chunk its own function
    valid = np.arange(act.chunk)[None, :] < rng.integers(1, act.chunk + 1, (batch_size, 1))  # episode ends
    return make_batch(config, images, instructions, actions[:, None, :] * later, valid=valid)


def instruction_ids(batch: dict, config: Config):
    """[B, instruction_len] the instruction's UTF-8 bytes, which FiLM reads: the batch's
    instruction_bytes beside a tokenizer's ids, else the first LLM inputs after the image tokens."""
    if "instruction_bytes" in batch:
        return batch["instruction_bytes"]
    return batch["inputs"][:, :config.actions.instruction_len]


def encode_images(params: dict, batch: dict, config: Config, coll: Collectives = Collectives(),
                  policy=None) -> jax.Array:
    """The batch's projected image tokens (the encoder reads the instruction too with vision.film)."""
    return vit.encode(params, batch["images"], config.vision, coll, policy, instruction_ids(batch, config))


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
    if config.actions.chunk > 1:
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
    return llama.head_loss_sum(params, x, batch["targets"], batch["mask"], config.model, coll,
                               loss_positions(config))


def loss_sum(params: dict, batch: dict, config: Config, llm_coll: Collectives = Collectives(),
             vision_coll: Collectives = Collectives(), llm_policy=None, vision_policy=None):
    """Single-program VLA loss (masked token sum, token count): what the parallel step must equal."""
    image_tokens = encode_images(params, batch, config, vision_coll, vision_policy)
    return llm_loss_sum(params, image_tokens, batch, config, llm_coll, llm_policy), jnp.sum(batch["mask"])
