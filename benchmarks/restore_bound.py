"""How much of a plan's KL gap can restoring a few positions give back, at best?

    .venv/bin/python benchmarks/restore_bound.py --model smollm2-135m --profile P [--methods kvguard@0.22,int2]
        [--corpus prose,code,dialog] [--tokens 2048] [--fractions 0.02,0.05] [--json F]

The feedback loop's compensation puts full-precision K/V back at chosen positions (restored from the backing
tier, or recomputed). This measures the ceiling of that idea on evaluation-split text, with the exact chunk-1
simulation: per layer, the top ``f`` of the quantized positions by the attention mass they receive *over the
whole text* under FP16 (an oracle: the loop only knows the mass of the queries so far) are kept exact from the
start (also an oracle: the loop restores them after an alarm), and every other position is stored as the plan
stores it. ``random`` keeps as many positions chosen at random, the control. ``recovered`` is the share of the
plan's KL to FP16 that goes away. Heads with calibrated static INT8 scales keep their codes (their error is
the smallest). Nothing here is tuned.
"""

from __future__ import annotations

import argparse
import sys

import torch


def attention_mass(model, ids: torch.Tensor, plan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(mass, logits)`` under ``plan`` (FP16 here): per layer, ``[T]``, the attention each position receives,
    summed over heads and queries; and the logits ``[T, vocab]``."""
    from kvguard.simulate import simulate_logits

    mass: list[torch.Tensor] = []

    def observer(layer, probs, *rest) -> None:
        mass.append(probs.sum((0, 1, 2)))  # [B, H_q, T_q, T_k] -> [T_k]

    logits = simulate_logits(model, ids, plan, observer=observer)
    return mass, logits


def chosen_positions(mass: list[torch.Tensor], first: int, fraction: float, how: str) -> list[torch.Tensor]:
    """Per layer, indices into the quantized span (which starts at position ``first``) to keep exact."""
    out = []
    for layer, m in enumerate(mass):
        span = m[first:]
        k = max(1, int(fraction * span.numel()))
        if how == "mass":
            out.append(torch.topk(span, k).indices)
        else:
            out.append(torch.randperm(span.numel(), generator=torch.Generator().manual_seed(layer))[:k])
    return out


def keeping(chosen: list[torch.Tensor]):
    """A simulation codec: the quantizer's round trip, except the chosen positions, which stay exact."""
    from kvguard.quantizer import quantize

    def codec(x: torch.Tensor, spec, layer: int, keys: bool) -> torch.Tensor:
        out = quantize(x, spec).dequantize(torch.float32)  # [B, 1, T', D]
        idx = chosen[layer][chosen[layer] < x.shape[-2]]
        out[..., idx, :] = x[..., idx, :]
        return out

    return codec


def kl_to(reference: torch.Tensor, logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits, -1)
    return float((reference.exp() * (reference - logp)).sum(-1).mean())


def corpus_rows(model, tok, profile, corpus: str, tokens: int, names: list[str], fractions: list[float]) -> list[dict]:
    from kvguard import data
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.simulate import simulate_logits

    arch = Architecture.from_config(model.config)
    ids = data.token_stream(corpus, "eval", tok, tokens)[:-1]
    mass, fp16 = attention_mass(model, ids, Plan.uniform(arch, "fp16", profile.plan.cache))
    reference = torch.log_softmax(fp16, -1)
    rows = []
    for name in names:
        method = methods.get(name, profile)
        plan = method.plan(arch)
        base = kl_to(reference, simulate_logits(model, ids, plan, method.scales))
        rows.append({"corpus": corpus, "method": name, "kept": "none", "fraction": 0.0, "kl": base, "recovered": 0.0})
        print(f"[restore_bound] {corpus} {name}: KL {base:.5f}", file=sys.stderr, flush=True)
        for fraction in fractions:
            for how in ("mass", "random"):
                codec = keeping(chosen_positions(mass, plan.cache.sinks, fraction, how))
                kl = kl_to(reference, simulate_logits(model, ids, plan, method.scales, codec=codec))
                rows.append({"corpus": corpus, "method": name, "kept": how, "fraction": fraction, "kl": kl,
                             "recovered": 1 - kl / base})
                print(f"[restore_bound]   {how} {fraction:.2f}: KL {kl:.5f}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from kvguard import models
    from kvguard.profile import Profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--methods", default="kvguard@0.22,int2", help="static methods whose plan is measured")
    parser.add_argument("--corpus", default="prose,code,dialog")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--fractions", default="0.02,0.05", help="shares of a layer's quantized positions kept exact")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    with torch.no_grad():
        for corpus in args.corpus.split(","):
            rows += corpus_rows(model, tok, profile, corpus, args.tokens, args.methods.split(","), fractions)
    print("| corpus | plan | kept exact | share of positions | KL | KL gap recovered |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['method']} | {r['kept']} | {100 * r['fraction']:.0f} % | {r['kl']:.5f} | "
              f"{100 * r['recovered']:.1f} % |")
    if args.json:
        from kvguard.evaluation.harness import write_json

        write_json(args.json, {"model": args.model, "tokens": args.tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
