"""Closed-loop evaluation of a VLA run on the procedural task: the model's actions drive the
environment (jaxpar.robot.env) until it reaches the named square, on scenes it never trained on.

    python -m jaxpar.rollout --workdir W --scenes N [--max_steps K] [--seed S] [--checkpoint_step N]
        [--execute K] [--gif PATH] [--gif_scenes 4] [--json]

Held-out token accuracy says how often the model copies the expert's next action; a rollout says
whether its own mistakes compound: each step's frame comes from where its previous actions led.
The N scenes are drawn from --seed, skipping every scene (squares + named square) recorded in the
run's data.train/scenes.jsonl; all N are stepped as one batch through the model (one device, a KV
cache: jaxpar.inference.decode.predict_actions) for at most --max_steps steps (default 2 x grid: the
expert needs at most grid). It reports the success rate and the mean steps to success, next to the
expert's steps on the same scenes and the success rate of uniform random actions (chance).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import numpy as np

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.robot.closed_loop import step_closed_loop
from jaxpar.robot.env import TaskEnv, TaskShape, draw_scenes, expert_steps, random_policy, split_task
from jaxpar.errors import ConfigError

USAGE = ("--workdir W --scenes N [--max_steps K] [--seed S] [--checkpoint_step N] [--execute K] [--gif PATH] "
         "[--gif_scenes 4] [--json]")
SEED_SALT = 7_919  # held-out scenes from --seed S differ from a data split written with seed S
GIF_TILE = 128  # pixels a scene is upscaled to (nearest), so a 16-pixel frame is visible
GIF_CAPTION = 14  # pixels of caption under each tile
GIF_BORDER = {"running": (90, 90, 90), "success": (40, 200, 60), "failure": (220, 40, 40)}


def run_rollouts(policy, scenes: list[dict], max_steps: int, shape: TaskShape = TaskShape(), frames: int = 0) -> dict:
    """Step `policy` on every scene at once until all succeed or `max_steps` steps.

    `policy(images uint8 [B, cameras, H, W, 3], instructions: B strings) -> float [B, dims]` (a model
    encodes the words as its training did: model_policy) sees all scenes each step (finished ones
    too: a fixed batch keeps one compiled
    shape). A policy that returns a chunk [B, H, dims] is called once per H steps, which run open
    loop; `policy_calls` counts the calls and `actions_per_second` the steps of all scenes per second.
    Returns success_rate, mean_steps (over the successes; nan without any),
    expert_mean_steps (the expert's on those same scenes), per-scene `success` [B] and `steps` [B]
    (-1: never), `trajectories` int [T + 1, B, 2] (effector cells), `colours` (the named squares'),
    `seconds`, and with `frames` > 0 the camera-0 `frames` uint8 [T + 1, frames, H, W, 3] of the
    first `frames` scenes (T: the steps taken, fewer than max_steps once every scene is done)."""
    env = TaskEnv(shape, scenes)
    path, recorded, start = [env.effector.copy()], [], time.perf_counter()
    taken, calls = step_closed_loop(env, policy, max_steps, frames, recorded,
                                    after_step=lambda: path.append(env.effector.copy()))
    success = env.done.copy()
    expert = np.array([expert_steps(scene) for scene in scenes])
    result = {"success_rate": float(success.mean()), "success": success, "steps": env.steps.copy(),
              "mean_steps": float(env.steps[success].mean()) if success.any() else float("nan"),
              "expert_mean_steps": float(expert[success].mean()) if success.any() else float("nan"),
              "trajectories": np.stack(path), "colours": env.colours, "seconds": time.perf_counter() - start,
              "policy_calls": calls, "actions_per_second": taken * len(scenes) / (time.perf_counter() - start)}
    if frames:
        result["frames"] = np.stack(recorded)
    return result


def model_policy(config, weights, predict=None, place=None):
    """A VLA's greedy actions as a policy: the uint8 images as rendered (the encoder scales them on the
    device, jaxpar.models.vit.normalise, as in training) and the instruction encoded as the training
    pipeline encodes it (jaxpar.data.instructions), action tokens de-tokenised to bin centres.
    `weights`: a dict as jaxpar.inference.loader.restore_weights returns (host numpy: put on the
    default device once) or jax arrays already placed, in model layer order. The decoder is jitted
    once; each batch size compiles once. The training loop may pass its own jitted `predict` and
    `place` (host arrays -> global arrays) to run on the training layout (TrainingRollouts). A chunk comes back
    cut to its first `actions.execute` steps when that is set (a receding horizon: the closed loop runs what it
    gets, then calls again)."""
    import jax

    from jaxpar.data.instructions import InstructionEncoder
    from jaxpar.inference import decode
    from jaxpar.models import vla

    if config.model.kind != "vla":
        raise ConfigError(f"rollouts need a VLA; this config is a {config.model.kind}")
    if not all(isinstance(w, jax.Array) for w in jax.tree.leaves(weights)):
        weights = jax.device_put(weights, jax.devices()[0])
    predict = predict or jax.jit(decode.predict_actions, static_argnums=3)
    place = place or (lambda array: array)
    tokenizer = vla.ActionTokenizer(config.actions, config.model.vocab_size)
    encoder, encoded = InstructionEncoder.for_config(config), {}

    def policy(images: np.ndarray, instructions: list[str], state: np.ndarray | None = None) -> np.ndarray:
        key = tuple(instructions)
        if key not in encoded:  # the same scenes' words every step
            arrays = encoder.encode_batch(instructions, "the rollout task")
            encoded[key] = tuple(None if a is None else place(a) for a in arrays)
        pixels = place(np.asarray(images, np.uint8))  # the encoder scales them (jaxpar.models.vit.normalise)
        if config.vision.state_dims and state is None:
            raise ValueError(f"vision.state_dims={config.vision.state_dims}: this policy reads the robot's state; "
                             f"pass it (the closed loop does: policy.reads_state)")
        # the state only where the model reads it, so a predict of the 5 arguments before it still serves
        reads = (place(np.asarray(state, np.float32)),) if config.vision.state_dims else ()
        out = np.asarray(predict(weights, pixels, encoded[key][0], config, encoded[key][1], *reads)[0])
        if config.actions.parallel_slots:  # [B, H x dims] step-major -> [B, H, dims]
            out = out.reshape(out.shape[0], config.actions.chunk, config.actions.dims)
        if config.actions.continuous:  # the actions themselves
            out = out.astype(np.float32)[:, 0] if config.actions.chunk == 1 else out.astype(np.float32)
        else:
            out = np.asarray(tokenizer.from_bins(tokenizer.tokens_to_bins(out)), np.float32)
        return out[:, :config.actions.steps_per_call] if out.ndim == 3 else out  # actions.execute: a receding horizon

    policy.reads_state = bool(config.vision.state_dims)
    return policy


# ----------------------------------------------------------------------------- GIF


def write_gif(path: pathlib.Path, result: dict, frame_ms: int = 400) -> None:
    """The recorded rollouts side by side, upscaled (nearest), each framed grey while it runs, green
    from the step it succeeds, red on the last frame if it failed, captioned with the named colour
    (the frame alone does not say which square is the goal), or with result["labels"] where given (Meta-World:
    the task)."""
    from PIL import Image, ImageDraw

    frames = result["frames"]
    shown = frames.shape[1]
    steps, success = result["steps"][:shown], result["success"][:shown]
    colours = result.get("labels", result.get("colours"))[:shown]
    scale = max(1, GIF_TILE // frames.shape[2])
    border, gap = max(2, scale // 2), 4
    width = frames.shape[3] * scale + 2 * (border + gap)
    images = []
    for t, row in enumerate(frames):
        last, tiles, captions = t == len(frames) - 1, [], []
        for j, frame in enumerate(row):
            state = "success" if success[j] and t >= steps[j] else "failure" if last and not success[j] else "running"
            big = frame.repeat(scale, axis=0).repeat(scale, axis=1)
            tile = np.pad(big, ((border, border), (border, border), (0, 0)))
            tile[:border], tile[-border:], tile[:, :border], tile[:, -border:] = (GIF_BORDER[state],) * 4
            tiles.append(np.pad(tile, ((gap, gap + GIF_CAPTION), (gap, gap), (0, 0)), constant_values=255))
            outcome = {"success": f"done in {steps[j]}", "failure": "failed", "running": f"step {t}"}[state]
            captions.append(f"{colours[j]}: {outcome}")
        image = Image.fromarray(np.concatenate(tiles, axis=1))
        draw = ImageDraw.Draw(image)
        for j, caption in enumerate(captions):
            draw.text((j * width + gap, image.height - GIF_CAPTION), caption, fill=(0, 0, 0))
        images.append(image)
    durations = [frame_ms] * (len(images) - 1) + [frame_ms * 5]  # hold the outcome
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str]):
    parser = OneLineArgumentParser(prog="python -m jaxpar.rollout", usage_hint=USAGE)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--scenes", type=int, required=True)
    parser.add_argument("--max_steps", type=int, default=None)  # default: 2 x grid
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint_step", type=int, default=None)  # default: the latest checkpoint
    parser.add_argument("--execute", type=int, default=None)  # steps of each chunk per call; default: actions.execute
    parser.add_argument("--gif")
    parser.add_argument("--gif_scenes", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.scenes < 1 or (args.max_steps is not None and args.max_steps < 1) or args.gif_scenes < 1:
        raise ConfigError("--scenes, --max_steps and --gif_scenes must be >= 1")
    return args


def run_config(workdir: pathlib.Path, execute: int | None = None):
    """The run's Config, read before any checkpoint is restored, so a wrong run fails at once; `execute` (--execute)
    replaces its actions.execute: how a chunk runs is the rollout's choice, not the weights'."""
    from jaxpar.config import Config, from_dict

    path = workdir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found; --workdir must be a jaxpar run's directory")
    config = from_dict(Config, json.loads(path.read_text()))
    if config.model.kind != "vla":
        raise ConfigError(f"{workdir} trained a {config.model.kind}; rollouts need a VLA run (model.kind=vla)")
    if execute is None:
        return config
    if not 0 <= execute <= config.actions.chunk:
        chunk = config.actions.chunk
        raise ConfigError(f"--execute {execute}: the run predicts chunks of actions.chunk={chunk} steps; run 1 to "
                          f"{chunk} of them per policy call, or 0 for all")
    return dataclasses.replace(config, actions=dataclasses.replace(config.actions, execute=execute))


def train_scenes(config) -> tuple[set[str], str | None]:
    """(scene keys of the run's data.train split, a note when there are none to exclude)."""
    from jaxpar.data.episodes import SCENES_FILE, read_scene_keys

    train = config.data.train
    if not train:
        return set(), "the run trained on synthetic data (data.train empty): no train scenes to exclude"
    keys = read_scene_keys(pathlib.Path(train))
    if keys is None:
        return set(), (f"{pathlib.Path(train) / SCENES_FILE} not found (paths are relative to the current "
                       f"directory): the scenes could not be checked against the train split")
    return keys, None


def restore(workdir: pathlib.Path, step: int | None):
    """(step, host weights) of the run's checkpoint, restored onto one device."""
    from jaxpar.inference.loader import restore_weights

    try:
        _, step, weights = restore_weights(workdir, step)
    except ConfigError as err:  # restore_weights names export's flag
        raise ConfigError(str(err).replace("--step ", "--checkpoint_step ", 1)) from None
    return step, weights


def evaluate(args) -> dict:
    """Restore the run, draw the held-out scenes, roll out; the CLI's result as plain JSON types."""
    workdir = pathlib.Path(args.workdir)
    config = run_config(workdir, args.execute)
    from jaxpar.robot.metaworld_eval import evaluate_metaworld, is_metaworld_split

    if is_metaworld_split(config.data.eval):
        return evaluate_metaworld(args, config, *restore(workdir, args.checkpoint_step), model_policy, write_gif)
    exclude, note = train_scenes(config)
    shape = TaskShape.from_config(config, split_task(exclude, config.vision.image_size // config.vision.patch_size))
    scenes = draw_scenes(args.scenes, args.seed + SEED_SALT, shape, exclude)
    max_steps = args.max_steps or 2 * shape.grid
    step, weights = restore(workdir, args.checkpoint_step)
    frames = min(args.gif_scenes, args.scenes) if args.gif else 0
    policy, first = model_policy(config, weights), TaskEnv(shape, scenes)
    # compiled before the clock starts: seconds and actions a second (with the state, if the policy reads it)
    policy(first.render(), first.instructions, *((first.state(),) if policy.reads_state else ()))
    result = run_rollouts(policy, scenes, max_steps, shape, frames)
    chance = run_rollouts(random_policy(shape, args.seed), scenes, max_steps, shape)
    if args.gif:
        write_gif(pathlib.Path(args.gif), result)
    return {"workdir": str(workdir), "step": int(step), "scenes": len(scenes), "seed": args.seed,
            "max_steps": max_steps, "execute": config.actions.steps_per_call, "success_rate": result["success_rate"],
            "mean_steps": _json(result["mean_steps"]),
            "expert_mean_steps": _json(result["expert_mean_steps"]), "random_success_rate": chance["success_rate"],
            "excluded_train_scenes": len(exclude), "checked_against_train": note is None, "note": note,
            "seconds": round(result["seconds"], 3), "policy_calls": result["policy_calls"],
            "actions_per_second": round(result["actions_per_second"], 1), "gif": args.gif,
            "per_scene": [{**scene, "success": bool(ok), "steps": int(n) if ok else None}
                          for scene, ok, n in zip(scenes, result["success"], result["steps"])]}


# ----------------------------------------------------------------------------- in the training loop


class TrainingRollouts:
    """eval.rollouts closed-loop episodes at each evaluation (jaxpar.training.loop), from the training state.

    On GPUs the weights stay where training keeps them (any dp, pp, tp, ZeRO stage): jit partitions the
    one-device decoder over the mesh from the weights' shardings, and the actions come back replicated,
    so every process steps the same environment with the same actions. On an emulated CPU mesh that
    program would hold thousands of pairs of collectives the partitioner leaves unordered, and XLA:CPU
    can enter them in different orders on different devices and hang (docs/design.md, "XLA:CPU
    deadlocks"); a 2-process CI run did, at its last rollout. There the weights are instead copied to
    host memory once per evaluation, one leaf per program (a gather of one array: nothing to order),
    and every process rolls out on its own first device with no collective at all: the same program on
    the same weights and frames gives every process the same actions, and only process 0 logs them.
    The scenes are drawn once, from train.seed, skipping data.train's scenes; with a Meta-World data.eval
    split they are its held-out scenes (jaxpar.robot.metaworld_eval)."""

    def __init__(self, config, builder):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxpar.inference import decode

        from jaxpar.robot.metaworld_eval import MetaWorldRollouts, is_metaworld_split

        self.config, self.builder = config, builder
        self.metaworld = MetaWorldRollouts(config) if is_metaworld_split(config.data.eval) else None
        self.note = None
        if self.metaworld is None:  # the procedural task
            exclude, self.note = train_scenes(config)
            grid = config.vision.image_size // config.vision.patch_size
            self.shape = TaskShape.from_config(config, split_task(exclude, grid))
            self.scenes = draw_scenes(config.eval.rollouts, config.train.seed + SEED_SALT, self.shape, exclude)
            self.max_steps = 2 * self.shape.grid
        self.on_layout = builder.mesh.devices.flat[0].platform != "cpu"
        self.replicated = NamedSharding(builder.mesh, PartitionSpec())
        self.predict = jax.jit(decode.predict_actions, static_argnums=3,
                               out_shardings=self.replicated if self.on_layout else None)
        self.gather = jax.jit(lambda leaf: leaf, out_shardings=self.replicated)

    def _global(self, array: np.ndarray):
        """The same host array on every process -> one replicated global array."""
        import jax

        return jax.make_array_from_callback(array.shape, self.replicated, lambda index: array[index])

    def host_leaf(self, leaf) -> np.ndarray:
        """One training-state array, whole, in this process's memory: assembled from its own shards when
        they are all here, else replicated by a program of its own (one array: one gather)."""
        if leaf.is_fully_addressable:
            return np.asarray(leaf)
        return np.asarray(self.gather(leaf).addressable_data(0))

    def policy(self, params):
        """The greedy policy of the training state's `params`, as run_rollouts calls it."""
        import jax

        if self.on_layout:
            return model_policy(self.config, self.builder.to_model_order(params), self.predict, self._global)
        host = self.builder.to_model_order(jax.tree.map(self.host_leaf, params))  # leaf by leaf, in order
        return model_policy(self.config, jax.device_put(host, jax.local_devices()[0]), self.predict)

    def run(self, params) -> dict:
        """The metrics logged at an evaluation."""
        result = self.rollout(params)
        per_task = {f"eval_success_rate/{task}": rate for task, rate in result.get("per_task", {}).items()}
        return {"eval_success_rate": result["success_rate"], "eval_steps_to_success": result["mean_steps"],
                "eval_rollout_seconds": result["seconds"], "eval_policy_calls": result["policy_calls"], **per_task}

    def rollout(self, params) -> dict:
        """run_rollouts' result for the training state's params, as they are laid out (Meta-World's
        run_rollouts for a Meta-World data.eval: jaxpar.robot.metaworld_eval)."""
        if self.metaworld is not None:
            return self.metaworld.run(self.policy(params))
        return run_rollouts(self.policy(params), self.scenes, self.max_steps, self.shape)


def _steps(n: int) -> str:
    return f"{n} step{'s' if n != 1 else ''}"


def _json(x: float) -> float | None:
    return None if np.isnan(x) else round(x, 4)  # JSON has no NaN


def summary(out: dict) -> str:
    if "per_task" in out:  # Meta-World
        tasks = ", ".join(f"{task} {rate:.0%}" for task, rate in out["per_task"].items())
        return (f"step {out['step']}: success rate {out['success_rate']:.1%} on {out['scenes']} held-out Meta-World "
                f"scenes of {out['data']} (at most {out['max_steps']} steps): {tasks}; {out['policy_calls']} policy "
                f"calls ({_steps(out['execute'])} each), {out['actions_per_second']:.0f} actions a second")
    successes = sum(s["success"] for s in out["per_scene"])
    steps = (f"mean steps to success {out['mean_steps']:.2f} (the expert's on those scenes: "
             f"{out['expert_mean_steps']:.2f})" if successes else "no success")
    excluded = (f"none of the {out['excluded_train_scenes']} train scenes" if out["checked_against_train"]
                else "not checked against the train split")
    lines = [f"step {out['step']}: success rate {out['success_rate']:.1%} ({successes}/{out['scenes']} held-out "
             f"scenes, {excluded}; at most {out['max_steps']} steps); {steps}; uniform random actions: "
             f"{out['random_success_rate']:.1%}; {out['policy_calls']} policy calls ({_steps(out['execute'])} each), "
             f"{out['actions_per_second']:.0f} actions a second"]
    if out["note"]:
        lines.append(f"note: {out['note']}")
    if out["gif"]:
        lines.append(f"wrote {out['gif']}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    out = evaluate(args)
    print(json.dumps(out) if args.json else summary(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)

