"""Which attention kernel a run uses: `model.attention` = auto | xla | cudnn, resolved once at start.

Why here and not in the layers: the choice depends on the devices (an NVIDIA GPU with cuDNN, its
compute capability), which the model math must not look at (it stays mesh- and device-free). So the
training entry points call `resolve_attention(config, devices)` when the step is built; it returns
the config with `model.attention` and `vision.attention` set to "xla" or "cudnn" (plain data the
layers read: jaxpar.layers.attention.kernel) and the one line saying what was chosen and why.

What cuDNN flash attention needs, read from jax 0.10.2 (jax/_src/nn/functions.py and
jax/_src/cudnn/fused_attention_stablehlo.py: check_layout, check_is_flash_attention):
- an NVIDIA GPU with cuDNN (jaxlib's CUDA plugin); Ampere (sm80) or newer for flash attention, and
  cuDNN >= 9.11 on sm103;
- query / key / value in bf16 or fp16 (precision=fp32 computes in fp32: not supported);
- head_dim a multiple of 8 and <= 128, or <= 256 on Hopper (sm90) and newer;
- masks: causal and no mask are kernel mask types (the causal one skips the masked blocks). Any
  other boolean mask, such as the VLA's prefix-LM mask, is turned by jax into a dense additive
  bias (bf16 [1, 1, S, S]) under mask type NO_MASK; with a bias, training needs even sequence
  lengths. jax always asks the backward for the bias gradient, which cuDNN does not compute for a
  [1, 1, S, S] bias (XLA leaves it out; ours comes from a constant mask and is dropped).
So cuDNN can express the prefix-LM mask, at the price of computing every block (no causal
skipping) and reading an S x S bias, on a path not yet run on a GPU here; at VLA sequence lengths
(a few hundred tokens) attention is ~1% of the step, so `auto` keeps XLA for it and `cudnn` asked
for explicitly uses it. The ViT (bidirectional, no mask) and the causal LLM get cuDNN under `auto`.
Under context parallelism every kernel call is a causal or an unmasked block, the VLA's prefix included
(jaxpar.layers.ring, jaxpar.layers.attention.context_attention), so `auto` gives the LLM cuDNN there too.
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import Config, patches_per_image
from jaxpar.errors import ConfigError
from jaxpar.models import vla


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What the capability check found: the devices' platform and, on NVIDIA GPUs, their compute
    capability and the cuDNN version jaxlib loads (None where there is none)."""

    platform: str  # jax's: "gpu", "cpu", "tpu"
    device_kind: str = ""
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None  # e.g. 90800 for 9.8.0


@dataclasses.dataclass(frozen=True)
class Site:
    """One place attention runs: the LLM or the ViT, with what cuDNN's constraints depend on."""

    name: str  # "LLM" or "ViT"
    key: str  # the config key that asked: model.attention or vision.attention
    dtype: str  # "bf16" or "fp32" (the compute dtype)
    head_dim: int
    seq_len: int
    mask: str  # "causal", "prefix" (the VLA's prefix-LM mask: a dense bias), "none" or "cp" (causal / unmasked blocks)


def accelerator(devices) -> Accelerator:
    """The capability check (tests stub it): platform, compute capability and cuDNN version of the
    run's devices. Only asks the already-initialised devices and jaxlib; compiles nothing."""
    device = devices[0]
    platform = device.platform
    if platform != "gpu":
        return Accelerator(platform, device.device_kind)
    capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA devices; absent on ROCm
    cc = tuple(int(x) for x in str(capability).split(".")[:2]) if capability else None
    try:
        from jax._src.lib import cuda_versions  # None without jaxlib's CUDA plugin
        cudnn = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 - a plugin without the query counts as "no cuDNN found"
        cudnn = None
    return Accelerator(platform, device.device_kind, cc, cudnn)


def sites(config: Config) -> list[Site]:
    """The LLM's attention and, for a VLA, the ViT's."""
    dtype = "bf16" if config.bf16_compute else "fp32"
    model = config.model
    if model.kind == "vla":
        seq, mask = vla.sequence_layout(config)[2], "prefix" if model.prefix_lm else "causal"
        if vla.prefix_len(config) >= seq:  # action chunks: every position sees every other (jaxpar.layers.attention)
            mask = "none"
    else:
        seq, mask = config.train.seq_len, "causal"
    if config.mesh.cp > 1 and config.mesh.cp_strategy != "ulysses" and mask != "none":  # jaxpar.layers.ring: causal
        mask = "cp"  # or unmasked blocks, a prefix-LM's prefix unmasked beside (ulysses: one device's call on 1/cp of
        # the heads; a whole-sequence prefix: one unmasked call against the gathered keys, no block)
    out = [Site("LLM", "model.attention", dtype, model.head_dim, seq, mask)]
    if model.kind == "vla":
        v = config.vision
        key = "vision.attention" if v.attention else "model.attention"
        out.append(Site("ViT", key, dtype, v.width // v.n_heads, patches_per_image(v), "none"))
    return out


def cudnn_problem(site: Site, acc: Accelerator) -> str | None:
    """Why cuDNN flash attention cannot run `site` on `acc` (one clause), or None when it can."""
    if acc.platform != "gpu":
        return f"cuDNN flash attention needs an NVIDIA GPU and this run's devices are {acc.platform.upper()}"
    if acc.cudnn_version is None or acc.compute_capability is None:
        return f"no cuDNN found for the {acc.device_kind} GPUs (install jaxlib's CUDA plugin: jax[cuda12])"
    cc = acc.compute_capability
    if cc < (8, 0):
        return (f"cuDNN flash attention needs compute capability >= 8.0 (Ampere) and {acc.device_kind} "
                f"is {cc[0]}.{cc[1]}")
    if cc == (10, 3) and acc.cudnn_version < 91100:
        return f"compute capability 10.3 needs cuDNN >= 9.11, found {acc.cudnn_version}"
    if site.dtype != "bf16":
        return "cuDNN flash attention takes bf16/fp16 inputs and precision=fp32 computes in float32"
    limit = 256 if cc >= (9, 0) else 128
    if site.head_dim % 8 or site.head_dim > limit:
        return (f"the {site.name}'s head_dim {site.head_dim} must be a multiple of 8 and <= {limit} "
                f"on compute capability {cc[0]}.{cc[1]}")
    if site.mask == "prefix" and site.seq_len % 2:
        return (f"the prefix-LM mask reaches cuDNN as a bias, and training with a bias needs an even sequence "
                f"length; the VLA sequence is {site.seq_len}")
    return None


def _choose(site: Site, asked: str, acc: Accelerator) -> tuple[str, str]:
    """(kernel, reason) for one site; an explicit cudnn that cannot run is a ConfigError."""
    if asked == "xla":
        return "xla", f"{site.key}=xla"
    problem = cudnn_problem(site, acc)
    if asked == "cudnn":
        if problem:
            alone = ", or vision.attention=xla for the encoder alone" if site.name == "ViT" \
                and site.key == "model.attention" else ""
            raise ConfigError(f"{site.key}=cudnn cannot run the {site.name}'s attention here: {problem}; "
                              f"use {site.key}=auto or xla{alone}")
        return "cudnn", f"{site.key}=cudnn"
    if problem:
        return "xla", f"auto: {problem}"
    if site.mask == "prefix":
        return "xla", ("auto: the prefix-LM mask would reach cuDNN as a dense bias (no block skipping, not yet run "
                       "on a GPU here); model.attention=cudnn uses it")
    cc = acc.compute_capability
    masks = {"none": "no mask", "causal": "causal mask",
             "cp": "context parallelism's blocks under the causal mask or none (never a bias)"}
    return "cudnn", (f"auto: {acc.device_kind} sm{cc[0]}{cc[1]}, cuDNN {acc.cudnn_version}, bf16, "
                     f"head_dim {site.head_dim}, {masks[site.mask]}")


def fp8_problem(acc: Accelerator) -> str | None:
    """Why `acc` cannot run precision=fp8's GEMMs (one clause), or None. FP8 tensor cores start at compute
    capability 8.9 (Ada; Hopper 9.0); XLA:CPU computes the FP8 GEMMs by upcasting (the tests' meshes)."""
    if acc.platform != "gpu":
        return None
    cc = acc.compute_capability
    if cc is None or cc < (8, 9):
        found = f"is {cc[0]}.{cc[1]}" if cc else "reports none"
        return (f"precision=fp8 needs FP8 tensor cores (compute capability 8.9 or newer: H100, H200, L40S) and "
                f"{acc.device_kind} {found}")
    return None


def choose_attention(config: Config, acc: Accelerator) -> tuple[Config, str]:
    """The config with every attention kernel resolved for `acc`, and the one line saying so. Also where
    the devices refuse precision=fp8 (`fp8_problem`): the one capability check at start, and the planner's."""
    if config.precision == "fp8" and (problem := fp8_problem(acc)):
        raise ConfigError(f"{problem}; use precision=bf16")
    asked = {"LLM": config.model.attention, "ViT": config.vision.attention or config.model.attention}
    chosen, parts = {}, {}
    for site in sites(config):
        chosen[site.name], reason = _choose(site, asked[site.name], acc)
        parts.setdefault(f"{chosen[site.name]} ({reason})", []).append(site.name)  # one entry when both agree
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention=chosen["LLM"]))
    if "ViT" in chosen:
        config = dataclasses.replace(config, vision=dataclasses.replace(config.vision, attention=chosen["ViT"]))
    return config, "attention: " + "; ".join(f"{' and '.join(names)} {what}" for what, names in parts.items())


def resolve_attention(config: Config, devices) -> tuple[Config, str]:
    """`choose_attention` for the run's devices (a sequence of devices, or a Mesh)."""
    if hasattr(devices, "devices"):  # a Mesh
        devices = list(devices.devices.flat)
    return choose_attention(config, accelerator(list(devices)))
