"""``kvguard report``: plots and an HTML page for a calibration profile."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="plots and an HTML page for a calibration profile")
    p.add_argument("--profile", required=True, help="profile directory (from `kvguard calibrate`)")
    p.add_argument("--out", required=True, help="directory for the PNG plots and index.html")
    p.add_argument("--events", help="events file of the live loop (kvguard generate --events): adds its timeline")
    p.add_argument("--eval", action="append", default=[], metavar="JSON", dest="evals",
                   help="a `kvguard eval --json` file (repeatable): adds the frontier on evaluation text with every "
                        "peer's point")
    p.add_argument("--rank-by", choices=("mean", "p99"), default="mean",
                   help="the KL the --eval frontier is drawn and judged by: the mean per-token KL, or its 99th "
                        "percentile (the rare tokens a mean hides)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.calibration import report
    from kvguard.cli.common import load_profile, writable_dir

    writable_dir("--out", args.out)
    page = report.write(load_profile(args.profile), args.out, events=args.events, evals=args.evals,
                        measure=args.rank_by)
    print(f"report written to {page}")
    return 0
