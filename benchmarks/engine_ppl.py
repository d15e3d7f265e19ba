"""Teacher-forced perplexity in vLLM against kvguard's prediction of it, on the same evaluation tokens.

    .venv/bin/python benchmarks/engine_ppl.py --export EXPORT_DIR --served SERVED_DIR [--tokens 1024]

vLLM scores the tokens with ``prompt_logprobs`` twice: the model's own folder (``auto`` cache: the model's
float32) and the served folder of an FP8 export (``kvguard check-engine`` builds it). kvguard scores the same
tokens with its ``fp16``, ``fp8`` (the exported scales, rounding to nearest as GPU engines do) and
``fp8:vllm-cpu`` (the same scales, rounding toward zero as vLLM's CPU build does) methods. vLLM's CPU build runs
an FP8 cache only on x86 with AVX-512 or AMX: elsewhere the FP8 rows say why it cannot run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvguard import data, models
from kvguard.evaluation import harness
from kvguard.export import engine_check
from kvguard.profile import Profile

ENGINE_PYTHON = ".venv-engines/bin/python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True)
    parser.add_argument("--served", required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--engine-python", default=ENGINE_PYTHON)
    args = parser.parse_args()
    manifest = json.loads((Path(args.export) / "kvguard_export.json").read_text())
    name = manifest["model"]["name"]
    model, tok = models.load(name)
    profile = Profile.load(manifest["profile"]["path"], model)
    ids = data.token_stream("prose", "eval", tok, args.tokens)
    names = ["fp16", manifest["eval_method"], "fp8:vllm-cpu"]
    rows = {r.method: r for r in harness.evaluate_stream(model, ids, "prose", names, profile=profile, progress=False)}
    del model
    engine = {"auto": engine_check.run_vllm(models.converted_dir(name), args.engine_python, tokens=ids.tolist()),
              "fp8": engine_check.run_vllm(args.served, args.engine_python, tokens=ids.tolist())}
    print(f"{name}, {args.tokens} evaluation tokens of prose (the eval split), teacher-forced; vLLM "
          f"{engine['fp8'].version}, CPU {engine['fp8'].cpu}")
    print()
    print("| cache | kvguard ppl | vLLM ppl | vLLM / kvguard |")
    print("|---|---|---|---|")
    for label, ours, theirs in (("FP16 (vLLM: auto, float32)", rows["fp16"], engine["auto"]),
                                (f"FP8, exported scales, kvguard `{manifest['eval_method']}` (to nearest)",
                                 rows[manifest["eval_method"]], engine["fp8"]),
                                ("FP8, exported scales, kvguard `fp8:vllm-cpu` (toward zero)", rows["fp8:vllm-cpu"],
                                 engine["fp8"])):
        if theirs.score is None:
            print(f"| {label} | {ours.ppl:.3f} | cannot run: {theirs.error} | - |")
        else:
            print(f"| {label} | {ours.ppl:.3f} | {theirs.score['ppl']:.3f} | {theirs.score['ppl'] / ours.ppl:.5f} |")
    if engine["fp8"].score is None:
        print()
        print(f"vLLM refused the FP8 cache here ({engine['fp8'].error}); with no GPU either, the in-engine FP8 "
              f"comparison cannot run on this machine.")


if __name__ == "__main__":
    main()
