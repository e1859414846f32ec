"""The XLA flags jaxpar sets on GPUs: communication / computation overlap, merged into XLA_FLAGS.

    python -m jaxpar.compiler.xla_flags [--gpu]   # print XLA_FLAGS as jaxpar would run with it (scripts/slurm uses it)

Why a bundle: XLA's GPU defaults leave most collectives unoverlapped, and the overlap is the
cheapest large win in the seed's measurements (section 6.4: 820 -> 1130 -> 1280 tokens/s/GPU).
The flags follow the JAX GPU performance tips, NVIDIA JAX-Toolbox's GPU_performance.md and
MaxText's A3 (H100) Llama-2 configs; every name is checked against this jaxlib by the tests (XLA
aborts on an unknown flag). Each entry says what it buys in jaxpar.

Rules:
- Applied only when the run will be on GPUs, decided without starting a JAX backend (XLA reads
  XLA_FLAGS once, when the first backend starts): if JAX_PLATFORMS is set, its first entry must be
  `cuda` or `gpu`; otherwise a CUDA PJRT plugin must be importable (jax[cuda12] / jax[cuda13]) and an
  NVIDIA device node (/dev/nvidia0, ...) present, with CUDA_VISIBLE_DEVICES not hiding every GPU.
  JAXPAR_XLA_BUNDLE=0 turns the bundle off.
- A flag the user already set in XLA_FLAGS wins: the bundle never overrides a name it finds there
  (whatever the value); the other bundle flags are still added.
- The merged value is printed once at start (process 0).

Not in the bundle: XLA's windowed einsum (`xla_gpu_threshold_for_windowed_einsum_mib`,
`xla_gpu_multi_streamed_windowed_einsum`). It rewrites dots that XLA's SPMD partitioner places, and
jaxpar's tensor-parallel collectives are written by hand in the shard_map: with both flags the
GPU-compiled llama7b tp 8 + sequence parallelism step is the same program. jaxpar decomposes them itself
(mesh.collective_matmul, jaxpar.layers.collective_matmul; issue 46).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

MIB = 2 ** 20

# (flag name, value, why) -- the documented bundle.
GPU_BUNDLE: tuple[tuple[str, str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule async collectives early and their waits late, so NCCL runs under independent compute"),
    ("xla_gpu_enable_highest_priority_async_stream", "true",
     "collectives' stream at the highest priority, so overlapped compute kernels do not starve them"),
    ("xla_gpu_enable_pipelined_all_gather", "true",
     "in the layer scan, start layer i+1's ZeRO-3 weight all-gather during layer i (prefetch)"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true",
     "in the backward scan, finish layer i's ZeRO-2/3 gradient reduce-scatter during layer i-1"),
    ("xla_gpu_enable_pipelined_all_reduce", "true",
     "likewise for an all-reduce a scan iteration produces but does not consume (e.g. a gradient sum)"),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "unroll scans by two so a pipelined collective's buffer is not the one the current iteration reads"),
    ("xla_gpu_all_reduce_combine_threshold_bytes", str(128 * MIB),
     "fuse small all-reduces (norm weights, ZeRO-0/1 gradients) into up to 128 MiB NCCL calls"),
    ("xla_gpu_all_gather_combine_threshold_bytes", str(128 * MIB),
     "fuse a layer's ZeRO-3 weight gathers into one NCCL call (MaxText A3 value)"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(64 * MIB),
     "fuse a layer's gradient reduce-scatters likewise (MaxText A3 value)"),
    ("xla_gpu_enable_all_gather_combine_by_dim", "false",
     "combine gathers over different dims too: ZeRO shards each weight on its own d_model dim"),
    ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false",
     "combine reduce-scatters over different dims too, for the same reason"),
)


def flag_name(token: str) -> str:
    """'--xla_foo=1' -> 'xla_foo' (also '--xla_foo' and '-xla_foo')."""
    return token.lstrip("-").split("=", 1)[0]


def bundle_tokens() -> list[str]:
    return [f"--{name}={value}" for name, value, _ in GPU_BUNDLE]


def merge(user_flags: str, bundle: list[str] | None = None) -> tuple[str, list[str], list[str]]:
    """(merged XLA_FLAGS, bundle flags added, user flags that took a bundle flag's place).

    The bundle goes first and the user's flags after, unchanged; a bundle flag whose name the user
    already set is left out, so the user's value is the only one XLA sees."""
    bundle = bundle_tokens() if bundle is None else bundle
    user = user_flags.split()
    names = {flag_name(token) for token in user}
    added = [token for token in bundle if flag_name(token) not in names]
    bundle_names = {flag_name(token) for token in bundle}
    kept = [token for token in user if flag_name(token) in bundle_names]
    return " ".join(added + user), added, kept


def _cuda_plugin_importable() -> bool:
    for module in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):  # a missing parent package
            continue
    return False


def runs_on_gpu(environ=os.environ) -> tuple[bool, str]:
    """Whether JAX will pick GPUs, decided without starting a backend (module docstring), and why."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return first in ("cuda", "gpu"), f"JAX_PLATFORMS={platforms}"
    if not _cuda_plugin_importable():
        return False, "no CUDA plugin for jaxlib is installed"
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False, f"CUDA_VISIBLE_DEVICES='{environ['CUDA_VISIBLE_DEVICES']}' hides every GPU"
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False, "no NVIDIA device node (/dev/nvidia0, ...)"
    return True, "a CUDA plugin and NVIDIA devices are present"


def apply_gpu_bundle(environ=os.environ, announce=None, force: bool = False) -> str | None:
    """Merge the bundle into environ['XLA_FLAGS'] when the run will be on GPUs (`force`: compiled for
    GPUs, as the GPU dry run is); returns the line that says so (also passed to `announce`), or None
    when nothing was applied. Call before JAX starts."""
    if environ.get("JAXPAR_XLA_BUNDLE", "1").lower() in ("0", "false", "off"):
        return None
    on_gpu = force or runs_on_gpu(environ)[0]
    if not on_gpu:
        return None
    merged, added, kept = merge(environ.get("XLA_FLAGS", ""))
    environ["XLA_FLAGS"] = merged
    line = f"jaxpar: XLA flags for GPUs (jaxpar/compiler/xla_flags.py): {' '.join(added) or '(none added)'}"
    if kept:
        line += f"; yours kept: {' '.join(kept)}"
    if announce is not None:
        announce(line)
    return line


def main(argv: list[str] | None = None) -> int:
    """Print XLA_FLAGS merged with the bundle (`--gpu`: whatever this machine is), for shell scripts."""
    argv = sys.argv[1:] if argv is None else argv
    force = "--gpu" in argv
    if force or runs_on_gpu()[0]:
        print(merge(os.environ.get("XLA_FLAGS", ""))[0])
    else:
        print(os.environ.get("XLA_FLAGS", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
