"""Foundation figures: model load times, FP16 equality, INT8 agreement and bytes ratios on real text.

    .venv/bin/python benchmarks/foundation.py [--model smollm2-135m]

Prints what the foundation's acceptance list asks for, measured in one run.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import DynamicCache

from kvguard import data, models
from kvguard.cache import KVGuardCache
from kvguard.scoring import score_stream


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t0


@torch.no_grad()
def top1_agreement(model, ids: torch.Tensor, precision: str, prefill: int) -> float:
    """Prefill, then teacher-force the rest one token at a time; top-1 agreement with the FP16 cache."""
    tops = {}
    for p in ("fp16", precision):
        cache = KVGuardCache(model.config, p)
        model(input_ids=ids[:, :prefill], cache=cache)
        tops[p] = torch.stack([
            model(input_ids=ids[:, t:t + 1], cache=cache).logits[0, -1].argmax()
            for t in range(prefill, ids.shape[1] - 1)
        ])
    return (tops["fp16"] == tops[precision]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in args.models.split(","):
        (model, tok), load_s = timed(models.load, name)
        print(f"\n## {name}: loaded in {load_s:.1f} s, fingerprint {models.fingerprint(model)}")

        prompt = data.token_stream("prose", "eval", tok, 540).unsqueeze(0)
        ref = model.generate(input_ids=prompt, max_new_tokens=24, do_sample=False, cache=DynamicCache(config=model.config))
        got = model.generate(input_ids=prompt, max_new_tokens=24, do_sample=False, cache=KVGuardCache(model.config, "fp16"))
        print(f"all-fp16 greedy == DynamicCache over 540 + 24 tokens: {torch.equal(ref, got)}")

        ids = data.token_stream("prose", "eval", tok, 513).unsqueeze(0)
        agree, secs = timed(top1_agreement, model, ids, "int8", 256)
        print(f"int8 top-1 agreement with fp16, 256 teacher-forced tokens after a 256-token prefill: {agree:.4f} ({secs:.0f} s)")

        long_ids = data.token_stream("long", "eval", tok, 2049)  # the last token is only a target: 2,048 enter the cache
        print("| cache | bytes at 2,048 tokens | vs FP16 | ppl (chunks of 256) |")
        print("|---|---|---|---|")
        for p in ("fp16", "int8", "int4", "int2"):
            cache = KVGuardCache(model.config, p)
            score = score_stream(model, long_ids, cache, chunk=256)
            print(f"| {p} | {cache.nbytes():,} | {cache.bytes_ratio():.4f} | {score.perplexity:.3f} |")


if __name__ == "__main__":
    main()
