"""Writing files and directories so that a reader never sees half of one.

Profiles, exports, converted models and result files are written to a temporary sibling and renamed into
place. A directory being replaced is first moved aside and deleted only once the new one is in place, and
put back when anything fails before that. Temporary names start with a dot and say what they are
(``.<name>.tmp-<id>``, ``.<name>.old-<id>``). New files and directories get the permissions the process's
umask gives (a service account in the same group can read a profile), not ``mkdtemp``'s owner-only ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator


def _sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; when the block ends without an error it replaces
    ``target`` (which may exist: it is swapped out and deleted). On an error nothing at ``target`` changes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(target, "tmp")
    os.mkdir(tmp)  # mode 0o777 minus the umask
    try:
        yield tmp
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = _sibling(target, "old")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)  # put the previous one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())
