"""How the ranking stage's order depends on its streams' length (the calibration split only).

Calibration's ranking stage (``kvguard/calibration/ranking.py``) scores the closest candidates at 0.75 and 0.60 x B4
again on one stream per domain from calibration documents no sample or held-out slice read. This script rebuilds a
profile's ranking streams exactly as calibration did and scores the same candidates on their first ``--lengths``
tokens per domain, printing each length's pick per budget:

    python benchmarks/ranking_length.py --model smollm2-135m \\
        --profile benchmarks/profiles/smollm2-135m-512-rank2048 --lengths 1024,1536,2048

The profile has to be calibrated with ranking streams at least as long as the longest length
(``kvguard calibrate --ranking-tokens 6144`` for 2,048 tokens per domain over three domains).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvguard import models
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.samples import calibration_text
from kvguard.plan import Plan
from kvguard.profile import Profile


def ranking_streams(meta: dict, tokenizer) -> dict[str, torch.Tensor]:
    """The profile's ranking streams, domain -> ``[tokens]``, rebuilt from its recorded settings."""
    d, s = meta["data"], meta["settings"]
    text = calibration_text(tokenizer, tuple(d["domains"]), d["samples"], d["max_tokens"], s["heldout_tokens"],
                            s["ranking_tokens"])
    if not text.ranking:
        raise SystemExit("the profile was calibrated without ranking streams")
    return text.ranking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile", required=True, type=Path)
    ap.add_argument("--lengths", default="1024,1536,2048", help="tokens per domain, comma-separated")
    ap.add_argument("--json", type=Path, help="also write the KLs here")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tokenizer = models.load(args.model)
    scales = Profile.load(args.profile).static_scales()
    meta = json.loads((args.profile / "profile.json").read_text())
    plans = {c["name"]: Plan.from_dict(c["plan"]) for c in meta["search_log"]}
    budgets = meta["ranking"]["budgets"]
    names = list(dict.fromkeys(n for b in budgets for n in b["kl"]))
    streams = ranking_streams(meta, tokenizer)
    shortest = min(int(s.numel()) for s in streams.values())
    kl: dict[int, dict[str, float]] = {}
    for n in (int(x) for x in args.lengths.split(",")):
        if n > shortest:
            raise SystemExit(f"the ranking streams hold {shortest} tokens per domain, not {n}")
        heldout, start = HeldOut(model, {d: s[:n] for d, s in streams.items()}), time.perf_counter()
        kl[n] = {name: heldout.score(plans[name], scales).kl for name in names}
        print(f"[ranking_length] {n} tokens per domain: {len(names)} candidates in {time.perf_counter() - start:.0f} s")
        for b in budgets:
            pick = min(b["kl"], key=kl[n].__getitem__)
            print(f"  <= {b['share']} x B4: " + "; ".join(f"{name}: {kl[n][name]:.5f}" for name in b["kl"])
                  + f"; pick {pick}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"budgets": budgets, "kl": kl}, indent=1))


if __name__ == "__main__":
    main()
