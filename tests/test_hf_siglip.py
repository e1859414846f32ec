"""A Hugging Face SigLIP vision tower as the VLA's encoder, checked against transformers'
SiglipVisionModel, and a VLA started from pretrained parts (Llama + SigLIP, fresh projector)."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import require
from jax.sharding import PartitionSpec as P

torch = require("torch")
transformers = require("transformers")

from jaxpar.interop import hf_siglip  # noqa: E402
from jaxpar.config import ConfigError, VisionConfig, load_config  # noqa: E402
from jaxpar.interop.pretrained import load_run_config  # noqa: E402
from jaxpar.layers.collectives import Collectives  # noqa: E402
from jaxpar.training.loop import _fresh_state  # noqa: E402
from jaxpar.parallel.mesh import Layout  # noqa: E402
from jaxpar.models import vit, vla  # noqa: E402
from jaxpar.parallel.step import StepBuilder  # noqa: E402
from jaxpar.sharding import tree_specs, unused_mesh_axes, vision_rules  # noqa: E402


def make_siglip(directory, image_size=16, patch_size=4, width=64, depth=2, heads=4, mlp=128):
    torch.manual_seed(0)
    config = transformers.SiglipVisionConfig(hidden_size=width, intermediate_size=mlp, num_hidden_layers=depth,
                                             num_attention_heads=heads, image_size=image_size, patch_size=patch_size)
    model = transformers.SiglipVisionModel(config).eval()
    with torch.no_grad():  # biases and norms away from their init, so a misplaced one shows
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def siglip_processor():
    """SiglipImageProcessor's PIL backend (resize by PIL, as the processor always did): transformers 5
    names it SiglipImageProcessorPil, and SiglipImageProcessor picks torchvision where it is installed."""
    return getattr(transformers, "SiglipImageProcessorPil", transformers.SiglipImageProcessor)


def images(n=2, size=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype(np.float32)


def hf_features(model, pixels_BxHxWxC):
    with torch.no_grad():
        return model(pixel_values=torch.tensor(pixels_BxHxWxC.transpose(0, 3, 1, 2))).last_hidden_state.numpy()


def vision_config(directory) -> VisionConfig:
    return VisionConfig(**hf_siglip.vision_fields(directory))


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * np.max(np.abs(expected)))


@pytest.mark.parametrize("whole_model_names", [False, True])
def test_features_equal_transformers_on_one_device(tmp_path, whole_model_names):
    model = make_siglip(tmp_path)
    if whole_model_names:  # the names inside a whole SigLIP model (the hub's checkpoints): "vision_model." first
        from safetensors.numpy import load_file, save_file

        tensors = load_file(tmp_path / "model.safetensors")
        save_file({f"vision_model.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    cfg = vision_config(tmp_path)
    assert cfg.bias and (cfg.width, cfg.depth, cfg.n_heads, cfg.mlp_dim, cfg.patch_size) == (64, 2, 4, 128, 4)
    params = hf_siglip.load_vision(tmp_path, cfg)
    pixels = images()
    ours = vit.features(params, pixels[:, None], cfg, Collectives())
    close(np.asarray(ours), hf_features(model, pixels))


def test_features_equal_transformers_with_tensor_parallel_biases(tmp_path):
    """tp = 2: the per-head q / k / v and MLP-in biases split with their weights, the out biases added
    once after the tp sum."""
    model = make_siglip(tmp_path)
    cfg = dataclasses.replace(vision_config(tmp_path), tp=2)
    params = hf_siglip.load_vision(tmp_path, cfg)
    mesh = Layout(dp=1, pp=1, tp=2).make_mesh()
    specs = tree_specs({"vit": vit.param_axes(cfg)["vit"]}, False, unused_mesh_axes(mesh), vision_rules(2, mesh))
    run = jax.shard_map(lambda p, x: vit.features(p, x, cfg, Collectives(tp_axis="tp")), mesh=mesh,
                        in_specs=(specs, P()), out_specs=P())
    pixels = images()
    close(np.asarray(jax.jit(run)(params, pixels[:, None])), hf_features(model, pixels))


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_vla_starts_from_llama_and_siglip(tmp_path):
    make_siglip(tmp_path / "siglip")
    llm_dir = tmp_path / "llama"
    torch.manual_seed(0)
    hf_llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0))
    hf_llm.save_pretrained(llm_dir)  # (the Llama import itself is tested in test_hf.py)
    config = load_run_config("vla_tiny", [f"init.llm_from_hf={llm_dir}", f"init.vision_from_hf={tmp_path / 'siglip'}",
                                      "vision.film=false"])
    assert config.vision.bias and config.model.n_layers == 4
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    state = _fresh_state(builder)
    params = jax.device_get(state.params)
    expected = hf_siglip.load_vision(tmp_path / "siglip", config.vision)["vit"]
    jax.tree.map(np.testing.assert_array_equal, params["vit"], expected)
    np.testing.assert_array_equal(params["embed"], hf_llm.model.embed_tokens.weight.detach().numpy())
    batch = vla.synthetic_batch(config, 0, config.train.global_batch_size)
    _, metrics = builder.jit_train_step()(state, jax.device_put(batch, builder.batch_sharding()))
    assert np.isfinite(float(metrics["loss"]))


def test_siglip_config_mistakes_are_one_line_errors(tmp_path):
    make_siglip(tmp_path)
    with pytest.raises(ConfigError, match=r"vision.width=128 disagrees"):
        load_run_config("vla_tiny", [f"init.vision_from_hf={tmp_path}", "vision.width=128", "vision.film=false"])
    with pytest.raises(ConfigError, match="needs model.kind=vla"):
        load_run_config("llama_tiny", [f"init.vision_from_hf={tmp_path}"])
    with pytest.raises(ConfigError, match="vision.film adds weights"):
        hf_siglip.load_vision(tmp_path, dataclasses.replace(vision_config(tmp_path), film=True))


@pytest.mark.slow  # two VLA compiles (make test's 15-minute budget)
def test_biased_encoder_in_parallel_matches_one_device(tmp_path):
    """The SigLIP encoder (every bias non-zero) in a VLA on (2, 2, 2) with vision tp = 2 and vision
    ZeRO-2 (the per-head biases have no ZeRO dim and stay whole) equals one device: losses and gradients."""
    make_siglip(tmp_path)
    common = [f"init.vision_from_hf={tmp_path}", "vision.film=false", "train.global_batch_size=8"]
    single = load_run_config("vla_tiny", common + ["mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1",
                                               "zero.stage=0", "vision.zero.stage=0"])
    parallel = load_run_config("vla_tiny", common + ["vision.tp=2", "pipeline.microbatches=2"])
    results = []
    for config in (single, parallel):
        builder = StepBuilder(config, Layout.for_config(config).make_mesh())
        state = builder.init_state_from(None, 0, hf_siglip.load_vision(tmp_path, config.vision))
        step = builder.jit_train_step(with_grads=True)
        losses, grads = [], None
        for i in range(2):
            batch = jax.device_put(vla.synthetic_batch(config, i, 8), builder.batch_sharding())
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            grads = grads or jax.device_get(metrics["grads"]["vit"])
        results.append((np.array(losses), grads))
    (ref_losses, ref_grads), (losses, grads) = results
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    # the key bias's true gradient is zero: q . (k + b) shifts every score of a query by the same q . b,
    # which softmax ignores; both sides must show only rounding there
    assert np.abs(grads["blocks"].pop("k_bias")).max() < 1e-6 and np.abs(ref_grads["blocks"].pop("k_bias")).max() < 1e-6

    def check(path, a, e):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, grads, ref_grads)
    assert np.abs(ref_grads["blocks"]["q_bias"]).max() > 1e-4


@pytest.mark.slow  # a VLA train step and transformers loads
def test_vla_export_writes_a_llama_and_a_siglip_that_transformers_loads(tmp_path):
    import json

    from safetensors.numpy import load_file

    from jaxpar import export
    from jaxpar.training.loop import train

    make_siglip(tmp_path / "siglip")
    config = load_run_config("vla_tiny", [f"init.vision_from_hf={tmp_path / 'siglip'}", "vision.film=false",
                                      "data.train=", "data.eval=", "data.generate=false", "train.steps=1",
                                      "eval.rollouts=0", "train.global_batch_size=8", "train.lr=0.01", "mesh.dp=2",
                                      "mesh.pp=1", "mesh.tp=2", "pipeline.microbatches=1"])  # export gathers any layout
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    train(config, Layout.for_config(config).make_mesh(), run_dir, show_progress=False)
    assert export.main(["--workdir", str(run_dir), "--out", str(tmp_path / "out")]) == 0

    _, _, weights = export.restore_weights(run_dir)
    tower = transformers.SiglipVisionModel.from_pretrained(tmp_path / "out" / "vision").eval()
    pixels = images()  # already normalised for transformers; jaxpar's encoder takes them in [0, 1] and normalises
    assert config.vision.image_mean == config.vision.image_std == (0.5, 0.5, 0.5)
    close(np.asarray(vit.features(weights, pixels[:, None] * 0.5 + 0.5, config.vision, Collectives())),
          hf_features(tower, pixels))
    processor = siglip_processor().from_pretrained(tmp_path / "out" / "vision")  # the run's pixel statistics
    assert list(processor.image_mean) == list(processor.image_std) == [0.5] * 3 and processor.resample == 3
    original = transformers.SiglipVisionModel.from_pretrained(tmp_path / "siglip").eval()
    assert not np.allclose(hf_features(original, pixels), hf_features(tower, pixels), atol=1e-4), "trained weights"
    projector = load_file(tmp_path / "out" / "vision" / "projector.safetensors")
    np.testing.assert_array_equal(projector["w2"], weights["projector"]["w2"])
    llm = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out" / "llm")
    np.testing.assert_array_equal(llm.model.embed_tokens.weight.detach().numpy(), weights["embed"])


# ----------------------------------------------------------------------------- pixels: uint8 to features


def write_lerobot_pngs(root, frames_TxHxWx3: np.ndarray, task: str = "look") -> None:
    """A one-episode LeRobot v2.1 dataset whose one camera is an image feature (PNG bytes, lossless):
    lerobot's layout as tests/test_lerobot.py writes it, with only what the reader needs."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    n, h, w, _ = frames_TxHxWx3.shape
    camera = "observation.images.cam"
    features = {"action": {"dtype": "float32", "shape": [7], "names": [f"a{i}" for i in range(7)]},
                camera: {"dtype": "image", "shape": [h, w, 3], "names": ["height", "width", "channels"]},
                "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                **{k: {"dtype": "int64", "shape": [1], "names": None}
                   for k in ("frame_index", "episode_index", "index", "task_index")}}
    info = {"codebase_version": "v2.1", "robot_type": "test", "total_episodes": 1, "total_frames": n,
            "total_tasks": 1, "chunks_size": 1000, "fps": 10, "splits": {"train": "0:1"}, "video_path": None,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet", "features": features}
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(json.dumps(info))
    pngs = []
    for frame in frames_TxHxWx3:
        buffer = pa.BufferOutputStream()
        Image.fromarray(frame).save(buffer, format="PNG")
        pngs.append({"bytes": buffer.getvalue().to_pybytes(), "path": ""})
    path = root / "data" / "chunk-000" / "episode_000000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({
        "action": pa.array(np.zeros((n, 7), np.float32).tolist(), pa.list_(pa.float32())),
        camera: pa.array(pngs, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "timestamp": pa.array(np.arange(n, dtype=np.float32) / 10, pa.float32()),
        "frame_index": pa.array(np.arange(n), pa.int64()), "episode_index": pa.array([0] * n, pa.int64()),
        "index": pa.array(np.arange(n), pa.int64()), "task_index": pa.array([0] * n, pa.int64())}), path)
    (root / "meta" / "episodes.jsonl").write_text(json.dumps({"episode_index": 0, "tasks": [task], "length": n}) + "\n")
    (root / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": task}) + "\n")


@pytest.mark.parametrize("processor_file", [True, False])
def test_uint8_frames_through_the_data_path_give_transformers_features(tmp_path, processor_file):
    """The issue's test: raw uint8 frames (40x40, so they are resized) read by the trainer's own data
    path (LeRobotSource -> pipeline.episode_batch, config from init.vision_from_hf) and encoded by
    jaxpar's ViT give the features transformers gives through SiglipImageProcessor (bicubic resize,
    rescale 1/255, mean / std) + SiglipVisionModel. With the processor's preprocessor_config.json
    (here mean / std other than SigLIP's, so that reading it matters) and without one (SigLIP's 0.5)."""
    from jaxpar.data import pipeline

    model = make_siglip(tmp_path / "siglip")
    processor = siglip_processor()(size={"height": 16, "width": 16},
                                   **({"image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25]}
                                      if processor_file else {}))
    if processor_file:
        processor.save_pretrained(tmp_path / "siglip")
    frames = np.random.default_rng(0).integers(0, 256, (4, 40, 40, 3), np.uint8)
    frames[1] = np.linspace(0, 255, 40, dtype=np.uint8)[None, :, None]  # a smooth ramp too: not only noise
    write_lerobot_pngs(tmp_path / "data", frames)

    config = load_run_config("vla_tiny", [f"init.vision_from_hf={tmp_path / 'siglip'}", "vision.film=false",
                                      f"data.train={tmp_path / 'data'}", "data.eval=", "data.generate=false"])
    assert config.vision.image_mean == tuple(processor.image_mean) and config.vision.resize == "bicubic"
    source = pipeline.make_source(config, config.data.train)
    records = {k: np.stack([source[i][k] for i in range(len(frames))]) for k in source[0]}
    batch = pipeline.episode_batch(config, records)
    params = hf_siglip.load_vision(tmp_path / "siglip", config.vision)
    ours = np.asarray(jax.jit(lambda p, x: vit.features(p, x, config.vision, Collectives()))(params, batch["images"]))

    pixels = processor(images=list(frames), return_tensors="np")["pixel_values"]
    with torch.no_grad():
        theirs = model(pixel_values=torch.tensor(pixels)).last_hidden_state.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-5 * np.max(np.abs(theirs)))


def test_pixel_statistics_defaults_checks_and_old_checkpoints(tmp_path):
    """Random init keeps today's x / 255 (mean 0, std 1: the encoder leaves the pixels alone); one float
    is every channel's; a config.json or checkpoint written before the keys existed reads as mean 0 /
    std 1; a checkpoint trained with other statistics is refused."""
    import json

    from jaxpar.parallel.checkpoint import _model_fingerprint, fingerprint_mismatch
    from jaxpar.config import Config, from_dict

    plain = load_config("vla_tiny")
    assert (plain.vision.image_mean, plain.vision.image_std, plain.vision.resize) == ((0.0,), (1.0,), "area")
    assert vit.pixel_stats(plain.vision) is None
    x = np.random.default_rng(0).random((1, 1, 16, 16, 3), np.float32)
    assert vit.normalise(x, plain.vision) is x
    one = load_config("vla_tiny", ["vision.image_mean=0.5", "vision.image_std=0.25"])
    np.testing.assert_allclose(vit.normalise(x, one.vision), (x - 0.5) / 0.25, rtol=1e-6)
    assert from_dict(Config, {"vision": {"image_mean": 0.5, "image_std": 1}}).vision.image_std == (1.0,)  # a file's
    with pytest.raises(ConfigError, match="one value per channel"):
        load_config("vla_tiny", ["vision.image_mean=0.5,0.5"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config("vla_tiny", ["vision.image_std=0"])
    with pytest.raises(ConfigError, match="vision.resize='cubic' is unknown"):
        load_config("vla_tiny", ["vision.resize=cubic"])

    saved = dataclasses.asdict(plain)
    for key in ("image_mean", "image_std", "resize"):
        del saved["vision"][key]
    assert from_dict(Config, json.loads(json.dumps(saved))) == plain
    meta = json.loads(json.dumps(_model_fingerprint(plain)))
    assert fingerprint_mismatch(meta, plain) is None
    del meta["vision"]["image_mean"], meta["vision"]["image_std"]
    assert fingerprint_mismatch(meta, plain) is None
    make_siglip(tmp_path)
    siglip = load_run_config("vla_tiny", [f"init.vision_from_hf={tmp_path}", "vision.film=false"])
    assert siglip.vision.image_mean == siglip.vision.image_std == (0.5, 0.5, 0.5)
    assert "vision" in fingerprint_mismatch(meta, dataclasses.replace(plain, vision=dataclasses.replace(
        plain.vision, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)))
