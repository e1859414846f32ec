"""Video input that keeps up (issue 32, item 4): images travel to the device as uint8 and are scaled
there (jaxpar.models.vit.normalise), the decoded-frame cache is data.frame_cache_mb, the reader's
read-ahead is data.prefetch, and the step loop logs data_wait_s."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import builder_for, make_config
from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.layers.collectives import Collectives
from jaxpar.models import vit, vla

SIGLIP = ["vision.image_mean=0.5", "vision.image_std=0.5"]


def small_vla(*overrides: str):
    return load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false", "eval.rollouts=0",
                                    "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1",
                                    "train.global_batch_size=4", *overrides])


def test_uint8_is_the_batch_dtype_from_host_to_the_compiled_step():
    config = small_vla()
    batch = vla.synthetic_batch(config, 0, 4)
    assert batch["images"].dtype == np.uint8 and batch["images"].max() > 200  # pixels, not [0, 1]
    assert builder_for(config).abstract_batch()["images"].dtype == jnp.uint8  # what the step is compiled for
    with pytest.raises(TypeError, match="uint8"):
        vla.make_batch(config, batch["images"] / 255.0, batch["inputs"][:, :32], np.zeros((4, 7)))


@pytest.mark.parametrize("stats", [[], SIGLIP, ["vision.image_mean=0.4,0.5,0.6", "vision.image_std=0.2,0.3,0.25"]])
def test_scaling_on_the_device_equals_the_old_host_scaling(stats):
    """x / 255 (then mean / std) in the encoder on uint8 equals what the host used to send (float32
    x / 255, normalised in the encoder), to float rounding: pixels and the encoder's features."""
    cfg = small_vla(*stats).vision
    pixels = np.random.default_rng(0).integers(0, 256, (2, 1, 16, 16, 3), np.uint8)
    pixels[0, 0, 0, :4] = [[0, 0, 0], [255, 255, 255], [1, 2, 3], [254, 128, 127]]
    host = pixels.astype(np.float32) / 255.0  # the old pipeline.episode_batch
    on_device = jax.jit(lambda x: vit.normalise(x, cfg))(pixels)
    np.testing.assert_allclose(np.asarray(on_device), np.asarray(vit.normalise(host, cfg)), rtol=1e-6, atol=5e-7)  # last-bit differences
    params = vit.init(cfg, 64, jax.random.key(0))
    text = np.ones((2, 32), np.int32)
    ours = vit.features(params, pixels, cfg, Collectives(), None, text)
    old = vit.features(params, host, cfg, Collectives(), None, text)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(old), rtol=1e-5, atol=1e-5)


def lerobot_dataset(root):
    from jaxpar.data.lerobot_write import write_lerobot_split

    write_lerobot_split(root, 3, 0, size=16, grid=4, steps=4, cameras=1, dims=7, video_size=16)
    return root


def test_frame_cache_mb_is_the_lerobot_readers_cache(tmp_path):
    from jaxpar.data.pipeline import make_source

    root = lerobot_dataset(tmp_path / "data")
    config = small_vla(f"data.train={root}", "data.frame_cache_mb=3")
    source = make_source(config, config.data.train)
    assert source.cache.limit == 3 << 20

    def decodes(cache_mb: int) -> int:
        """Frames of episodes 0, 1, then 0 again: a cache of 0 MB keeps one segment, so episode 0 is
        decoded twice; the default keeps both."""
        config = small_vla(f"data.train={root}", f"data.frame_cache_mb={cache_mb}")
        source = make_source(config, config.data.train)
        for record in (0, int(source.starts[1]), 1):
            source[record]
        return source.decodes

    assert decodes(0) == 3 and decodes(256) == 2
    with pytest.raises(ConfigError, match="data.frame_cache_mb=-1 must be >= 0"):
        make_source(small_vla(f"data.train={root}", "data.frame_cache_mb=-1"), str(root))


def test_prefetch_sets_the_read_ahead():
    from jaxpar.data.pipeline import read_options

    options = read_options(small_vla("data.prefetch=7"))
    assert (options.prefetch_buffer_size, options.num_threads) == (7, 2)
    assert read_options(small_vla("data.prefetch=1")).num_threads == 1
    with pytest.raises(ConfigError, match="data.prefetch=0 must be >= 1"):
        from jaxpar.data.pipeline import make_source

        make_source(small_vla("data.prefetch=0"), "unused")


def test_data_wait_s_is_logged_and_is_the_time_spent_getting_the_batch(tmp_path, monkeypatch):
    """Every metrics.jsonl step record has data_wait_s >= 0 (the mean per step since the last record);
    a reader that takes 0.2 s per batch shows as >= 0.2 s of it, inside step_time_s."""
    from jaxpar.training import loop

    config = make_config(steps=4, log_every=2)
    mesh = builder_for(config).mesh
    records = loop.train(config, mesh, tmp_path / "fast", show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4] and all(r["data_wait_s"] >= 0 for r in lines)
    assert records[-1]["data_wait_s"] == lines[-1]["data_wait_s"]

    made = loop.train_data

    def slow_data(config, sharding):
        data = made(config, sharding)
        fetch = data.next_batch

        def next_batch():
            time.sleep(0.2)
            return fetch()

        data.next_batch = next_batch
        return data

    monkeypatch.setattr(loop, "train_data", slow_data)
    slow = loop.train(config, mesh, tmp_path / "slow", show_progress=False)
    assert all(0.2 <= r["data_wait_s"] < 0.35 for r in slow), slow  # each step's wait counted once, in its record
    steps = np.diff([0] + [r["step"] for r in slow])
    assert sum(steps * [r["data_wait_s"] for r in slow]) <= sum(steps * [r["step_time_s"] for r in slow])
