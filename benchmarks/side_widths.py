"""Keys and values at their own widths: every layer at one keys / values pair, measured on its own.

    .venv/bin/python benchmarks/side_widths.py --model gemma3-270m --split calib --corpus prose,code \
        --pairs int3/int3,int3/int2,int2/int3,int2/int2,int4/int3,int4/int2,int3/int4 [--json F]

Each pair is a uniform plan in the model's low-bit layout (``kvguard.calibration.search.low_bit_layout`` at the
stream's length) with both sides Hadamard-rotated, scored by the exact chunk-1 simulation against the model's
FP16 cache: KL, perplexity change, and the bytes the plan stores over FP16's. ``int3/int2`` stores INT3 keys and
INT2 values (``LayerPlan.value_drop``); a pair whose values are *above* their keys (``int2/int3``) is measured
through the simulation's codec, since plans only store values at or below their keys' tier, and its bytes are
the mean of the two uniform plans' (codes are the only bytes that differ between the tiers of one layout).
The calibration split is what chose the search's options; ``--split eval`` measures them on evaluation text.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import fixed_plans
import torch


def _drop(keys, values) -> int | None:
    """How many tiers below ``keys`` the ``values`` are, or ``None`` when they are above them."""
    return next((d for d in range(3) if keys.below(d) is values), None)


def _codec(values):
    """A simulation codec that stores the values at ``values`` and the keys as their spec says."""
    from kvguard.quantizer import quantize

    def codec(x, spec, layer, keys):
        # One-byte scales are for INT3 / INT2 only (kvguard.scale_codes): INT4 values keep float16 ones.
        spec = spec if keys else replace(spec, precision=values, scale_bits=spec.scale_bits if values.bits <= 3 else 16)
        return quantize(x, spec).dequantize(torch.float32)

    return codec


def _row(model, stream, pair, layout) -> dict:
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.precision import Precision

    arch = Architecture.from_config(model.config)
    keys, values = (Precision.parse(p) for p in pair.split("/"))
    drop = _drop(keys, values)
    tokens = stream.ids.numel() - 1

    def uniform(tier, d=0):
        return Plan.uniform(arch, tier, layout).with_rotation(True, True).with_value_drop(d)

    if drop is not None:
        plan, codec = uniform(keys, drop), None
        stored, fp16 = plan.kv_bytes(model.config, tokens)
    else:  # values above their keys: only through the codec
        plan, codec = uniform(keys), _codec(values)
        (k_bytes, fp16), (v_bytes, _) = (uniform(t).kv_bytes(model.config, tokens) for t in (keys, values))
        stored = (k_bytes + v_bytes) / 2
    return {"pair": pair, "bytes_ratio": stored / fp16, **fixed_plans.score(model, stream, plan, codec)}


def main(argv: list[str] | None = None) -> int:
    from kvguard.calibration.search import LAYOUTS

    p = fixed_plans.parser(__doc__, "gemma3-270m", 2048)
    p.add_argument("--pairs", default="int3/int3,int3/int2,int2/int3,int2/int2,int4/int3,int4/int2,int3/int4")
    args = p.parse_args(argv)
    model, tok, arch, layout_name = fixed_plans.setup(args)
    # The window in 16 bits: these uniform plans have no calibrated scales (and the table predates w8).
    layout = replace(LAYOUTS[layout_name], window_bits=16)
    rows = []
    for stream in fixed_plans.streams(model, tok, arch, args):
        for pair in args.pairs.split(","):
            row = {"corpus": stream.corpus, **_row(model, stream, pair, layout)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| corpus | keys / values | bytes / FP16 | KL | ppl change |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['pair']} | {r['bytes_ratio']:.3f} | {r['kl']:.5f} | {r['ppl_delta_pct']:+.2f} % |")
    fixed_plans.write_json(args, layout_name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
