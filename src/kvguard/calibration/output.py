"""Where a calibration writes: ``--out`` checked before any work, and held by one run at a time.

A run takes an exclusive ``flock`` on ``.<out>.lock`` next to ``--out`` for as long as it runs: a second run
on the same ``--out`` is refused at once instead of deleting the first one's checkpoints. The kernel releases
the lock when the process ends, however it ends, so a killed run never blocks its ``--resume``. The lock file
itself stays (removing it would race with a run that just opened it); it is empty but for the holder's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Iterator

from kvguard.profile import JSON_NAME


class OutputError(ValueError):
    """``--out`` cannot take a profile, or another calibration is writing it."""


def check_out(out: Path) -> None:
    """Refuse an ``--out`` the final write would fail on: an existing file, a folder holding something other
    than a profile, or a place where no file can be created."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} exists and is not a directory")
    if out.is_dir() and not (out / JSON_NAME).is_file() and any(out.iterdir()):
        raise OutputError(f"--out {out} exists and is not a kvguard profile; refusing to overwrite it")
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise OutputError(f"--out {out}: cannot write in {parent}: {err.strerror or err}") from None


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the calibration lock of ``out`` for the block; :class:`OutputError` when another run holds it."""
    lock_path = out.absolute().parent / f".{out.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise OutputError(f"--out {out} is being written by another calibration (pid {holder}, lock "
                              f"{lock_path}); wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
