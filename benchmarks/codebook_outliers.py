"""Below 4 bits, two more storage formats measured on their own at a fixed budget: calibrated non-uniform
levels (a codebook per layer and side) and full-precision outliers.

    .venv/bin/python benchmarks/codebook_outliers.py --model smollm2-135m --corpus prose,code,dialog --tokens 2048 \
        --json benchmarks/results/smollm2-135m-codebook-outliers.json

- **codebook** (``+cb``): the group's ``[min, max]`` is mapped onto ``2**bits`` levels as by the quantizer, but
  the levels inside it are not evenly spaced: per layer and side (K / V), and per rotation, Lloyd-Max levels
  fitted on the normalized values ``(x - min) / (max - min)`` of **calibration** text (the ``calib`` split of
  every corpus; scoring uses the ``eval`` split). The two end levels stay at 0 and 1, so each group's extremes
  stay exact. Bytes: ``2**bits`` float16 levels per layer and side, on top of the uniform format.
- **outliers** (``+ol``): per token and KV head, the ``--outliers`` largest-magnitude channels of each side are
  kept in float16 (value + a one-byte channel index: 3 bytes each) and left out of their group's range.

Both run through the exact chunk-1 simulation (``kvguard.simulate``'s ``codec``); neither is in the cache yet:
this measures whether they would move the frontier. Every row is KL / top-1 / perplexity change against the
model's FP16 cache, with bytes over FP16's counted as for the other methods plus the format's own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import torch
from lowbit import print_table  # run as a script: benchmarks/ is on sys.path

from kvguard import rotation
from kvguard.quantizer import _MIN_SCALE, SCALE_DTYPE, Axis, QuantSpec

DEFAULT_METHODS = ("int3,int3+cb,int3+ol,int3+rot,int3+rot+cb,int3+rot+ol,"
                   "int2+rot,int2+rot+cb,int2+rot+ol,int2+rot+cb+ol")
LLOYD_STEPS = 40
FIT_SAMPLE = 400_000  # normalized values per (layer, side, bits, rotation) the levels are fitted on


def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``[B, 1, T, D]`` -> groups on the last axis: ``[B, 1, T/G, D, G]`` (keys) or ``[B, 1, T, D/G, G]``."""
    b, h, t, d = x.shape
    g = spec.group_size
    if spec.axis is Axis.CHANNEL:
        return x.reshape(b, h, t // g, g, d).transpose(-1, -2)
    return x.reshape(b, h, t, d // g, g)


def _ungrouped(y: torch.Tensor, spec: QuantSpec, shape) -> torch.Tensor:
    if spec.axis is Axis.CHANNEL:
        return y.transpose(-1, -2).reshape(shape)
    return y.reshape(shape)


def _range(grouped: torch.Tensor, spec: QuantSpec, keep: torch.Tensor | None):
    """The quantizer's float16-rounded zero point and span per group, over the kept values only."""
    lo = grouped if keep is None else grouped.masked_fill(~keep, math.inf)
    hi = grouped if keep is None else grouped.masked_fill(~keep, -math.inf)
    lo, hi = lo.amin(-1, keepdim=True), hi.amax(-1, keepdim=True)
    if spec.clip < 1.0:
        centre, half = (hi + lo) / 2, (hi - lo) / 2 * spec.clip
        lo, hi = centre - half, centre + half
    scale = ((hi - lo) / (spec.levels - 1)).to(SCALE_DTYPE).clamp(min=_MIN_SCALE).to(torch.float32)
    zero = lo.to(SCALE_DTYPE).to(torch.float32)
    return zero, scale * (spec.levels - 1)


def _outlier_mask(x: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, 1, T, D]``: True for each token's ``count`` largest-magnitude channels."""
    idx = x.abs().topk(count, dim=-1).indices
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)


@dataclass
class Format:
    """One experimental storage format: levels per (layer, keys, bits) or None (uniform), outliers per token."""

    levels: dict | None
    outliers: int

    def __call__(self, x: torch.Tensor, spec: QuantSpec, layer: int, keys: bool) -> torch.Tensor:
        mask = _outlier_mask(x, self.outliers) if self.outliers else None
        grouped = _grouped(x, spec)
        keep = None if mask is None else ~_grouped(mask, spec)
        zero, span = _range(grouped, spec, keep)
        u = ((grouped - zero) / span).clamp(0, 1)
        if self.levels is None:
            read = torch.round(u * (spec.levels - 1)) / (spec.levels - 1)
        else:
            c = self.levels[(layer, keys, spec.precision.bits)]
            read = c[torch.bucketize(u.contiguous(), (c[1:] + c[:-1]) / 2)]
        out = _ungrouped(zero + read * span, spec, x.shape)
        if mask is not None:
            out = torch.where(mask, x.to(SCALE_DTYPE).to(torch.float32), out)
        return out


def _lloyd(u: torch.Tensor, levels: int) -> torch.Tensor:
    """Lloyd-Max levels on ``[0, 1]`` for the samples ``u``, the two ends fixed at 0 and 1."""
    c = torch.linspace(0, 1, levels)
    for _ in range(LLOYD_STEPS):
        code = torch.bucketize(u, (c[1:] + c[:-1]) / 2)
        sums = torch.zeros(levels).index_add_(0, code, u)
        counts = torch.zeros(levels).index_add_(0, code, torch.ones_like(u))
        inner = counts[1:-1] > 0
        c[1:-1] = torch.where(inner, sums[1:-1] / counts[1:-1].clamp(min=1), c[1:-1])
        c = c.sort().values
    return c


@torch.no_grad()
def calibration_kv(model, calib_ids: list[torch.Tensor]) -> dict[int, list]:
    """Per layer, the ``(keys, values)`` ``[1, H, T, D]`` (float32) of each calibration stream."""
    from transformers import DynamicCache

    kv: dict[int, list] = {}
    for ids in calib_ids:
        cache = DynamicCache()
        model(input_ids=ids.reshape(1, -1), past_key_values=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            kv.setdefault(i, []).append((layer.keys.float(), layer.values.float()))
    return kv


@torch.no_grad()
def fit_levels(model, calib_ids: list[torch.Tensor], bits_list, rotate_list, group_size: int) -> dict:
    """Codebooks ``{(layer, keys, bits): levels}`` per rotation setting, from K/V of calibration text."""
    kv = calibration_kv(model, calib_ids)
    gen = torch.Generator().manual_seed(0)
    books: dict[bool, dict] = {r: {} for r in rotate_list}
    for i, pairs in kv.items():
        heads, dim = pairs[0][0].shape[1], pairs[0][0].shape[-1]
        signs = rotation.signs(dim, heads, i, pairs[0][0].device)
        for rotated in rotate_list:
            for keys in (True, False):
                spec_axis = Axis.CHANNEL if keys else Axis.TOKEN
                xs = []
                for k, v in pairs:
                    x = k if keys else v
                    x = rotation.rotate(x, signs) if rotated else x
                    t = x.shape[2] // group_size * group_size
                    xs.append(x[:, :, :t])
                for bits in bits_list:
                    spec = QuantSpec(f"int{bits}", spec_axis, group_size)
                    us = []
                    for x in xs:
                        for h in range(heads):
                            grouped = _grouped(x[:, h:h + 1], spec)
                            zero, span = _range(grouped, spec, None)
                            us.append(((grouped - zero) / span).clamp(0, 1).reshape(-1))
                    u = torch.cat(us)
                    u = u[torch.randperm(u.numel(), generator=gen)[:FIT_SAMPLE]]
                    books[rotated][(i, keys, bits)] = _lloyd(u, 2 ** bits)
    return books


def _parse(name: str) -> tuple[str, bool, bool]:
    """``int3+rot+cb+ol`` -> (``int3+rot``, codebook, outliers)."""
    parts = name.split("+")
    cb, ol = "cb" in parts, "ol" in parts
    base = "+".join(p for p in parts if p not in ("cb", "ol"))
    return base, cb, ol


def _format_bytes(plan, arch, tokens: int, cb: bool, outliers: int) -> int:
    """Bytes the format adds to the plan's: codebooks per layer and side, 3 bytes per outlier."""
    from kvguard.simulate import quantize_switch_points

    end, _ = quantize_switch_points(tokens, plan)
    quantized = max(0, end - plan.cache.sinks)
    low = [sum(p.is_quantized and p.bits < 8 for p in lp.precision) for lp in plan.layers]
    total = 0
    if cb:
        total += sum(2 * 2 * (2 ** max(p.bits for p in lp.precision)) for lp, n in zip(plan.layers, low) if n)
    total += outliers * 3 * 2 * quantized * sum(low)
    return total


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.scoring import score_logits, score_simulated
    from kvguard.simulate import simulate_logits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="prose,code,dialog")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens per corpus for the levels")
    p.add_argument("--outliers", type=int, default=1, help="full-precision channels per token, KV head and side")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tok = models.load(args.model)
    arch = Architecture.from_config(model.config)
    names = args.methods.split(",")
    corpora = args.corpus.split(",")
    group = Plan.uniform(arch, "int4").cache.group_size
    calib = [data.token_stream(c, "calib", tok, args.calib_tokens) for c in corpora]
    rotate_list = sorted({"rot" in _parse(n)[0] for n in names if _parse(n)[1]})
    bits_list = sorted({int(_parse(n)[0][3]) for n in names if _parse(n)[1]})
    books = fit_levels(model, calib, bits_list, rotate_list, group) if rotate_list else {}
    for rotated, book in books.items():
        for bits in bits_list:
            print(f"levels int{bits} rot={rotated} layer 0 keys {[round(float(v), 3) for v in book[(0, True, bits)]]} "
                  f"values {[round(float(v), 3) for v in book[(0, False, bits)]]}", flush=True)
    rows = []
    for corpus in corpora:
        ids = data.token_stream(corpus, "eval", tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        print(f"{corpus}: fp16 ppl {fp.perplexity:.3f}", flush=True)
        for name in names:
            base, cb, ol = _parse(name)
            plan = methods.get(base).plan(arch)
            rotated = any(lp.key_rotation or lp.value_rotation for lp in plan.layers)
            codec = Format(books[rotated] if cb else None, args.outliers if ol else 0) if (cb or ol) else None
            logits = simulate_logits(model, ids[:-1], plan, codec=codec)
            score = score_logits(ids, [logits], reference=reference)
            stored, fp16 = plan.kv_bytes(model.config, ids.numel() - 1)
            stored += _format_bytes(plan, arch, ids.numel() - 1, cb, args.outliers if ol else 0)
            row = {"corpus": corpus, "method": name, "bytes_ratio": stored / fp16, "ppl": score.perplexity,
                   "ppl_delta_pct": 100.0 * (math.exp(score.nll - fp.nll) - 1.0), "kl": score.kl,
                   "top1_agree": score.top1_agree}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "outliers": args.outliers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
