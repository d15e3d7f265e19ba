"""The layers calibration keeps unquantized for each vLLM KV dtype under a memory budget, and the engine arguments.

    .venv/bin/python benchmarks/engine_skip.py --profile PROFILE [--int4-budget 0.32] [--budget 0.60] [--max-skip 4]

One model load and one FP16 reference on the profile's held-out calibration text, then the same chooser
``kvguard export --memory-budget`` runs (:func:`kvguard.calibration.engine_skip.choose`) for
``int4_per_token_head`` (under ``--int4-budget``) and ``int8_per_token_head`` / ``fp8`` (under ``--budget``:
alone they take about half of FP16). Prints each dtype's candidates and the arguments ``kvguard export`` prints.
"""

from __future__ import annotations

import argparse
import time

from kvguard import models
from kvguard.calibration.engine_skip import EngineDtype, choose, heldout_of
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.fp8 import fp8_scales
from kvguard.profile import Profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--int4-budget", type=float, default=0.32)
    parser.add_argument("--budget", type=float, default=0.60)
    parser.add_argument("--max-skip", type=int, default=4)
    args = parser.parse_args()
    t0 = time.perf_counter()
    profile = Profile.load(args.profile)
    model, tok = models.load(profile.model_name)
    profile.check_model(model)
    heldout = heldout_of(profile, model, tok)
    sens = Sensitivity.from_parts(profile.meta.record["sensitivity"], profile.tensors)
    context = profile.meta.settings.context
    print(f"{profile.model_name}: held-out calibration text {heldout.tokens} tokens ({', '.join(heldout.streams)}), "
          f"memory at {context} tokens; sensitivity ranking (most sensitive first): {sens.layer_ranking()[:8]} ...")
    for dtype, budget in ((EngineDtype.INT4_PER_TOKEN_HEAD, args.int4_budget), (EngineDtype.INT8_PER_TOKEN_HEAD, args.budget),
                          (EngineDtype.FP8, args.budget)):
        scales = fp8_scales(profile) if dtype is EngineDtype.FP8 else None
        choice = choose(heldout, sens, dtype, budget, context=context, scales=scales, max_skip=args.max_skip)
        print(f"\n{dtype.value}, memory budget {budget} of FP16, at most {args.max_skip} layers skipped:\n")
        print(choice.table())
        print(f"\nengine arguments: {' '.join(choice.engine_args()) if choice.chosen else 'nothing fits the budget'}")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
