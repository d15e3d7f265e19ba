"""Decode step time of the fused read against today's materialized read, interleaved in one process.

One prefill (a DynamicCache) gives every layer's prompt K/V; each cache under test is filled from them with the
same ``update`` call the model's prefill makes, so all start from the same state. Then every cache decodes the
same greedy tokens, one step each in turn, so a loaded machine slows every variant alike; the medians and their
ratio to ``fp16`` (fused) come from the same run.

    python benchmarks/fused_decode.py --context 4096 --steps 16 --precisions fp16,int4,int2
    python benchmarks/fused_decode.py --context 4096 --precisions fp16,int2,kvguard@0.22 --profile P   # a plan too
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from kvguard import data, models
from kvguard.cache import KVGuardCache
from kvguard.control.decoding import CacheDecoder
from kvguard.evaluation import methods
from kvguard.profile import Profile


def _filled(model, prompt_cache: DynamicCache, precision: str, profile) -> KVGuardCache:
    """A cache of one precision, or of a method's plan (``kvguard``, ``kvguard@0.22``: needs ``--profile``)."""
    try:
        cache = KVGuardCache(model.config, precision)
    except ValueError:
        cache = methods.get(precision, profile).make_cache(model)
    for idx, layer in enumerate(prompt_cache.layers):
        cache.update(layer.keys, layer.values, idx)
    return cache


def interleaved(decoders: dict[str, CacheDecoder], tokens: dict[str, int], steps: int) -> dict[str, list[float]]:
    """Seconds per decode step of each decoder, over ``steps`` greedy steps taken one decoder after another (so
    a drifting machine slows them alike), each starting from its ``tokens`` entry; a first step warms up."""
    tokens = dict(tokens)
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    for step in range(steps + 1):
        for name, decoder in decoders.items():
            started = time.perf_counter()
            logits = decoder.step(tokens[name])
            if step:
                seconds[name].append(time.perf_counter() - started)
            tokens[name] = int(logits.argmax())
    return seconds


def print_medians(seconds: dict[str, list[float]], base: str, title: str) -> None:
    """A Markdown table of each decoder's median step time, tok/s and speed relative to ``base``."""
    reference = statistics.median(seconds[base])
    print(f"| {title} | median ms/step | tok/s | vs {base} |")
    print("|---|---|---|---|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {1 / median:.2f} | {reference / median:.2f} |")


def parser(description: str, steps: int = 16, precisions: str = "fp16,int4,int2") -> argparse.ArgumentParser:
    """The decode benchmarks' command line: model, context, steps, precisions or plans, profile."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--precisions", default=precisions, help="precisions or plan methods (kvguard@0.22)")
    p.add_argument("--profile", help="calibration profile, for plan methods")
    return p


@torch.no_grad()
def prefilled(args: argparse.Namespace) -> tuple:
    """``(model, profile, prompt_cache, first token)``: the model, its profile (``--profile``), a DynamicCache
    holding ``--context`` tokens of unseen long text, and the greedy token after them."""
    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model) if args.profile else None
    ids = data.token_stream("long", "eval", tok, args.context).reshape(1, -1)
    prompt_cache = DynamicCache(config=model.config)
    first = int(model(input_ids=ids, cache=prompt_cache, use_cache=True).logits[0, -1].argmax())
    return model, profile, prompt_cache, first


@torch.no_grad()
def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    model, profile, prompt_cache, first = prefilled(args)
    decoders = {}
    for precision in args.precisions.split(","):
        cache = _filled(model, prompt_cache, precision, profile)
        decoders[f"{precision} fused"] = CacheDecoder(model, cache, fused=True)
        decoders[f"{precision} materialized"] = CacheDecoder(model, copy.deepcopy(cache), fused=False)
    seconds = interleaved(decoders, {name: first for name in decoders}, args.steps)
    print_medians(seconds, f"{args.precisions.split(',')[0]} fused", f"context {args.context}")


if __name__ == "__main__":
    main()
