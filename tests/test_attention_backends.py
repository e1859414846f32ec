"""model.attention = auto | xla | cudnn: the kernel reaches jax.nn.dot_product_attention, the kernels
available on CPU give today's losses and gradients, and `auto`'s choice (capability check stubbed)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config
from jaxpar.compiler import attention_choice
from jaxpar.compiler.attention_choice import Accelerator, choose_attention, resolve_attention
from jaxpar.config import ConfigError, ModelConfig, VisionConfig, load_config, validate
from jaxpar.data.synthetic import synthetic_batch
from jaxpar.layers import attention as attention_layer
from jaxpar.layers.attention import attention
from jaxpar.layers.collectives import Collectives
from jaxpar.models import llama, vit, vla

REPO = pathlib.Path(__file__).resolve().parent.parent
H100 = Accelerator("gpu", "NVIDIA H100 80GB HBM3", (9, 0), 90800)
A100 = Accelerator("gpu", "NVIDIA A100-SXM4-80GB", (8, 0), 90800)
T4 = Accelerator("gpu", "Tesla T4", (7, 5), 90800)
CPU = Accelerator("cpu", "cpu")
VLA = load_config("vla_tiny")  # LLM sequence 16 + 32 + 6 = 54, prefix-LM, head_dims 16 (LLM) and 16 (ViT)


def replace(config, **groups):
    return dataclasses.replace(config, **{k: dataclasses.replace(getattr(config, k), **v) if isinstance(v, dict)
                                          else v for k, v in groups.items()})


def llm(head_dim=128, precision="bf16", attention="auto"):
    model = ModelConfig(vocab_size=256, d_model=8 * head_dim, n_heads=8, n_kv_heads=4, d_ff=512, attention=attention)
    config = make_config(model=model, precision=precision)
    return config


# ----------------------------------------------------------------------------- the kernel reaches jax

@pytest.fixture
def recorded(monkeypatch):
    """jax.nn.dot_product_attention, and the LLM layer's cuDNN call (jax's kernel with its residuals named,
    jaxpar.layers.attention.cudnn_attention), replaced by a recorder (returns zeros: cuDNN cannot run here)."""
    calls = []

    def fake(q, k, v, bias=None, mask=None, is_causal=False, **kwargs):
        calls.append({"mask": mask is not None, "is_causal": is_causal, **kwargs})
        return jnp.zeros_like(q)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    monkeypatch.setattr(attention_layer, "cudnn_attention",
                        lambda q, k, v, mask=None, **kwargs: fake(q, k, v, mask=mask, implementation="cudnn", **kwargs))
    return calls


def layer0(params):
    return jax.tree.map(lambda w: w[0], params["layers"])


@pytest.mark.parametrize("implementation,expected", [("cudnn", "cudnn"), ("xla", "xla"), ("auto", "xla")])
def test_layer_passes_the_kernel_for_causal_and_prefix_masks(recorded, implementation, expected):
    p = layer0(init_params(make_config()))
    x = jnp.ones((2, 6, TINY_MODEL.d_model))
    attention(x, p, 1e4, Collectives(), implementation=implementation)
    attention(x, p, 1e4, Collectives(), prefix_len=3, implementation=implementation)
    assert recorded == [{"mask": False, "is_causal": True, "implementation": expected},
                        {"mask": True, "is_causal": False, "implementation": expected}]


def test_vit_passes_its_kernel(recorded):
    cfg = VisionConfig(attention="cudnn")
    params = vit.init(cfg, 64, jax.random.key(0))
    vit.encode(params, jnp.zeros((2, 1, cfg.image_size, cfg.image_size, 3)), cfg, Collectives())
    assert recorded == [{"mask": False, "is_causal": False, "implementation": "cudnn"}]  # bidirectional; traced once


def test_llama_passes_model_attention(recorded):
    cfg = dataclasses.replace(TINY_MODEL, attention="cudnn")
    params = init_params(make_config(model=cfg))
    llama.decoder_layer(jnp.ones((2, 6, cfg.d_model)), layer0(params), cfg, Collectives())
    assert [c["implementation"] for c in recorded] == ["cudnn"]


# ----------------------------------------------------------------------------- same numbers as today

def todays_attention(monkeypatch):
    """Route every call through jax.nn.dot_product_attention as the code called it before the kernel
    choice existed (no implementation argument)."""
    original = jax.nn.dot_product_attention

    def without_implementation(*args, implementation=None, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", without_implementation)


def init_params(config):
    """The model's weights (jitted: eager init dispatches one small program per leaf)."""
    def init(key):
        params = llama.init(config.model, key)
        if config.model.kind == "vla":
            params.update(vit.init(config.vision, config.model.d_model, key))
        return params

    return jax.jit(init)(jax.random.key(0))


def loss_and_grads(config, params):
    """Single-program loss and gradients of a few examples (the kernel choice does not depend on the layout)."""
    if config.model.kind == "vla":
        batch = vla.synthetic_batch(config, 0, 4)
        loss = lambda p: vla.loss_sum(p, batch, config)[0]  # noqa: E731
    else:
        batch = synthetic_batch(0, 0, 4, config.train.seq_len, config.model.vocab_size)
        loss = lambda p: llama.loss_sum(p, batch, config.model)[0]  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.device_get(grads)


@pytest.mark.parametrize("base", [make_config(), replace(VLA, model=dict(n_layers=2), vision=dict(depth=1))],
                         ids=["llama (causal)", "vla (prefix-LM + ViT)"])
def test_kernels_available_here_give_todays_loss_and_grads(monkeypatch, base):
    """xla and auto (XLA on CPU) resolve to the same program, whose numbers are exactly today's."""
    devices = jax.devices()[:1]
    resolved = {kind: resolve_attention(replace(base, model=dict(attention=kind)), devices)[0]
                for kind in ("xla", "auto")}
    assert resolved["xla"] == resolved["auto"] and resolved["auto"].model.attention == "xla"
    if base.model.kind == "vla":
        assert resolved["auto"].vision.attention == "xla"
    params = init_params(base)
    loss, grads = loss_and_grads(resolved["auto"], params)
    with monkeypatch.context() as patch:
        todays_attention(patch)
        todays_loss, todays_grads = loss_and_grads(base, params)
    assert loss == todays_loss
    jax.tree.map(np.testing.assert_array_equal, grads, todays_grads)


# ----------------------------------------------------------------------------- auto's choice, stubbed

def test_auto_picks_cudnn_on_a_gpu_with_bf16_and_a_supported_head_dim():
    config, line = choose_attention(llm(128), H100)
    assert config.model.attention == "cudnn"
    assert line.startswith("attention: LLM cudnn (auto: NVIDIA H100") and "head_dim 128" in line
    assert choose_attention(llm(256), H100)[0].model.attention == "cudnn"  # Hopper: up to 256


@pytest.mark.parametrize("config,acc,reason", [
    (llm(128, precision="fp32"), H100, "precision=fp32"),
    (llm(128), CPU, "this run's devices are CPU"),
    (llm(256), A100, "head_dim 256 must be a multiple of 8 and <= 128"),
    (llm(132), H100, "head_dim 132 must be a multiple of 8"),
    (llm(128), T4, "compute capability >= 8.0"),
    (llm(128), Accelerator("gpu", "some GPU", None, None), "no cuDNN found"),
])
def test_auto_falls_back_to_xla_and_says_why(config, acc, reason):
    resolved, line = choose_attention(config, acc)
    assert resolved.model.attention == "xla"
    assert "LLM xla (auto: " in line and reason in line and "\n" not in line


def test_prefix_lm_mask_stays_on_xla_under_auto_and_the_vit_gets_cudnn():
    config = replace(VLA, precision="bf16")
    resolved, line = choose_attention(config, H100)
    assert (resolved.model.attention, resolved.vision.attention) == ("xla", "cudnn")
    assert "LLM xla (auto: the prefix-LM mask" in line and "ViT cudnn (auto:" in line
    causal = choose_attention(replace(config, model=dict(prefix_lm=False)), H100)[0]
    assert causal.model.attention == "cudnn"  # the VLA without a prefix is causal: cuDNN's own mask


def test_explicit_cudnn_takes_the_prefix_mask_as_a_bias_when_the_sequence_is_even():
    config = replace(VLA, precision="bf16", model=dict(attention="cudnn"))
    assert vla.sequence_layout(config)[2] % 2 == 0
    assert choose_attention(config, H100)[0].model.attention == "cudnn"
    odd = replace(config, actions=dict(dims=6))  # 16 + 32 + 5 = 53 tokens
    with pytest.raises(ConfigError, match="even sequence length; the VLA sequence is 53"):
        choose_attention(odd, H100)


def test_vision_attention_overrides_the_encoder_only():
    config = replace(VLA, precision="bf16", model=dict(attention="cudnn", prefix_lm=False),
                     vision=dict(attention="xla"))
    resolved, line = choose_attention(config, H100)
    assert (resolved.model.attention, resolved.vision.attention) == ("cudnn", "xla")
    assert "ViT xla (vision.attention=xla)" in line


@pytest.mark.parametrize("config,acc,fragments", [
    (llm(128, attention="cudnn"), CPU, ["model.attention=cudnn", "devices are CPU", "use model.attention=auto or xla"]),
    (llm(128, precision="fp32", attention="cudnn"), H100, ["precision=fp32"]),
    (llm(256, attention="cudnn"), A100, ["head_dim 256"]),
    (replace(VLA, precision="bf16", model=dict(attention="cudnn", prefix_lm=False), vision=dict(width=60, n_heads=6,
                                                                                                pos_init="normal")),
     H100, ["ViT's attention", "head_dim 10", "vision.attention=xla for the encoder alone"]),
])
def test_explicit_cudnn_that_cannot_run_is_a_one_line_config_error(config, acc, fragments):
    with pytest.raises(ConfigError) as err:
        choose_attention(config, acc)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_resolve_uses_the_capability_check_which_tests_can_stub(monkeypatch):
    mesh = builder_for(make_config(tp=2)).mesh
    assert attention_choice.accelerator(list(mesh.devices.flat)) == Accelerator("cpu", "cpu")
    monkeypatch.setattr(attention_choice, "accelerator", lambda devices: H100)
    assert resolve_attention(llm(128), mesh)[0].model.attention == "cudnn"


def test_the_kernel_is_free_to_change_on_resume():
    """Checkpoints hold weights, which no kernel changes: one written before model.attention existed, or
    under another kernel, restores (the fingerprint leaves the attention fields out)."""
    from jaxpar.parallel.checkpoint import _model_fingerprint, fingerprint_mismatch

    saved = json.loads(json.dumps(_model_fingerprint(VLA)))
    assert "attention" not in saved["model"] and "attention" not in saved["vision"]
    other_kernels = replace(VLA, model=dict(attention="cudnn"), vision=dict(attention="xla"))
    assert fingerprint_mismatch(saved, other_kernels) is None
    saved["model"]["attention"], saved["vision"]["attention"] = "xla", "cudnn"  # a resolved config's metadata
    assert fingerprint_mismatch(saved, VLA) is None


def test_every_config_value_maps_to_a_jax_kernel():
    from jaxpar.config import ATTENTION_KINDS
    from jaxpar.layers.attention import kernel

    assert [kernel(k) for k in ATTENTION_KINDS] == ["xla", "xla", "cudnn"]  # auto unresolved: XLA, runs anywhere
    with pytest.raises(ValueError, match="'flash' is unknown"):
        kernel("flash")


def test_unknown_attention_values_are_config_errors():
    for groups, key in ((dict(model=dict(attention="flash")), "model.attention='flash'"),
                        (dict(vision=dict(attention="fa2")), "vision.attention='fa2'")):
        with pytest.raises(ConfigError, match=key + " is unknown; use one of auto, xla, cudnn"):
            validate(replace(make_config(), **groups))


def test_cudnn_on_cpu_is_refused_by_the_cli_in_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", "llama_tiny.py",
                           "--config.model.attention=cudnn", "--config.data.train=", "--config.data.eval=",
                           "--config.data.generate=false", "--workdir", str(tmp_path / "wd")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr  # one line, and nothing was compiled
    assert lines[0].startswith("jaxpar: error: model.attention=cudnn cannot run the LLM's attention here: ")
    assert "devices are CPU" in lines[0] and "use model.attention=auto or xla" in lines[0]


def test_under_context_parallelism_the_vlas_prefix_takes_cudnn_and_the_line_says_blocks():
    """Under cp every kernel call is a causal or unmasked block, the prefix included (jaxpar.layers.ring):
    no bias reaches cuDNN, so `auto` gives the LLM cuDNN and says what its calls are."""
    config = replace(VLA, precision="bf16", mesh=dict(cp=2))
    resolved, line = choose_attention(config, H100)
    assert (resolved.model.attention, resolved.vision.attention) == ("cudnn", "cudnn")
    assert "causal mask or none (never a bias)" in line and "\n" not in line
    ulysses = replace(VLA, precision="bf16", mesh=dict(cp=2, cp_strategy="ulysses"))  # one device's masks, heads split
    assert choose_attention(ulysses, H100)[0].model.attention == "xla"
