"""Import time, peak host memory and export time of a Hugging Face Llama checkpoint (issue 16).

    python scripts/measure_hf_import.py --layers 4 --dir /tmp/hf_llama7b_shaped

Writes a random Llama-2-7B-shaped checkpoint (d_model 4096, 32 heads, d_ff 11008, vocab 32000,
`--layers` layers; bf16 safetensors shards of 2 GB) unless DIR already has one, then, each in a
fresh process so peak RSS is the import's own:
- 1 process with 8 emulated devices (tp = 8),
- 2 processes with 4 devices each (tp = 8 across them, jax.distributed over loopback),
and reports per process: import seconds, peak RSS, the bytes its devices hold (fp32 master), and the
RSS of the same process before the import (the fixed overhead: Python, JAX, the CPU client). Then
the export time of the loaded weights (one process, fp32 safetensors).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
             num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0)


def rss_bytes(field: str = "VmHWM") -> int:
    """This process's peak (VmHWM) or current (VmRSS) resident memory. (getrusage's ru_maxrss would
    carry the peak of the parent from before exec.)"""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def write_checkpoint(directory: pathlib.Path, layers: int) -> None:
    import jax
    import jax.numpy as jnp
    from safetensors.flax import save_file

    directory.mkdir(parents=True, exist_ok=True)
    d, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    tensors = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                        **{p + f"self_attn.{w}_proj.weight": (d, d) for w in "qkvo"},
                        p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f)})
    shards, current, size = [], {}, 0
    for name, shape in tensors.items():
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > 2 << 30:
            shards.append(current)
            current, size = {}, 0
        current[name], size = shape, size + nbytes
    shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {name: (0.02 * jax.random.normal(jax.random.key(zlib.crc32(name.encode())), shape)).astype(jnp.bfloat16)
                  for name, shape in shard.items()}
        save_file(arrays, directory / filename)
        weight_map.update({name: filename for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
              "torch_dtype": "bfloat16", **SHAPE}
    (directory / "config.json").write_text(json.dumps(config))


def load(directory: str, devices: int, process_id: int, processes: int, port: int, export_to: str) -> dict:
    """One process's import (and, with export_to, the export of what it loaded)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, process_id)
    jax.devices()  # start the backend: its memory is part of the fixed overhead
    before = rss_bytes("VmRSS")
    from jaxpar.interop import hf_llama
    from jaxpar.config import ModelConfig
    from jaxpar.inference.generate import weight_shardings
    from jaxpar.parallel.mesh import Layout

    model = ModelConfig(**hf_llama.model_fields(directory))
    mesh = Layout(dp=1, pp=1, tp=devices * processes).make_mesh()
    start = time.perf_counter()
    weights = hf_llama.load_weights(directory, model, weight_shardings(mesh, model))
    jax.block_until_ready(weights)
    seconds = time.perf_counter() - start
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(weights) for shard in leaf.addressable_shards)
    out = {"process": process_id, "import_s": round(seconds, 1), "peak_rss_gb": round(rss_bytes() / 1e9, 2),
           "rss_before_import_gb": round(before / 1e9, 2), "device_bytes_gb": round(held / 1e9, 2),
           # after the import: anonymous memory (the weights + runtime) vs the checkpoint pages safetensors
           # has mapped (page cache, counted in RSS while mapped, reclaimable)
           "rss_anon_after_gb": round(rss_bytes("RssAnon") / 1e9, 2),
           "rss_file_after_gb": round(rss_bytes("RssFile") / 1e9, 2)}
    if export_to:
        start = time.perf_counter()
        hf_llama.write(jax.device_get(weights), model, export_to, model.max_position)
        out["export_s"] = round(time.perf_counter() - start, 1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/hf_llama7b_shaped")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # devices process_id processes port export
    args = parser.parse_args()
    if args.child:
        devices, pid, processes, port = map(int, args.child[:4])
        print(json.dumps(load(args.dir, devices, pid, processes, port, args.child[4] if args.child[4] != "-" else "")))
        return
    directory = pathlib.Path(args.dir)
    if not (directory / "config.json").is_file():
        write_checkpoint(directory, args.layers)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--dir", str(directory), "--child"]
    one = subprocess.run(cmd + ["8", "0", "1", "0", str(directory) + "_export"], capture_output=True, text=True,
                         env=env, check=True)
    print("1 process x 8 devices:", one.stdout.strip().splitlines()[-1])
    port = free_port()
    procs = [subprocess.Popen(cmd + ["4", str(i), "2", str(port), "-"], stdout=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate()
        print("2 processes x 4 devices:", out.strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e9:.2f} GB of bf16 safetensors in {directory}")


if __name__ == "__main__":
    main()
