"""Step time of the optimizer update on the host (offload.update=host) against today's move-to-the-device
update (offload.update=device) and no offload, as ratios measured in one run on XLA:CPU.

    python scripts/measure_host_update.py [--d_model 512] [--n_layers 4] [--steps 8]

On XLA:CPU "host" and "device" are the same memory and the same cores, so the ratio shows what the host
update costs in program structure (the copies it drops, the select that replaces the NaN guard's cond),
not what a GPU would gain: there the device update also pays PCIe both ways for the whole state
(jaxpar.planner models it). Layout: dp=2 x tp=2, ZeRO-1, bf16 (fp32 master + Adam state offloaded).
"""

from __future__ import annotations

import argparse
import time

from jaxpar.parallel.mesh import emulate_cpu_devices

emulate_cpu_devices(4)

import jax  # noqa: E402

from jaxpar.config import Config, MeshConfig, ModelConfig, OffloadConfig, TrainConfig, ZeroConfig, validate  # noqa: E402
from jaxpar.data.synthetic import synthetic_batch  # noqa: E402
from jaxpar.parallel.mesh import Layout  # noqa: E402
from jaxpar.parallel.step import StepBuilder  # noqa: E402


def config_for(args, offload: OffloadConfig) -> Config:
    model = ModelConfig(vocab_size=1024, d_model=args.d_model, n_layers=args.n_layers, n_heads=8, n_kv_heads=8,
                        d_ff=4 * args.d_model)
    config = Config(mesh=MeshConfig(dp=2, tp=2), zero=ZeroConfig(stage=1), precision="bf16", model=model,
                    train=TrainConfig(steps=args.steps, global_batch_size=4, seq_len=64, lr=1e-3, warmup_steps=0),
                    offload=offload)
    validate(config)
    return config


def seconds_per_step(config: Config, steps: int) -> float:
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    state, step = builder.init_state(0), builder.jit_train_step()
    t = config.train
    batch = jax.device_put(synthetic_batch(0, 0, t.global_batch_size, t.seq_len, config.model.vocab_size),
                           builder.batch_sharding())
    for _ in range(2):  # compile and warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    rows = {"no offload": OffloadConfig(), "offload.update=device": OffloadConfig(optimizer=True),
            "offload.update=host": OffloadConfig(optimizer=True, update="host")}
    times = {name: seconds_per_step(config_for(args, offload), args.steps) for name, offload in rows.items()}
    base = times["no offload"]
    print(f"| layout (d_model {args.d_model}, {args.n_layers} layers, dp2 x tp2 ZeRO-1 bf16) | step / no offload |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
