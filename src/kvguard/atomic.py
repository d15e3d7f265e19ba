"""Writing files and directories so that a reader never sees half of one, even when the writer is killed.

Profiles, exports, converted models and result files are written to a temporary sibling and renamed into
place. Temporary names start with a dot and say what they are and who wrote them (``.<name>.tmp-<pid>-<id>``,
``.<name>.old-<pid>-<id>``), so no reader takes one for a profile. A directory being replaced is swapped
with the new one in one step where the kernel can (``renameat2(RENAME_EXCHANGE)``, Linux): there is no moment
without ``target``. Elsewhere the old one is moved aside first; a writer killed between the two renames
leaves only the ``.old-*`` sibling, and :func:`recover` (called by every writer and by the profile loader)
moves it back. Leftovers of writers that are no longer running are deleted by the next write. New files and
directories get the permissions the process's umask gives (a service account in the same group can read a
profile), not ``mkdtemp``'s owner-only ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator

_RENAME_EXCHANGE = 2


def _sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _leftovers(path: Path, kind: str) -> list[tuple[Path, int]]:
    """Siblings of ``path`` of ``kind`` (``tmp`` / ``old``) and the pid that wrote each, oldest first."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.{kind}-(\d+)-[0-9a-f]{{8}}")
    if not path.parent.is_dir():
        return []
    found = [(p, int(m.group(1))) for p in path.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return sorted(found, key=lambda x: x[0].stat().st_mtime)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def recover(target: str | os.PathLike) -> None:
    """Undo what a killed writer left: with ``target`` missing, its newest ``.old-*`` sibling of a writer no
    longer running is moved back; then ``.tmp-*`` and ``.old-*`` siblings of dead writers are deleted."""
    target = Path(target)
    dead_old = [p for p, pid in _leftovers(target, "old") if not _running(pid)]
    if dead_old and not target.exists():
        with contextlib.suppress(OSError):  # another process recovered it first, or no write access
            os.rename(dead_old.pop(), target)  # the previous version, whole: the swap never finished
    for p in dead_old + [p for p, pid in _leftovers(target, "tmp") if not _running(pid)]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # a reader without write access leaves it to the next writer
                p.unlink()


@contextlib.contextmanager
def directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; when the block ends without an error it replaces
    ``target`` (which may exist: it is swapped out and deleted). On an error nothing at ``target`` changes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    tmp = _sibling(target, "tmp")
    os.mkdir(tmp)  # mode 0o777 minus the umask
    try:
        yield tmp
        _umask_modes(tmp)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask_modes(root: Path) -> None:
    """Give what was written under ``root`` the umask's permissions: some writers (safetensors) create files
    owner-only. ``root`` itself was made by ``os.mkdir``, so its mode is ``0o777`` minus the umask."""
    dir_mode = root.stat().st_mode & 0o777
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(folder, d), dir_mode)
        for f in files:
            os.chmod(os.path.join(folder, f), dir_mode & 0o666)


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; False where the kernel or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    return False


def _swap_in(tmp: Path, target: Path) -> None:
    if target.exists() and _exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous version
        return
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


@contextlib.contextmanager
def file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file opened for writing that appears at ``path`` whole when the block ends, and not at all when
    it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling renamed into place."""
    with file(path) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())
