"""The ``kvguard`` command line: one module per command, each with ``add_parser(sub)`` and ``run(args)``.

Every command reports bad input the same way: ``kvguard <command>: error: <message>`` on stderr and exit
status 2 (set ``KVGUARD_DEBUG=1`` to see the traceback instead).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvguard import __version__
from kvguard.cli import (calibrate, check_engine, evaluate, export, generate, install_assets, models, report, run,
                         serve)

COMMANDS = (models, run, evaluate, calibrate, report, generate, serve, export, check_engine, install_assets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Calibrated KV-cache quantization for LLM inference, with real-time error compensation.",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a command may raise for bad input: shown as one line, not a traceback. ``OSError``: a file that
    cannot be read or written (output paths are checked before the work, but a disk can still fill up; what
    was computed is printed before the final write)."""
    from kvguard.calibration.distributed import RayUnavailableError
    from kvguard.data import CorpusNotInstalledError

    return (ValueError, OSError, RayUnavailableError, CorpusNotInstalledError)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as err:
        if os.environ.get("KVGUARD_DEBUG"):
            raise
        print(f"kvguard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
