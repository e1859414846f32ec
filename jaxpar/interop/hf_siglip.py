"""A Hugging Face SigLIP vision tower as the VLA's encoder (OpenVLA and PaliGemma start from one).

SigLIP's vision model is jaxpar's ViT with `vision.bias=true`: biased patch embedding, learned
position embedding, pre-LN blocks (LayerNorm eps 1e-6), GELU-tanh MLP, a final (post) LayerNorm. The
MAP pooling head is not used (a VLA feeds every patch token to the projector, as OpenVLA does).

| Hugging Face ([vision_model.] prefix)                | jaxpar vit.*                      |
|------------------------------------------------------|-----------------------------------|
| embeddings.patch_embedding.weight [D, C, P, P] / bias | patch_embed [P*P*C, D] / patch_bias |
| embeddings.position_embedding.weight [N, D]          | pos_embed [N, D]                  |
| encoder.layers.{i}.layer_norm1.weight / bias         | blocks.ln1_scale / ln1_bias       |
| encoder.layers.{i}.self_attn.{q,k,v}_proj.weight [N*H, D] / bias | blocks.wq / wk / wv [D, N, H], q_bias ... [N, H] |
| encoder.layers.{i}.self_attn.out_proj.weight [D, N*H] / bias | blocks.wo [N, H, D] / o_bias  |
| encoder.layers.{i}.layer_norm2.weight / bias         | blocks.ln2_scale / ln2_bias       |
| encoder.layers.{i}.mlp.fc1.weight [F, D] / bias      | blocks.w_in [D, F] / in_bias      |
| encoder.layers.{i}.mlp.fc2.weight [D, F] / bias      | blocks.w_out [F, D] / out_bias    |
| post_layernorm.weight / bias                         | final_scale / final_bias          |

Pixels: SigLIP was trained on (x / 255 - 0.5) / 0.5 (SiglipImageProcessor: bicubic resize to
image_size, rescale by 1/255, normalise with image_mean = image_std = 0.5), not on jaxpar's x / 255.
`with_vision_from_hf` therefore also sets vision.image_mean / image_std (applied in the encoder,
jaxpar.models.vit.normalise) and vision.resize (applied to LeRobot frames, jaxpar.data.video.resize)
from the directory's preprocessor_config.json, or SigLIP's values where it has none
(`preprocessing_fields`); `write_vision` writes them back into one.

The encoder (0.4B parameters for so400m) is read whole on each host and then laid out; the LLM is
the part that needs streaming (jaxpar.interop.hf_llama).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jaxpar.config import Config, VisionConfig
from jaxpar.errors import ConfigError
from jaxpar.interop.hf_llama import SafetensorsReader, with_section_from_checkpoint

PREFIX = "vision_model."
LAYER = "encoder.layers.{}."


def vision_fields(directory: str | pathlib.Path) -> dict:
    """VisionConfig fields of the SigLIP vision model in `directory`/config.json (a SiglipVisionModel's
    own config, or a whole SigLIP model's, whose vision_config is used)."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"init.vision_from_hf={directory}: no config.json there; point it at a Hugging Face "
                          f"SigLIP directory")
    hf = json.loads(path.read_text())
    if hf.get("model_type") == "siglip":
        hf = hf.get("vision_config", {})
    elif hf.get("model_type") != "siglip_vision_model":
        raise ConfigError(f"{path}: model_type '{hf.get('model_type')}' is not supported; jaxpar imports SigLIP "
                          f"vision towers (siglip, siglip_vision_model)")
    if hf.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"{path}: hidden_act '{hf['hidden_act']}' is not supported; jaxpar's ViT uses GELU-tanh")
    if float(hf.get("layer_norm_eps", 1e-6)) != 1e-6:
        raise ConfigError(f"{path}: layer_norm_eps={hf['layer_norm_eps']} is not supported; jaxpar's LayerNorm uses 1e-6")
    return dict(width=hf.get("hidden_size", 768), depth=hf.get("num_hidden_layers", 12),
                n_heads=hf.get("num_attention_heads", 12), mlp_dim=hf.get("intermediate_size", 3072),
                image_size=hf.get("image_size", 224), patch_size=hf.get("patch_size", 16),
                channels=hf.get("num_channels", 3), bias=True)


SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)  # SiglipImageProcessor's defaults (IMAGENET_STANDARD_MEAN / STD)
SIGLIP_RESAMPLE = 3  # PIL.Image.BICUBIC, SiglipImageProcessor's default
PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # PIL.Image.Resampling


def preprocessing_fields(directory: str | pathlib.Path) -> dict:
    """vision.image_mean / image_std / resize of the image processor in `directory`/preprocessor_config.json
    (SiglipImageProcessor's fields), or SigLIP's (0.5, 0.5, bicubic) where there is no such file. jaxpar
    always feeds pixels / 255 to the encoder, so a processor that rescales otherwise is refused."""
    path = pathlib.Path(directory) / "preprocessor_config.json"
    hf = json.loads(path.read_text()) if path.is_file() else {}
    if not hf.get("do_rescale", True) or abs(float(hf.get("rescale_factor", 1 / 255)) * 255 - 1) > 1e-6:
        raise ConfigError(f"{path}: do_rescale={hf.get('do_rescale', True)}, rescale_factor="
                          f"{hf.get('rescale_factor', 1 / 255)} is not supported; jaxpar scales pixels by 1/255 "
                          f"before normalising")
    per_channel = lambda v: tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v]))  # noqa: E731
    if hf.get("do_normalize", True):
        mean, std = per_channel(hf.get("image_mean", SIGLIP_MEAN)), per_channel(hf.get("image_std", SIGLIP_STD))
    else:
        mean, std = (0.0,), (1.0,)
    resample = hf.get("resample", SIGLIP_RESAMPLE)
    if resample not in PIL_FILTERS:
        raise ConfigError(f"{path}: resample={resample!r} is not a PIL filter (0-5)")
    return dict(image_mean=mean, image_std=std, resize=PIL_FILTERS[resample])


def with_vision_from_hf(config: Config) -> Config:
    """`config` with vision.* taken from init.vision_from_hf's config.json and preprocessor_config.json
    (conflicts: one line)."""
    directory = config.init.vision_from_hf
    if not directory:
        return config
    fields = {**vision_fields(directory), **preprocessing_fields(directory)}
    return with_section_from_checkpoint(config, "vision", fields, directory)


def load_vision(directory: str | pathlib.Path, cfg: VisionConfig) -> dict:
    """The encoder's weights {"vit": ...} as fp32 numpy in jaxpar's layout (no projector)."""
    if cfg.film:
        raise ConfigError("vision.film adds weights SigLIP does not have; use vision.film=false with "
                          "init.vision_from_hf")
    reader = SafetensorsReader(directory)
    # a whole SigLIP model (and transformers < 5) stores the tower under "vision_model."; a
    # SiglipVisionModel saved by transformers 5 without it
    prefix = PREFIX if reader.has(PREFIX + "embeddings.patch_embedding.weight") else ""
    d, n, f, p, c = cfg.width, cfg.n_heads, cfg.mlp_dim, cfg.patch_size, cfg.channels
    h = d // n
    grid = (cfg.image_size // p) ** 2

    def read(name, shape):
        return reader.read(name, tuple(slice(None) for _ in shape), shape)

    emb = prefix + "embeddings."
    vit = {"patch_embed": read(emb + "patch_embedding.weight", (d, c, p, p)).transpose(2, 3, 1, 0).reshape(-1, d),
           "patch_bias": read(emb + "patch_embedding.bias", (d,)),
           "pos_embed": read(emb + "position_embedding.weight", (grid, d)),
           "final_scale": read(prefix + "post_layernorm.weight", (d,)),
           "final_bias": read(prefix + "post_layernorm.bias", (d,))}

    def block(i):
        name = prefix + LAYER.format(i)
        heads_in = lambda w: read(name + f"self_attn.{w}_proj.weight", (n * h, d)).reshape(n, h, d).transpose(2, 0, 1)  # noqa: E731
        out = {f"w{w}": heads_in(w) for w in "qkv"}
        out.update({f"{w}_bias": read(name + f"self_attn.{w}_proj.bias", (n * h,)).reshape(n, h) for w in "qkv"})
        out.update(wo=read(name + "self_attn.out_proj.weight", (d, n * h)).reshape(d, n, h).transpose(1, 2, 0),
                   o_bias=read(name + "self_attn.out_proj.bias", (d,)),
                   ln1_scale=read(name + "layer_norm1.weight", (d,)), ln1_bias=read(name + "layer_norm1.bias", (d,)),
                   ln2_scale=read(name + "layer_norm2.weight", (d,)), ln2_bias=read(name + "layer_norm2.bias", (d,)),
                   w_in=read(name + "mlp.fc1.weight", (f, d)).T, in_bias=read(name + "mlp.fc1.bias", (f,)),
                   w_out=read(name + "mlp.fc2.weight", (d, f)).T, out_bias=read(name + "mlp.fc2.bias", (d,)))
        return out

    blocks = [block(i) for i in range(cfg.depth)]
    vit["blocks"] = {k: np.stack([b[k] for b in blocks]) for k in blocks[0]}
    return {"vit": vit}


def siglip_config(cfg: VisionConfig) -> dict:
    """config.json of a SiglipVisionModel with `cfg`'s shapes."""
    return {"architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model", "hidden_size": cfg.width,
            "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.n_heads,
            "num_channels": cfg.channels, "image_size": cfg.image_size, "patch_size": cfg.patch_size,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "torch_dtype": "float32"}


def processor_config(cfg: VisionConfig) -> dict:
    """preprocessor_config.json of a SiglipImageProcessor that feeds the encoder as this run did (its
    mean / std / resize; "area" has no PIL filter of its own and is written as bilinear)."""
    resample = {name: code for code, name in PIL_FILTERS.items()}.get(cfg.resize, 2)
    three = lambda v: list(v) * (cfg.channels if len(v) == 1 else 1)  # noqa: E731
    return {"image_processor_type": "SiglipImageProcessor", "do_resize": True, "resample": resample,
            "size": {"height": cfg.image_size, "width": cfg.image_size}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": three(cfg.image_mean),
            "image_std": three(cfg.image_std), "do_convert_rgb": True}


def write_vision(weights: dict, cfg: VisionConfig, out_dir: str | pathlib.Path) -> pathlib.Path:
    """A Hugging Face SiglipVisionModel directory from the encoder's weights ({"vit": ...}, numpy) with
    the run's pixel statistics as preprocessor_config.json (`processor_config`), plus
    projector.safetensors (jaxpar's w1 [width, projector_dim], w2 [projector_dim, llm width]) when
    `weights` has a projector. Needs vision.bias (SigLIP has every bias) and no FiLM."""
    from safetensors.numpy import save_file

    if not cfg.bias or cfg.film:
        raise ConfigError("only an encoder with vision.bias=true and vision.film=false is a SigLIP tower; "
                          "this run's cannot be written as one")
    vit, (d, n, p, c) = weights["vit"], (cfg.width, cfg.n_heads, cfg.patch_size, cfg.channels)
    h = d // n
    emb = "embeddings."
    out = {emb + "patch_embedding.weight": vit["patch_embed"].reshape(p, p, c, d).transpose(3, 2, 0, 1),
           emb + "patch_embedding.bias": vit["patch_bias"], emb + "position_embedding.weight": vit["pos_embed"],
           "post_layernorm.weight": vit["final_scale"], "post_layernorm.bias": vit["final_bias"]}
    blocks = vit["blocks"]
    for i in range(cfg.depth):
        name, b = LAYER.format(i), {k: v[i] for k, v in blocks.items()}
        for w in "qkv":
            out[name + f"self_attn.{w}_proj.weight"] = b[f"w{w}"].transpose(1, 2, 0).reshape(n * h, d)
            out[name + f"self_attn.{w}_proj.bias"] = b[f"{w}_bias"].reshape(n * h)
        out.update({name + "self_attn.out_proj.weight": b["wo"].transpose(2, 0, 1).reshape(d, n * h),
                    name + "self_attn.out_proj.bias": b["o_bias"],
                    name + "layer_norm1.weight": b["ln1_scale"], name + "layer_norm1.bias": b["ln1_bias"],
                    name + "layer_norm2.weight": b["ln2_scale"], name + "layer_norm2.bias": b["ln2_bias"],
                    name + "mlp.fc1.weight": b["w_in"].T, name + "mlp.fc1.bias": b["in_bias"],
                    name + "mlp.fc2.weight": b["w_out"].T, name + "mlp.fc2.bias": b["out_bias"]})
    target = pathlib.Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, target / "model.safetensors",
              metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(siglip_config(cfg), indent=2))
    (target / "preprocessor_config.json").write_text(json.dumps(processor_config(cfg), indent=2))
    if "projector" in weights:
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights["projector"].items()},
                  target / "projector.safetensors", metadata={"format": "jaxpar-projector"})
    return target
