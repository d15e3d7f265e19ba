"""What every ``kvguard`` command shares: argument helpers, table printing, and the one error type."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from pathlib import Path

from kvguard.models import DEFAULT_MODEL


class CommandError(ValueError):
    """A bad argument or input: ``kvguard <command>: error: <message>`` on stderr, exit status 2."""


def default(cls, name: str):
    """The default of field ``name`` of the dataclass ``cls`` (so the command line never repeats it)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or local model folder (default: %(default)s)")


def add_device(p: argparse.ArgumentParser) -> None:
    from kvguard.device import Device

    p.add_argument("--device", default=Device.AUTO.value, choices=[d.value for d in Device],
                   help="where the model runs: cpu, cuda, or auto (cuda when torch sees a GPU, else cpu) "
                        "(default: %(default)s)")


def device(args: argparse.Namespace) -> str:
    """``--device`` resolved (``auto`` -> ``cuda`` or ``cpu``), before any work: ``cuda`` without a GPU fails
    here, in a second, with the fix in the message."""
    from kvguard.device import name

    return name(args.device)


def csv(text: str, kind=str) -> list:
    """``"a,b,,c"`` -> ``[kind("a"), kind("b"), kind("c")]``."""
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise CommandError(f"cannot read {text!r} as a comma-separated list: {err}") from None


def positive(flag: str, value: int) -> int:
    """``value`` if it is >= 1, else a :class:`CommandError` naming ``flag``."""
    if value < 1:
        raise CommandError(f"{flag} must be a positive integer, got {value}")
    return value


def finite(flag: str, value: float | None, *, low: float = 0.0) -> float | None:
    """``value`` if it is a finite number >= ``low`` (or None), else a :class:`CommandError` naming ``flag``."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise CommandError(f"{flag} must be a finite number >= {low:g}, got {value}")
    return value


def writable_file(flag: str, path: str | None) -> None:
    """Refuse, before any work, an output file that could not be written at the end: a directory, or a place
    whose nearest existing folder is not a writable directory."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise CommandError(f"{flag} {path} is a directory; give a file name")
    _writable_parent(flag, path, target)


def writable_dir(flag: str, path: str | None) -> None:
    """Refuse, before any work, an output directory that is an existing file or could not be created."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CommandError(f"{flag} {path} exists and is not a directory")
    _writable_parent(flag, path, target)


def _writable_parent(flag: str, path: str, target: Path) -> None:
    # Outputs are written through a temporary sibling, so the parent (created if missing) must take a new file.
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CommandError(f"{flag} {path}: {parent} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise CommandError(f"{flag} {path}: cannot write in {parent}: {err.strerror or err}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} {path}: cannot write in {parent}: permission denied")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def load_profile(path: str, model=None):
    """The profile at ``path`` (checked against ``model`` when given); errors are :class:`ProfileError`."""
    from kvguard.profile import Profile

    return Profile.load(path, model)
