"""A grain source over a Hugging Face LeRobot dataset on disk (codebase_version v2.0, v2.1, v3.0).

Format facts this reader relies on (huggingface/lerobot, main as fetched, and tag v0.3.2 for v2.x):
- meta/info.json (src/lerobot/datasets/utils.py: INFO_PATH, class DatasetInfo): codebase_version,
  fps, features {key: {dtype, shape, names, info}}, total_episodes, total_frames, total_tasks,
  chunks_size, data_path and video_path (str.format templates; video_path null without videos).
- Every frame row has the features stored in parquet plus timestamp (float32, seconds from the
  episode's start), frame_index, episode_index, index (global), task_index (int64)
  (src/lerobot/utils/constants.py: DEFAULT_FEATURES). A dtype "video" feature lives in mp4 files;
  a dtype "image" feature is a parquet struct {bytes (PNG), path} (datasets.Image(); see
  src/lerobot/datasets/io_utils.py: embed_images and the v3.0 conversion's concat_data_files).
- Camera shapes are (H, W, C) with names ["height", "width", "channels"] (src/lerobot/utils/
  feature_utils.py: hw_to_dataset_features; "channel" is a v2.0 legacy spelling there), or
  channel-first with names ["channels", "height", "width"] (src/lerobot/rl/gym_manipulator.py).
- v2.1 (tag v0.3.2, src/lerobot/datasets/utils.py, lerobot_dataset.py): one parquet and one mp4 per
  episode, data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet and
  videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4 with
  episode_chunk = episode_index // chunks_size; meta/episodes.jsonl {episode_index, tasks, length},
  meta/tasks.jsonl {task_index, task}, meta/episodes_stats.jsonl. v2.0 is the same layout with
  meta/stats.json instead of episodes_stats.jsonl (src/lerobot/datasets/v21/
  convert_dataset_v20_to_v21.py), so it is read the same way here.
- v3.0 (src/lerobot/datasets/utils.py, dataset_metadata.py, dataset_writer.py,
  src/lerobot/scripts/convert_dataset_v21_to_v30.py): data/chunk-{chunk_index:03d}/file-{file_index:03d}
  .parquet and videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4 each hold many
  episodes back to back (the per-episode parquet rows and mp4 streams concatenated, timestamps left
  per-episode); meta/episodes/chunk-XXX/file-XXX.parquet has one row per episode with episode_index,
  tasks, length, data/chunk_index, data/file_index, dataset_from_index, dataset_to_index,
  videos/{key}/chunk_index, videos/{key}/file_index, videos/{key}/from_timestamp (the summed durations
  of the file's earlier episodes), videos/{key}/to_timestamp and stats/... columns; meta/tasks.parquet
  is a pandas frame indexed by "task" with a task_index column (io_utils.write_tasks).
- A frame's video time is from_timestamp (0 in v2.x) + its timestamp; a decoded frame's time is
  pts * stream.time_base; lerobot's PyAV path seeks to the keyframe before the first wanted time and
  decodes forward (src/lerobot/datasets/dataset_reader.py: _query_videos; video_utils.py:
  decode_video_frames_pyav). The task text is tasks[task_index] (dataset_reader.py: get_item).
- meta/stats.json maps a feature to min/max/mean/std/count and, when written by a version with
  src/lerobot/datasets/compute_stats.py DEFAULT_QUANTILES, q01/q10/q50/q90/q99 (older datasets lack
  them: src/lerobot/scripts/augment_dataset_quantile_stats.py).
- Videos default to AV1 (libsvtav1), yuv420p, a keyframe every 2 frames (src/lerobot/configs/video.py).

Differences from lerobot, on purpose: a video frame matches the decoded frame nearest its time within
0.4 / fps (lerobot: 1e-4 s), which still tells a missing frame (>= 1 / fps away) from the right one.
"""

from __future__ import annotations

import collections
import io
import json
import pathlib
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.video import FIX, FrameCache, decode_video, resize
from jaxpar.errors import ConfigError

VERSIONS = ("v2.0", "v2.1", "v3.0")
CACHE_BYTES = 256 << 20  # decoded frames kept per source (per grain worker); the trainer's is data.frame_cache_mb
CAMERA_DTYPES = ("video", "image")
STATE_KEY = "observation.state"  # the proprioceptive state a VLA reads with vision.state_dims


def is_lerobot(path) -> bool:
    """A LeRobot dataset is a directory with meta/info.json."""
    return (pathlib.Path(path) / "meta" / "info.json").is_file()


def split_episodes(total_episodes, eval_episodes: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) episode indices, both sorted: `eval_episodes` of range(total_episodes) (or of a
    list of episode indices) drawn with `seed`; the same arguments always give the same split."""
    pool = sorted(range(total_episodes) if isinstance(total_episodes, int) else total_episodes)
    if not 0 <= eval_episodes < len(pool):
        raise ConfigError(f"cannot hold out {eval_episodes} of {len(pool)} episodes; set data.eval_episodes "
                          f"to at least 0 and below the number of episodes")
    held = {pool[i] for i in np.random.default_rng(seed).choice(len(pool), eval_episodes, replace=False)}
    return [e for e in pool if e not in held], sorted(held)


# ----------------------------------------------------------------------------- metadata


def load_info(directory: pathlib.Path) -> dict:
    """meta/info.json, checked for a supported version and the keys this reader uses."""
    path = directory / "meta" / "info.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing; a LeRobot dataset directory holds meta/info.json (point data.train "
                          f"at the dataset's root directory)")
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not readable JSON ({err}); {FIX}") from None
    version = info.get("codebase_version")
    if version not in VERSIONS:
        raise ConfigError(f"{path}: codebase_version {version!r} is not supported (only {', '.join(VERSIONS)}); "
                          f"convert it with lerobot's scripts (convert_dataset_v21_to_v30)")
    missing = [k for k in ("fps", "features", "data_path") if k not in info]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(missing)}; {FIX}")
    return info


def camera_size(key: str, feature: dict, where: pathlib.Path) -> tuple[int, int]:
    """(height, width) of a camera feature declared channel-last (H, W, C) or channel-first (C, H, W)."""
    shape, names = list(feature.get("shape", ())), list(feature.get("names") or ())
    if len(shape) != 3:
        raise ConfigError(f"{where}: camera '{key}' has shape {shape}, not (H, W, C) or (C, H, W); {FIX}")
    first = names[0] in ("channel", "channels") if len(names) == 3 else (shape[0] in (1, 3) and shape[2] not in (1, 3))
    channels, height, width = (shape[0], shape[1], shape[2]) if first else (shape[2], shape[0], shape[1])
    if channels != 3 or (feature.get("info") or {}).get("is_depth_map"):
        raise ConfigError(f"{where}: camera '{key}' has {channels} channel(s) (depth or grey); only RGB cameras are "
                          f"read: leave it out of data.cameras")
    return int(height), int(width)


def select_cameras(info: dict, cameras, where: pathlib.Path) -> list[str]:
    """The camera keys in the order asked for (None: every video / image feature, in info.json order)."""
    available = [k for k, f in info["features"].items() if f.get("dtype") in CAMERA_DTYPES]
    chosen = available if cameras is None else list(cameras)
    unknown = [k for k in chosen if k not in available]
    if unknown or not chosen:
        raise ConfigError(f"{where}: camera(s) {unknown or chosen} not among the video / image features "
                          f"{available}; set data.cameras to some of them")
    return chosen


def action_dims(info: dict, action_key: str, where: pathlib.Path) -> int:
    """The values per frame of numeric feature `action_key` (the actions, or the state)."""
    feature = info["features"].get(action_key)
    if feature is None or feature.get("dtype") in CAMERA_DTYPES + ("string",):
        numeric = [k for k, f in info["features"].items() if f.get("dtype") not in CAMERA_DTYPES + ("string",)]
        fix = ("set vision.state_dims=0 (no state input) or use a dataset that records it" if action_key == STATE_KEY
               else "pick the action feature")
        raise ConfigError(f"{where}: no numeric feature '{action_key}' (numeric features: {numeric}); {fix}")
    return int(np.prod(feature.get("shape") or (1,)))


def read_parquet(path: pathlib.Path, columns: list[str], filters=None) -> pa.Table:
    """Only `columns` of a parquet file; a missing, truncated or column-less file is a ConfigError."""
    try:
        have = pq.read_schema(path).names
        missing = [c for c in columns if c not in have]
        if missing:
            raise ConfigError(f"{path}: no column(s) {missing} (it has {have}); {FIX}")
        return pq.read_table(path, columns=columns, filters=filters)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"{path}: not a readable parquet file ({str(err).splitlines()[0]}); {FIX}") from None


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not readable JSON lines ({err}); {FIX}") from None


def load_tasks(directory: pathlib.Path, version: str) -> tuple[dict[int, str], pathlib.Path]:
    """({task_index: task text}, the file they came from)."""
    if version == "v3.0":
        path = directory / "meta" / "tasks.parquet"
        table = read_parquet(path, ["task_index", "task"])
        return dict(zip(table["task_index"].to_pylist(), table["task"].to_pylist())), path
    path = directory / "meta" / "tasks.jsonl"
    rows = _read_jsonl(path)
    try:
        return {int(r["task_index"]): str(r["task"]) for r in rows}, path
    except KeyError as err:
        raise ConfigError(f"{path}: a line without {err}; {FIX}") from None


def episode_table(directory: pathlib.Path, info: dict, video_keys: list[str]) -> list[dict]:
    """Every episode in index order: {index, length, data (parquet path), videos {key: (path, from_ts,
    to_ts)}}; v2.x has one video per episode (from 0, no to_ts)."""
    if info["codebase_version"] == "v3.0":
        return _episodes_v3(directory, info, video_keys)
    path = directory / "meta" / "episodes.jsonl"
    chunk = int(info.get("chunks_size", 1000))
    episodes = []
    for row in sorted(_read_jsonl(path), key=lambda r: r.get("episode_index", -1)):
        if "episode_index" not in row or "length" not in row:
            raise ConfigError(f"{path}: a line without episode_index / length; {FIX}")
        e = int(row["episode_index"])
        fields = {"episode_chunk": e // chunk, "episode_index": e}
        videos = {k: (directory / info["video_path"].format(video_key=k, **fields), 0.0, None) for k in video_keys}
        episodes.append({"index": e, "length": int(row["length"]),
                         "data": directory / info["data_path"].format(**fields), "videos": videos})
    return episodes


def _episodes_v3(directory: pathlib.Path, info: dict, video_keys: list[str]) -> list[dict]:
    files = sorted((directory / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise ConfigError(f"{directory / 'meta' / 'episodes'}: no chunk-XXX/file-XXX.parquet episode files; {FIX}")
    columns = ["episode_index", "length", "data/chunk_index", "data/file_index"]
    for k in video_keys:
        columns += [f"videos/{k}/{c}" for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    episodes = []
    for path in files:
        for row in read_parquet(path, columns).to_pylist():
            data = info["data_path"].format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
            videos = {k: (directory / info["video_path"].format(
                video_key=k, chunk_index=row[f"videos/{k}/chunk_index"], file_index=row[f"videos/{k}/file_index"]),
                float(row[f"videos/{k}/from_timestamp"]), float(row[f"videos/{k}/to_timestamp"])) for k in video_keys}
            episodes.append({"index": int(row["episode_index"]), "length": int(row["length"]),
                             "data": directory / data, "videos": videos})
    return sorted(episodes, key=lambda e: e["index"])


def column_array(table: pa.Table, key: str, dims: int, path: pathlib.Path) -> np.ndarray:
    """A numeric (list or fixed-size list) column as float32 [rows, dims]."""
    column = table[key].combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
            pa.types.is_fixed_size_list(column.type):
        values = column.flatten()
    else:
        values = column
    array = np.asarray(values.to_numpy(zero_copy_only=False), np.float32)
    if array.size != len(table) * dims:
        raise ConfigError(f"{path}: column '{key}' holds {array.size} values for {len(table)} rows, not {dims} per "
                          f"row as meta/info.json declares; {FIX}")
    return array.reshape(len(table), dims)


def frame_rows(episodes: list[dict], action_key: str, dims: int, state: tuple[str, int] | None = None) -> list[dict]:
    """Per episode {actions [T, dims], timestamp [T], task_index [T]} (+ "state" [T, its dims] with
    `state` = (its key, its dims)) from its data file, one read per file (only the needed columns), its row
    count checked against the episode metadata."""
    by_file = collections.defaultdict(list)
    for episode in episodes:
        by_file[episode["data"]].append(episode)
    rows = {}
    for path, members in by_file.items():
        columns = ["episode_index", "timestamp", "task_index", action_key] + ([state[0]] if state else [])
        table = read_parquet(path, columns)
        owner = table["episode_index"].to_numpy()
        order = np.argsort(owner, kind="stable")  # each episode's rows, in file order
        owners = owner[order]
        actions, stamps = column_array(table, action_key, dims, path), table["timestamp"].to_numpy()
        tasks = table["task_index"].to_numpy()
        states = column_array(table, state[0], state[1], path) if state else None
        for episode in members:
            take = order[np.searchsorted(owners, episode["index"], "left"):
                         np.searchsorted(owners, episode["index"], "right")]
            if len(take) != episode["length"]:
                raise ConfigError(f"{path}: episode {episode['index']} has {len(take)} rows but the episode metadata "
                                  f"says {episode['length']}; {FIX}")
            rows[episode["index"]] = {"actions": actions[take], "timestamp": stamps[take].astype(np.float64),
                                      "task_index": tasks[take].astype(np.int64)}
            if state:
                rows[episode["index"]]["state"] = states[take]
    return [rows[e["index"]] for e in episodes]


def compute_action_quantiles(directory, action_key: str = "action") -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension (q01, q99) of `action_key` (the actions, or the state: any numeric feature) over every
    frame of the dataset (np.quantile)."""
    directory = pathlib.Path(directory)
    info = load_info(directory)
    dims = action_dims(info, action_key, directory / "meta" / "info.json")
    files = dict.fromkeys(e["data"] for e in episode_table(directory, info, []))
    actions = np.concatenate([column_array(read_parquet(p, [action_key]), action_key, dims, p) for p in files])
    q01, q99 = np.quantile(actions, [0.01, 0.99], axis=0)
    return q01.astype(np.float32), q99.astype(np.float32)


# ----------------------------------------------------------------------------- images in parquet


def decode_pngs(path: pathlib.Path, key: str, episode: int, rows: slice, size: int,
                method: str = "area") -> np.ndarray:
    """uint8 [frames, size, size, 3] from an image feature's PNG bytes (the episode's `rows`)."""
    table = read_parquet(path, [key], filters=[("episode_index", "=", episode)])
    images = []
    for value in table[key].to_pylist()[rows]:
        try:
            with Image.open(io.BytesIO(value["bytes"])) as image:
                images.append(resize(image, size, method))
        except (OSError, TypeError, KeyError) as err:
            raise ConfigError(f"{path}: episode {episode}'s '{key}' is not a readable PNG ({err}); {FIX}") from None
    return np.stack(images)


# ----------------------------------------------------------------------------- the source


class LeRobotSource:
    """grain random-access source: record i is frame i of the selected episodes (in the order given),
    as {"images" uint8 [cameras, image_size, image_size, 3], "instruction" [instruction_len] (the
    frame's task as the LLM reads it: jaxpar.data.instructions; + "instruction_bytes" for FiLM beside
    a tokenizer's ids), "actions" float32 [dims]} (+ "state" float32 [its dims] with `state_key`, e.g.
    observation.state: the proprioceptive state the encoder reads with vision.state_dims).

    The episodes, actions, timestamps and task indices are read at construction (only those parquet
    columns), so a bad file fails at start. Pixels are decoded on demand, one segment (the whole
    episode, or `segment_frames` frames of it) of one camera at a time, and kept in a FrameCache of
    `cache_bytes`: a shuffled epoch then decodes each segment about once per process when the decoded
    frames fit in it. Shorter segments bound the work of a cache miss (lerobot's videos have a keyframe
    every 2 frames) when they do not. The source pickles without its cache or open files (grain workers)."""

    def __init__(self, directory, encoder: InstructionEncoder, image_size: int, cameras: tuple[str, ...] | None = None,
                 episodes: list[int] | None = None, action_key: str = "action", *, cache_bytes: int = CACHE_BYTES,
                 segment_frames: int | None = None, resize: str = "area", state_key: str | None = None):
        self.directory = pathlib.Path(directory)
        self.info_path = self.directory / "meta" / "info.json"
        info = load_info(self.directory)
        self.version, self.fps = info["codebase_version"], float(info["fps"])
        self.encoder, self.image_size, self.action_key = encoder, image_size, action_key
        self.resize = resize  # vision.resize: how frames are brought to image_size (see `resize`)
        self.camera_keys = select_cameras(info, cameras, self.info_path)
        self.camera_sizes = {k: camera_size(k, info["features"][k], self.info_path) for k in self.camera_keys}
        self.video_keys = [k for k in self.camera_keys if info["features"][k]["dtype"] == "video"]
        if self.video_keys and not info.get("video_path"):
            raise ConfigError(f"{self.info_path}: video features {self.video_keys} but no video_path; {FIX}")
        dims = action_dims(info, action_key, self.info_path)
        self.shapes = {"images": (len(self.camera_keys), image_size, image_size, 3), "actions": (dims,)}
        state = None
        if state_key:
            state = (state_key, action_dims(info, state_key, self.info_path))
            self.shapes["state"] = (state[1],)
        self.episodes = self._select(episode_table(self.directory, info, self.video_keys), episodes)
        self.episode_indices = [e["index"] for e in self.episodes]
        if not sum(e["length"] for e in self.episodes):
            raise ConfigError(f"{self.directory}: the selected episodes hold no frames; {FIX} or select others")
        rows = frame_rows(self.episodes, action_key, dims, state)
        self.starts = np.concatenate([[0], np.cumsum([e["length"] for e in self.episodes])]).astype(np.int64)
        self.actions = np.concatenate([r["actions"] for r in rows])
        self.states = np.concatenate([r["state"] for r in rows]) if state else None
        self.timestamps = [r["timestamp"] for r in rows]
        self.task_index = np.concatenate([r["task_index"] for r in rows])
        self.tolerance = 0.4 / self.fps
        self._check_spans()
        self.tasks, self.tasks_path = load_tasks(self.directory, self.version)
        self.cache_bytes, self.segment_frames = cache_bytes, segment_frames
        self._runtime()

    def _select(self, table: list[dict], wanted: list[int] | None) -> list[dict]:
        by_index = {e["index"]: e for e in table}
        if wanted is None:
            return table
        unknown = [e for e in wanted if e not in by_index]
        if unknown or len(set(wanted)) != len(wanted) or not wanted:
            raise ConfigError(f"{self.directory}: episodes {list(wanted)} must be distinct indices among the "
                              f"dataset's {len(table)} (0..{max(by_index, default=-1)}); unknown: {unknown}")
        return [by_index[e] for e in wanted]

    def _check_spans(self) -> None:
        """v3.0: an episode's frames must lie within its [from_timestamp, to_timestamp) of the shared
        video file; past it they would silently read the next episode's frames."""
        for slot, episode in enumerate(self.episodes):
            for key, (path, start, end) in episode["videos"].items() if episode["length"] else ():
                last = start + float(self.timestamps[slot].max()) + 1 / self.fps
                if end is not None and last > end + self.tolerance:
                    raise ConfigError(f"{path}: episode {episode['index']}'s last frame ends at {last:.4f}s, past its "
                                      f"videos/{key}/to_timestamp {end:.4f}s in meta/episodes: the parquet has more "
                                      f"frames than the video; {FIX}")

    def subset(self, episodes: list[int]) -> "LeRobotSource":
        """The same source over `episodes` only (in that order), without reading the files again."""
        slots = {e: slot for slot, e in enumerate(self.episode_indices)}
        picked = [slots[e["index"]] for e in self._select(self.episodes, episodes)]
        clone = LeRobotSource.__new__(LeRobotSource)
        clone.__dict__.update(self.__getstate__())
        rows = [slice(int(self.starts[s]), int(self.starts[s + 1])) for s in picked]
        clone.episodes, clone.episode_indices = [self.episodes[s] for s in picked], list(episodes)
        clone.starts = np.concatenate([[0], np.cumsum([r.stop - r.start for r in rows])]).astype(np.int64)
        clone.actions = np.concatenate([self.actions[r] for r in rows])
        clone.states = None if self.states is None else np.concatenate([self.states[r] for r in rows])
        clone.task_index = np.concatenate([self.task_index[r] for r in rows])
        clone.timestamps = [self.timestamps[s] for s in picked]
        clone._runtime()
        return clone

    def _runtime(self) -> None:
        """What is not pickled: the decoded frames, the locks, the decode count (per process)."""
        self.cache, self.decodes = FrameCache(self.cache_bytes), 0
        self._lock, self._inflight, self._instructions = threading.Lock(), {}, {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("cache", "decodes", "_lock", "_inflight", "_instructions"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._runtime()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, record: int) -> dict:
        record = int(record)
        if not 0 <= record < len(self):
            raise IndexError(f"record {record} of {len(self)}")
        slot = int(np.searchsorted(self.starts, record, side="right")) - 1
        step = record - int(self.starts[slot])
        images = np.stack([self.frame(slot, key, step) for key in self.camera_keys])
        out = {"images": images, **self.instruction(int(self.task_index[record])), "actions": self.actions[record]}
        if self.states is not None:
            out["state"] = self.states[record]
        return out

    def episode_actions(self, record: int) -> tuple[np.ndarray, int]:
        """(the actions [T, dims] of the episode frame `record` belongs to, its step): action chunks."""
        slot = int(np.searchsorted(self.starts, record, side="right")) - 1
        return self.actions[self.starts[slot]:self.starts[slot + 1]], record - int(self.starts[slot])

    def frame(self, slot: int, camera: str, step: int) -> np.ndarray:
        """Frame `step` of camera `camera` of the slot-th selected episode, its segment decoded once."""
        length = self.episodes[slot]["length"]
        span = self.segment_frames or length
        first = step - step % span
        key = (slot, camera, first)
        frames = self.cache.get(key)
        if frames is None:
            with self._lock:
                lock = self._inflight.setdefault(key, threading.Lock())
            with lock:  # one thread decodes a segment; the others wait for it and then hit the cache
                frames = self.cache.get(key)
                if frames is None:
                    frames = self._decode(slot, camera, slice(first, min(first + span, length)))
                    self.cache.put(key, frames)
                    self.decodes += 1
            with self._lock:
                self._inflight.pop(key, None)
        return frames[step - first]

    def _decode(self, slot: int, camera: str, rows: slice) -> np.ndarray:
        episode = self.episodes[slot]
        if camera in self.video_keys:
            path, start, _ = episode["videos"][camera]
            return decode_video(path, start + self.timestamps[slot][rows], self.image_size, self.tolerance,
                                self.resize)
        return decode_pngs(episode["data"], camera, episode["index"], rows, self.image_size, self.resize)

    def instruction(self, task: int) -> dict:
        """Task `task`'s instruction, encoded once (InstructionEncoder.encode)."""
        ids = self._instructions.get(task)
        if ids is None:
            if task not in self.tasks:
                raise ConfigError(f"{self.tasks_path}: no task_index {task}, which the frames use; {FIX}")
            ids = self._instructions[task] = self.encoder.encode(self.tasks[task], self.tasks_path)
        return ids

    def check_instructions(self) -> None:
        """Every task the selected frames use fits instruction_len (the error names the tasks file)."""
        for task in np.unique(self.task_index):
            self.instruction(int(task))

    def action_quantiles(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dim (q01, q99) of the actions over the whole dataset: meta/stats.json's when it has them,
        else computed from the parquet files."""
        stored = self.stored_action_quantiles(self.directory, self.action_key)
        return stored if stored is not None else compute_action_quantiles(self.directory, self.action_key)

    @staticmethod
    def stored_action_quantiles(directory, action_key: str = "action") -> tuple[np.ndarray, np.ndarray] | None:
        """meta/stats.json's per-dim (q01, q99) of `action_key` as float32, or None where it has none."""
        directory = pathlib.Path(directory)
        path, dims = directory / "meta" / "stats.json", action_dims(load_info(directory), action_key, directory)
        if not path.is_file():
            return None
        try:
            stats = json.loads(path.read_text()).get(action_key, {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
            raise ConfigError(f"{path}: not a readable stats file ({err}); {FIX} or delete it") from None
        if "q01" not in stats or "q99" not in stats:
            return None
        q01, q99 = (np.asarray(stats[q], np.float32).reshape(-1) for q in ("q01", "q99"))
        if q01.shape != (dims,) or q99.shape != (dims,):
            raise ConfigError(f"{path}: {action_key} q01 / q99 have {q01.size} / {q99.size} values, not {dims}; "
                              f"{FIX} or delete it")
        return q01, q99
