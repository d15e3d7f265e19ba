"""Does the held-out slice rank close plans as longer calibration text does? (the calibration split only)

Level 2 of the search puts on the frontier, at each memory budget, the candidate with the lowest KL on the
held-out streams: 512 tokens per domain, taken from the first calibration documents, which for dialog and code is
one document each (the profile's ``data.heldout_documents``). The evaluation runs 2,048-token streams. This script
takes a profile's search-log candidates just under each budget and scores them four ways:

- ``held-out``: the held-out streams exactly as calibration builds them;
- ``capped``: as many tokens per domain, from more documents (at most ``--cap`` tokens of each);
- ``reference``: one ``--reference-tokens`` stream per domain from calibration documents past every held-out and
  sample document of the profile (never the evaluation split);
- ``short``: the reference streams cut to the held-out length: other documents, the same short context.

It prints every candidate's KL each way, each way's pick per budget with the reference's KL of that pick, and how
many pairs of candidates each way orders as the reference does:

    python benchmarks/heldout_ranking.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512

The reference costs about six times a held-out pass per candidate on SmolLM2 (attention grows with the square of
the length): about 37 s against 6 s on this machine (75 s before the simulation attended 128 queries at a time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from kvguard import data, models
from kvguard.architecture import Architecture
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.samples import _heldout_stream
from kvguard.plan import Plan
from kvguard.profile import Profile

WAYS = ("held-out", "capped", "short", "reference")


def _stream(docs, tokenizer, bos: int | None, sep: list[int], tokens: int, cap: int | None) -> torch.Tensor:
    """``tokens`` tokens of documents joined by the corpus separator, at most ``cap`` tokens of each."""
    stream = [] if bos is None else [bos]
    for used, doc in enumerate(docs):
        ids = tokenizer(doc.text[: (cap or tokens) * 16], add_special_tokens=False)["input_ids"][:cap]
        stream += (sep if used else []) + ids
        if len(stream) >= tokens:
            return torch.tensor(stream[:tokens], dtype=torch.long)
    raise ValueError(f"too few calibration documents for a {tokens}-token stream")


def streams(profile, tokenizer, cap: int, reference_tokens: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per way, domain -> token stream, as the module docstring describes."""
    bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None
    sep = tokenizer(data.DOC_SEPARATOR, add_special_tokens=False)["input_ids"]
    out = {way: {} for way in WAYS}
    for domain, d in profile.meta.data.domains.items():
        def docs():  # a fresh pass over the domain's calibration documents each time
            return data.iter_documents(domain, "calib", tokenizer)

        out["held-out"][domain] = _heldout_stream(docs(), tokenizer, bos, sep, d.heldout_tokens, domain)[0]
        out["capped"][domain] = _stream(docs(), tokenizer, bos, sep, d.heldout_tokens, cap)
        unused = itertools.islice(docs(), d.heldout_documents + d.documents, None)  # past what calibration read
        out["reference"][domain] = _stream(unused, tokenizer, bos, sep, reference_tokens, None)
        out["short"][domain] = out["reference"][domain][: d.heldout_tokens]
    return out


def candidates(log: list[dict], b4: float, budgets: list[float], band: float) -> dict[float, list[dict]]:
    """Per budget (a share of B4), the search-log candidates with memory in ``[budget - band, budget] x B4``."""
    return {b: [c for c in log if (b - band) * b4 <= c["memory"] <= b * b4] for b in budgets}


def report(kl: dict[str, dict[str, float]], memory: dict[str, float], groups: dict[float, list[dict]]) -> list[str]:
    """The markdown tables: every candidate's KL each way, then each way's pick per budget."""
    lines = ["| x B4 | candidate | " + " | ".join(WAYS) + " |", "|---|---|" + "---|" * len(WAYS)]
    for name in sorted(kl, key=lambda n: memory[n]):
        lines.append(f"| {memory[name]:.3f} | {name} | " + " | ".join(f"{kl[name][w]:.5f}" for w in WAYS) + " |")
    lines += ["", "| budget | way | pick | its reference KL | pairs ordered as the reference |", "|---|---|---|---|---|"]
    for budget, group in groups.items():
        names = [c["name"] for c in group]
        pairs = list(itertools.combinations(names, 2))
        for way in WAYS:
            pick = min(names, key=lambda n: kl[n][way])
            same = sum((kl[a][way] < kl[b][way]) == (kl[a]["reference"] < kl[b]["reference"]) for a, b in pairs)
            lines.append(f"| <= {budget} x B4 | {way} | {pick} | {kl[pick]['reference']:.5f} | {same} / {len(pairs)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile", required=True, type=Path)
    ap.add_argument("--budgets", default="0.60,0.75", help="shares of B4, the uniform int4 bytes ratio")
    ap.add_argument("--band", type=float, default=0.02, help="candidates within this share of B4 under each budget")
    ap.add_argument("--cap", type=int, default=256, help="most tokens of one document in the capped streams")
    ap.add_argument("--reference-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="also write the KLs here")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tokenizer = models.load(args.model)
    profile = Profile.load(args.profile)
    log = json.loads((args.profile / "profile.json").read_text())["search_log"]
    stored, fp16 = Plan.uniform(Architecture.from_config(model.config), "int4").kv_bytes(model.config, 2048)
    b4 = stored / fp16
    groups = candidates(log, b4, [float(b) for b in args.budgets.split(",")], args.band)
    chosen = {c["name"]: c for group in groups.values() for c in group}
    plans, scales = {name: Plan.from_dict(c["plan"]) for name, c in chosen.items()}, profile.static_scales()
    kl = {name: {} for name in chosen}
    for way, ways_streams in streams(profile, tokenizer, args.cap, args.reference_tokens).items():
        heldout, start = HeldOut(model, ways_streams), time.perf_counter()
        for name, plan in plans.items():
            kl[name][way] = heldout.score(plan, scales).kl
        print(f"[heldout_ranking] {way}: {len(chosen)} candidates in {time.perf_counter() - start:.0f} s", flush=True)
    print("\n".join(report(kl, {n: c["memory"] / b4 for n, c in chosen.items()}, groups)))
    if args.json:
        args.json.write_text(json.dumps({"b4": b4, "kl": kl}, indent=1))


if __name__ == "__main__":
    main()
