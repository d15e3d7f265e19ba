"""Would calibrated levels (a codebook per layer and side) move the calibrated frontier? Each ``kvguard@<bytes>``
plan of a profile, on and off at its own bytes.

    .venv/bin/python benchmarks/codebook_plans.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512 \
        --methods kvguard@0.259,kvguard@0.207,kvguard@0.155 --corpus prose,code,dialog --tokens 2048 \
        --json benchmarks/results/smollm2-135m-codebook-plans.json

``benchmarks/codebook_outliers.py`` measured levels on the uniform formats (float16 scales, ``[min, max]``
ranges). The frontier's plans below 0.75 x B4 store their INT3 / INT2 heads with one-byte scales and searched
ranges, in an 8-bit window. Here each such head is stored as the plan stores it (the quantizer's own range, scale
and zero point, after the plan's rotation of that layer and side), but its codes index ``2**bits`` levels inside
that range, fitted by Lloyd-Max per layer, side and width on the normalized values of **calibration** text (the
``calib`` split of every corpus, the plan's own rotation; scoring uses the ``eval`` split). The two end levels stay
at 0 and 1. ``+cb3`` applies it to the INT3 heads only, ``+cb`` to INT3 and INT2. Bytes: ``2**bits`` float16
levels per layer, side and width used, on top of the plan's. Neither is in the cache or the search: this measures
whether they would move the frontier, through the exact chunk-1 simulation's ``codec``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from codebook_outliers import _lloyd, calibration_kv  # run as a script: benchmarks/ is on sys.path
from lowbit import logits_row, print_table

from kvguard import rotation
from kvguard.quantizer import Axis, QuantSpec, _expand, _group, quantize

FIT_SAMPLE = 400_000  # normalized values per (layer, side, bits) the levels are fitted on


def _normalized(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[B, 1, T, D]`` as the quantizer groups it, with each group's zero point and span (its stored
    range, searched or not, one-byte or float16): ``(u in [0, 1], zero, span)``, all grouped."""
    q = quantize(x, spec)
    scale = _expand(q.scales().to(torch.float32), spec)
    zero = _expand(q.zeros().to(torch.float32), spec)
    span = scale * (spec.levels - 1)
    grouped = _group(x.to(torch.float32), spec)
    return ((grouped - zero) / span).clamp(0, 1), zero, span


class Codebook:
    """The simulation's codec: heads of ``widths`` read through the fitted levels, others as the quantizer stores."""

    def __init__(self, levels: dict, widths: set[int]) -> None:
        self.levels, self.widths = levels, widths

    def __call__(self, x: torch.Tensor, spec: QuantSpec, layer: int, keys: bool) -> torch.Tensor:
        bits = spec.precision.bits
        if bits not in self.widths:
            return quantize(x, spec).dequantize(torch.float32)
        u, zero, span = _normalized(x, spec)
        c = self.levels[(layer, keys, bits)]
        read = c[torch.bucketize(u.contiguous(), (c[1:] + c[:-1]) / 2)]
        return (zero + read * span).reshape(x.shape)


@torch.no_grad()
def fit(model, plan, calib: list[torch.Tensor]) -> dict:
    """Levels ``{(layer, keys, bits): [2**bits]}`` for every width below 4 bits the plan uses, per layer and side,
    from K/V of calibration text as the plan stores them (its rotation, its cache layout's spec)."""
    kv = calibration_kv(model, calib)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, lp in enumerate(plan.layers):
        pairs = kv[i]
        heads, dim = pairs[0][0].shape[1], pairs[0][0].shape[-1]
        signs = rotation.signs(dim, heads, i, pairs[0][0].device)
        for keys, tiers, rotated, clip in ((True, lp.precision, lp.key_rotation, lp.key_clip),
                                           (False, lp.value_precision, lp.value_rotation, lp.value_clip)):
            for precision in sorted({p for p in tiers if p.is_quantized and p.bits < 4}, key=lambda p: p.bits):
                bits = precision.bits
                spec = plan.cache.quant_spec(precision, Axis.CHANNEL if keys else Axis.TOKEN, clip)
                us = []
                for k, v in pairs:
                    x = rotation.rotate(k if keys else v, signs) if rotated else (k if keys else v)
                    t = x.shape[2] // spec.group_size * spec.group_size if keys else x.shape[2]
                    for h in range(heads):
                        us.append(_normalized(x[:, h:h + 1, :t], spec)[0].reshape(-1))
                u = torch.cat(us)
                u = u[torch.randperm(u.numel(), generator=gen)[:FIT_SAMPLE]]
                out[(i, keys, bits)] = _lloyd(u, 2 ** bits)
    return out


def _codebook_bytes(levels: dict, widths: set[int]) -> int:
    return sum(2 * c.numel() for (_, _, bits), c in levels.items() if bits in widths)


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.profile import Profile
    from kvguard.scoring import score_simulated
    from kvguard.simulate import simulate_logits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", required=True)
    p.add_argument("--methods", required=True, help="kvguard@<bytes>,...: each is scored off, +cb3 and +cb")
    p.add_argument("--corpus", default="prose,code,dialog")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens per corpus for the levels")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    arch = Architecture.from_config(model.config)
    corpora = args.corpus.split(",")
    calib = [data.token_stream(c, "calib", tok, args.calib_tokens) for c in corpora]
    scales = profile.static_scales()
    fitted = {}
    for name in args.methods.split(","):
        plan = methods.get(name, profile).plan(arch)
        fitted[name] = (plan, fit(model, plan, calib))
        print(f"{name}: levels fitted for {len(fitted[name][1])} (layer, side, width)", flush=True)
    rows = []
    for corpus in corpora:
        ids = data.token_stream(corpus, "eval", tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        for name, (plan, levels) in fitted.items():
            for suffix, widths in (("", set()), ("+cb3", {3}), ("+cb", {2, 3})):
                codec = Codebook(levels, widths) if widths else None
                logits = simulate_logits(model, ids[:-1], plan, scales, codec=codec)
                stored, fp16 = plan.kv_bytes(model.config, ids.numel() - 1, scales)
                rows.append(logits_row(corpus, name + suffix, ids, logits, reference, fp.nll,
                                       stored + _codebook_bytes(levels, widths), fp16))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "calib_tokens": args.calib_tokens, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
