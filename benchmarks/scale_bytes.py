"""One-byte scales and the per-group range search, each on and off, at fixed plans.

    .venv/bin/python benchmarks/scale_bytes.py --model smollm2-135m --split calib --corpus prose,code \
        --tokens 1024 [--json F]

Each tier (INT4, INT3, INT2) is a uniform plan in the model's low-bit layout
(``kvguard.calibration.search.low_bit_layout``), both sides Hadamard-rotated, the window in 16 bits (no calibrated
scales needed), scored by the exact chunk-1 simulation against the model's FP16 cache. The layout is taken four
ways: float16 scales and zero points or one byte each (``CacheConfig.scale_bits``; INT4 always keeps float16), and
each group's range as its ``[min, max]`` or searched (``CacheConfig.range_search``; a layout searches INT2's and
one-byte INT3's ranges only, so INT4 and float16 INT3 have one row per scale format). The bytes are what the cache
stores over FP16's at the stream's length. The calibration split is what chose these options; ``--split eval``
measures them on evaluation text. The rows that made the range search skip INT4 and float16 INT3 were measured
when it applied to every asymmetric tier (commit ``eddc2c5``): ``results/smollm2-135m-scale-bytes.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import fixed_plans

VARIANTS = ((16, False), (16, True), (8, False), (8, True))  # (scale_bits, range_search)


def _variants(base, tier):
    """The layouts of :data:`VARIANTS` that store ``tier`` differently, with their options (a layout applies
    one-byte scales to INT3 / INT2 only and the range search to INT2 and one-byte INT3 only; the same spec
    twice is measured once)."""
    from kvguard.precision import Precision
    from kvguard.quantizer import Axis

    seen = set()
    for scale_bits, search in VARIANTS:
        layout = replace(base, window_bits=16, scale_bits=scale_bits, range_search=search)
        spec = layout.quant_spec(Precision.parse(tier), Axis.TOKEN, 1.0)
        if spec not in seen:
            seen.add(spec)
            yield layout, spec.scale_bits, spec.range_search


def main(argv: list[str] | None = None) -> int:
    from kvguard.calibration.search import LAYOUTS
    from kvguard.evaluation import methods
    from kvguard.plan import Plan

    p = fixed_plans.parser(__doc__, "smollm2-135m", 1024)
    p.add_argument("--tiers", default="int4,int3,int2")
    args = p.parse_args(argv)
    model, tok, arch, layout_name = fixed_plans.setup(args)
    rows = []
    for stream in fixed_plans.streams(model, tok, arch, args):
        for tier in args.tiers.split(","):
            for layout, scale_bits, search in _variants(LAYOUTS[layout_name], tier):
                plan = Plan.uniform(arch, tier, layout).with_rotation(True, True)
                stored, fp16 = plan.kv_bytes(model.config, stream.ids.numel() - 1)
                row = {"corpus": stream.corpus, "tier": tier, "scale_bits": scale_bits, "range_search": search,
                       "bytes_ratio": stored / fp16, **fixed_plans.score(model, stream, plan)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| corpus | tier | scales | range | bytes / FP16 | KL | ppl change |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['tier']} | {r['scale_bits']}-bit | {'searched' if r['range_search'] else 'min-max'} "
              f"| {r['bytes_ratio']:.4f} | {r['kl']:.5f} | {r['ppl_delta_pct']:+.2f} % |")
    fixed_plans.write_json(args, layout_name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
