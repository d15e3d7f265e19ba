"""What watching costs: the feedback loop's monitor on, nothing acting, against the same plan without it and
against ``fp16``, decode steps interleaved in one process.

Each decoder prefills the same held-out prompt, then all decode the same number of greedy steps, one step each
in turn, so a drifting machine slows every variant alike. The watching session is the profile's loop with every
alarm threshold at its ceiling (1.0), so it records every monitored layer's attention and runs its monitoring
steps but never acts; the script checks that it did not.

    python benchmarks/watch_decode.py --profile benchmarks/profiles/smollm2-135m-512 --context 4096 --steps 32
"""

from __future__ import annotations

import argparse

import torch
from fused_decode import interleaved, print_medians  # a sibling script: python puts this folder on the path

from kvguard import data, models
from kvguard.control.decoding import CacheDecoder
from kvguard.evaluation import methods
from kvguard.evaluation.method_spec import LIVE
from kvguard.profile import Profile

NEVER_ACT = {"warn_drop": 1.0, "trigger_drop": 1.0, "heavy_drop": 1.0, "promote_risk": 1.0, "promote_layer_risk": 1.0}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--plan", default="kvguard", help="the static method the loop watches (kvguard, kvguard@0.22)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    ids = data.token_stream("long", "eval", tok, args.context)
    plan = methods.get(args.plan, profile)
    live = methods.get(f"{LIVE}:{args.plan}" if args.plan != "kvguard" else LIVE, profile)
    decoders = {
        "fp16": CacheDecoder(model, methods.get("fp16").make_cache(model)),
        args.plan: CacheDecoder(model, plan.make_cache(model)),
        f"{args.plan} watched": live.session(model, monitor_overrides=NEVER_ACT),
    }
    tokens = {name: int(d.prefill(ids).argmax()) for name, d in decoders.items()}
    seconds = interleaved(decoders, tokens, args.steps)
    session = decoders[f"{args.plan} watched"]
    c = session.counters
    if c.acted_steps or c.recompute_ms:
        raise SystemExit(f"the watching session acted ({c.acted_steps} steps): the timing is not of watching alone")
    print_medians(seconds, "fp16", f"context {args.context}, {args.steps} steps")
    print(f"monitoring steps of the watched session: {c.steps}, acting: {c.acted_steps}")


if __name__ == "__main__":
    main()
