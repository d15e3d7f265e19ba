"""The prompt check on and off: the loop over an aggressive plan on the long-range recall task.

    .venv/bin/python benchmarks/prompt_check.py --model smollm2-135m --profile P [--base kvguard@0.22]
        [--distances 1024,2048] [--trials 10] [--variants on,off] [--json F]

With the check (the default) the last token of a prefilled prompt is a monitoring step of its own, so layers
the risk classifier puts at risk are promoted, and their history re-encoded from the backing tier, before the
first decoded token; without it (``MonitorConfig.prompt_check=False``) the first step comes ``refresh_tokens``
decoded tokens later. Each variant copies the same word lists (``kvguard eval --task recall``'s prompts, seeded
by distance and trial) through ``kvguard-live:<base>``; compare with that task's ``fp16`` and ``<base>`` rows.
"""

from __future__ import annotations

import argparse
import json
import sys

VARIANTS = {"on": True, "off": False}


class _Overridden:
    """A live method whose sessions get monitor overrides (the recall task asks ``method.session(model)``)."""

    def __init__(self, method, name: str, overrides: dict) -> None:
        self.method, self.name, self.overrides, self.live = method, name, overrides, True

    def session(self, model):
        return self.method.session(model, monitor_overrides=self.overrides)


def main(argv: list[str] | None = None) -> int:
    from kvguard import models
    from kvguard.evaluation import methods, recall
    from kvguard.profile import Profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--base", default="kvguard@0.22", help="the static method the loop runs over")
    parser.add_argument("--distances", default="1024,2048")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--variants", default="on,off", help="a subset of on,off")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; valid: {sorted(VARIANTS)}")

    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    live = methods.get(f"kvguard-live:{args.base}", profile)
    distances = [int(d) for d in args.distances.split(",")]
    results = []
    for variant in args.variants.split(","):
        method = _Overridden(live, f"{live.name} (prompt check {variant})", {"prompt_check": VARIANTS[variant]})
        results += recall.run(model, tok, method, distances, args.trials)
    print(recall.markdown_table(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "base": args.base, "results": [r.to_json() for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
