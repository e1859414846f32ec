"""Frames/s of jaxpar.data.lerobot.LeRobotSource over one shuffled epoch, read through grain.

    python scripts/measure_lerobot.py                      # builds a v3.0 dataset with 2 AV1 cameras
    python scripts/measure_lerobot.py --dataset DIR        # or measures an existing LeRobot dataset

Rows: grain.MapDataset.source(src).shuffle(seed=0) iterated in this process; the same through
to_iter_dataset with 2 reader threads (as jaxpar.data.pipeline reads); and with
mp_prefetch(num_workers=N) worker processes. Every row starts from a fresh source (an empty decode
cache), so it includes the decoding of every segment the epoch needs: with the default whole-episode
segments and a cache that holds the decoded epoch, each episode's video is decoded once per process.

The built dataset follows lerobot's v3.0 layout (see jaxpar/data/lerobot.py) with each camera's
episodes encoded as one continuous AV1 stream (lerobot concatenates per-episode files into the
same thing); frames are a moving square on an episode-coloured background.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import av
import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.lerobot import LeRobotSource

CAMERAS = ("observation.images.front", "observation.images.wrist")
TASKS = ["pick up the cube", "open the drawer", "push the button"]


def picture(size: int, episode: int, frame: int, camera: int) -> np.ndarray:
    rng = np.random.default_rng(episode)
    image = np.empty((size, size, 3), np.uint8)
    image[:] = rng.integers(40, 200, 3)
    cell = size // 8
    r, c = (frame // 8 + camera) % 8, frame % 8
    image[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] = (230, 40 + 150 * camera, 40)
    return image


def encode_camera(path: pathlib.Path, size: int, lengths: list[int], camera: int, fps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libsvtav1", fps, options={"g": "2", "crf": "30", "preset": "12"})
        stream.pix_fmt, stream.width, stream.height = "yuv420p", size, size
        for episode, length in enumerate(lengths):
            for frame in range(length):
                image = av.VideoFrame.from_ndarray(picture(size, episode, frame, camera), format="rgb24")
                out.mux(stream.encode(image))
        out.mux(stream.encode())


def build(root: pathlib.Path, episodes: int, frames: int, size: int, fps: int = 30) -> pathlib.Path:
    """A v3.0 dataset: one data file, one mp4 per camera, episodes of `frames` frames."""
    lengths, starts = [frames] * episodes, np.arange(episodes + 1) * frames
    features = {"action": {"dtype": "float32", "shape": [7], "names": None},
                **{k: {"dtype": "video", "shape": [size, size, 3], "names": ["height", "width", "channels"]}
                   for k in CAMERAS},
                "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                **{k: {"dtype": "int64", "shape": [1], "names": None}
                   for k in ("frame_index", "episode_index", "index", "task_index")}}
    (root / "meta/episodes/chunk-000").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps({
        "codebase_version": "v3.0", "fps": fps, "total_episodes": episodes, "total_frames": int(starts[-1]),
        "total_tasks": len(TASKS), "chunks_size": 1000, "features": features,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"}))
    total = int(starts[-1])
    episode_of = np.repeat(np.arange(episodes), frames)
    (root / "data/chunk-000").mkdir(parents=True)
    pq.write_table(pa.table({
        "action": pa.array(np.random.default_rng(0).normal(size=(total, 7)).astype(np.float32).tolist(),
                           pa.list_(pa.float32(), 7)),
        "timestamp": pa.array(np.tile(np.arange(frames), episodes) / fps, pa.float32()),
        "frame_index": np.tile(np.arange(frames), episodes), "episode_index": episode_of,
        "index": np.arange(total), "task_index": episode_of % len(TASKS)}), root / "data/chunk-000/file-000.parquet")
    rows = [{"episode_index": e, "tasks": [TASKS[e % len(TASKS)]], "length": frames, "data/chunk_index": 0,
             "data/file_index": 0, "dataset_from_index": int(starts[e]), "dataset_to_index": int(starts[e + 1]),
             **{f"videos/{k}/{name}": value for k in CAMERAS for name, value in
                (("chunk_index", 0), ("file_index", 0), ("from_timestamp", starts[e] / fps),
                 ("to_timestamp", starts[e + 1] / fps))}} for e in range(episodes)]
    pq.write_table(pa.Table.from_pylist(rows), root / "meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(pa.table({"task_index": np.arange(len(TASKS)), "task": TASKS}), root / "meta/tasks.parquet")
    for camera, key in enumerate(CAMERAS):
        encode_camera(root / f"videos/{key}/chunk-000/file-000.mp4", size, lengths, camera, fps)
    return root


def mark_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags, which this script never parses."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def measure(name: str, make_source, read) -> dict:
    """One epoch through `read`: frames/s over the whole epoch and after the first frame (which
    includes the start of worker processes)."""
    source = make_source()
    start, count, first = time.perf_counter(), 0, None
    for _ in read(grain.MapDataset.source(source).shuffle(seed=0)):
        count += 1
        first = first or time.perf_counter()
    end = time.perf_counter()
    return {"mode": name, "frames": count, "seconds": end - start, "fps": count / (end - start),
            "first": first - start, "steady": (count - 1) / max(end - first, 1e-9),
            "decodes": source.decodes if "worker" not in name else "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", help="an existing LeRobot dataset (default: build one in a temp dir)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--frames", type=int, default=40, help="frames per built episode")
    parser.add_argument("--size", type=int, default=256, help="stored frame size of the built dataset")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--segment-frames", type=int, default=None)
    parser.add_argument("--cache-mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.dataset:
            root = pathlib.Path(args.dataset)
        else:
            start = time.perf_counter()
            root = build(pathlib.Path(scratch) / "dataset", args.episodes, args.frames, args.size)
            print(f"built {root}: {args.episodes} episodes x {args.frames} frames, 2 AV1 cameras {args.size}px "
                  f"({time.perf_counter() - start:.1f}s)")

        def make_source():
            return LeRobotSource(root, InstructionEncoder(64), args.image_size, segment_frames=args.segment_frames,
                                 cache_bytes=args.cache_mb << 20)

        probe = make_source()
        print(f"{len(probe)} frames, cameras {probe.camera_keys}, image_size {args.image_size}, segments "
              f"{args.segment_frames or 'whole episodes'}, cache {args.cache_mb} MB")
        mark_absl_flags_parsed()
        rows = [measure("in-process", make_source, lambda ds: ds),
                measure("in-process, 2 threads", make_source,
                        lambda ds: ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))),
                measure(f"{args.workers} worker processes", make_source, lambda ds: ds.to_iter_dataset().mp_prefetch(
                    grain.MultiprocessingOptions(num_workers=args.workers)))]
    print(f"{'mode':<24} {'frames':>7} {'seconds':>8} {'frames/s':>9} {'1st frame s':>12} {'after 1st/s':>12} "
          f"{'decodes':>8}")
    for row in rows:
        print(f"{row['mode']:<24} {row['frames']:>7} {row['seconds']:>8.2f} {row['fps']:>9.1f} {row['first']:>12.2f} "
              f"{row['steady']:>12.1f} {row['decodes']:>8}")


if __name__ == "__main__":
    main()
