"""LeRobotSource against tiny LeRobot datasets written here with pyarrow and PyAV alone, following
lerobot's layout (huggingface/lerobot: src/lerobot/datasets/utils.py path templates, v2.1 from tag
v0.3.2, dataset_writer.py / convert_dataset_v21_to_v30.py for v3.0's concatenated files). These writers
are the outside reference: they share no code with jaxpar.

Three episodes (5, 4, 6 frames; tasks A, B, A), a 7-dim action, three cameras: `top` AV1 (libsvtav1,
lerobot's default codec and settings g=2, crf=30, but preset 8 rather than 12, whose artefacts
are larger), `wrist` H.264 (libx264, 64x96 so it is always resized) and `side` an image feature (PNG
bytes in the parquet). v2.1 declares `top` channel-first, v3.0 `side`. v3.0 puts episodes 0-1 in one
data file and `top` video file and episode 2 in the next; all of `wrist` in one file, concatenated
with ffmpeg's concat demuxer as lerobot does.

Codec tolerance, measured on these frames: the mean abs error of a decoded frame against its original
is 1.6 levels on average and 2.4 at most (AV1 and H.264 alike; preset 12 gave 3.4), PNG 0; a decoded
frame is >= 6.1 from every other frame's original. The tests allow a mean abs error of 4.
"""

import json
import pickle
import shutil

import av
import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.lerobot import LeRobotSource, compute_action_quantiles, is_lerobot, split_episodes
from jaxpar.data.lerobot_write import scheduling_kept
from jaxpar.errors import ConfigError

FPS = 10
TOP, WRIST, SIDE = "observation.images.top", "observation.images.wrist", "observation.images.side"
SIZES = {TOP: (64, 64), WRIST: (64, 96), SIDE: (48, 48)}
CODECS = {TOP: "libsvtav1", WRIST: "libx264"}
SQUARE = {TOP: (220, 40, 40), WRIST: (50, 80, 220), SIDE: (230, 210, 40)}
BACKGROUNDS = [(110, 110, 110), (60, 150, 90), (160, 90, 50)]
LENGTHS = [5, 4, 6]
TASKS = ["pick up the red cube", "open the top drawer"]
EPISODE_TASK = [0, 1, 0]
MEAN_ERROR = 4.0
SIZE = 64


def picture(camera: str, episode: int, frame: int) -> np.ndarray:
    """The episode's background colour with the camera's 16-pixel square on cell `frame` of the
    16-pixel grid: frames of an episode differ in 512 pixels, episodes in every pixel."""
    h, w = SIZES[camera]
    image = np.empty((h, w, 3), np.uint8)
    image[:] = BACKGROUNDS[episode]
    r, c = 16 * (frame // (w // 16)), 16 * (frame % (w // 16))
    image[r:r + 16, c:c + 16] = SQUARE[camera]
    return image


def actions_of(episode: int) -> np.ndarray:
    return np.random.default_rng(100 + episode).uniform(-1, 1, (LENGTHS[episode], 7)).astype(np.float32)


def camera_feature(camera: str, channel_first: bool) -> dict:
    h, w = SIZES[camera]
    dtype = "image" if camera == SIDE else "video"
    if channel_first:
        return {"dtype": dtype, "shape": [3, h, w], "names": ["channels", "height", "width"]}
    return {"dtype": dtype, "shape": [h, w, 3], "names": ["height", "width", "channels"]}


def write_info(root, version: str, channel_first: str, data_path: str, video_path: str) -> None:
    features = {"action": {"dtype": "float32", "shape": [7], "names": [f"a{i}" for i in range(7)]},
                **{k: camera_feature(k, k == channel_first) for k in (TOP, WRIST, SIDE)},
                "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                **{k: {"dtype": "int64", "shape": [1], "names": None}
                   for k in ("frame_index", "episode_index", "index", "task_index")}}
    info = {"codebase_version": version, "robot_type": "test", "total_episodes": 3, "total_frames": sum(LENGTHS),
            "total_tasks": 2, "chunks_size": 1000, "fps": FPS, "splits": {"train": "0:3"},
            "data_path": data_path, "video_path": video_path, "features": features}
    (root / "meta").mkdir(parents=True, exist_ok=True)
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2))


def frame_table(episode: int, first_index: int, fixed_size: bool) -> pa.Table:
    """One episode's rows as lerobot stores them (the image feature as a {bytes, path} struct)."""
    n, actions = LENGTHS[episode], actions_of(episode)
    pngs = []
    for f in range(n):
        buffer = pa.BufferOutputStream()
        Image.fromarray(picture(SIDE, episode, f)).save(buffer, format="PNG")
        pngs.append({"bytes": buffer.getvalue().to_pybytes(), "path": f"frame_{f:06d}.png"})
    action_type = pa.list_(pa.float32(), 7) if fixed_size else pa.list_(pa.float32())
    return pa.table({
        "action": pa.array(actions.tolist(), action_type),
        SIDE: pa.array(pngs, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "timestamp": pa.array(np.arange(n, dtype=np.float32) / FPS, pa.float32()),
        "frame_index": pa.array(np.arange(n), pa.int64()),
        "episode_index": pa.array([episode] * n, pa.int64()),
        "index": pa.array(first_index + np.arange(n), pa.int64()),
        "task_index": pa.array([EPISODE_TASK[episode]] * n, pa.int64())})


def encode(path, camera: str, episode: int, frames: int | None = None) -> float:
    """One episode's mp4 (lerobot's encoder settings); returns its duration as lerobot measures it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"g": "2", "crf": "30", **({"preset": "8"} if CODECS[camera] == "libsvtav1" else {})}
    with av.open(str(path), "w") as out, scheduling_kept():  # see scheduling_kept: SVT-AV1 makes us real-time
        stream = out.add_stream(CODECS[camera], FPS, options=options)
        stream.pix_fmt, (stream.height, stream.width) = "yuv420p", SIZES[camera]
        for f in range(LENGTHS[episode] if frames is None else frames):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(picture(camera, episode, f), format="rgb24")))
        out.mux(stream.encode())
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return float(stream.duration * stream.time_base)


def concatenate(parts: list, path) -> None:
    """Stream-copy `parts` into one mp4 through ffmpeg's concat demuxer (as lerobot's video_utils)."""
    listing = path.with_suffix(".ffconcat")
    listing.write_text("ffconcat version 1.0\n" + "".join(f"file '{p.resolve()}'\n" for p in parts))
    with av.open(str(listing), format="concat", options={"safe": "0"}) as src, av.open(str(path), "w") as dst:
        source = src.streams.video[0]
        out = dst.add_stream_from_template(template=source, opaque=True)
        out.time_base = source.time_base
        for packet in src.demux(source):
            if packet.dts is not None:
                packet.stream = out
                dst.mux(packet)
    listing.unlink()
    for part in parts:
        part.unlink()


def write_v21(root) -> None:
    write_info(root, "v2.1", TOP, "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
               "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4")
    start = 0
    for e in range(3):
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(frame_table(e, start, fixed_size=False), path)
        start += LENGTHS[e]
        for camera in (TOP, WRIST):
            encode(root / f"videos/chunk-000/{camera}/episode_{e:06d}.mp4", camera, e)
    lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    (root / "meta/episodes.jsonl").write_text(lines(
        {"episode_index": e, "tasks": [TASKS[EPISODE_TASK[e]]], "length": LENGTHS[e]} for e in range(3)))
    (root / "meta/tasks.jsonl").write_text(lines({"task_index": i, "task": t} for i, t in enumerate(TASKS)))
    (root / "meta/episodes_stats.jsonl").write_text(lines(
        {"episode_index": e, "stats": {"action": {"min": actions_of(e).min(0).tolist(),
                                                  "max": actions_of(e).max(0).tolist()}}} for e in range(3)))


V3_FILES = {"data": [0, 0, 1], TOP: [0, 0, 1], WRIST: [0, 0, 0]}  # episode -> file index


def write_v3_videos(root) -> dict:
    """Per camera, the episodes' mp4s concatenated into file-XXX.mp4; returns each episode's span."""
    spans = {}
    for camera in (TOP, WRIST):
        for file in sorted(set(V3_FILES[camera])):
            members, offset, parts = [e for e in range(3) if V3_FILES[camera][e] == file], 0.0, []
            target = root / f"videos/{camera}/chunk-000/file-{file:03d}.mp4"
            for e in members:
                parts.append(target.parent / f"tmp-{e}.mp4")
                duration = encode(parts[-1], camera, e)
                spans[camera, e] = (file, offset, offset + duration)
                offset += duration
            concatenate(parts, target)
    return spans


def write_v30(root) -> None:
    write_info(root, "v3.0", SIDE, "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
               "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4")
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    for file in (0, 1):
        path = root / f"data/chunk-000/file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        tables = [frame_table(e, int(starts[e]), True) for e in range(3) if V3_FILES["data"][e] == file]
        pq.write_table(pa.concat_tables(tables), path)
    spans = write_v3_videos(root)
    rows = []
    for e in range(3):
        row = {"episode_index": e, "tasks": [TASKS[EPISODE_TASK[e]]], "length": LENGTHS[e],
               "data/chunk_index": 0, "data/file_index": V3_FILES["data"][e],
               "dataset_from_index": int(starts[e]), "dataset_to_index": int(starts[e + 1])}
        for camera in (TOP, WRIST):
            file, begin, end = spans[camera, e]
            row.update({f"videos/{camera}/chunk_index": 0, f"videos/{camera}/file_index": file,
                        f"videos/{camera}/from_timestamp": begin, f"videos/{camera}/to_timestamp": end})
        row.update({"stats/action/min": actions_of(e).min(0).tolist(),
                    "stats/action/max": actions_of(e).max(0).tolist(),
                    "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        rows.append(row)
    (root / "meta/episodes/chunk-000").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(pa.table({"task_index": pa.array([0, 1], pa.int64()), "task": TASKS}), root / "meta/tasks.parquet")
    all_actions = np.concatenate([actions_of(e) for e in range(3)])
    stats = {"min": all_actions.min(0), "max": all_actions.max(0), "mean": all_actions.mean(0),
             "std": all_actions.std(0), **{f"q{q:02d}": STATS_SHIFT + np.quantile(all_actions, q / 100, axis=0)
                                           for q in (1, 10, 50, 90, 99)}}
    (root / "meta/stats.json").write_text(json.dumps({"action": {k: v.tolist() for k, v in stats.items()}}))


STATS_SHIFT = 0.125  # stats.json's quantiles are lerobot's histogram estimates: here shifted, to tell them apart


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    roots = {}
    for version, writer in (("v2.1", write_v21), ("v3.0", write_v30)):
        roots[version] = tmp_path_factory.mktemp(version.replace(".", ""))
        writer(roots[version])
    return roots


def copy(datasets, version, tmp_path):
    return shutil.copytree(datasets[version], tmp_path / "copy")


def resized(image: np.ndarray, size: int) -> np.ndarray:
    """PIL's box filter (area average) to shrink, bilinear to enlarge."""
    shrink = min(image.shape[:2]) >= size
    return np.asarray(Image.fromarray(image).resize((size, size), Image.BOX if shrink else Image.BILINEAR))


def expected_image(camera: str, episode: int, frame: int, size: int = SIZE) -> np.ndarray:
    image = picture(camera, episode, frame)
    return image if image.shape[:2] == (size, size) else resized(image, size)


def mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# ----------------------------------------------------------------------------- reading back


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_every_frame_reads_back(datasets, version):
    source = LeRobotSource(datasets[version], InstructionEncoder(32), image_size=SIZE)
    assert (source.version, source.fps, source.episode_indices) == (version, FPS, [0, 1, 2])
    assert source.camera_keys == [TOP, WRIST, SIDE]
    assert source.shapes == {"images": (3, SIZE, SIZE, 3), "actions": (7,)}
    assert len(source) == sum(LENGTHS)
    errors = {camera: [] for camera in source.camera_keys}
    record = 0
    for e, n in enumerate(LENGTHS):
        for f in range(n):
            item = source[record]
            np.testing.assert_array_equal(item["actions"], actions_of(e)[f])
            text = TASKS[EPISODE_TASK[e]].encode()
            assert bytes(item["instruction"][:len(text)]) == text and not item["instruction"][len(text):].any()
            assert item["images"].dtype == np.uint8 and item["instruction"].shape == (32,)
            for c, camera in enumerate(source.camera_keys):
                errors[camera].append(mean_error(item["images"][c], expected_image(camera, e, f)))
            record += 1
    assert max(errors[SIDE]) == 0  # PNG is lossless and 48 -> 64 is the same bilinear upsampling
    for camera in (TOP, WRIST):
        assert max(errors[camera]) < MEAN_ERROR, (camera, max(errors[camera]))


def test_frames_do_not_leak_across_episodes(datasets):
    """Each decoded frame is nearer its own picture than the same frame index of the neighbour episodes."""
    source = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE, cameras=(TOP,))
    for e in range(3):
        for f in (0, LENGTHS[e] - 1):
            image = source[int(source.starts[e]) + f]["images"][0]
            own = mean_error(image, expected_image(TOP, e, f))
            others = [mean_error(image, expected_image(TOP, o, min(f, LENGTHS[o] - 1))) for o in range(3) if o != e]
            assert own < MEAN_ERROR < min(others), (e, f, own, others)


def test_cameras_order_subset_and_resize(datasets):
    source = LeRobotSource(datasets["v2.1"], InstructionEncoder(32), 32, cameras=(SIDE, WRIST))
    assert source.shapes["images"] == (2, 32, 32, 3) and source.camera_keys == [SIDE, WRIST]
    item = source[LENGTHS[0] + 2]  # episode 1, frame 2
    assert mean_error(item["images"][0], resized(picture(SIDE, 1, 2), 32)) < 1
    assert mean_error(item["images"][1], resized(picture(WRIST, 1, 2), 32)) < MEAN_ERROR


def test_episode_selection_keeps_the_given_order(datasets):
    source = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE, episodes=[2, 0])
    assert source.episode_indices == [2, 0] and len(source) == LENGTHS[2] + LENGTHS[0]
    np.testing.assert_array_equal(source[0]["actions"], actions_of(2)[0])
    np.testing.assert_array_equal(source[LENGTHS[2]]["actions"], actions_of(0)[0])
    assert mean_error(source[LENGTHS[2] - 1]["images"][0], expected_image(TOP, 2, LENGTHS[2] - 1)) < MEAN_ERROR


def test_subset_reads_like_a_fresh_selection(datasets):
    whole = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE, cameras=(WRIST,))
    part, fresh = whole.subset([2, 0]), LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE, cameras=(WRIST,), episodes=[2, 0])
    assert part.episode_indices == [2, 0] and len(part) == len(fresh) and len(whole) == sum(LENGTHS)
    for record in range(len(fresh)):
        for key, value in fresh[record].items():
            np.testing.assert_array_equal(part[record][key], value)
    with pytest.raises(ConfigError, match="episodes \\[1, 5\\]"):
        whole.subset([1, 5])


def test_action_quantiles(datasets):
    everything = np.concatenate([actions_of(e) for e in range(3)])
    want = np.quantile(everything, [0.01, 0.99], axis=0)
    for version in ("v2.1", "v3.0"):
        computed = compute_action_quantiles(datasets[version])
        np.testing.assert_allclose(computed, want, rtol=1e-6, atol=1e-6)
    q01, q99 = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE).action_quantiles()  # from meta/stats.json
    np.testing.assert_allclose([q01, q99], want + STATS_SHIFT, rtol=1e-6, atol=1e-6)
    assert LeRobotSource.stored_action_quantiles(datasets["v2.1"]) is None
    q01, q99 = LeRobotSource(datasets["v2.1"], InstructionEncoder(32), SIZE).action_quantiles()  # no stats.json: computed
    np.testing.assert_allclose([q01, q99], want, rtol=1e-6, atol=1e-6)
    assert q01.dtype == np.float32 and q01.shape == (7,)


def test_pickled_source_reads_the_same_and_decodes_once(datasets):
    source = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE)
    first = source[1]
    assert source.decodes == 3  # episode 0's segment of each camera
    for record in range(LENGTHS[0]):
        source[record]
    assert source.decodes == 3  # the other frames of episode 0 come from the cache
    source[LENGTHS[0]]
    assert source.decodes == 6
    data = pickle.dumps(source)
    assert len(data) < 100_000  # no decoded frames travel to the workers
    clone = pickle.loads(data)
    assert clone.decodes == 0
    for key in first:
        np.testing.assert_array_equal(clone[1][key], first[key])
    small = LeRobotSource(datasets["v3.0"], InstructionEncoder(32), SIZE, cameras=(TOP,), cache_bytes=1)
    small[0], small[LENGTHS[0]], small[0]
    assert small.decodes == 3  # a one-segment cache decodes episode 0 again


def test_segments_and_grain(datasets):
    source = LeRobotSource(datasets["v2.1"], InstructionEncoder(32), SIZE, cameras=(TOP,), segment_frames=2)
    records = list(grain.MapDataset.source(source).shuffle(seed=0))
    assert len(records) == sum(LENGTHS) and source.decodes == sum((n + 1) // 2 for n in LENGTHS)
    got = sorted(tuple(r["actions"]) for r in records)
    assert got == sorted(tuple(a) for e in range(3) for a in actions_of(e))


def test_split_episodes_and_is_lerobot(datasets, tmp_path):
    train, held = split_episodes(10, 3, seed=1)
    assert (train, held) == split_episodes(10, 3, seed=1) and len(held) == 3
    assert sorted(train + held) == list(range(10)) and train == sorted(train) and held == sorted(held)
    assert split_episodes(10, 3, seed=2) != (train, held) or split_episodes(10, 3, seed=3) != (train, held)
    assert split_episodes(4, 0, seed=0) == ([0, 1, 2, 3], [])
    assert split_episodes([10 + e for e in range(10)], 3, seed=1) == ([10 + e for e in train], [10 + e for e in held])
    with pytest.raises(ConfigError, match="cannot hold out 4 of 4"):
        split_episodes(4, 4, seed=0)
    assert is_lerobot(datasets["v3.0"]) and not is_lerobot(tmp_path)


# ----------------------------------------------------------------------------- errors


def rewrite_info(root, **changes):
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))


def test_metadata_errors(datasets, tmp_path):
    root = copy(datasets, "v2.1", tmp_path)
    with pytest.raises(ConfigError, match="info.json: missing"):
        LeRobotSource(tmp_path, InstructionEncoder(32), SIZE)
    with pytest.raises(ConfigError, match=r"info.json: no numeric feature 'action.nope'"):
        LeRobotSource(root, InstructionEncoder(32), SIZE, action_key="action.nope")
    with pytest.raises(ConfigError, match=r"info.json: camera\(s\) \['observation.images.nope'\].*'observation"):
        LeRobotSource(root, InstructionEncoder(32), SIZE, cameras=(TOP, "observation.images.nope"))
    with pytest.raises(ConfigError, match="episodes \\[0, 7\\]"):
        LeRobotSource(root, InstructionEncoder(32), SIZE, episodes=[0, 7])
    with pytest.raises(ConfigError, match=r"tasks.jsonl: instruction 'pick up the red cube' is 20 bytes"):
        LeRobotSource(root, InstructionEncoder(8), SIZE).check_instructions()
    rewrite_info(root, codebase_version="v1.6")
    with pytest.raises(ConfigError, match=r"info.json: codebase_version 'v1.6' is not supported"):
        LeRobotSource(root, InstructionEncoder(32), SIZE)


def test_truncated_parquet(datasets, tmp_path):
    root = copy(datasets, "v3.0", tmp_path)
    path = root / "data/chunk-000/file-001.parquet"
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"file-001.parquet: not a readable parquet file"):
        LeRobotSource(root, InstructionEncoder(32), SIZE)


def test_undecodable_video(datasets, tmp_path):
    root = copy(datasets, "v3.0", tmp_path)
    path = root / f"videos/{WRIST}/chunk-000/file-000.mp4"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    source = LeRobotSource(root, InstructionEncoder(32), SIZE)  # the metadata is fine: the error comes at the first decode
    with pytest.raises(ConfigError, match=rf"{WRIST}/chunk-000/file-000.mp4: cannot decode the video"):
        source[0]


def test_frames_past_the_video_end(datasets, tmp_path):
    root = copy(datasets, "v2.1", tmp_path)  # v2.1: episode 1's top video holds 2 of its 4 frames
    encode(root / f"videos/chunk-000/{TOP}/episode_000001.mp4", TOP, 1, frames=2)
    source = LeRobotSource(root, InstructionEncoder(32), SIZE, episodes=[1])
    with pytest.raises(ConfigError, match=rf"{TOP}/episode_000001.mp4: no frame within .* past the video's end"):
        source[3]
    root = copy(datasets, "v3.0", tmp_path / "v3")  # v3.0: the parquet runs past the episode's span of the file
    table = pq.read_table(root / "data/chunk-000/file-001.parquet")
    column = table.schema.get_field_index("timestamp")
    extra = table.slice(len(table) - 1).set_column(column, "timestamp", pa.array([LENGTHS[2] / FPS], pa.float32()))
    pq.write_table(pa.concat_tables([table, extra]), root / "data/chunk-000/file-001.parquet")
    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    episodes[2]["length"] += 1
    pq.write_table(pa.Table.from_pylist(episodes), root / "meta/episodes/chunk-000/file-000.parquet")
    with pytest.raises(ConfigError, match=rf"{TOP}/chunk-000/file-001.mp4: episode 2's last frame .* past its"):
        LeRobotSource(root, InstructionEncoder(32), SIZE)
