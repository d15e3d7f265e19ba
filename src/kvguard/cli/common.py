"""What every ``kvguard`` command shares: argument helpers, table printing, and the one error type."""

from __future__ import annotations

import argparse
import dataclasses

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


def csv(text: str, kind=str) -> list:
    """``"a,b,,c"`` -> ``[kind("a"), kind("b"), kind("c")]``."""
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise CommandError(f"cannot read {text!r} as a comma-separated list: {err}") from None


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
