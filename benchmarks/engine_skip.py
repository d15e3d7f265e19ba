"""The layers calibration keeps unquantized for each vLLM KV dtype under a memory budget, and the engine arguments.

    .venv/bin/python benchmarks/engine_skip.py --profile PROFILE [--int4-budget 0.32] [--budget 0.60] [--max-skip 4]

One model load and one FP16 reference on the profile's held-out calibration text, then the same chooser
``kvguard export --memory-budget`` runs (:func:`kvguard.calibration.engine_skip.choose`) for
``int4_per_token_head`` (under ``--int4-budget``) and ``int8_per_token_head`` / ``fp8`` (under ``--budget``:
alone they take about half of FP16). Prints each dtype's candidates and the arguments ``kvguard export`` prints.

    .venv/bin/python benchmarks/engine_skip.py --model gemma3-270m --domains prose --heldout-tokens 256 --dtypes int4_per_token_head

Without a profile (``--model``): the ranking is measured on the spot, on held-out calibration text, as
calibration's sensitivity stage measures its *alone* column (each layer alone at INT2, the others FP16); for a
model whose full calibration is too slow to run first. FP8 needs a profile (its scales).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvguard import models
from kvguard.calibration.engine_skip import choose, heldout_of
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.samples import calibration_text
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.export.skip_list import EngineDtype
from kvguard.fp8 import fp8_scales
from kvguard.plan import LayerPlan, Plan
from kvguard.precision import Precision
from kvguard.profile import Profile


def alone_ranking(heldout: HeldOut) -> Sensitivity:
    """Each layer alone at INT2 (the others FP16), scored on ``heldout``: the *alone* column of calibration's
    sensitivity stage, without the rest."""
    arch = heldout.arch
    fp16 = Plan.uniform(arch, Precision.FP16)
    alone = torch.tensor([heldout.score(fp16.replace_layer(i, LayerPlan((Precision.INT2,) * arch.num_kv_heads))).kl
                          for i in range(arch.num_layers)])
    n = arch.num_layers
    return Sensitivity(Precision.INT4, Precision.INT2, float("nan"), alone, torch.zeros(n), torch.zeros(n),
                       torch.full((n, arch.num_kv_heads), float("nan")))


def _inputs(args):
    """(name, held-out text, sensitivity, context, profile or None)."""
    if args.profile:
        profile = Profile.load(args.profile)
        model, tok = models.load(profile.model_name)
        profile.check_model(model)
        sens = Sensitivity.from_parts(profile.meta.record["sensitivity"], profile.tensors)
        return profile.model_name, heldout_of(profile, model, tok), sens, profile.meta.settings.context, profile
    model, tok = models.load(args.model)
    domains = tuple(args.domains.split(","))
    heldout = HeldOut(model, calibration_text(tok, domains, len(domains), 64, args.heldout_tokens).streams)
    return args.model, heldout, alone_ranking(heldout), args.context, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="calibration profile (its sensitivity ranking and held-out text)")
    parser.add_argument("--model", help="without a profile: measure the ranking on the spot")
    parser.add_argument("--domains", default="prose")
    parser.add_argument("--heldout-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--dtypes", default="int4_per_token_head,int8_per_token_head,fp8")
    parser.add_argument("--int4-budget", type=float, default=0.32)
    parser.add_argument("--budget", type=float, default=0.60)
    parser.add_argument("--max-skip", type=int, default=4)
    args = parser.parse_args()
    t0 = time.perf_counter()
    name, heldout, sens, context, profile = _inputs(args)
    print(f"{name}: held-out calibration text {heldout.tokens} tokens ({', '.join(heldout.streams)}), "
          f"memory at {context} tokens; sensitivity ranking (most sensitive first): {sens.layer_ranking()[:8]} ...")
    for dtype in map(EngineDtype.parse, args.dtypes.split(",")):
        budget = args.int4_budget if dtype is EngineDtype.INT4_PER_TOKEN_HEAD else args.budget
        scales = fp8_scales(profile) if dtype is EngineDtype.FP8 else None
        choice = choose(heldout, sens, dtype, budget, context=context, scales=scales, max_skip=args.max_skip)
        print(f"\n{dtype.value}, memory budget {budget} of FP16, at most {args.max_skip} layers skipped:\n")
        print(choice.table())
        print(f"\nengine arguments: {' '.join(choice.engine_args()) if choice.chosen else 'nothing fits the budget'}")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
