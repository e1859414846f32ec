"""Distributed checkpoints with orbax: asynchronous saves, resume, restore onto any layout.

A checkpoint stores global arrays (orbax writes each process's shards of the global array), so it
restores onto any other valid (dp, pp, tp, zero.stage): the target shardings come from the new
layout's abstract state; with interleaved pipeline stages the stacked layers are stored in their
devices' order, recorded in the metadata and moved on restore. Next to the state it stores, as JSON, the step, a VLA's action range (quantile bins), the data iterator's state
(jaxpar.data.pipeline: grain's position, or the synthetic data's step) and the model shape, checked
on restore. Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves the previous checkpoint as the latest readable one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.config import Config
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline import layer_order, reorder_layers
from jaxpar.parallel.processes import barriers_outside_gloo

# the encoder's layout, init, kernel and the data's resize filter: free (vision.image_mean / image_std are
# not: they define the inputs the weights were trained on)
VISION_FREE = ("tp", "zero", "remat", "pos_init", "attention", "resize")
MODEL_FREE = ("attention",)  # the attention kernel (auto / xla / cudnn) changes no weight: free on resume


def _model_fingerprint(config: Config) -> dict:
    """What must match for a checkpoint to restore: the model's shapes and the state's structure
    (precision decides whether fp32 master weights exist; clipping adds an optimizer-state entry).
    The parallel layout may differ freely, and so may bf16 and fp8 with current scaling (it keeps no state:
    the same tree, so a run may switch its GEMMs to FP8 or back on resume); fp8.recipe=delayed's counters
    are state, so a delayed checkpoint restores only into a delayed run and the other way round."""
    model = {k: v for k, v in dataclasses.asdict(config.model).items() if k not in MODEL_FREE}
    state = {"precision": "bf16" if config.precision == "fp8" else config.precision, "clipping": config.train.grad_clip > 0}
    if config.fp8_delayed:  # the FP8 counters (and the optimizer's partition): another tree
        state["fp8_counters"] = "llm and vision" if config.model.kind == "vla" else True
    if config.model.kind == "vla" and config.actions.head == "flow":  # its conditioning weight: another tree (l1
        state["action_head"] = "flow"  # and tokens checkpoints written before this key carry none, so it names flow)
    out = {"model": model, "state": state}
    if config.model.kind == "vla":
        out["vision"] = {k: _as_json(v) for k, v in dataclasses.asdict(config.vision).items() if k not in VISION_FREE}
    return out


def _as_json(value):
    """A config value as it reads back from the checkpoint's JSON metadata (tuples are lists)."""
    return list(value) if isinstance(value, tuple) else value


def fingerprint_mismatch(saved: dict, config: Config) -> str | None:
    """The first fingerprint entry in which a checkpoint's metadata differs from `config`, or None.

    A field added to the config after the checkpoint was written is absent from its metadata and
    counts as its default, which is the behaviour before the field existed (e.g. vision.film=false)."""
    for key, value in _model_fingerprint(config).items():
        section = getattr(config, key, None)
        defaults = {f.name: _as_json(f.default) for f in dataclasses.fields(section)
                    if f.default is not dataclasses.MISSING} if dataclasses.is_dataclass(section) else {}
        old = saved.get(key)
        if isinstance(old, dict):
            old = {**{k: defaults[k] for k in value if k in defaults and k not in old}, **old}
            old = {k: v for k, v in old.items() if k in value or k not in VISION_FREE + MODEL_FREE}
        if old != value:
            return f"{key} ({saved.get(key)}, now {value})"
    return None


def _action_range(config: Config) -> dict | None:
    """A VLA's per-dimension action range when its bins split the data's quantiles (else None):
    the tokens the weights were trained on mean nothing without it."""
    act = config.actions
    return {"q01": list(act.q01), "q99": list(act.q99)} if config.model.kind == "vla" and act.q01 else None


def _stored_layer_order(config: Config) -> list[int] | None:
    """The order of the stacked layers in this run's state (interleaved pipelines store them by device)."""
    order = layer_order(config.model.n_layers, config.mesh.pp, config.pipeline.virtual_stages)
    return None if order is None else order.tolist()


def _to_layer_order(state, saved: list[int] | None, wanted: list[int] | None, abstract_state):
    """A state restored in a checkpoint's layer order, moved into this run's (one jitted gather)."""
    if saved == wanted:
        return state
    shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
    move = jax.jit(lambda tree: reorder_layers(tree, None if saved is None else np.asarray(saved),
                                               None if wanted is None else np.asarray(wanted)),
                   out_shardings=shardings, donate_argnums=0)
    return move(state)


class Checkpointer:
    def __init__(self, workdir: pathlib.Path, config: Config):
        self.config = config
        self.directory = (workdir / "checkpoints").resolve()
        barriers_outside_gloo()
        options = ocp.CheckpointManagerOptions(max_to_keep=config.checkpoint.keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints (orbax finalises a step by renaming its temporary directory)."""
        return list(self.manager.all_steps())

    def quarantine(self, step: int) -> pathlib.Path:
        """Move an unreadable checkpoint aside (never delete work) so later saves can use its step.
        The name is stamped with the time and made unique: a step can be moved aside, re-saved and
        moved aside again within one second, and rename() onto the earlier copy would fail."""
        stamp = int(time.time())
        target = self.directory / f"{step}.unreadable.{stamp}"
        copy = 1
        while target.exists():
            target, copy = self.directory / f"{step}.unreadable.{stamp}.{copy}", copy + 1
        (self.directory / str(step)).rename(target)
        self.reload()
        return target

    def reload(self) -> None:
        """Re-read which steps exist (after another process moved one aside)."""
        self.manager.reload()

    def check_readable(self, step: int) -> None:
        """Raise OSError / ValueError if this process sees step `step`'s files damaged, without reading
        the arrays and without any collective (orbax's restore has cross-process barriers, so a process
        that fails inside it while the others wait there would hang them): every file opens, and the
        small JSON metadata orbax needs first parses. Run by every process before a restore; the
        verdict is agreed (jaxpar.training.loop)."""
        root = self.directory / str(step)
        for name in ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA"):
            json.loads((root / name).read_bytes())
        for path in root.rglob("*"):
            if path.is_file():
                with open(path, "rb"):
                    pass

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Start an asynchronous save of `state` after optimizer step `step`, with the data iterator's
        state at that point (the next batch to read); training goes on."""
        meta = {"step": step, "data": data_state, "layer_order": _stored_layer_order(self.config),
                "action_range": _action_range(self.config), **_model_fingerprint(self.config)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, abstract_state, step: int | None = None):
        """(state laid out as `abstract_state`'s shardings, step, data iterator state or None) from the
        latest complete checkpoint (or `step`)."""
        step = self.latest_step() if step is None else step
        meta = self._checked_meta(step)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        state = _to_layer_order(restored["state"], meta.get("layer_order"), _stored_layer_order(self.config),
                                abstract_state)
        return state, step, meta.get("data")

    def restore_weights(self, field: str, abstract_weights, step: int | None = None):
        """(the weights, step): only the state's `field` ("params", or "master" for a bf16 run's fp32
        weights), read straight into `abstract_weights`' shardings (orbax's partial restore): the
        optimizer moments and the other copy stay on disk, so a 7B run's weights need 28 GB of fp32
        on the target devices, not the whole train state's 112."""
        step = self.latest_step() if step is None else step
        meta = self._checked_meta(step)
        item = {field: abstract_weights}
        restored = ocp.PyTreeCheckpointer().restore(
            self.directory / str(step) / "state",
            args=ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                        partial_restore=True))[field]
        weights = _to_layer_order(restored, meta.get("layer_order"), _stored_layer_order(self.config), abstract_weights)
        return weights, step

    def _checked_meta(self, step: int) -> dict:
        """Step `step`'s metadata, refused in one line when the checkpoint belongs to another model."""
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        mismatch = fingerprint_mismatch(meta, self.config)
        if mismatch:
            raise ConfigError(f"checkpoint {self.directory / str(step)} was written for a different {mismatch}; "
                              f"use a fresh --workdir or the original settings")
        saved_range, wanted_range = meta.get("action_range"), _action_range(self.config)
        if saved_range and wanted_range and saved_range != wanted_range:
            raise ConfigError(f"checkpoint {self.directory / str(step)} was trained with action bins between "
                              f"q01={saved_range['q01']} and q99={saved_range['q99']}, not {wanted_range}; set "
                              f"actions.q01 / q99 to the checkpoint's or use a fresh --workdir")
        return meta

    def wait(self) -> None:
        """Block until every started save is durable on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
