"""How much do the ranking stage's close calls vary from one stream of calibration text to the next?

Calibration's ranking stage (``kvguard/calibration/ranking.py``) orders the closest candidates at 0.75 and 0.60 x B4 by
their KL on one stream per domain, which for dialog and code is one or two documents. This script scores the same
candidates on ``--streams`` further streams per domain of ``--tokens`` tokens each, from the calibration documents
after every one the profile read (samples, held-out slice and ranking streams; never the evaluation split), one stream
at a time. For each pair of candidates at a budget it prints on how many streams the first has the lower KL and the
spread of their log KL ratio, so that a ranking margin can be read against the stream-to-stream noise:

    python benchmarks/ranking_noise.py --model smollm2-135m \\
        --profile benchmarks/profiles/smollm2-135m-512-rank2048 --streams 4 --tokens 2048
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from kvguard import data
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.samples import _heldout_stream

from ranking_length import load_ranked  # run as a script: benchmarks/ is on sys.path


def unread_streams(meta: dict, tokenizer, count: int, tokens: int) -> list[tuple[str, torch.Tensor]]:
    """``count`` streams of ``tokens`` tokens per domain, ``(domain, [tokens])``, from the calibration documents past
    every held-out, sample and ranking document of the profile, each stream from its own documents."""
    bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None
    sep = tokenizer(data.DOC_SEPARATOR, add_special_tokens=False)["input_ids"]
    out = []
    for domain, d in meta["data"]["domains"].items():
        read = d["heldout_documents"] + d["documents"] + d.get("ranking_documents", 0)
        docs = itertools.islice(data.iter_documents(domain, "calib", tokenizer), read, None)
        for i in range(count):
            out.append((domain, _heldout_stream(docs, tokenizer, bos, sep, tokens, domain, f"stream {i}")[0]))
    return out


def pair_lines(budgets: list[dict], kl: dict[str, list[float]]) -> list[str]:
    """Per budget and pair of candidates: streams where the first is lower, mean and spread of ln(KL_a / KL_b)."""
    lines = ["| budget | a | b | a lower on | mean ln(a / b) | std | ranking stream's ln(a / b) |",
             "|---|---|---|---|---|---|---|"]
    for b in budgets:
        for x, y in itertools.combinations(b["kl"], 2):
            logs = [math.log(p / q) for p, q in zip(kl[x], kl[y])]
            lines.append(f"| <= {b['share']} x B4 | {x} | {y} | {sum(v < 0 for v in logs)} / {len(logs)} | "
                         f"{statistics.mean(logs):+.3f} | {statistics.stdev(logs):.3f} | "
                         f"{math.log(b['kl'][x] / b['kl'][y]):+.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile", required=True, type=Path)
    ap.add_argument("--streams", type=int, default=4, help="streams per domain")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per stream")
    ap.add_argument("--json", type=Path, help="also write the KLs here")
    args = ap.parse_args()

    ranked = load_ranked(args.model, args.profile)
    streams = unread_streams(ranked.meta, ranked.tokenizer, args.streams, args.tokens)
    labels = [f"{domain} {i % args.streams}" for i, (domain, _) in enumerate(streams)]
    kl: dict[str, list[float]] = {name: [] for name in ranked.plans}
    for label, (domain, ids) in zip(labels, streams):
        heldout, start = HeldOut(ranked.model, {domain: ids}), time.perf_counter()
        for name, plan in ranked.plans.items():
            kl[name].append(heldout.score(plan, ranked.scales).kl)
        print(f"[ranking_noise] {label}: " + "; ".join(f"{v[-1]:.5f}" for v in kl.values())
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    print("\n".join(f"{i}: {name}" for i, name in enumerate(ranked.plans)))
    print("\n".join(pair_lines(ranked.budgets, kl)))
    if args.json:
        args.json.write_text(json.dumps({"streams": labels, "kl": kl, "budgets": ranked.budgets}, indent=1))


if __name__ == "__main__":
    main()
