"""Global batches from grain, fed in the mesh's batch layout without a host gather.

Each JAX process reads only the rows of the global batch its devices hold. Processes whose devices
hold the same rows (they differ only over pp / tp) form one data shard and read the same records.
With S shards, shard k takes records k, k + S, k + 2S, ... of the (seeded, per-epoch reshuffled)
record order and batches them by B / S, so global step s consumes records [s B, (s + 1) B) of that
order whatever the number of processes: a different process count changes only the order of rows
inside a batch. `jax.make_array_from_process_local_data` assembles the global array from the shards.

The training iterator's grain state ({"next_index": steps consumed}, the same on every process by
construction) goes into each checkpoint and is restored on resume, so resume sees exactly the data
an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np

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
                           records.get("instruction_bytes"))
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
    from jaxpar.data.lerobot import LeRobotSource, is_lerobot

    if is_lerobot(directory):
        source = LeRobotSource(directory, InstructionEncoder.for_config(config), config.vision.image_size,
                               cameras=config.data.cameras or None, resize=config.vision.resize,
                               cache_bytes=config.data.frame_cache_mb << 20)
        if config.data.eval_episodes:
            source = source.subset(held_out_split(config, source.episode_indices)[split])
    else:
        if config.data.cameras or config.data.eval_episodes:
            raise ConfigError(f"data.cameras and data.eval_episodes are for LeRobot datasets; {directory} holds "
                              f"jaxpar episodes (all cameras, in order; held out in their own data.eval directory)")
        source = EpisodeSource(directory, InstructionEncoder.for_config(config))
    _check_episode_shapes(config, source)
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
    v, act = config.vision, config.actions
    want = {"images": (v.cameras, v.image_size, v.image_size, v.channels), "actions": (act.dims,)}
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
        shard, shards = process_shard(sharding, self.global_batch)
        dataset = grain.MapDataset.source(self.source).shuffle(seed=config.train.seed + SHUFFLE_SALT).repeat()
        self.batches = dataset[shard::shards].batch(self.global_batch // shards).map(_batch_fn(config))
        self.position, self.iterator = 0, None

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
        shard, shards = process_shard(sharding, self.global_batch)
        dataset = grain.MapDataset.source(self.source)[:self.batches * self.global_batch]
        self.dataset = dataset[shard::shards].batch(self.global_batch // shards).map(_batch_fn(config, True))

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
