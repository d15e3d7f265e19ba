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
from dataclasses import dataclass
from pathlib import Path

import torch

from kvguard import models
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.samples import calibration_text
from kvguard.plan import Plan, StaticScales
from kvguard.profile import Profile


@dataclass(frozen=True)
class Ranked:
    """A profile's ranked candidates, ready to score again."""

    model: object
    tokenizer: object
    meta: dict  # profile.json
    scales: StaticScales
    plans: dict[str, Plan]  # the candidates the ranking stage scored, by name, in its order
    budgets: list[dict]  # profile.json's ranking budgets


def load_ranked(model_name: str, profile: Path) -> Ranked:
    torch.manual_seed(0)
    model, tokenizer = models.load(model_name)
    meta = json.loads((profile / "profile.json").read_text())
    if "ranking" not in meta:
        raise SystemExit(f"{profile} records no ranking stage")
    log = {c["name"]: c for c in meta["search_log"]}
    budgets = meta["ranking"]["budgets"]
    names = dict.fromkeys(n for b in budgets for n in b["kl"])
    plans = {name: Plan.from_dict(log[name]["plan"]) for name in names}
    return Ranked(model, tokenizer, meta, Profile.load(profile).static_scales(), plans, budgets)


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

    ranked = load_ranked(args.model, args.profile)
    streams = ranking_streams(ranked.meta, ranked.tokenizer)
    shortest = min(int(s.numel()) for s in streams.values())
    kl: dict[int, dict[str, float]] = {}
    for n in (int(x) for x in args.lengths.split(",")):
        if n > shortest:
            raise SystemExit(f"the ranking streams hold {shortest} tokens per domain, not {n}")
        heldout, start = HeldOut(ranked.model, {d: s[:n] for d, s in streams.items()}), time.perf_counter()
        kl[n] = {name: heldout.score(plan, ranked.scales).kl for name, plan in ranked.plans.items()}
        print(f"[ranking_length] {n} tokens per domain: {len(kl[n])} candidates in {time.perf_counter() - start:.0f} s")
        for b in ranked.budgets:
            pick = min(b["kl"], key=kl[n].__getitem__)
            print(f"  <= {b['share']} x B4: " + "; ".join(f"{name}: {kl[n][name]:.5f}" for name in b["kl"])
                  + f"; pick {pick}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"budgets": ranked.budgets, "kl": kl}, indent=1))


if __name__ == "__main__":
    main()
