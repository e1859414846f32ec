"""Hugging Face Llama checkpoints in and out: config.json <-> ModelConfig, safetensors <-> jaxpar weights.

HF stores each Linear weight as [out, in]; jaxpar keeps [in, out] with the heads split out:

| Hugging Face                                   | jaxpar                   |
|------------------------------------------------|--------------------------|
| model.embed_tokens.weight [V, D]               | embed [V, D]             |
| model.layers.{i}.input_layernorm.weight [D]    | layers.attn_norm [L, D]  |
| model.layers.{i}.self_attn.q_proj.weight [N*H, D] | layers.wq [L, D, N, H] |
| ... k_proj / v_proj [K*H, D]                   | layers.wk / wv [L, D, K, H] |
| ... o_proj [D, N*H]                            | layers.wo [L, N, H, D]   |
| model.layers.{i}.post_attention_layernorm      | layers.mlp_norm          |
| ... mlp.gate_proj / up_proj [F, D]             | layers.w_gate / w_up [L, D, F] |
| ... mlp.down_proj [D, F]                       | layers.w_down [L, F, D]  |
| model.norm.weight [D]                          | final_norm [D]           |
| lm_head.weight [V, D] (tied: embed_tokens)     | lm_head [D, V]           |

Both use RoPE's rotate-half form, so q and k need no permutation. jaxpar always has its own LM head:
a tied checkpoint's embedding is copied into it, and the export writes it untied.

Loading streams: every device's shard is read straight from the safetensors files with slices
(`jax.make_array_from_callback`), so no process ever holds more than its own devices' weights.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxpar.config import Config, ModelConfig
from jaxpar.errors import ConfigError
from jaxpar.models import llama

PREFIX = "model.layers.{}."
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


# ----------------------------------------------------------------------------- config.json

def _rope(hf: dict) -> tuple[float, dict]:
    """(rope_theta, rope scaling dict or {}) from either layout of config.json: transformers < 5
    (`rope_theta` + `rope_scaling`) or transformers 5 (`rope_parameters`)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or {})
    if params.get("rope_type", "default") != "default":
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", "llama3"):
        raise ConfigError(f"config.json: rope scaling type '{kind}' is not supported; jaxpar supports none "
                          f"(Llama 2) and 'llama3'")
    return float(theta), (scaling if kind == "llama3" else {})


def model_fields(directory: str | pathlib.Path) -> dict:
    """ModelConfig fields of the Llama model in `directory`/config.json; one-line errors for what
    jaxpar cannot represent."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"init.from_hf={directory}: no config.json there; point it at a Hugging Face model directory")
    hf = json.loads(path.read_text())
    arch = hf.get("model_type")
    if arch != "llama":
        raise ConfigError(f"{path}: model_type '{arch}' is not supported; jaxpar imports Llama models")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{path}: {flag}=true is not supported (jaxpar's Llama has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: hidden_act '{hf['hidden_act']}' is not supported; jaxpar's MLP is SwiGLU (silu)")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // n):
        raise ConfigError(f"{path}: head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads "
                          f"= {d // n}, which jaxpar assumes")
    theta, scaling = _rope(hf)
    fields = dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n,
                  n_kv_heads=hf.get("num_key_value_heads") or n, d_ff=hf["intermediate_size"],
                  rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  max_position=int(hf.get("max_position_embeddings") or 0))
    if scaling:
        fields.update(rope_scaling_factor=float(scaling["factor"]),
                      rope_low_freq_factor=float(scaling["low_freq_factor"]),
                      rope_high_freq_factor=float(scaling["high_freq_factor"]),
                      rope_original_max_len=int(scaling["original_max_position_embeddings"]))
    return fields


def with_section_from_checkpoint(config: Config, section: str, fields: dict, directory) -> Config:
    """`config` with `section`.* (model or vision) set to a checkpoint's `fields`. A field the user set
    to something other than its default that disagrees is a one-line error naming it. (A field set
    explicitly to its default value cannot be told from an unset one and takes the checkpoint's.)"""
    current = getattr(config, section)
    defaults = type(current)()
    for name, value in fields.items():
        mine = getattr(current, name)
        if mine != value and mine != getattr(defaults, name):
            raise ConfigError(f"{section}.{name}={mine} disagrees with {directory}/config.json ({value}); "
                              f"drop the override ({section}.* comes from the checkpoint)")
    return dataclasses.replace(config, **{section: dataclasses.replace(current, **fields)})


def with_model_from_hf(config: Config) -> Config:
    """`config` with model.* taken from init.from_hf's (or init.llm_from_hf's) config.json."""
    directory = config.init.llm_dir
    if not directory:
        return config
    return with_section_from_checkpoint(config, "model", model_fields(directory), directory)


# ----------------------------------------------------------------------------- reading safetensors

class SafetensorsReader:
    """Tensor slices by name from a model directory's one or many safetensors files."""

    def __init__(self, directory: str | pathlib.Path):
        from safetensors import safe_open

        self.directory = pathlib.Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: self.directory / f for name, f in json.loads(index.read_text())["weight_map"].items()}
            missing = sorted({path.name for path in self.files.values() if not path.is_file()})
            if missing:
                raise ConfigError(f"{index} names shard {missing[0]}, which is not in {self.directory}"
                                  + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
        elif (self.directory / "model.safetensors").is_file():
            with safe_open(self.directory / "model.safetensors", framework="flax") as f:
                self.files = {name: self.directory / "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(f"{self.directory}: neither model.safetensors nor model.safetensors.index.json")
        self._open = safe_open
        self._handles: dict[pathlib.Path, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise ConfigError(f"{self.directory}: tensor '{name}' is missing")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._open(path, framework="flax")
        return self._handles[path].get_slice(name)

    def read(self, name: str, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
        """float32 numpy of `name`[index], checking the stored shape is `shape`."""
        tensor = self._slice(name)
        if tuple(tensor.get_shape()) != tuple(shape):
            raise ConfigError(f"{self.directory}: tensor '{name}' has shape {tuple(tensor.get_shape())}, "
                              f"expected {tuple(shape)} from config.json")
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return np.asarray(tensor[index], dtype=np.float32)


def _bounds(index: tuple, shape: tuple) -> list[slice]:
    return [slice(*s.indices(n)) for s, n in zip(index, shape)]


def _read_leaf(reader: SafetensorsReader, hf_name: str, key: str, cfg: ModelConfig, index: list[slice]) -> np.ndarray:
    """jaxpar leaf `key` (one layer's, without the layer dim) at `index`, from HF tensor `hf_name`."""
    d, n, k, h, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    if key in ("attn_norm", "mlp_norm", "final_norm"):
        return reader.read(hf_name, tuple(index), (d,))
    if key in ("wq", "wk", "wv"):  # [D, heads, H] <- [heads * H, D]
        heads = n if key == "wq" else k
        sd, sn, sh = index
        rows = slice(sn.start * h, sn.stop * h)
        block = reader.read(hf_name, (rows, sd), (heads * h, d)).reshape(sn.stop - sn.start, h, -1)
        return block[:, sh].transpose(2, 0, 1)
    if key == "wo":  # [N, H, D] <- [D, N * H]
        sn, sh, sd = index
        block = reader.read(hf_name, (sd, slice(sn.start * h, sn.stop * h)), (d, n * h))
        return block.reshape(-1, sn.stop - sn.start, h).transpose(1, 2, 0)[:, sh]
    if key in ("w_gate", "w_up"):  # [D, F] <- [F, D]
        return reader.read(hf_name, (index[1], index[0]), (f, d)).T
    if key == "w_down":  # [F, D] <- [D, F]
        return reader.read(hf_name, (index[1], index[0]), (d, f)).T
    if key == "embed":
        return reader.read(hf_name, tuple(index), (v, d))
    if key == "lm_head":  # [D, V] <- [V, D]
        return reader.read(hf_name, (index[1], index[0]), (v, d)).T
    raise AssertionError(key)


def load_weights(directory: str | pathlib.Path, cfg: ModelConfig, shardings: dict) -> dict:
    """The LLM's fp32 weights in model layer order, each leaf built shard by shard with `shardings`'s
    layout (a tree like llama.param_shapes): every device's slice is read from disk on its own."""
    reader = SafetensorsReader(directory)
    shapes = llama.param_shapes(cfg)
    tied = not reader.has(TOP_NAMES["lm_head"])

    def top(key):
        hf_name = TOP_NAMES["embed"] if key == "lm_head" and tied else TOP_NAMES[key]

        def callback(index):
            bounds = _bounds(index, shapes[key])
            if key == "lm_head" and tied:  # [D, V] from the embedding [V, D]
                return reader.read(hf_name, (bounds[1], bounds[0]), (cfg.vocab_size, cfg.d_model)).T
            return _read_leaf(reader, hf_name, key, cfg, bounds)
        return jax.make_array_from_callback(shapes[key], shardings[key], callback)

    def stacked(key):
        shape = shapes["layers"][key]

        def callback(index):
            layers, *rest = _bounds(index, shape)
            return np.stack([_read_leaf(reader, PREFIX.format(i) + LAYER_NAMES[key], key, cfg, rest)
                             for i in range(layers.start, layers.stop)])
        return jax.make_array_from_callback(shape, shardings["layers"][key], callback)

    out = {key: top(key) for key in TOP_NAMES}
    out["layers"] = {key: stacked(key) for key in LAYER_NAMES}
    return out


# ----------------------------------------------------------------------------- writing

def hf_config(cfg: ModelConfig, max_position: int, dtype: str = "float32") -> dict:
    """config.json of a LlamaForCausalLM with `cfg`'s shapes (both rope layouts written), for
    `max_position` positions, its weights in `dtype` (torch's name: float32 / bfloat16)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.d_ff, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "max_position_embeddings": max_position, "torch_dtype": dtype, "dtype": dtype}
    scaling = {"rope_type": "default"}
    if cfg.rope_scaling:
        factor, low, high, original = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": original}
        out["rope_scaling"] = scaling
    out["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    return out


def hf_tensors(weights: dict, cfg: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """Host weights in model layer order (numpy, jaxpar layout) -> HF tensors by name, in `dtype`."""
    n, k, h, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    out = {TOP_NAMES["embed"]: weights["embed"], TOP_NAMES["final_norm"]: weights["final_norm"],
           TOP_NAMES["lm_head"]: weights["lm_head"].T}
    as_hf = {"attn_norm": lambda w: w, "mlp_norm": lambda w: w,
             "wq": lambda w: w.transpose(1, 2, 0).reshape(n * h, d), "wk": lambda w: w.transpose(1, 2, 0).reshape(k * h, d),
             "wv": lambda w: w.transpose(1, 2, 0).reshape(k * h, d), "wo": lambda w: w.transpose(2, 0, 1).reshape(d, n * h),
             "w_gate": lambda w: w.T, "w_up": lambda w: w.T, "w_down": lambda w: w.T}
    for key, convert in as_hf.items():
        for i, layer in enumerate(weights["layers"][key]):
            out[PREFIX.format(i) + LAYER_NAMES[key]] = convert(layer)
    return {name: np.ascontiguousarray(np.asarray(w, np.float32).astype(dtype)) for name, w in out.items()}


EXPORT_DTYPES = {"fp32": ("float32", np.float32), "bf16": ("bfloat16", ml_dtypes.bfloat16)}


def write(weights: dict, cfg: ModelConfig, out_dir: str | pathlib.Path, max_position: int, dtype: str = "fp32",
          shard_bytes: int = 2 << 30) -> pathlib.Path:
    """A Hugging Face Llama directory: config.json (for `max_position` positions), generation_config.json,
    safetensors shards in `dtype` (fp32 | bf16) of at most `shard_bytes` and their index (always
    written, as the hub's sharded checkpoints are)."""
    from safetensors.numpy import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_name, np_dtype = EXPORT_DTYPES[dtype]
    tensors = hf_tensors(weights, cfg, np_dtype)
    shards: list[dict] = [{}]
    for name, w in tensors.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + w.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = w
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    total = sum(w.nbytes for w in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, max_position, torch_name), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}, indent=2))
    return out
