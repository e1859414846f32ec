"""Frames/s of jaxpar.data.lerobot.LeRobotSource over one shuffled epoch, read through grain.

    python scripts/measure_lerobot.py                      # builds a v3.0 dataset with 2 AV1 cameras
    python scripts/measure_lerobot.py --dataset DIR        # or measures an existing LeRobot dataset
    python scripts/measure_lerobot.py --episodes 50 --size 64 --image-size 16 --train-steps 120
                                                           # + vla_tiny trained on it: data_wait_s / step_time_s

Rows: grain.MapDataset.source(src).shuffle(seed=0) iterated in this process (records, no batching);
then the trainer's own reader (jaxpar.data.pipeline.GrainData: shuffled, batched by
--batch, uint8 batches placed on a device) at each of --worker-counts (data.workers: 0 = reader
threads in this process; N = N grain worker processes, which decode). Every row starts from a fresh
source (an empty decode cache), so it includes the decoding of every segment the epoch needs: with
the default whole-episode segments and a cache that holds the decoded epoch, each episode's video is
decoded once per reading process (each worker has its own cache).

--train-steps N also trains configs/vla_tiny.py (2 cameras, the dataset as data.train, no evaluation)
for N steps at each worker count and reports the mean data_wait_s (the time the step loop waited for
its batch, jaxpar.training.loop) against step_time_s from its metrics.jsonl, leaving out the first
logged record (start-up). Needs --image-size 16 (vla_tiny's).

The built dataset follows lerobot's v3.0 layout (see jaxpar/data/lerobot.py) with each camera's
episodes encoded as one continuous AV1 stream (lerobot concatenates per-episode files into the
same thing); frames are a moving square on an episode-coloured background.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
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


def trainer_config(root: pathlib.Path, image_size: int, workers: int, batch: int, cache_mb: int, prefetch: int,
                   extra: tuple[str, ...] = ()):
    from jaxpar.interop.pretrained import load_run_config

    return load_run_config("vla_tiny", [f"data.train={root}", "data.eval=", "data.generate=false",
                                        "vision.cameras=2", f"vision.image_size={image_size}",
                                        f"train.global_batch_size={batch}", f"data.workers={workers}",
                                        f"data.frame_cache_mb={cache_mb}", f"data.prefetch={prefetch}",
                                        "eval.rollouts=0", *extra])


def measure_trainer(root: pathlib.Path, args, workers: int) -> dict:
    """One epoch of the trainer's batches (GrainData.next_batch: uint8 arrays on a device)."""
    import jax

    from jaxpar.data.pipeline import GrainData

    config = trainer_config(root, args.image_size, workers, args.batch, args.cache_mb, args.prefetch,
                            ("mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1"))
    data = GrainData(config, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    batches = len(data.source) // args.batch
    start, first = time.perf_counter(), None
    for _ in range(batches):
        batch = data.next_batch()
        jax.block_until_ready(batch)
        first = first or time.perf_counter()
    end = time.perf_counter()
    assert batch["images"].dtype == np.uint8
    count = batches * args.batch
    return {"mode": f"trainer, data.workers={workers}", "frames": count, "seconds": end - start,
            "fps": count / (end - start), "first": first - start,
            "steady": (count - args.batch) / max(end - first, 1e-9),
            "decodes": data.source.decodes if not workers else "-"}


def measure_training(root: pathlib.Path, args, workers: int) -> dict:
    """vla_tiny (its 8-device layout) on the dataset for --train-steps: mean data_wait_s / step_time_s."""
    with tempfile.TemporaryDirectory() as workdir:
        overrides = [f"data.train={root}", "data.eval=", "data.generate=false", "vision.cameras=2",
                     f"train.steps={args.train_steps}", f"data.workers={workers}", "eval.rollouts=0",
                     f"data.frame_cache_mb={args.cache_mb}", f"data.prefetch={args.prefetch}", "checkpoint.every=0",
                     "train.log_every=10", "compile.cache_dir="]
        command = [sys.executable, "-m", "jaxpar.train", "--config", "vla_tiny.py", "--workdir", workdir,
                   *(f"--config.{o}" for o in overrides)]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if done.returncode:
            raise SystemExit(f"training with data.workers={workers} failed:\n{done.stderr[-4000:]}")
        records = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "data_wait_s" in r][1:]  # the first record holds start-up
    wait = float(np.mean([r["data_wait_s"] for r in steps]))
    step_time = float(np.mean([r["step_time_s"] for r in steps]))
    return {"workers": workers, "steps": args.train_steps, "data_wait_s": wait, "step_time_s": step_time,
            "fraction": wait / step_time, "frames_per_s_needed": 32 / step_time,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", help="an existing LeRobot dataset (default: build one in a temp dir)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--frames", type=int, default=40, help="frames per built episode")
    parser.add_argument("--size", type=int, default=256, help="stored frame size of the built dataset")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--worker-counts", default="0,1,2", help="data.workers values to measure")
    parser.add_argument("--batch", type=int, default=32, help="the trainer reader's batch (vla_tiny's 32)")
    parser.add_argument("--prefetch", type=int, default=4, help="data.prefetch")
    parser.add_argument("--segment-frames", type=int, default=None)
    parser.add_argument("--cache-mb", type=int, default=256, help="data.frame_cache_mb")
    parser.add_argument("--train-steps", type=int, default=0, help="also train vla_tiny this many steps per count")
    parser.add_argument("--keep", help="build the dataset here (and keep it) instead of a temp dir")
    args = parser.parse_args()
    counts = [int(w) for w in args.worker_counts.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        if args.dataset:
            root = pathlib.Path(args.dataset)
        else:
            start = time.perf_counter()
            root = pathlib.Path(args.keep or pathlib.Path(scratch) / "dataset")
            root = build(root, args.episodes, args.frames, args.size)
            print(f"built {root}: {args.episodes} episodes x {args.frames} frames, 2 AV1 cameras {args.size}px "
                  f"({time.perf_counter() - start:.1f}s)")

        def make_source():
            return LeRobotSource(root, InstructionEncoder(64), args.image_size, segment_frames=args.segment_frames,
                                 cache_bytes=args.cache_mb << 20)

        probe = make_source()
        print(f"{len(probe)} frames, cameras {probe.camera_keys}, image_size {args.image_size}, segments "
              f"{args.segment_frames or 'whole episodes'}, cache {args.cache_mb} MB")
        mark_absl_flags_parsed()
        rows = [measure("records, in-process", make_source, lambda ds: ds)]
        rows += [measure_trainer(root, args, workers) for workers in counts]
        print(f"{'mode':<26} {'frames':>7} {'seconds':>8} {'frames/s':>9} {'1st item s':>11} {'after 1st/s':>12} "
              f"{'decodes':>8}")
        for row in rows:
            print(f"{row['mode']:<26} {row['frames']:>7} {row['seconds']:>8.2f} {row['fps']:>9.1f} "
                  f"{row['first']:>11.2f} {row['steady']:>12.1f} {row['decodes']:>8}", flush=True)
        if args.train_steps:
            if args.segment_frames:
                raise SystemExit("--train-steps trains with whole-episode segments; drop --segment-frames")
            print(f"\nvla_tiny (dp 2 x pp 2 x tp 2, batch 32, 2 cameras at {args.image_size} px), "
                  f"{args.train_steps} steps, mean over logged steps after the first:")
            print(f"{'data.workers':>12} {'data_wait_s':>12} {'step_time_s':>12} {'wait/step':>10} {'frames/s used':>14}")
            for workers in counts:
                r = measure_training(root, args, workers)
                print(f"{workers:>12} {r['data_wait_s']:>12.4f} {r['step_time_s']:>12.3f} {r['fraction']:>10.1%} "
                      f"{r['frames_per_s_needed']:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
