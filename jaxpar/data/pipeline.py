"""Global batches from grain, fed in the mesh's batch layout without a host gather.

Each JAX process reads only the rows of the global batch its devices hold. Processes whose devices
hold the same rows (they differ only over pp / tp) form one data shard and read the same records.
With S shards, shard k takes records k, k + S, k + 2S, ... of the (seeded, per-epoch reshuffled)
record order and batches them by B / S, so global step s consumes records [s B, (s + 1) B) of that
order whatever the number of processes: a different process count changes only the order of rows
inside a batch. `jax.make_array_from_process_local_data` assembles the global array from the shards.

Processes of one data shard each hand JAX their own copy of its rows, and JAX compares nothing: a cp
group that spans nodes (each rank slices its tokens of the whole sequences on the device,
jaxpar.parallel.step.context_shard), or a tp / pp group that does, trains on a mix of two batches if
the nodes' copies of data.train differ. So before the first step every process fingerprints the batch
it is about to read, with the number of records it reads from, and the fingerprints are compared
(`check_shards_agree`): a mismatch is one line on every process, before any work. It is a cheap check,
not a proof: copies of the same length that differ only in records outside that batch pass it. Whole
sequences are read per process on purpose (as Megatron gives every cp rank the whole batch and slices
it): token ids are 12 bytes a token with the targets and the mask, 12 MB for a 1,048,576-token
sequence, against the gigabytes of a layer's activations.

The training iterator's grain state ({"next_index": steps consumed}, the same on every process by
construction) goes into each checkpoint and is restored on resume, so resume sees exactly the data
an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.config import Config
from jaxpar.data.episodes import EpisodeSource
from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.synthetic import SyntheticData
from jaxpar.data.text import TokenSource
from jaxpar.errors import ConfigError

SHUFFLE_SALT = 104_729  # the data order's seed is train.seed + this, so it differs from the init seed
READ_THREADS = 2  # reader threads per reading process


def process_shard(sharding, global_batch: int) -> tuple[int, int]:
    """(shard index, shard count) of this process's rows of a batch laid out by `sharding`."""
    ranges = {(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
              for s in sharding.addressable_devices_indices_map((global_batch, 1)).values()}
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    rows = hi - lo
    if sum(b - a for a, b in ranges) != rows or global_batch % rows or lo % rows:
        raise ConfigError(f"this process holds batch rows {sorted(ranges)}, not one aligned contiguous block; "
                          f"order the devices so each process holds whole dp shards")
    return lo // rows, global_batch // rows


def fingerprint(local: dict) -> np.ndarray:
    """Two int32 words of a 64-bit digest of a batch's keys, shapes and bytes (JAX without x64 carries
    no int64 through a collective)."""
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(local):
        value = np.ascontiguousarray(local[key])
        digest.update(f"{key}{value.shape}{value.dtype}".encode())
        digest.update(value.tobytes())
    return np.frombuffer(digest.digest(), np.int32)


def check_shards_agree(local: dict, records: int, shard: int, where: str) -> None:
    """Every process of the run, after meeting the others (jaxpar.parallel.processes.meet): the processes
    that read the same data shard read the same `local` batch from the same number of `records` (see the
    module docstring), or a one-line ConfigError on all of them."""
    if jax.process_count() == 1:
        return
    # (the caller has met the other processes first: they reach their first batch at their own speeds)
    digest = fingerprint({**local, "records": np.asarray(records, np.int64)})
    rows = multihost_utils.process_allgather(np.concatenate([[shard], digest]).astype(np.int32))
    first_reader = {}
    for process, (row_shard, *words) in enumerate(np.asarray(rows).reshape(-1, 3).tolist()):
        reader, seen = first_reader.setdefault(row_shard, (process, words))
        if seen != words:
            raise ConfigError(f"processes {reader} and {process} read different records for the same batch rows "
                              f"(data shard {row_shard}) from {where}: every process must see the same dataset "
                              f"(a node-local copy that differs?); give all nodes identical data")


def to_global(local: dict, sharding, global_batch: int) -> dict:
    """Process-local numpy rows -> global jax.Arrays laid out by `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch,) + v.shape[1:])
            for k, v in local.items()}


# ----------------------------------------------------------------------------- examples -> model batches


def text_batch(windows_BxL: np.ndarray) -> dict:
    return {"inputs": windows_BxL[:, :-1], "targets": windows_BxL[:, 1:],
            "mask": np.ones((windows_BxL.shape[0], windows_BxL.shape[1] - 1), np.float32)}


def episode_batch(config: Config, records: dict, with_values: bool = False) -> dict:
    """Stacked episode steps -> the VLA batch (images stay uint8: the encoder scales them to [0, 1] and
    normalises them with vision.image_mean / image_std on the device, jaxpar.models.vit.normalise);
    `with_values` adds the continuous actions at the action targets for the L1 metric."""
    from jaxpar.models import vla

    batch = vla.make_batch(config, records["images"], records["instruction"].astype(np.int32), records["actions"],
                           records.get("instruction_bytes"), records.get("action_valid"), records.get("state"))
    if with_values:
        batch["values"] = vla.action_values(config, records["actions"])
    return batch


def make_source(config: Config, directory: str, split: str = "train"):
    """The grain source for `directory`, checked against the model it feeds. A LeRobot dataset is
    recognised by its meta/info.json; with data.eval_episodes its episodes are split into train and
    held-out ones by train.seed (`split` picks which)."""
    _check_reader_keys(config)
    if config.model.kind != "vla":
        return TokenSource(directory, config.train.seq_len, config.model.vocab_size)
    from jaxpar.data.lerobot import STATE_KEY, LeRobotSource, is_lerobot

    if is_lerobot(directory):
        source = LeRobotSource(directory, InstructionEncoder.for_config(config), config.vision.image_size,
                               cameras=config.data.cameras or None, resize=config.vision.resize,
                               cache_bytes=config.data.frame_cache_mb << 20,
                               state_key=STATE_KEY if config.vision.state_dims else None)
        if config.data.eval_episodes:
            source = source.subset(held_out_split(config, source.episode_indices)[split])
    else:
        if config.vision.state_dims:
            raise ConfigError(f"vision.state_dims={config.vision.state_dims} reads a LeRobot dataset's {STATE_KEY}, "
                              f"but {directory} holds jaxpar episodes, which carry no state; write the demo as LeRobot "
                              f"(data.demo_format=lerobot) or set vision.state_dims=0")
        if config.data.cameras or config.data.eval_episodes:
            raise ConfigError(f"data.cameras and data.eval_episodes are for LeRobot datasets; {directory} holds "
                              f"jaxpar episodes (all cameras, in order; held out in their own data.eval directory)")
        source = EpisodeSource(directory, InstructionEncoder.for_config(config))
    _check_episode_shapes(config, source)
    if config.actions.chunk > 1:
        from jaxpar.data.chunks import ChunkedSource

        source = ChunkedSource(source, config.actions.chunk)
    source.check_instructions()
    return source


def _check_reader_keys(config: Config) -> None:
    for key in ("prefetch", "frame_cache_mb"):
        value = getattr(config.data, key)
        if value < (1 if key == "prefetch" else 0):
            raise ConfigError(f"data.{key}={value} must be >= {1 if key == 'prefetch' else 0}")


def read_options(config: Config) -> grain.ReadOptions:
    """The reader threads of one reading process (the training process, or each grain worker): 2
    threads, data.prefetch batches read ahead."""
    return grain.ReadOptions(num_threads=min(READ_THREADS, config.data.prefetch),
                             prefetch_buffer_size=config.data.prefetch)


def held_out_split(config: Config, episodes: list[int]) -> dict[str, list[int]]:
    """{"train": ..., "eval": ...}: data.eval_episodes of `episodes` drawn by train.seed are held out."""
    from jaxpar.data.lerobot import split_episodes

    if config.data.eval_episodes >= len(episodes):
        raise ConfigError(f"data.eval_episodes={config.data.eval_episodes} leaves no training episode of the "
                          f"{len(episodes)} in {config.data.train}; hold out fewer")
    train, held_out = split_episodes(episodes, config.data.eval_episodes, config.train.seed)
    return {"train": train, "eval": held_out}


def _check_episode_shapes(config: Config, source: EpisodeSource) -> None:
    from jaxpar.data.lerobot import STATE_KEY

    v, act = config.vision, config.actions
    want = {"images": (v.cameras, v.image_size, v.image_size, v.channels), "actions": (act.dims,)}
    if v.state_dims:
        want["state"] = (v.state_dims,)
        if source.shapes.get("state") != want["state"]:
            raise ConfigError(f"{source.directory}: {STATE_KEY} has {source.shapes.get('state', (0,))[0]} dims, but "
                              f"vision.state_dims={v.state_dims}; set vision.state_dims="
                              f"{source.shapes.get('state', (0,))[0]}")
    if source.shapes != want:
        raise ConfigError(f"{source.directory}: episodes have images {source.shapes['images']} and actions "
                          f"{source.shapes['actions']} per step, but the config expects {want['images']} "
                          f"(vision.cameras, image_size, image_size, channels) and {want['actions']} "
                          f"(actions.dims); regenerate the data or change the config")


def _batch_fn(config: Config, with_values: bool = False):
    if config.model.kind == "vla":
        return lambda records: episode_batch(config, records, with_values)
    return text_batch


class GrainData:
    """The training batches: an endless, per-epoch reshuffled pass over `data.train`.

    The state is the number of batches read. The batched dataset is a grain MapDataset (random
    access), so resuming re-opens it at that index: the same state whatever the number of processes
    or of grain workers (whose own iterator states differ in form)."""

    def __init__(self, config: Config, sharding):
        self.config, self.sharding = config, sharding
        self.global_batch = config.train.global_batch_size
        self.source = make_source(config, config.data.train)
        self.shard, shards = process_shard(sharding, self.global_batch)
        dataset = grain.MapDataset.source(self.source).shuffle(seed=config.train.seed + SHUFFLE_SALT).repeat()
        self.batches = dataset[self.shard::shards].batch(self.global_batch // shards).map(_batch_fn(config))
        self.position, self.iterator = 0, None

    def check_agreement(self) -> None:
        """Before the first step (after a resume's set_state): the processes of each data shard are about
        to read the same batch (check_shards_agree)."""
        check_shards_agree(self.batches[self.position], len(self.source), self.shard, self.config.data.train)

    def _open(self) -> Iterator[dict]:
        """With data.workers, grain slices the batched MapDataset (the shuffle, the batching, the
        decoding in the source's __getitem__ and episode_batch) over the worker processes: worker w
        reads batches w, w + W, ..., each with its own reader threads, data.prefetch batches ahead, and
        its own frame cache; this process only takes the finished uint8 batches, in order."""
        data = self.config.data
        iter_dataset = self.batches[self.position:].to_iter_dataset(read_options(self.config))
        if data.workers:
            _mark_absl_flags_parsed()
            iter_dataset = iter_dataset.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=data.workers, per_worker_buffer_size=data.prefetch))
        return iter(iter_dataset)

    def next_local(self) -> dict:
        """This process's rows of the next global batch (numpy)."""
        if self.iterator is None:
            self.iterator = self._open()
        batch = next(self.iterator)
        self.position += 1
        return batch

    def next_batch(self) -> dict:
        return to_global(self.next_local(), self.sharding, self.global_batch)

    def get_state(self) -> dict:
        return {"grain": {"next_index": self.position}}

    def set_state(self, state: dict) -> None:
        if "grain" not in state:
            raise ConfigError("the checkpoint was written with synthetic data (data.train empty); resume with "
                              "the original settings or use a fresh --workdir")
        self.position, self.iterator = int(state["grain"]["next_index"]), None


def _mark_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags, which a non-absl CLI never parses."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class EvalData:
    """Held-out batches from `data.eval` in file order: all of them, or the first eval.batches."""

    def __init__(self, config: Config, sharding):
        self.config, self.sharding = config, sharding
        self.global_batch = config.train.global_batch_size
        self.source = (make_source(config, config.data.eval) if config.data.eval
                       else make_source(config, config.data.train, split="eval"))
        available = len(self.source) // self.global_batch
        if available == 0:
            where = config.data.eval or f"data.eval_episodes={config.data.eval_episodes}"
            raise ConfigError(f"{where} holds {len(self.source)} held-out examples, fewer than one global batch of "
                              f"{self.global_batch}; add held-out data or lower the batch size")
        self.batches = min(available, config.eval.batches or available)
        self.shard, shards = process_shard(sharding, self.global_batch)
        dataset = grain.MapDataset.source(self.source)[:self.batches * self.global_batch]
        self.dataset = dataset[self.shard::shards].batch(self.global_batch // shards).map(_batch_fn(config, True))

    def check_agreement(self) -> None:
        """The processes of each data shard read the same first held-out batch from as many records
        (check_shards_agree)."""
        check_shards_agree(self.dataset[0], len(self.source), self.shard,
                           self.config.data.eval or f"{self.config.data.train} (held out)")

    def __iter__(self) -> Iterator[dict]:
        for local in self.dataset.to_iter_dataset(read_options(self.config)):
            yield to_global(local, self.sharding, self.global_batch)

    @property
    def bytes_per_token(self) -> float | None:
        return getattr(self.source, "bytes_per_token", None)

    @property
    def unigram_bits_per_byte(self) -> float | None:
        return getattr(self.source, "meta", {}).get("unigram_bits_per_byte")


def train_data(config: Config, sharding):
    return GrainData(config, sharding) if config.data.train else SyntheticData(config, sharding)


def eval_data(config: Config, sharding) -> EvalData | None:
    return EvalData(config, sharding) if config.data.eval or config.data.eval_episodes else None
