"""Where a VLA's action bins come from: fixed bounds, or the data's per-dimension quantiles.

OpenVLA bins each action dimension between its 1st and 99th percentile (q01, q99) over the
training set: robot datasets have dims of very different scales (metres, radians, a 0/1 gripper)
and a few outliers that would waste bins. With `actions.normalization=quantile` (the default for a
LeRobot dataset) the range is resolved once at start, before JAX starts, and written into the
config (`actions.q01` / `actions.q99`), so WORKDIR/config.json, every checkpoint's metadata, the
evaluation's decoded actions, `jaxpar.inference.generate` and `jaxpar.robot.rollout` all use the same bins:

1. the range the user gave (actions.q01 / q99), else
2. the range this workdir's previous run used (its config.json: a resumed run must keep the bins
   its checkpoints were trained with), else
3. the dataset's own statistics: a LeRobot dataset's meta/stats.json `action` q01 / q99 when it
   has them, otherwise computed from the actions and cached in WORKDIR/action_stats.json (keyed by
   the data directory), so a restart does not read every action again.

Every process resolves the same range from the same files; only process 0 writes the cache.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from jaxpar.config import Config
from jaxpar.errors import ConfigError
from jaxpar.files import write_atomic

CACHE_FILE = "action_stats.json"


def normalization_mode(config: Config) -> str:
    """bounds or quantile: `auto` is quantile for a LeRobot dataset, bounds otherwise."""
    mode = config.actions.normalization
    if mode != "auto":
        return mode
    from jaxpar.data.lerobot import is_lerobot

    return "quantile" if config.data.train and is_lerobot(config.data.train) else "bounds"


def resolve_action_range(config: Config, workdir: pathlib.Path, is_primary: bool = True) -> Config:
    """`config` with actions.q01 / q99 filled in when the bins split the data's quantiles."""
    act = config.actions
    if config.model.kind != "vla" or act.q01 or normalization_mode(config) != "quantile":
        return config
    if not config.data.train:
        raise ConfigError("actions.normalization=quantile reads the action range from the data, but data.train is "
                          "empty (synthetic data); set data.train, or use actions.normalization=bounds")
    q01, q99 = _previous_run_range(workdir, act.dims)
    if q01 is None:
        q01, q99 = _data_quantiles(config, workdir, is_primary)
    if len(q01) != act.dims:
        raise ConfigError(f"{config.data.train}: actions have {len(q01)} dims, but actions.dims={act.dims}; "
                          f"set actions.dims={len(q01)}")
    actions = dataclasses.replace(act, normalization="quantile", q01=tuple(map(float, q01)),
                                  q99=tuple(map(float, q99)))
    return dataclasses.replace(config, actions=actions)


def resolve_state_range(config: Config, workdir: pathlib.Path) -> Config:
    """`config` with vision.state_low / state_high filled in from a LeRobot dataset's observation.state
    (vision.state_dims > 0 and no range given): the range a previous run in `workdir` used, else meta/stats.json's
    q01 / q99, else computed from the parquet files (the state column only: every process reads the same). The
    state is then normalised as the actions' bins are (jaxpar.models.vit.normalise_state), and the range travels
    with config.json and every checkpoint to the rollout. Synthetic data keeps [-1, 1]."""
    vis = config.vision
    if config.model.kind != "vla" or not vis.state_dims or vis.state_low or not config.data.train:
        return config
    from jaxpar.data.lerobot import STATE_KEY, LeRobotSource, compute_action_quantiles, is_lerobot

    if not is_lerobot(config.data.train):
        return config  # (jaxpar episodes carry no state: make_source says so in one line)
    low, high = _previous_run_range(workdir, vis.state_dims, "vision", ("state_low", "state_high"))
    if low is None:
        low, high = (LeRobotSource.stored_action_quantiles(config.data.train, STATE_KEY)
                     or compute_action_quantiles(config.data.train, STATE_KEY))
    if len(low) != vis.state_dims:
        raise ConfigError(f"{config.data.train}: {STATE_KEY} has {len(low)} dims, but vision.state_dims="
                          f"{vis.state_dims}; set vision.state_dims={len(low)}")
    vision = dataclasses.replace(vis, state_low=tuple(map(float, low)), state_high=tuple(map(float, high)))
    return dataclasses.replace(config, vision=vision)


def _previous_run_range(workdir: pathlib.Path, dims: int, group: str = "actions", keys=("q01", "q99")):
    """The range (`keys` of config group `group`) of the config.json a previous run left in `workdir`, if it had one."""
    path = workdir / "config.json"
    if not path.is_file() or not (workdir / "checkpoints").is_dir():
        return None, None
    try:
        values = json.loads(path.read_text()).get(group, {})
    except json.JSONDecodeError:
        raise ConfigError(f"{path} is not valid JSON; restore it or use a fresh --workdir") from None
    low, high = values.get(keys[0]) or None, values.get(keys[1]) or None
    return (low, high) if low and len(low) == dims else (None, None)


def _data_quantiles(config: Config, workdir: pathlib.Path, is_primary: bool):
    """(q01, q99) of data.train's actions: the LeRobot stats file, the workdir's cache, or computed."""
    from jaxpar.data.lerobot import is_lerobot

    source = str(pathlib.Path(config.data.train).resolve())
    if is_lerobot(config.data.train):
        from jaxpar.data.lerobot import LeRobotSource

        stats = LeRobotSource.stored_action_quantiles(config.data.train)
        if stats is not None:
            return stats
    cache = workdir / CACHE_FILE
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("source") == source:
            return cached["q01"], cached["q99"]
    q01, q99 = compute_quantiles(config.data.train)
    if is_primary:
        # atomic: a peer that reads it meanwhile finds it whole or absent (and then computes the same values)
        write_atomic(cache, json.dumps({"source": source, "q01": list(map(float, q01)), "q99": list(map(float, q99))}))
    return q01, q99


def compute_quantiles(directory: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension 1st / 99th percentiles of every action in a LeRobot dataset or episode directory."""
    from jaxpar.data.lerobot import compute_action_quantiles, is_lerobot

    if is_lerobot(directory):
        return compute_action_quantiles(directory)
    from jaxpar.data import NPY_LOCK

    files = sorted(pathlib.Path(directory).glob("episode_*.npz"))
    if not files:
        raise ConfigError(f"no episode_*.npz files in {directory} to compute action quantiles from")
    with NPY_LOCK:
        actions = np.concatenate([np.load(path)["actions"] for path in files]).astype(np.float64)
    return np.quantile(actions, 0.01, axis=0), np.quantile(actions, 0.99, axis=0)
