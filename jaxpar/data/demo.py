"""The demo data a config can ask for with data.generate=true, made on first use.

llama: Python's own standard library sources (every machine with Python has them), byte-tokenized,
5% of the files held out. vla: the procedural task of jaxpar.data.episodes, shaped by the config, as jaxpar episodes or
(data.demo_format=lerobot) as a LeRobot v3.0 dataset (jaxpar.data.lerobot_write).
Each split is written into a temporary directory and renamed into place when complete, so an
interrupted generation is never mistaken for data; with several processes, process 0 generates and
the others wait for the directories to appear. Independent jobs on one host that ask for the same
data at once (two `make run`s, two test suites) take turns on a lock on the data's parent
directory: the first generates, the others find it made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import sysconfig
import time

from jaxpar.config import Config
from jaxpar.errors import ConfigError

STDLIB_SKIP = ("site-packages", "test", "tests")
VLA_EPISODES = {"train": 4000, "heldout": 500}
WAIT_S = 600


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _generate(config: Config, train: pathlib.Path, heldout: pathlib.Path) -> None:
    if config.model.kind == "vla":
        from jaxpar.data.episodes import write_splits
        from jaxpar.data.lerobot_write import write_lerobot_splits

        v, act = config.vision, config.actions
        write = write_lerobot_splits if config.data.demo_format == "lerobot" else write_splits
        write(train, VLA_EPISODES["train"], VLA_EPISODES["heldout"], heldout_dir=heldout, size=v.image_size,
              grid=v.image_size // v.patch_size, dims=act.dims, cameras=v.cameras)
    else:
        from jaxpar.data.text import prepare_text

        prepare_text(stdlib_dir(), train, heldout, pattern="**/*.py", skip_dirs=STDLIB_SKIP)


def ensure_demo_data(config: Config, is_primary: bool = True) -> None:
    """Generate data.train and data.eval when data.generate is set and they do not exist yet."""
    data = config.data
    targets = [pathlib.Path(p) for p in (data.train, data.eval) if p]
    if not data.generate or all(t.exists() for t in targets):
        return
    if not (data.train and data.eval):
        raise ConfigError("data.generate=true makes a train and a held-out split: set both data.train and data.eval")
    if not is_primary:
        _wait_for(targets)
        return
    with _exclusive(targets[0].parent):
        if all(t.exists() for t in targets):  # another job made it while we waited for the lock
            return
        train, heldout = targets
        if train.exists() or heldout.exists():
            raise ConfigError(f"data.generate=true: only one of {train} and {heldout} exists; remove it to "
                              "regenerate both")
        suffix = f".partial-{os.getpid()}"
        staging = [t.with_name(t.name + suffix) for t in targets]
        print(f"generating demo data into {train} and {heldout} (data.generate=true; first use only)")
        try:
            _generate(config, *staging)
            for tmp, target in zip(staging, targets):
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp.rename(target)
        finally:
            for tmp in staging:
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(directory: pathlib.Path):
    """An exclusive flock on `directory` itself (no lock file is left behind), held for the block. On a
    filesystem without locks it goes on unlocked (as before the lock: one job per data directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _wait_for(targets: list[pathlib.Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(t.exists() for t in targets):
        if time.monotonic() > deadline:
            raise ConfigError(f"waited {WAIT_S}s for process 0 to generate {', '.join(map(str, targets))}; "
                              f"generate the data first (data.generate on one process) and restart")
        time.sleep(1.0)


def check_paths(config: Config) -> None:
    """Missing or empty data directories, before any JAX start-up or compilation."""
    for key in ("train", "eval"):
        path = getattr(config.data, key)
        if not path:
            continue
        directory = pathlib.Path(path)
        if not directory.is_dir():
            hint = ("set data.generate=true to make the demo data" if not config.data.generate
                    else "it could not be generated")
            raise ConfigError(f"data.{key}={path}: no such directory; {hint} or point data.{key} at your data")
        if not any(directory.iterdir()):
            raise ConfigError(f"data.{key}={path} is empty; fill it with scripts/"
                              f"{'make_vla_data.py' if config.model.kind == 'vla' else 'prepare_text.py'}")
