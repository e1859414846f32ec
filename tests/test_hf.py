"""Hugging Face Llama weights in and out, checked against `transformers` itself.

Tiny random LlamaForCausalLM models are made and saved with transformers (CPU torch) inside the
tests: GQA and MHA, tied and untied embeddings, Llama 3 rope scaling, one file and sharded files,
and both config.json layouts (transformers 5's `rope_parameters`, and `rope_theta` + `rope_scaling`).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import require

torch = require("torch")
transformers = require("transformers")

from conftest import builder_for  # noqa: E402
from jaxpar.interop import hf_llama  # noqa: E402
from jaxpar.config import Config, ConfigError, InitConfig, MeshConfig, ModelConfig, TrainConfig, ZeroConfig  # noqa: E402
from jaxpar.config import validate  # noqa: E402
from jaxpar.layers.collectives import Collectives  # noqa: E402
from jaxpar.training.loop import _fresh_state  # noqa: E402
from jaxpar.models import llama  # noqa: E402

SEQ = 32
VARIANTS = {
    "gqa": dict(num_key_value_heads=2),
    "mha_tied": dict(num_key_value_heads=8, tie_word_embeddings=True),
    # head_dim 8, theta 500: wavelengths 6, 30, 140, 664 against 64 / 4 and 64 / 1: one band kept, one
    # interpolated, two slowed down by the factor
    "llama3_rope": dict(num_key_value_heads=2, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                 high_freq_factor=4.0, original_max_position_embeddings=64)),
}


def make_hf_model(directory, variant: str, shard: bool = False, legacy_layout: bool = False):
    torch.manual_seed(0)
    extra = dict(VARIANTS[variant])
    scaling = extra.pop("rope_scaling", None)
    hf_config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=8, rms_norm_eps=1e-5, max_position_embeddings=64,
                                         rope_theta=500.0, **extra)
    if scaling:
        hf_config.rope_parameters = {**scaling, "rope_theta": 500.0}
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    if legacy_layout:  # the layout of checkpoints written before transformers 5
        path = directory / "config.json"
        cfg = json.loads(path.read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = params
        path.write_text(json.dumps(cfg))
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def config_for(directory, **layout) -> Config:
    config = Config(mesh=MeshConfig(**layout.pop("mesh", {})), zero=ZeroConfig(**layout.pop("zero", {})),
                    train=TrainConfig(global_batch_size=8, seq_len=SEQ), init=InitConfig(from_hf=str(directory)))
    config = hf_llama.with_model_from_hf(config)
    validate(config)
    return config


def jaxpar_logits(config: Config, params: dict, ids: np.ndarray) -> np.ndarray:
    coll = Collectives()
    x = llama.embed_tokens(params, ids, coll)
    x = llama.run_layers(x, params["layers"], config.model, coll)
    return np.asarray(llama.head_logits(params, x, config.model, coll))


def one_device_params(config: Config) -> dict:
    builder = builder_for(config)
    return builder.to_model_order(jax.device_get(_fresh_state(builder).params))


def ids(batch=2, seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, 128, size=(batch, seq)).astype(np.int32)


def assert_logits_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * np.max(np.abs(expected)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers_on_one_device(tmp_path, variant):
    model = make_hf_model(tmp_path, variant)
    config = config_for(tmp_path)
    assert config.model.n_kv_heads == model.config.num_key_value_heads
    tokens = ids()
    assert_logits_close(jaxpar_logits(config, one_device_params(config), tokens), hf_logits(model, tokens))


@pytest.mark.parametrize("legacy_layout", [False, True])
def test_both_config_layouts_and_sharded_files_import_alike(tmp_path, legacy_layout):
    model = make_hf_model(tmp_path, "llama3_rope", shard=True, legacy_layout=legacy_layout)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config = config_for(tmp_path)
    assert config.model.rope_scaling == (8.0, 1.0, 4.0, 64)
    tokens = ids()
    assert_logits_close(jaxpar_logits(config, one_device_params(config), tokens), hf_logits(model, tokens))


@pytest.mark.parametrize("layout,stage,remat", [
    ((2, 2, 2), 1, "none"),  # the layout: pipeline x tp x ZeRO-1
    ((4, 1, 2), 3, "full"),  # ZeRO-3 with its prefetching layer scan
    ((2, 1, 4), 2, "none"),  # tp 4 over 2 KV heads: replicated KV projections
])
def test_loss_equals_transformers_on_parallel_layouts(tmp_path, layout, stage, remat):
    from jaxpar.config import RematConfig

    model = make_hf_model(tmp_path, "gqa")
    dp, pp, tp = layout
    config = config_for(tmp_path, mesh=dict(dp=dp, pp=pp, tp=tp), zero=dict(stage=stage))
    config = dataclasses.replace(config, remat=RematConfig(policy=remat))
    builder = builder_for(config)
    state = _fresh_state(builder)
    tokens = ids(batch=8, seq=SEQ + 1, seed=1)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((8, SEQ), np.float32)}
    _, metrics = builder.jit_train_step()(state, jax.device_put(batch, builder.batch_sharding()))
    logits = torch.tensor(hf_logits(model, tokens[:, :-1]))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), torch.tensor(tokens[:, 1:]).long().reshape(-1))
    np.testing.assert_allclose(float(metrics["loss"]), float(expected), rtol=1e-4)


def test_streaming_reads_only_each_devices_slice(tmp_path, monkeypatch):
    """On (2, 1, 4) ZeRO-1 every read is one device's shard: a quarter of a head-split weight's rows
    and half of its d_model columns, never a whole tensor."""
    make_hf_model(tmp_path, "mha_tied")
    config = config_for(tmp_path, mesh=dict(dp=2, tp=4), zero=dict(stage=1))
    reads = []
    original = hf_llama.SafetensorsReader.read

    def spy(self, name, index, shape):
        out = original(self, name, index, shape)
        reads.append((name, out.size, int(np.prod(shape))))
        return out

    monkeypatch.setattr(hf_llama.SafetensorsReader, "read", spy)
    _fresh_state(builder_for(config))
    q_reads = [(size, whole) for name, size, whole in reads if name.endswith("q_proj.weight")]
    assert q_reads and all(size * 8 == whole for size, whole in q_reads)
    assert all(size < whole for name, size, whole in reads if not name.endswith("norm.weight"))


def test_export_of_a_trained_run_loads_in_transformers(tmp_path, capsys):
    from jaxpar.inference import loader
    from jaxpar import export
    from jaxpar.training.loop import train

    make_hf_model(tmp_path / "hf", "gqa")
    config = config_for(tmp_path / "hf", mesh=dict(dp=2, pp=2, tp=2), zero=dict(stage=1))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2, lr=1e-2))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(config, builder_for(config).mesh, run_dir, show_progress=False)
    # as if the run's data had been tokenized with a tokenizers file: the export ships it
    import tokenizers

    vocab = {"</s>": 0, **{f"t{i}": i for i in range(1, 128)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text(json.dumps({"tokenizer": str(tmp_path / "tok.json")}))
    with_data = dataclasses.replace(config, data=dataclasses.replace(config.data, train=str(tmp_path / "data")))
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(with_data)))
    assert export.main(["--workdir", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (tmp_path / "tok.json").read_text()

    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    single = loader.single_device(config)
    state = builder_for(single)
    from jaxpar.parallel.checkpoint import Checkpointer
    restored, step, _ = Checkpointer(run_dir, single).restore(state.abstract_state())
    assert step == 2
    params = state.to_model_order(jax.device_get(restored.params))
    tokens = ids()
    assert_logits_close(hf_logits(exported, tokens), jaxpar_logits(single, params, tokens))
    original = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not np.allclose(hf_logits(original, tokens), hf_logits(exported, tokens), atol=1e-3), "trained weights"

    # generation straight from the run (tp = 2) equals transformers' greedy decoding of the export
    from jaxpar.inference import generate

    with torch.no_grad():
        expected = exported.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=6, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    capsys.readouterr()
    assert generate.main(["--workdir", str(run_dir), "--prompt_ids", "3,1,4,1,5", "--max_new_tokens", "6",
                          "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_ids"] == expected


def test_config_mistakes_are_one_line_errors(tmp_path):
    make_hf_model(tmp_path, "gqa")
    base = Config(init=InitConfig(from_hf=str(tmp_path)), model=ModelConfig(d_model=128))
    with pytest.raises(ConfigError, match=r"model.d_model=128 disagrees with .*config.json \(64\)"):
        hf_llama.with_model_from_hf(base)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()),
                                                      "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
        hf_llama.model_fields(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        hf_llama.model_fields(tmp_path / "nowhere")


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf_model(tmp_path, "gqa")
    config = config_for(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=f"tensor '{name}' is missing"):
        one_device_params(config)
    save_file({**tensors, name: tensors[name][:, :32]}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"tensor '{name}' has shape \(128, 32\), expected \(128, 64\)"):
        one_device_params(config)


@pytest.mark.parametrize("variant", ["gqa", "mha_tied"])
def test_hf_to_jaxpar_to_hf_is_bit_identical(tmp_path, variant):
    """Import, then write back without training: every tensor equals the original bit for bit (a tied
    checkpoint comes back with lm_head = the embedding, written untied)."""
    from safetensors.numpy import load_file

    make_hf_model(tmp_path / "in", variant)
    config = config_for(tmp_path / "in")
    hf_llama.write(one_device_params(config), config.model, tmp_path / "out", config.model.max_position)
    original = load_file(tmp_path / "in" / "model.safetensors")
    written = {}
    for shard in sorted((tmp_path / "out").glob("model-*.safetensors")):
        written.update(load_file(shard))
    if "lm_head.weight" not in original:
        original["lm_head.weight"] = original["model.embed_tokens.weight"]
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name


def test_a_missing_shard_is_named(tmp_path):
    make_hf_model(tmp_path, "gqa", shard=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"names shard {shard.name}, which is not in"):
        one_device_params(config_for(tmp_path))


def _saved_run(run_dir, config):
    """`config`'s fresh state saved as step 1 of a run directory (what export reads)."""
    from jaxpar.parallel.checkpoint import Checkpointer

    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    checkpoints = Checkpointer(run_dir, config)
    checkpoints.save(1, builder_for(config).init_state(0))
    checkpoints.close()


def test_export_writes_the_runs_positions_and_dtype(tmp_path):
    """Issue 28 item 6: max_position_embeddings is the Hugging Face init's own (64 here; it was max(8192,
    2048)) or, from scratch, the trained sequence; --dtype bf16 writes bf16 tensors that transformers
    loads as bf16, the fp32 export's weights rounded; a bf16 run exports bf16 by default."""
    from safetensors import safe_open

    from jaxpar import export

    make_hf_model(tmp_path / "hf", "gqa")
    pretrained = config_for(tmp_path / "hf")
    assert pretrained.model.max_position == 64
    scratch = Config(model=dataclasses.replace(pretrained.model, max_position=0), precision="bf16",
                     train=TrainConfig(global_batch_size=8, seq_len=SEQ))
    _saved_run(tmp_path / "pre", pretrained)
    _saved_run(tmp_path / "scratch", scratch)
    for run, out, extra in (("pre", "fp32", []), ("pre", "bf16", ["--dtype", "bf16"]), ("scratch", "scratch", [])):
        assert export.main(["--workdir", str(tmp_path / run), "--out", str(tmp_path / out), *extra]) == 0

    def first_tensor(directory):
        with safe_open(next(directory.glob("model-*.safetensors")), framework="numpy") as f:
            return f.get_tensor("model.embed_tokens.weight")

    positions = {d: json.loads((tmp_path / d / "config.json").read_text())["max_position_embeddings"]
                 for d in ("fp32", "bf16", "scratch")}
    assert positions == {"fp32": 64, "bf16": 64, "scratch": SEQ}
    assert first_tensor(tmp_path / "fp32").dtype == np.float32 and str(first_tensor(tmp_path / "scratch").dtype) == "bfloat16"
    np.testing.assert_array_equal(first_tensor(tmp_path / "bf16").astype(np.float32),
                                  first_tensor(tmp_path / "fp32").astype(first_tensor(tmp_path / "bf16").dtype).astype(np.float32))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert loaded.dtype == torch.bfloat16 and loaded.config.max_position_embeddings == 64
    assert transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32", dtype="auto").dtype == torch.float32
