"""The LeRobot v3.0 writer (jaxpar.data.lerobot_write), checked against the format with pyarrow and PyAV
directly, never with the writer's own helpers.

Oracles: the generator (jaxpar.data.episodes.iter_split, same seed) for actions, instructions, images and
scenes; the effector's cell read back from the generator's images (the white dot); numpy for every
statistic; lerobot's source (github:huggingface/lerobot, src/lerobot/datasets/utils.py, dataset_writer.py,
dataset_metadata.py, compute_stats.py, video_utils.py) for names, paths and layout.

Codec tolerance (measured over 1000-episode splits at video_size 64, seeds 0-2, decoded to rgb24 and
box-filtered back to 16 pixels): AV1 (libsvtav1 preset 8, crf 30) max 44 levels, h264 (libx264 crf 30)
max 54, mean 1.6-1.8 for both; most of it is yuv420p chroma bleeding across colour edges (lossless h264
still errs by 27). Every decoded pixel stays nearer its own palette colour than any other, which is what
makes the scene readable. The tests allow max 64, mean 3 and no palette misread.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conftest import require

av = require("av")
pa = require("pyarrow")
pq = require("pyarrow.parquet")

from jaxpar.data.episodes import COLOURS, DONE_MARKER, EFFECTOR, TABLE, iter_split, read_scene_keys  # noqa: E402
from jaxpar.data.lerobot_write import histogram_quantiles, write_lerobot_split, write_lerobot_splits  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
EPISODES, CAMERAS, SIZE, GRID, DIMS, FPS, VIDEO = 6, 2, 16, 4, 7, 10, 64
SHAPE = dict(size=SIZE, grid=GRID, steps=8, dims=DIMS, cameras=CAMERAS)
MAX_ERROR, MEAN_ERROR = 64, 3.0
CAMERA_KEYS = [f"observation.images.cam{k}" for k in range(CAMERAS)]
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
PALETTE = np.array([TABLE, EFFECTOR, *COLOURS.values()], np.float64)


@pytest.fixture(scope="module", params=["av1", "h264"])
def split(request, tmp_path_factory):
    """(dataset root, codec, the generator's episodes) for one 6-episode, 2-camera split."""
    root = tmp_path_factory.mktemp(request.param) / "train"
    written = write_lerobot_split(root, EPISODES, seed=0, fps=FPS, video_size=VIDEO, codec=request.param, **SHAPE)
    episodes = [episode for _, episode in iter_split(EPISODES, 0, **SHAPE)]
    assert written == {key for key, _ in iter_split(EPISODES, 0, **SHAPE)}
    return root, request.param, episodes


def read_json(path: pathlib.Path):
    return json.loads(path.read_text())


def episodes_table(root: pathlib.Path) -> list[dict]:
    return pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()


def test_info_json(split):
    root, codec, episodes = split
    info = read_json(root / "meta/info.json")
    assert set(info) >= {"codebase_version", "robot_type", "fps", "total_episodes", "total_frames", "total_tasks",
                         "chunks_size", "data_files_size_in_mb", "video_files_size_in_mb", "splits", "data_path",
                         "video_path", "features"}
    assert info["codebase_version"] == "v3.0" and info["fps"] == FPS and info["chunks_size"] == 1000
    assert info["total_episodes"] == EPISODES and info["splits"] == {"train": f"0:{EPISODES}"}
    assert info["total_frames"] == sum(len(e["actions"]) for e in episodes)
    assert info["total_tasks"] == len({e["instruction"] for e in episodes})
    assert info["data_files_size_in_mb"] >= 100 and info["video_files_size_in_mb"] >= 200
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    features = info["features"]
    assert list(features)[-5:] == ["timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert features["timestamp"] == {"dtype": "float32", "shape": [1], "names": None}
    for key in ("frame_index", "episode_index", "index", "task_index"):
        assert features[key] == {"dtype": "int64", "shape": [1], "names": None}
    assert features["action"]["dtype"] == "float32" and features["action"]["shape"] == [DIMS]
    assert len(features["action"]["names"]) == DIMS and features["action"]["names"][-1] == "gripper"
    assert features["observation.state"]["dtype"] == "float32" and features["observation.state"]["shape"] == [2]
    for key in CAMERA_KEYS:
        feature = features[key]
        assert feature["dtype"] == "video" and feature["shape"] == [VIDEO, VIDEO, 3]
        assert feature["names"] == ["height", "width", "channels"]
        with av.open(str(root / f"videos/{key}/chunk-000/file-000.mp4")) as container:
            stream = container.streams.video[0]
            probed = {"video.height": stream.height, "video.width": stream.width, "video.pix_fmt": stream.pix_fmt,
                      "video.codec": stream.codec_context.codec.canonical_name, "video.fps": stream.base_rate.numerator // stream.base_rate.denominator}
        assert probed == {"video.height": VIDEO, "video.width": VIDEO, "video.pix_fmt": "yuv420p",
                          "video.codec": codec, "video.fps": FPS}
        assert {k: feature["info"][k] for k in probed} == probed
        assert feature["info"]["video.channels"] == 3 and feature["info"]["has_audio"] is False
        assert feature["info"]["video.g"] == 2 and feature["info"]["is_depth_map"] is False


def effector_state(image: np.ndarray) -> list[float]:
    """The white dot's (row, col) cell / (grid - 1), read from the pixels."""
    rows, cols = np.nonzero((image == EFFECTOR).all(-1))
    cell = SIZE // GRID
    return [rows.min() // cell / (GRID - 1), cols.min() // cell / (GRID - 1)]


def test_data_parquet(split):
    root, _, episodes = split
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    assert table.column_names == ["observation.state", "action", "timestamp", "frame_index", "episode_index",
                                  "index", "task_index"]
    assert table.schema.field("action").type == pa.list_(pa.float32(), DIMS)
    assert table.schema.field("timestamp").type == pa.float32() and table.schema.field("index").type == pa.int64()
    hf = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert hf["action"] == {"feature": {"dtype": "float32", "_type": "Value"}, "length": DIMS, "_type": "List"}
    assert hf["timestamp"] == {"dtype": "float32", "_type": "Value"}
    assert pq.ParquetFile(path).metadata.num_row_groups == EPISODES  # one row group per episode
    lengths = [len(e["actions"]) for e in episodes]
    frame_index = np.concatenate([np.arange(n) for n in lengths])
    np.testing.assert_array_equal(np.stack(table["action"].to_numpy(zero_copy_only=False)),
                                  np.concatenate([e["actions"] for e in episodes]))
    np.testing.assert_array_equal(table["frame_index"].to_numpy(), frame_index)
    np.testing.assert_array_equal(table["episode_index"].to_numpy(), np.repeat(np.arange(EPISODES), lengths))
    np.testing.assert_array_equal(table["index"].to_numpy(), np.arange(sum(lengths)))
    np.testing.assert_array_equal(table["timestamp"].to_numpy(), (frame_index / FPS).astype(np.float32))
    states = [effector_state(image) for e in episodes for image in e["images"][:, 0]]
    np.testing.assert_allclose(np.stack(table["observation.state"].to_numpy(zero_copy_only=False)), states, atol=1e-7)
    tasks = pq.read_table(root / "meta/tasks.parquet").to_pylist()
    task_of = {row["task_index"]: row["task"] for row in tasks}
    assert [task_of[t] for t in table["task_index"].to_pylist()] == [e["instruction"] for e in episodes
                                                                      for _ in e["actions"]]


def test_tasks_table(split):
    root, _, episodes = split
    table = pq.read_table(root / "meta/tasks.parquet")
    assert sorted(table.column_names) == ["task", "task_index"]
    assert json.loads(table.schema.metadata[b"pandas"])["index_columns"] == ["task"]  # pandas reads it as the index
    first_seen = list(dict.fromkeys(e["instruction"] for e in episodes))
    assert table["task"].to_pylist() == first_seen and table["task_index"].to_pylist() == list(range(len(first_seen)))


def test_episodes_table(split):
    root, _, episodes = split
    rows = episodes_table(root)
    start = 0
    for index, (row, episode) in enumerate(zip(rows, episodes, strict=True)):
        length = len(episode["actions"])
        assert row["episode_index"] == index and row["tasks"] == [episode["instruction"]] and row["length"] == length
        assert (row["dataset_from_index"], row["dataset_to_index"]) == (start, start + length)
        assert row["data/chunk_index"] == row["data/file_index"] == 0
        assert row["meta/episodes/chunk_index"] == row["meta/episodes/file_index"] == 0
        for key in CAMERA_KEYS:
            assert row[f"videos/{key}/chunk_index"] == row[f"videos/{key}/file_index"] == 0
            assert row[f"videos/{key}/from_timestamp"] == pytest.approx(start / FPS, abs=1e-9)
            assert row[f"videos/{key}/to_timestamp"] == pytest.approx((start + length) / FPS, abs=1e-9)
        actions = episode["actions"].astype(np.float64)
        for name, q in QUANTILES.items():
            np.testing.assert_allclose(row[f"stats/action/{name}"], np.quantile(actions, q, axis=0), atol=1e-12)
        assert row["stats/action/count"] == [length]
        assert np.array(row[f"stats/{CAMERA_KEYS[0]}/mean"]).shape == (3, 1, 1)
        start += length


def decode(path: pathlib.Path) -> tuple[dict[float, np.ndarray], set[float]]:
    """{timestamp: rgb frame} of every frame and the keyframes' timestamps, straight from PyAV."""
    frames, keyframes = {}, set()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            ts = round(float(frame.pts * stream.time_base), 6)
            frames[ts] = frame.to_ndarray(format="rgb24")
            if frame.key_frame:
                keyframes.add(ts)
    return frames, keyframes


def seek_first_frame(path: pathlib.Path, timestamp: float) -> float:
    """The timestamp of the first frame decoded after seeking to `timestamp`, as lerobot's PyAV decoder
    seeks (video_utils.py decode_video_frames_pyav): back to the keyframe at or before it."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        container.seek(round(timestamp / stream.time_base), backward=True, any_frame=False, stream=stream)
        frame = next(container.decode(stream))
        return float(frame.pts * stream.time_base)


def test_video_frames_at_episode_timestamps(split):
    root, _, episodes = split
    rows = episodes_table(root)
    errors = []
    for camera, key in enumerate(CAMERA_KEYS):
        path = root / f"videos/{key}/chunk-000/file-000.mp4"
        frames, keyframes = decode(path)
        assert len(frames) == sum(len(e["actions"]) for e in episodes)
        for row, episode in zip(rows, episodes):
            start = row[f"videos/{key}/from_timestamp"]
            assert round(start, 6) in keyframes  # every episode starts on a keyframe
            assert seek_first_frame(path, start) == pytest.approx(start, abs=1e-4)
            for frame_index, truth in enumerate(episode["images"][:, camera]):
                ts = round(start + frame_index / FPS, 6)  # lerobot: from_timestamp + timestamp, tolerance 1e-4
                factor = VIDEO // SIZE
                small = frames[ts].astype(np.float64).reshape(SIZE, factor, SIZE, factor, 3).mean((1, 3))
                errors.append(np.abs(small - truth).ravel())
                nearest = np.argmin(((small[:, :, None] - PALETTE) ** 2).sum(-1), -1)
                assert (PALETTE[nearest] == truth).all(), f"{key} episode {row['episode_index']} frame {frame_index}"
    errors = np.concatenate(errors)
    assert errors.max() <= MAX_ERROR and errors.mean() <= MEAN_ERROR, (errors.max(), errors.mean())


def test_stats_json(split):
    root, _, episodes = split
    stats = read_json(root / "meta/stats.json")
    info = read_json(root / "meta/info.json")
    assert set(stats) == set(info["features"])
    actions = np.concatenate([e["actions"] for e in episodes]).astype(np.float64)
    action = stats["action"]
    assert set(action) == {"min", "max", "mean", "std", "count", *QUANTILES}
    np.testing.assert_allclose(action["min"], actions.min(0), atol=1e-12)
    np.testing.assert_allclose(action["max"], actions.max(0), atol=1e-12)
    np.testing.assert_allclose(action["mean"], actions.mean(0), atol=1e-12)
    np.testing.assert_allclose(action["std"], actions.std(0), atol=1e-12)
    assert action["count"] == [len(actions)]
    for name, q in QUANTILES.items():
        np.testing.assert_allclose(action[name], np.quantile(actions, q, axis=0), atol=1e-12)
    assert np.array(stats["timestamp"]["q50"]).shape == (1,)
    for camera, key in enumerate(CAMERA_KEYS):
        pixels = np.concatenate([e["images"][:, camera] for e in episodes]).reshape(-1, 3).astype(np.float64)
        assert stats[key]["count"] == [len(actions)]
        np.testing.assert_allclose(np.array(stats[key]["mean"]).reshape(3), pixels.mean(0) / 255, atol=1e-12)
        np.testing.assert_allclose(np.array(stats[key]["std"]).reshape(3), pixels.std(0) / 255, atol=1e-9)
        for name, q in QUANTILES.items():
            assert np.array(stats[key][name]).shape == (3, 1, 1)
            np.testing.assert_allclose(np.array(stats[key][name]).reshape(3), np.quantile(pixels, q, axis=0) / 255,
                                       atol=1e-12)


def test_histogram_quantile_is_numpys(rng):
    """The image quantiles come from pixel histograms (stats.json keeps no pixels); on the task's few
    colours any rank rule looks right, so check the rule on spread-out values too."""
    for n in (1, 2, 7, 1000):
        values = rng.integers(0, 256, n)
        hist = np.bincount(values, minlength=256)
        qs = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
        np.testing.assert_allclose(histogram_quantiles(hist, qs), np.quantile(values, qs), atol=1e-9, err_msg=str(n))


def test_scenes_and_marker(split):
    root, _, episodes = split
    scenes = [json.loads(line) for line in (root / "scenes.jsonl").read_text().splitlines()]
    assert scenes == [e["scene"] for e in episodes]
    assert (root / DONE_MARKER).is_file()
    assert not list(root.parent.glob("*.partial-*"))


def test_encoding_leaves_the_callers_scheduling_as_it_was(tmp_path):
    """SVT-AV1 sets the thread that feeds it frames to real-time SCHED_FIFO 99 where it may (root, as
    in containers); the threads and processes started from that thread later (XLA's pools, gloo's
    polling loop, a multi-process launch) inherit it, and a 2-process run then never finished its
    first step. The writer hands the caller's policy back."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    write_lerobot_split(tmp_path / "out", 1, 0, fps=FPS, video_size=VIDEO, codec="av1", **{**SHAPE, "cameras": 1})
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before


def test_splits_share_no_scene(tmp_path):
    """One square on a 2x2 grid: 6 colours x 4 cells = 24 scenes, so the held-out 12 are the train's complement."""
    write_lerobot_splits(tmp_path, 12, 12, seed=5, codec="h264", objects=1, size=SIZE, grid=2, cameras=1)
    train, heldout = read_scene_keys(tmp_path / "train"), read_scene_keys(tmp_path / "heldout")
    assert len(train) == len(heldout) == 12 and not train & heldout
    assert read_json(tmp_path / "heldout/meta/info.json")["total_episodes"] == 12


@pytest.mark.parametrize("kwargs, message", [
    (dict(codec="vp9"), "codec='vp9'"),
    (dict(video_size=40), "video_size=40 is not a multiple"),
    (dict(video_size=8), "video_size=8 is not a multiple"),
    (dict(fps=0), "fps=0"),
])
def test_errors_write_nothing(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        write_lerobot_split(tmp_path / "out", 2, 0, **kwargs)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_existing_directory_is_an_error(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        write_lerobot_split(tmp_path / "out", 2, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts/make_vla_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_script_lerobot(tmp_path):
    done = run_script(tmp_path / "d", "--format", "lerobot", "--episodes", 3, "--heldout", 2, "--codec", "h264",
                      "--video_size", 32, "--cameras", 1)
    assert done.returncode == 0, done.stderr
    info = read_json(tmp_path / "d/train/meta/info.json")
    assert info["total_episodes"] == 3 and info["features"]["observation.images.cam0"]["shape"] == [32, 32, 3]
    assert read_json(tmp_path / "d/heldout/meta/info.json")["total_episodes"] == 2
    for args in (["--format", "lerobot", "--video_size", 40], ["--format", "lerobot", "--codec", "vp9"],
                 ["--codec", "h264"]):
        failed = run_script(tmp_path / "e", *args)
        assert failed.returncode == 2 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        assert failed.stderr.startswith("make_vla_data: error: ")
    assert not (tmp_path / "e").exists()
