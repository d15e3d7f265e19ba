"""Restore or recompute? The live loop over a static plan, with and without the backing tier, on one text.

    .venv/bin/python benchmarks/backing.py --model smollm2-135m --profile P [--base int2] [--corpus prose]
        [--tokens 2048] [--cap-mib 256] [--json F]

Scores, side by side on the same evaluation-split tokens: ``fp16`` (the reference), ``<base>`` (no loop),
``kvguard-live:<base>`` as it is (compensation recomputes against the quantized past), and the same loop with
a backing tier of ``--cap-mib`` MiB (compensation restores the original K/V where the tier holds them,
:mod:`kvguard.backing`). ``gap_recovered`` is the share of the base plan's KL (and of its perplexity excess over
``fp16``) the loop takes back. Thresholds come from the profile; nothing is tuned here.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.backing import BackingConfig
    from kvguard.evaluation import methods
    from kvguard.evaluation.scoring import score_live, score_simulated
    from kvguard.plan import Plan
    from kvguard.profile import Profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--base", default="int2", help="the static method the loop runs over")
    parser.add_argument("--corpus", default="prose")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--cap-mib", type=float, default=256.0, help="the backing tier's byte cap, in MiB")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    ids = data.token_stream(args.corpus, "eval", tok, args.tokens)
    arch = Architecture.from_config(model.config)
    fp16 = score_simulated(model, ids, Plan.uniform(arch, "fp16", profile.plan.cache), keep_logits=True)
    reference = torch.log_softmax(fp16.logits, dim=-1)
    base = methods.get(args.base, profile)
    static = score_simulated(model, ids, base.plan(arch), reference=reference, scales=base.scales)
    live = methods.get(f"kvguard-live:{args.base}", profile)
    rows = [{"method": "fp16", "ppl": fp16.perplexity, "kl": 0.0},
            {"method": args.base, "ppl": static.perplexity, "kl": static.kl}]
    backing = BackingConfig(enabled=True, max_bytes=int(args.cap_mib * 2**20))
    for name, kwargs in ((f"kvguard-live:{args.base} (recompute)", {}),
                         (f"kvguard-live:{args.base} (restore, {args.cap_mib:g} MiB)", {"backing": backing})):
        session = live.session(model, sequence_id=name, **kwargs)
        score = score_live(session, ids, reference=reference, desc=name)
        s = session.summary()
        rows.append({"method": name, "ppl": score.perplexity, "kl": score.kl, "top1_agree": score.top1_agree,
                     "tok_s": (score.tokens - 1) / score.seconds, "trigger_rate": s["trigger_rate"],
                     "restored_positions": s["restored_positions"], "recomputed_positions": s["recomputed_positions"],
                     "kv_bytes_ratio": s["kv_bytes"] / s["kv_bytes_fp16"],
                     "backing_bytes": s["backing_bytes"], "max_level": s["max_level"]})
    for row in rows:
        row["kl_gap_recovered"] = 1 - row["kl"] / static.kl if static.kl else None
        excess = static.perplexity - fp16.perplexity
        row["ppl_gap_recovered"] = 1 - (row["ppl"] - fp16.perplexity) / excess if excess else None
    cols = ["method", "ppl", "kl", "kl_gap_recovered", "ppl_gap_recovered", "restored_positions",
            "recomputed_positions", "kv_bytes_ratio", "backing_bytes", "trigger_rate", "tok_s"]
    print(f"{args.model}, {args.corpus}, {args.tokens} tokens, profile {args.profile}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "rows": rows}, f, indent=1)
    return 0


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5f}" if abs(value) < 1 else f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
