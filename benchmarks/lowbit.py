"""Below 4 bits: INT3 and the Hadamard rotation, each on and off at a fixed budget.

    .venv/bin/python benchmarks/lowbit.py --model smollm2-135m --corpus prose,code --tokens 2048 [--json F]

Every method is scored by the exact simulation of chunk-1 decoding on the evaluation split against the model's
FP16 cache (KL, top-1 agreement, perplexity change) with its stored bytes over FP16's. Rotation changes no
byte count beyond its sign bits, so ``X`` against ``X+rot`` / ``X+rotk`` / ``X+rotv`` is the ablation at a
fixed budget; ``int3`` against ``int4`` / ``int2`` places the new tier. A row is printed as soon as it is
measured (a run is minutes per method on 2 cores), the markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

DEFAULT_METHODS = "int4,int3,int2,int4+rot,int3+rot,int3+rotk,int3+rotv,int2+rot,int2+rotk,int2+rotv"


def _row(model, ids, name, reference, ref_nll) -> dict:
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.scoring import score_simulated

    method = methods.get(name)
    plan = method.plan(Architecture.from_config(model.config))
    score = score_simulated(model, ids, plan, reference=reference)
    stored, fp16 = plan.kv_bytes(model.config, ids.numel() - 1)
    return {"method": name, "bytes_ratio": stored / fp16, "ppl": score.perplexity,
            "ppl_delta_pct": 100.0 * (math.exp(score.nll - ref_nll) - 1.0),
            "kl": score.kl, "top1_agree": score.top1_agree}


def logits_row(corpus: str, method: str, ids, logits, reference, ref_nll: float, stored: float, fp16: float) -> dict:
    """The scored row of ``logits`` ``[T - 1, vocab]`` predicting ``ids`` against the FP16 ``reference`` log-probs
    (whose NLL is ``ref_nll``), ``stored`` of ``fp16`` bytes; printed as JSON as it comes."""
    from kvguard.scoring import score_logits

    score = score_logits(ids, [logits], reference=reference)
    row = {"corpus": corpus, "method": method, "bytes_ratio": stored / fp16, "ppl": score.perplexity,
           "ppl_delta_pct": 100.0 * (math.exp(score.nll - ref_nll) - 1.0), "kl": score.kl,
           "top1_agree": score.top1_agree}
    print(json.dumps(row), flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    """The markdown table of scored rows (corpus, method, bytes, perplexity change, KL, top-1)."""
    print("\n| corpus | method | bytes / FP16 | ppl change | KL | top-1 |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['method']} | {r['bytes_ratio']:.3f} | {r['ppl_delta_pct']:+.2f} % | "
              f"{r['kl']:.5f} | {r['top1_agree']:.4f} |")


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.plan import Plan
    from kvguard.scoring import score_simulated

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="prose,code")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tok = models.load(args.model)
    rows = []
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, "eval", tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(Architecture.from_config(model.config), "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        print(f"{corpus}: fp16 ppl {fp.perplexity:.3f}", flush=True)
        for name in args.methods.split(","):
            row = dict(corpus=corpus, **_row(model, ids, name, reference, fp.nll))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
