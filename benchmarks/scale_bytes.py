"""One-byte scales and the per-group range search, each on and off, at fixed plans.

    .venv/bin/python benchmarks/scale_bytes.py --model smollm2-135m --split calib --corpus prose,code \
        --tokens 1024 [--json F]

Each tier (INT4, INT3, INT2) is a uniform plan in the model's low-bit layout
(``kvguard.calibration.search.low_bit_layout``), both sides Hadamard-rotated, the window in 16 bits (no calibrated
scales needed), scored by the exact chunk-1 simulation against the model's FP16 cache. The layout is taken four
ways: float16 scales and zero points or one byte each (``CacheConfig.scale_bits``; INT4 always keeps float16), and
each group's range as its ``[min, max]`` or searched (``CacheConfig.range_search``). The bytes are what the cache
stores over FP16's at the stream's length. The calibration split is what chose these options; ``--split eval``
measures them on evaluation text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

import torch

VARIANTS = ((16, False), (16, True), (8, False), (8, True))  # (scale_bits, range_search)


def _row(model, ids, plan, reference, ref_nll) -> dict:
    from kvguard.evaluation import methods
    from kvguard.evaluation.scoring import score_logits
    from kvguard.simulate import simulate_logits

    stored, fp16 = methods.static_kv_bytes(plan, model.config, ids.numel() - 1)
    score = score_logits(ids, [simulate_logits(model, ids[:-1], plan)], reference=reference)
    return {"bytes_ratio": stored / fp16, "kl": score.kl, "ppl_delta_pct": 100.0 * (math.exp(score.nll - ref_nll) - 1.0)}


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.calibration.search import LAYOUTS, low_bit_layout
    from kvguard.evaluation.scoring import score_simulated
    from kvguard.plan import Plan

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--split", default="calib", choices=("calib", "eval"))
    p.add_argument("--corpus", default="prose,code")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--tiers", default="int4,int3,int2")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tok = models.load(args.model)
    arch = Architecture.from_config(model.config)
    layout_name = low_bit_layout(model.config, args.tokens)
    print(f"{args.model}: layout {layout_name} (16-bit window), {args.split} split, {args.tokens} tokens", flush=True)
    rows = []
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, args.split, tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        for tier in args.tiers.split(","):
            for scale_bits, search in VARIANTS:
                if scale_bits == 8 and tier == "int4":
                    continue  # INT4 keeps float16 scales in every layout
                layout = replace(LAYOUTS[layout_name], window_bits=16, scale_bits=scale_bits, range_search=search)
                plan = Plan.uniform(arch, tier, layout).with_rotation(True, True)
                row = {"corpus": corpus, "tier": tier, "scale_bits": scale_bits, "range_search": search,
                       **_row(model, ids, plan, reference, fp.nll)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| corpus | tier | scales | range | bytes / FP16 | KL | ppl change |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['tier']} | {r['scale_bits']}-bit | {'searched' if r['range_search'] else 'min-max'} "
              f"| {r['bytes_ratio']:.4f} | {r['kl']:.5f} | {r['ppl_delta_pct']:+.2f} % |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "split": args.split, "tokens": args.tokens, "layout": layout_name,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
