"""The procedural demo task (jaxpar.data.episodes) written as a Hugging Face LeRobot dataset, codebase v3.0.

Why: LeRobot's format is what VLA datasets on the Hub use; writing the demo task in it lets the trainer's
LeRobot reader be tested end to end on data whose every pixel and action is known. The writer does not
import lerobot (no Hub, heavy deps): it follows lerobot's source, read at github:huggingface/lerobot
(commit 7427f318, Aug 2026; paths below are in that repository).

Layout (src/lerobot/datasets/utils.py):
    meta/info.json                                   INFO_PATH
    meta/stats.json                                  STATS_PATH
    meta/tasks.parquet                               DEFAULT_TASKS_PATH
    meta/episodes/chunk-000/file-000.parquet         DEFAULT_EPISODES_PATH
    data/chunk-000/file-000.parquet                  DEFAULT_DATA_PATH   (chunk-{chunk_index:03d}/file-{file_index:03d})
    videos/<video_key>/chunk-000/file-000.mp4        DEFAULT_VIDEO_PATH
plus, outside the format, scenes.jsonl (the scenes, so closed-loop evaluation avoids train scenes) and
DONE_MARKER, written last. Everything is staged in `<dir>.partial-<pid>` and renamed into place.

Facts relied on:
- info.json (utils.py DatasetInfo, feature_utils.py create_empty_dataset_info, io_utils write_info ->
  utils/io_utils.py write_json: json indent=4): codebase_version "v3.0" (dataset_metadata.py
  CODEBASE_VERSION), fps (int > 0), features, total_episodes, total_frames, total_tasks, chunks_size 1000,
  data_files_size_in_mb 100, video_files_size_in_mb 200 (DEFAULT_*; here raised to the written file's
  size if larger, since files are not rotated), data_path, video_path, robot_type, splits
  {"train": "0:<episodes>"} (dataset_metadata.py save_episode).
- features (utils/constants.py DEFAULT_FEATURES appended by LeRobotDatasetMetadata.create): timestamp
  float32 (1,), frame_index / episode_index / index / task_index int64 (1,), names None. Cameras
  (utils/feature_utils.py hw_to_dataset_features): dtype "video", shape [H, W, 3], names
  ["height", "width", "channels"]; vectors: dtype float32, shape [n], names = a list of n strings.
- a video feature's "info" (video_utils.py get_video_info, probed from the written file): video.height,
  video.width, video.codec (the stream codec's canonical_name: "av1" / "h264"), video.pix_fmt,
  video.fps (int(base_rate)), video.channels (pyav_utils.py: components of pix_fmt), has_audio, then the
  encoder config fields as video.<field> (configs/video.py VideoEncoderConfig: g, crf, preset,
  fast_decode, video_backend, extra_options) and is_depth_map.
- encoding (configs/video.py VideoEncoderConfig defaults, video_utils.py encode_video_frames): vcodec
  "libsvtav1" (alias "av1") or "h264", pix_fmt yuv420p, g=2, crf=30, fast_decode 0 (libsvtav1:
  svtav1-params fast-decode=0), libx264's own preset for h264; RGB frames handed to PyAV as rgb24 and
  converted by the encoder. One deviation: lerobot's libsvtav1 preset is 12 (LIBSVTAV1_DEFAULT_PRESET,
  which SVT-AV1 4.1 maps to M11); on these 64-pixel frames presets 12, 11 and 10 smear the effector dot
  in inter frames (measured over 1000 episodes: 24-66 frames with pixels nearer another palette colour
  than their own after box-filtering back to 16 pixels, errors up to 184 levels), so AV1 uses preset 8,
  the fastest with no such pixel in 3000 episodes (max error 44 levels; h264 at crf 30: 54).
- videos (dataset_writer.py _save_episode_video, video_utils.py concatenate_video_files): each episode is
  encoded on its own and the episodes of a file are concatenated (stream copy), so episode k starts at a
  keyframe at from_timestamp = the summed durations of the episodes before it, and to_timestamp =
  from_timestamp + its duration (get_video_duration_in_s). Here one encoder per camera writes the whole
  split with pts = global frame index (time base 1/fps) and a forced keyframe at every episode start,
  which is the same stream layout and the same timestamps (from = first frame / fps, to = end / fps)
  without per-episode files. A reader decodes frame i of episode k at from_timestamp + timestamp
  (dataset_reader.py _query_videos), within tolerance_s = 1e-4 (lerobot_dataset.py).
- data parquet (dataset_writer.py _save_episode_data, feature_utils.py get_hf_features_from_features):
  the non-video features in feature order; shape (1,) as a plain column (datasets.Value), shape (n,) as
  a fixed-size list (datasets List(length=n) -> pa.list_(type, n)); schema metadata "huggingface" =
  {"info": {"features": Features.to_dict()}} (datasets features.py arrow_schema); one row group per
  episode (io_utils.py write_table_one_row_group_per_episode), snappy. timestamp = frame_index / fps
  (add_frame), index = global frame index, task_index = index of the episode's task.
- episodes parquet (dataset_metadata.py save_episode / _save_episode_metadata, pa.Table.from_pydict):
  episode_index, tasks (list of str), length, data/chunk_index, data/file_index, dataset_from_index,
  dataset_to_index, videos/<key>/{chunk_index, file_index, from_timestamp, to_timestamp}, the episode's
  stats flattened as stats/<feature>/<stat> (utils/utils.py flatten_dict, "/"), meta/episodes/chunk_index,
  meta/episodes/file_index.
- tasks.parquet (io_utils.py write_tasks: pandas DataFrame({"task_index"}, index=Index(tasks,
  name="task")).to_parquet): columns task_index int64 and task string, with pandas metadata naming
  "task" the index, so lerobot's pd.read_parquet gets tasks indexed by their text. Written here with
  pyarrow and that metadata by hand (pandas is not a dependency).
- stats (compute_stats.py compute_episode_stats / get_feature_stats / aggregate_stats; io_utils.py
  write_stats): per feature min, max, mean, std (population), count [n], q01 q10 q50 q90 q99
  (DEFAULT_QUANTILES, keys f"q{int(q*100):02d}"); vectors shaped [n], (1,)-features shaped [1], images
  per channel shaped [3, 1, 1] in [0, 1] (divided by 255), count = frames. Every feature has stats,
  including timestamp and the indices. Deviation: lerobot estimates quantiles from histograms and
  aggregates episodes' quantiles as an envelope (min of lower, max of upper); here every quantile is
  exact (numpy's default linear interpolation, np.quantile), for the episodes and for stats.json alike,
  which training normalises actions with. Image stats are over all pixels of the task-size frames, equal
  to the stats of the nearest-neighbour upscaled frames lerobot would compute them from.

The task's images are upscaled nearest-neighbour by video_size / size, so the 4-pixel cells of the 16-pixel
task become 16-pixel blocks aligned to the 2x2 chroma subsampling and the codec's transform blocks;
decoding and box-filtering back to the task's size recovers the frames within a few levels.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil

import numpy as np

from jaxpar.data.episodes import DONE_MARKER, iter_split, write_scenes
from jaxpar.data.video import as_fraction
from jaxpar.errors import ConfigError

CODEBASE_VERSION = "v3.0"
ROBOT_TYPE = "jaxpar_grid_task"
CHUNKS_SIZE, DATA_FILE_MB, VIDEO_FILE_MB = 1000, 100, 200
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
INFO_PATH, STATS_PATH, TASKS_PATH = "meta/info.json", "meta/stats.json", "meta/tasks.parquet"
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_KEYS = tuple(f"q{int(q * 100):02d}" for q in QUANTILES)
HELDOUT_SEED_OFFSET = 1_000_003  # as jaxpar.data.episodes.write_splits: the held-out split's seed
STATE, ACTION = "observation.state", "action"
# lerobot's VideoEncoderConfig for each codec: vcodec as lerobot passes it to PyAV, and the fields it records.
ENCODERS = {
    # preset 8, not lerobot's 12: 12 to 10 misread the scene in inter frames (see the module docstring)
    "av1": {"vcodec": "libsvtav1", "pix_fmt": "yuv420p", "g": 2, "crf": 30, "preset": 8, "fast_decode": 0,
            "video_backend": "pyav", "extra_options": {}},
    "h264": {"vcodec": "h264", "pix_fmt": "yuv420p", "g": 2, "crf": 30, "preset": None, "fast_decode": 0,
             "video_backend": "pyav", "extra_options": {}},
}


def _libs():
    """pyarrow and PyAV, imported on first use: only the LeRobot format needs them."""
    try:
        import av
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ConfigError(f"the LeRobot format needs pyarrow and PyAV ({err}); pip install pyarrow av") from None
    return av, pa, pq


@contextlib.contextmanager
def scheduling_kept():
    """Run an encoder without letting it change the calling thread's scheduling.

    Why: SVT-AV1 (libsvtav1) sets the thread that feeds its first frame to SCHED_FIFO priority 99 when
    it may (root, as in most containers), and every thread started from it afterwards inherits that:
    the trainer's XLA pools and gloo's event loop, or the processes a test launches. A real-time
    thread that polls (gloo's loop does) then starves the others on a small machine; a 2-process run
    launched after encoding never finished its first step. The caller's policy comes back here."""
    if not hasattr(os, "sched_getscheduler"):  # not Linux: nothing to keep
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def camera_key(camera: int) -> str:
    return f"observation.images.cam{camera}"


def action_names(dims: int) -> list[str]:
    """The action's dims by meaning (jaxpar.data.episodes.expert_action): the move, unused dims, the gripper."""
    return ["move_row", "move_col"] + [f"unused_{i}" for i in range(2, dims - 1)] + ["gripper"]


GRID_STATE_NAMES = ["effector_row", "effector_col"]


def make_features(cameras: int, video_size: int, dims: int, state_names: list[str] = GRID_STATE_NAMES,
                  names_of_actions: list[str] | None = None, camera_keys: list[str] | None = None) -> dict:
    """info.json's features, before the video info blocks: cameras, state, action, then lerobot's defaults.
    The names and camera keys default to the grid task's (action_names, camera_key)."""
    keys = camera_keys or [camera_key(k) for k in range(cameras)]
    features = {key: {"dtype": "video", "shape": [video_size, video_size, 3],
                      "names": ["height", "width", "channels"]} for key in keys}
    features[STATE] = {"dtype": "float32", "shape": [len(state_names)], "names": list(state_names)}
    features[ACTION] = {"dtype": "float32", "shape": [dims], "names": names_of_actions or action_names(dims)}
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        features[key] = {"dtype": "float32" if key == "timestamp" else "int64", "shape": [1], "names": None}
    return features


def check_args(episodes: int, codec: str, fps: int, video_size: int, size: int, cameras: int) -> None:
    """One-line errors for a LeRobot split that cannot be written as asked, before anything is written."""
    if cameras < 1:
        raise ConfigError(f"cameras={cameras}: the LeRobot split stores each camera as a video; cameras >= 1")
    if codec not in ENCODERS:
        raise ConfigError(f"codec={codec!r}: the LeRobot writer encodes {' or '.join(ENCODERS)}")
    if video_size < size or video_size % size:
        raise ConfigError(f"video_size={video_size} is not a multiple of the image size {size}: frames are "
                          f"upscaled by an integer factor (e.g. video_size={size * max(1, 64 // size)})")
    if video_size % 2:
        raise ConfigError(f"video_size={video_size} is odd; yuv420p video needs an even size")
    if not isinstance(fps, int) or fps <= 0:
        raise ConfigError(f"fps={fps!r}: LeRobot datasets have a positive integer fps")
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: a LeRobot split needs at least one episode")


# ----------------------------------------------------------------------------- statistics


def vector_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """lerobot's stats of [N] or [N, D] values (per dim), with exact quantiles; [N] gives shape [1]."""
    values = np.asarray(values, np.float64).reshape(len(values), -1)
    stats = {"min": values.min(0), "max": values.max(0), "mean": values.mean(0), "std": values.std(0),
             "count": np.array([len(values)])}
    for key, q in zip(QUANTILE_KEYS, np.quantile(values, QUANTILES, axis=0)):
        stats[key] = q
    return stats


def split_stats(columns: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """vector_stats of each column, computed in one pass over the columns side by side (one np.quantile
    per episode instead of one per feature: the per-episode stats were most of the write time)."""
    arrays = [np.asarray(values, np.float64).reshape(len(values), -1) for values in columns.values()]
    stats = vector_stats(np.concatenate(arrays, axis=1))
    bounds = np.cumsum([0] + [a.shape[1] for a in arrays])
    return {key: {stat: value if stat == "count" else value[start:stop] for stat, value in stats.items()}
            for key, start, stop in zip(columns, bounds[:-1], bounds[1:])}


def histogram_quantiles(hist: np.ndarray, qs=QUANTILES) -> np.ndarray:
    """np.quantile's linear-interpolation quantiles of the values a histogram of integer bins counts."""
    cumulative = np.cumsum(hist)
    position = (cumulative[-1] - 1) * np.asarray(qs, np.float64)
    low = np.floor(position).astype(np.int64)
    below = np.searchsorted(cumulative, low, side="right")  # the value of rank `low` in sorted order
    above = np.searchsorted(cumulative, np.minimum(low + 1, cumulative[-1] - 1), side="right")
    return below + (position - low) * (above - below)


def image_stats(hist: np.ndarray, frames: int) -> dict[str, np.ndarray]:
    """Per-channel stats in [0, 1], shaped [3, 1, 1], from [3, 256] pixel-value histograms (exact, and
    summable over episodes, so stats.json needs no pixels kept)."""
    levels = np.arange(256, dtype=np.float64)
    count = hist.sum(1)
    mean = hist @ levels / count
    std = np.sqrt(np.maximum(hist @ levels ** 2 / count - mean ** 2, 0.0))
    nonzero = [np.nonzero(h)[0] for h in hist]
    quantiles = np.stack([histogram_quantiles(h) for h in hist], axis=1)  # [quantile, channel]
    stats = {"min": [n[0] for n in nonzero], "max": [n[-1] for n in nonzero], "mean": mean, "std": std,
             **dict(zip(QUANTILE_KEYS, quantiles))}
    shaped = {key: (np.asarray(value, np.float64) / 255.0).reshape(3, 1, 1) for key, value in stats.items()}
    return {**{k: shaped[k] for k in ("min", "max", "mean", "std")}, "count": np.array([frames]),
            **{k: shaped[k] for k in QUANTILE_KEYS}}


def pixel_histogram(images: np.ndarray) -> np.ndarray:
    """[3, 256] counts of each channel's values over uint8 images [..., 3]."""
    flat = images.reshape(-1, 3)
    return np.stack([np.bincount(flat[:, c], minlength=256) for c in range(3)]).astype(np.int64)


def jsonable(stats: dict) -> dict:
    return {feature: {key: np.asarray(value).tolist() for key, value in s.items()} for feature, s in stats.items()}


# ----------------------------------------------------------------------------- video


class CameraVideo:
    """One camera's mp4: every episode's frames, upscaled, encoded with lerobot's settings; each episode
    starts with a forced keyframe, as if encoded alone and concatenated (see the module docstring)."""

    def __init__(self, path: pathlib.Path, codec: str, fps: int, video_size: int):
        av, _, _ = _libs()
        self.config, self.path, self.frames, self.last_dts = ENCODERS[codec], path, 0, None
        path.parent.mkdir(parents=True, exist_ok=True)
        options = {"g": str(self.config["g"]), "crf": str(self.config["crf"])}
        if self.config["preset"] is not None:
            options["preset"] = str(self.config["preset"])
        if self.config["vcodec"] == "libsvtav1":
            options["svtav1-params"] = f"fast-decode={self.config['fast_decode']}"
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise
        try:
            self.container = av.open(str(path), "w")
            self.stream = self.container.add_stream(self.config["vcodec"], fps, options=options)
        except (av.error.FFmpegError, ValueError) as err:
            raise ConfigError(f"cannot open a {self.config['vcodec']} encoder in this PyAV build: {err}") from None
        self.stream.width = self.stream.height = video_size
        self.stream.pix_fmt = self.config["pix_fmt"]
        self.video_size, self._frame, self._intra = video_size, av.VideoFrame, av.video.frame.PictureType.I

    def add_episode(self, images: np.ndarray) -> None:
        """Encode one episode's [T, H, W, 3] frames; its first frame is a keyframe."""
        factor = self.video_size // images.shape[1]
        with scheduling_kept():
            self._encode(images, factor)

    def _encode(self, images: np.ndarray, factor: int) -> None:
        for step, image in enumerate(images):
            big = np.ascontiguousarray(np.repeat(np.repeat(image, factor, 0), factor, 1))
            frame = self._frame.from_ndarray(big, format="rgb24")
            frame.pts = self.frames
            if step == 0:
                frame.pict_type = self._intra
            self._mux(self.stream.encode(frame))
            self.frames += 1

    def _mux(self, packets) -> None:
        """Write packets; a muxer refusal names the packet and the last one written (pts, dts in 1/fps)."""
        for packet in packets:
            try:
                self.container.mux(packet)
            except Exception as err:
                raise RuntimeError(f"{self.path}: muxing packet pts={packet.pts} dts={packet.dts} after dts="
                                   f"{self.last_dts} of {self.frames} frames failed: {err}") from err
            self.last_dts = packet.dts

    def close(self) -> None:
        with scheduling_kept():
            self._mux(self.stream.encode(None))
        self.container.close()

    def info(self) -> dict:
        """The feature's info block, probed from the file as lerobot's get_video_info does."""
        av, _, _ = _libs()
        with av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            info = {"video.height": stream.height, "video.width": stream.width,
                    "video.codec": stream.codec_context.codec.canonical_name, "video.pix_fmt": stream.pix_fmt,
                    "video.fps": int(as_fraction(stream.base_rate)),
                    "video.channels": len(av.VideoFormat(stream.pix_fmt).components),
                    "has_audio": len(container.streams.audio) > 0}
        for field, value in self.config.items():
            if field != "vcodec":
                info.setdefault(f"video.{field}", value)
        info["is_depth_map"] = False
        return info


# ----------------------------------------------------------------------------- parquet tables


def data_schema(features: dict):
    """The data parquet's arrow schema and the "huggingface" metadata datasets writes with it."""
    _, pa, _ = _libs()
    fields, hf = [], {}
    for key, feature in features.items():
        if feature["dtype"] == "video":
            continue
        dtype = pa.float32() if feature["dtype"] == "float32" else pa.int64()
        value = {"dtype": feature["dtype"], "_type": "Value"}
        if feature["shape"] == [1]:
            fields.append(pa.field(key, dtype))
            hf[key] = value
        else:
            fields.append(pa.field(key, pa.list_(dtype, feature["shape"][0])))
            hf[key] = {"feature": value, "length": feature["shape"][0], "_type": "List"}
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": hf}})})


def episode_table(schema, columns: dict):
    """One episode's rows as an arrow table of `schema` (fixed-size lists from [T, n] float32 arrays)."""
    _, pa, _ = _libs()
    arrays = []
    for field in schema:
        values = columns[field.name]
        if pa.types.is_fixed_size_list(field.type):
            flat = pa.array(np.ascontiguousarray(values, np.float32).reshape(-1), pa.float32())
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, field.type.list_size))
        else:
            arrays.append(pa.array(values, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_tasks(path: pathlib.Path, tasks: list[str]) -> None:
    """meta/tasks.parquet as pandas writes DataFrame({"task_index"}, index=Index(tasks, name="task"))."""
    _, pa, pq = _libs()
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
                     "metadata": None}],
        "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


# ----------------------------------------------------------------------------- the split


def effector_cells(episode: dict, grid: int) -> np.ndarray:
    """[T, 2] effector cells: the target cell minus the expert action's cell offset (expert_action)."""
    _, row, col = episode["scene"]["squares"][episode["scene"]["target"]]
    cells = np.array([row, col]) - np.rint(episode["actions"][:, :2] * (grid - 1)).astype(np.int64)
    if list(cells[0]) != list(episode["scene"]["start"]):
        raise AssertionError(f"effector path {cells[0]} does not start at the scene's start {episode['scene']}")
    return cells


class SplitWriter:
    """Streams episodes into the data parquet and the camera videos, keeping only what the metadata
    and stats need (actions, states, per-episode rows, pixel histograms). An episode is a dict of
    images uint8 [T, cameras, H, W, 3], state and actions float [T, n], and its instruction (the task):
    any simulator's demonstrations (the grid task here, Meta-World in jaxpar.robot.metaworld_demos)."""

    def __init__(self, root: pathlib.Path, features: dict, fps: int, codec: str, video_size: int,
                 robot_type: str = ROBOT_TYPE):
        _, _, pq = _libs()
        self.root, self.features, self.fps, self.robot_type = root, features, fps, robot_type
        self.video_keys = [key for key, f in features.items() if f["dtype"] == "video"]
        self.videos = [CameraVideo(root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=0), codec, fps,
                                   video_size) for key in self.video_keys]
        self.schema = data_schema(features)
        data_path = root / DATA_PATH.format(chunk_index=0, file_index=0)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        self.data = pq.ParquetWriter(str(data_path), self.schema, compression="snappy", use_dictionary=True)
        self.tasks: dict[str, int] = {}
        self.rows: list[dict] = []
        self.columns: dict[str, list] = {key: [] for key in self.schema.names}
        self.histograms = np.zeros((len(self.video_keys), 3, 256), np.int64)
        self.frames = 0

    def add(self, episode: dict) -> None:
        index, length = len(self.rows), len(episode["actions"])
        task = self.tasks.setdefault(episode["instruction"], len(self.tasks))
        frame_index = np.arange(length)
        columns = {STATE: np.asarray(episode["state"], np.float32),
                   ACTION: episode["actions"].astype(np.float32),
                   "timestamp": (frame_index / self.fps).astype(np.float32),
                   "frame_index": frame_index, "episode_index": np.full(length, index),
                   "index": self.frames + frame_index, "task_index": np.full(length, task)}
        self.data.write_table(episode_table(self.schema, columns))  # one row group per episode
        for key in self.columns:
            self.columns[key].append(columns[key])
        stats = {}
        for camera, (key, video) in enumerate(zip(self.video_keys, self.videos)):
            video.add_episode(episode["images"][:, camera])
            hist = pixel_histogram(episode["images"][:, camera])
            self.histograms[camera] += hist
            stats[key] = image_stats(hist, length)
        stats.update(split_stats(columns))
        self.rows.append(self._episode_row(index, episode["instruction"], length, stats))
        self.frames += length

    def _episode_row(self, index: int, task: str, length: int, stats: dict) -> dict:
        """The episode's meta/episodes row, in lerobot's column order."""
        row = {"episode_index": index, "tasks": [task], "length": length, "data/chunk_index": 0,
               "data/file_index": 0, "dataset_from_index": self.frames, "dataset_to_index": self.frames + length}
        for key in self.video_keys:
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": 0,
                        f"videos/{key}/from_timestamp": self.frames / self.fps,
                        f"videos/{key}/to_timestamp": (self.frames + length) / self.fps})
        for feature in self.features:
            for stat, value in stats[feature].items():
                row[f"stats/{feature}/{stat}"] = np.asarray(value).tolist()
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        return row

    def finish(self) -> None:
        """Close the files, then write the metadata that describes them."""
        _, pa, pq = _libs()
        self.data.close()
        for video in self.videos:
            video.close()
        episodes_path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        episodes_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.rows), episodes_path, compression="snappy")
        write_tasks(self.root / TASKS_PATH, list(self.tasks))
        stats = {key: image_stats(hist, self.frames) for key, hist in zip(self.video_keys, self.histograms)}
        stats.update(split_stats({key: np.concatenate(values) for key, values in self.columns.items()}))
        (self.root / STATS_PATH).write_text(json.dumps(jsonable({k: stats[k] for k in self.features}), indent=4),
                                           encoding="utf-8")
        self._write_info()

    def _write_info(self) -> None:
        features = json.loads(json.dumps(self.features))
        for key, video in zip(self.video_keys, self.videos):
            features[key]["info"] = video.info()
        size_mb = lambda path: math.ceil(path.stat().st_size / 1024 ** 2)  # noqa: E731
        data_mb = size_mb(self.root / DATA_PATH.format(chunk_index=0, file_index=0))
        video_mb = max([size_mb(video.path) for video in self.videos], default=0)
        info = {"codebase_version": CODEBASE_VERSION, "fps": self.fps, "features": features,  # DatasetInfo's order
                "total_episodes": len(self.rows), "total_frames": self.frames, "total_tasks": len(self.tasks),
                "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": max(DATA_FILE_MB, data_mb),
                "video_files_size_in_mb": max(VIDEO_FILE_MB, video_mb), "data_path": DATA_PATH,
                "video_path": VIDEO_PATH if self.video_keys else None, "robot_type": self.robot_type,
                "splits": {"train": f"0:{len(self.rows)}"}}
        (self.root / INFO_PATH).write_text(json.dumps(info, indent=4, ensure_ascii=False), encoding="utf-8")


def check_free(directory: pathlib.Path) -> None:
    """A split is written into a new (or empty) directory: never mixed with an older dataset's files."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{directory} already exists; remove it to write the LeRobot split again")


@contextlib.contextmanager
def staged(directory: pathlib.Path):
    """Yield a sibling staging directory that is renamed to `directory` when the block completes, so a
    partial write is never mistaken for data (and removed if the block fails)."""
    check_free(directory)
    _libs()
    staging = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        yield staging
        if directory.exists():
            directory.rmdir()  # empty, checked above
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_lerobot_split(directory: pathlib.Path, episodes: int, seed: int, exclude: set[str] = frozenset(),
                        objects: int = 3, fps: int = 10, video_size: int = 64, codec: str = "av1",
                        **shape) -> set[str]:
    """Write `episodes` episodes of distinct scenes not in `exclude` (drawn from `seed`, as write_split)
    as a LeRobot v3.0 dataset in `directory`; returns the scenes written. Staged in a sibling
    directory and renamed into place when complete, so a partial write is never mistaken for data."""
    directory = pathlib.Path(directory)
    generator = iter_split(episodes, seed, exclude, objects, **shape)  # checks the task's shape first
    check_args(episodes, codec, fps, video_size, shape.get("size", 16), shape.get("cameras", 1))
    grid = shape.get("grid", 4)
    with staged(directory) as staging:
        features = make_features(shape.get("cameras", 1), video_size, shape.get("dims", 7))
        writer = SplitWriter(staging, features, fps, codec, video_size)
        written, scenes = set(), []
        for key, episode in generator:
            writer.add({**episode, "state": effector_cells(episode, grid).astype(np.float32) / (grid - 1)})
            written.add(key)
            scenes.append(episode["scene"])
        writer.finish()
        write_scenes(staging, scenes)
        (staging / DONE_MARKER).write_text(f"{episodes}\n")
    return written


def write_lerobot_splits(out: pathlib.Path, train: int, heldout: int, seed: int = 0,
                         heldout_dir: pathlib.Path | None = None, **kwargs) -> None:
    """A train split in `out`/train (or `out` itself when `heldout_dir` is given) and a held-out split in
    `out`/heldout (or `heldout_dir`) with another seed and no scene in common, as write_splits."""
    out = pathlib.Path(out)
    train_dir = out if heldout_dir is not None else out / "train"
    heldout_dir = pathlib.Path(heldout_dir or out / "heldout")
    check_free(heldout_dir)  # before the train split, not after it
    seen = write_lerobot_split(train_dir, train, seed, **kwargs)
    write_lerobot_split(heldout_dir, heldout, seed + HELDOUT_SEED_OFFSET, exclude=seen, **kwargs)
