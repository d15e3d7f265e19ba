"""The softmax bias of key quantization noise, corrected analytically: does it give anything back?

    .venv/bin/python benchmarks/softmax_bias.py --model smollm2-135m [--profile P] \\
        [--methods int2,int2+rot,int3+rot,int4,kvguard@0.22] [--corpus prose,code,dialog] [--tokens 2048] [--json F]

Noise ``n`` on a stored key adds ``q . n`` to its attention score. Taken as zero-mean noise of variance
``s^2 = sum_d q_d^2 Delta_d^2 / 12`` (uniform rounding error of step ``Delta_d`` per channel), it inflates the
expected softmax weight of that key by ``exp(s^2 / 2)`` (the mean of a log-normal); keys stored with larger steps
draw more attention than they should. The correction subtracts ``s^2 / 2`` (times the score scaling squared, so
``sum_d q_d^2 Delta_d^2 / (24 d)`` with the usual ``1 / sqrt(d)`` scaling) from the score of every quantized key.
It needs no storage: ``Delta`` is the key's group scale, which the cache holds anyway (per channel and group of
tokens: keys are grouped per channel), and for a rotated side the query is rotated as the stored keys are.

Each method is scored on the eval split by the exact simulation of chunk-1 decoding, with and without the
correction (``CacheConfig.score_correction``, :mod:`kvguard.score_bias`; the cache's decode reads apply the same),
against the FP16 cache of the same tokens. Nothing is fitted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.scoring import score_logits, score_simulated
    from kvguard.simulate import simulate_logits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", help="needed for kvguard@<bytes> methods")
    p.add_argument("--methods", default="int2,int2+rot,int3+rot,int4")
    p.add_argument("--corpus", default="prose,code,dialog")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json")
    args = p.parse_args(argv)

    model, tok = models.load(args.model)
    profile = None
    if args.profile:
        from kvguard.profile import Profile

        profile = Profile.load(args.profile, model)
    arch = Architecture.from_config(model.config)
    rows = []
    print("| corpus | method | ppl change, plain | ppl change, corrected | KL, plain | KL, corrected | KL change |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, "eval", tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        for name in args.methods.split(","):
            method = methods.get(name, profile)
            plan = method.plan(arch)
            row = {"corpus": corpus, "method": name}
            for label, variant in (("plain", plan), ("corrected", plan.with_score_correction())):
                logits = simulate_logits(model, ids[:-1], variant, method.scales)
                score = score_logits(ids, [logits], reference=reference)
                row[label] = {"ppl_delta_pct": 100.0 * (math.exp(score.nll - fp.nll) - 1.0), "kl": score.kl,
                              "top1_agree": score.top1_agree}
            rows.append(row)
            a, b = row["plain"], row["corrected"]
            print(f"| {corpus} | {name} | {a['ppl_delta_pct']:+.2f} % | {b['ppl_delta_pct']:+.2f} % | {a['kl']:.5f} | "
                  f"{b['kl']:.5f} | {100 * (b['kl'] / a['kl'] - 1):+.1f} % |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
