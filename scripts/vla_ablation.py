"""Single-device ablations of the vla_tiny task: what limits how fast the VLA learns (docs/vla_tiny.md).

Trains the vla_tiny model (jaxpar's own model and optimizer code, one device, no mesh) on episodes made
in memory, and prints held-out and train accuracy of the two move dims every --every steps. Variants
of the task take one flag each: --objects 1 (nothing to bind: one square), --colour red (three squares,
always the red one named: no need to read the instruction). Config overrides go last, as in train:

    python scripts/vla_ablation.py --steps 1500 --objects 1 vision.pos_init=normal
    python scripts/vla_ablation.py --steps 3000 train.lr=2e-3
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.config import load_config
from jaxpar.data.episodes import make_episode, make_scene, scene_key
from jaxpar.data.instructions import InstructionEncoder
from jaxpar.data.pipeline import episode_batch
from jaxpar.layers.collectives import Collectives
from jaxpar.parallel.mesh import Layout
from jaxpar.models import llama, vla
from jaxpar.parallel.optim import make_optimizer
from jaxpar.parallel.step import StepBuilder

SINGLE_DEVICE = ["mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1", "vision.zero.stage=0"]


def episodes(config, count: int, seed: int, objects: int, colour: str | None, exclude=frozenset()):
    """Records of `count` episodes of distinct scenes not in `exclude` (with one object there are only
    96 scenes, so they repeat and only the start cell differs)."""
    rng, keys, written = np.random.default_rng(seed), set(), 0
    steps = {"images": [], "instruction": [], "actions": []}
    while written < count:
        squares, target = make_scene(rng, 4, objects)
        key = scene_key(squares, target)
        if (colour and squares[target][0] != colour) or (objects > 1 and (key in exclude or key in keys)):
            continue
        keys.add(key)
        written += 1
        episode = make_episode(rng, squares, target, size=config.vision.image_size)
        text = InstructionEncoder.for_config(config).llm_ids(episode["instruction"], "generated episode")
        for step in range(len(episode["actions"])):
            steps["images"].append(episode["images"][step])
            steps["instruction"].append(text)
            steps["actions"].append(episode["actions"][step])
    return {k: np.stack(v) for k, v in steps.items()}, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--objects", type=int, default=3)
    parser.add_argument("--colour", default=None, help="always name this colour (no instruction reading)")
    parser.add_argument("--episodes", type=int, default=4000)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.lr=2e-3")
    args = parser.parse_args()
    config = load_config("vla_tiny", SINGLE_DEVICE + [f"train.steps={args.steps}"] + args.overrides)
    train, seen = episodes(config, args.episodes, 0, args.objects, args.colour)
    heldout, _ = episodes(config, 100, 1_000_003, args.objects, args.colour, exclude=seen)
    heldout_batch = episode_batch(config, heldout)
    train_probe = episode_batch(config, {k: v[:400] for k, v in train.items()})
    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    params = jax.device_get(builder.init_state(config.train.seed).params)
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)

    def loss(p, batch):
        total, count = vla.loss_sum(p, batch, config)
        return total / count

    @jax.jit
    def step(p, state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    @jax.jit
    def predictions(p, batch):
        x = vla.llm_inputs(p, vla.encode_images(p, batch, config), batch["inputs"], Collectives())
        x = llama.run_layers(x, p["layers"], config.model, Collectives(), prefix_len=vla.prefix_len(config))
        return jnp.argmax(llama.head_logits(p, x, config.model, Collectives()), -1)

    def move_accuracy(p, batch):
        dims = config.actions.dims
        hits = np.asarray(predictions(p, batch))[:, -dims:] == batch["targets"][:, -dims:]
        return hits.mean(), hits[:, :2].mean(0)

    rng, start, size = np.random.default_rng(0), time.time(), config.train.global_batch_size
    print(f"{len(train['actions'])} train / {len(heldout['actions'])} held-out steps", flush=True)
    for i in range(1, args.steps + 1):
        rows = rng.integers(0, len(train["actions"]), size)
        params, opt_state, value = step(params, opt_state, episode_batch(config, {k: v[rows] for k, v in train.items()}))
        if i % args.every == 0:
            accuracy, moves = move_accuracy(params, heldout_batch)
            _, train_moves = move_accuracy(params, train_probe)
            print(f"step {i} loss {float(value):.3f} held-out accuracy {accuracy:.3f} moves {moves.round(3)} "
                  f"train moves {train_moves.round(3)} {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
