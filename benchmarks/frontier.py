"""The calibrated low-bit frontier on evaluation text, next to the peers, and the low-bit targets checked.

    .venv/bin/python benchmarks/frontier.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512 \
        --corpus prose,code,dialog --tokens 2048 --json benchmarks/results/smollm2-135m-frontier.json

Evaluates (``kvguard eval``, chunk 1, the eval split) every Pareto-frontier plan of the profile at or below
the model's uniform-INT4 bytes (``kvguard@<bytes>``), the chosen plan and the uncalibrated methods, then
prints, per corpus, the frontier plan each target of the low-bit issue picks and whether it holds:

- at <= 0.60 x B4: KL below ``llamacpp-q4_0``'s (when measured; its ``--llamacpp`` JSON) and ppl <= +1.5 %;
- at <= 0.75 x B4: ppl <= +0.5 % and KL no higher than uniform ``int4``;
- at <= 0.45 x B4: ppl <= +4 %;

with B4 the uniform ``int4`` bytes ratio measured in the same run. ``--peers`` adds transformers' caches
(streamed token by token: minutes each), ``--llamacpp FILE`` reads llama.cpp's rows from a ``kvguard eval``
JSON of the same tokens. The JSON is ``kvguard eval``'s, so ``kvguard report --eval`` draws it. It also prints,
per corpus and peer, whether the peer lies below kvguard's frontier (:func:`peers_below`). ``--check A.json
B.json ...`` evaluates nothing and prints both checks over existing ``kvguard eval`` JSONs of the same tokens:

    .venv/bin/python benchmarks/frontier.py --check benchmarks/results/gemma3-270m-frontier-w16alloc.json \
        benchmarks/results/gemma3-270m-ppl.json benchmarks/results/gemma3-270m-llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

UNCALIBRATED = "int4,int3+rot,int2,int2+rot,kivi-4,kivi-2"
PEERS = "hf-quanto-4,hf-quanto-2,hf-hqq-4"
TARGETS = ((0.75, 0.5, "int4"), (0.60, 1.5, "llamacpp-q4_0"), (0.45, 4.0, None))  # (x B4, max ppl %, KL to beat)


def frontier_methods(profile_dir: Path, limit: float) -> list[str]:
    """``kvguard@<bytes>`` of every frontier point at or below ``limit`` bytes (held-out memory, exact repr)."""
    meta = json.loads((profile_dir / "profile.json").read_text())
    front = set(meta["pareto_front"])
    points = sorted(c["memory"] for c in meta["search_log"] if c["name"] in front and c["memory"] <= limit)
    return [f"kvguard@{m!r}" for m in points]


def check(rows: list[dict]) -> list[str]:
    """Per corpus and target: the frontier plan with the lowest KL within the bytes, and the verdict."""
    lines = ["| corpus | target | B4 | plan | bytes | ppl change | KL | to beat | holds |", "|---|---|---|---|---|---|---|---|---|"]
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        mine = {r["method"]: r for r in rows if r["corpus"] == corpus and not r.get("error")}
        b4 = mine["int4"]["kv_bytes_ratio"]
        calibrated = [r for m, r in mine.items() if m == "kvguard" or m.startswith("kvguard@")]
        for share, max_ppl, rival in TARGETS:
            within = [r for r in calibrated if r["kv_bytes_ratio"] <= share * b4 + 1e-9]
            rival_kl = mine[rival]["kl"] if rival in mine else None
            if not within:
                lines.append(f"| {corpus} | <= {share} x B4 | {b4:.3f} | none that small | | | | | no |")
                continue
            best = min(within, key=lambda r: r["kl"])
            holds = best["ppl_delta_pct"] <= max_ppl and (rival_kl is None or best["kl"] <= rival_kl)
            beat = "-" if rival is None else (f"{rival} {rival_kl:.5f}" if rival_kl is not None else f"{rival}: not measured")
            lines.append(f"| {corpus} | <= {share} x B4, ppl <= +{max_ppl} % | {b4:.3f} | {best['method']} | "
                         f"{best['kv_bytes_ratio']:.3f} | {best['ppl_delta_pct']:+.2f} % | {best['kl']:.5f} | {beat} | "
                         f"{'yes' if holds else 'no'} |")
    return lines


PEER_PREFIXES = ("kivi-", "hf-", "llamacpp-")
REFERENCES = ("llamacpp-f16",)  # llama.cpp's own FP16 reference: no compression, KL 0 by definition


def peers_below(rows: list[dict]) -> list[str]:
    """Per corpus and peer: kvguard's point with the lowest KL at equal or fewer bytes, and whether the peer lies
    below the frontier (a lower KL than every kvguard point at or under its bytes)."""
    lines = ["| corpus | peer | bytes | KL | kvguard at or under its bytes | bytes | KL | peer below |",
             "|---|---|---|---|---|---|---|---|"]
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        ok = [r for r in rows if r["corpus"] == corpus and not r.get("error") and r.get("kl") is not None]
        mine = [r for r in ok if r["method"] == "kvguard" or r["method"].startswith("kvguard@")]
        for peer in (r for r in ok if r["method"].startswith(PEER_PREFIXES) and r["method"] not in REFERENCES):
            within = [r for r in mine if r["kv_bytes_ratio"] <= peer["kv_bytes_ratio"] + 1e-9]
            best = min(within, key=lambda r: r["kl"]) if within else None
            below = best is None or peer["kl"] < best["kl"]
            theirs = f"{best['method']} | {best['kv_bytes_ratio']:.3f} | {best['kl']:.5f}" if best else "none | | "
            lines.append(f"| {corpus} | {peer['method']} | {peer['kv_bytes_ratio']:.3f} | {peer['kl']:.5f} | {theirs} | "
                         f"{'yes' if below else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from kvguard import cli
    from kvguard.evaluation.harness import write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--profile", type=Path)
    p.add_argument("--corpus", default="prose,code,dialog")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json", type=Path)
    p.add_argument("--peers", action="store_true", help=f"also {PEERS} (streamed, minutes each)")
    p.add_argument("--llamacpp", type=Path, help="a kvguard eval JSON with the llamacpp-* rows of the same tokens")
    p.add_argument("--limit", type=float, default=0.45, help="frontier points up to this many bytes of FP16")
    p.add_argument("--check", type=Path, nargs="+", metavar="JSON",
                   help="no evaluation: check these kvguard eval JSONs of the same tokens (targets and peers)")
    args = p.parse_args(argv)
    if args.check:
        rows = [r for f in args.check for r in json.loads(f.read_text())["results"]]
        print("\n".join(check(rows) + [""] + peers_below(rows)))
        return 0

    if not (args.model and args.profile and args.json):
        p.error("--model, --profile and --json are required unless --check is given")
    names = ["kvguard", *frontier_methods(args.profile, args.limit), *UNCALIBRATED.split(",")]
    names += PEERS.split(",") if args.peers else []
    code = cli.main(["eval", "--model", args.model, "--profile", str(args.profile), "--methods", ",".join(names),
                     "--corpus", args.corpus, "--tokens", str(args.tokens), "--json", str(args.json)])
    if code:
        return code
    payload = json.loads(args.json.read_text())
    if args.llamacpp:  # llama.cpp's rows (deltas against its own f16) join the same file for the report
        extra = [r for r in json.loads(args.llamacpp.read_text())["results"] if r["method"].startswith("llamacpp-")]
        payload["results"] += extra
        write_json(args.json, payload)
    print("\n".join(check(payload["results"]) + [""] + peers_below(payload["results"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
