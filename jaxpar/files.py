"""Files a run writes whole: one writer, and a reader never sees half of one.

In a multi-process run every process runs the same program, so each file has one writer (process 0,
or the one process a launcher says generates data) and is written to a temporary file in the same
directory and renamed over the target: a rename is atomic on POSIX filesystems, so a process that
reads the file meanwhile (a slower peer at start, a restarted run) finds the old file, the new one or
none, never a torn one; a crash mid-write leaves the old file as it was.
"""

from __future__ import annotations

import os
import pathlib
import tempfile


def write_atomic(path: pathlib.Path | str, text: str) -> pathlib.Path:
    """Write `text` to `path` through a temporary file and a rename."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as tmp:
        tmp.write(text)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)
    return path
