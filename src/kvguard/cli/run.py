"""``kvguard run``: the main job on the embedded default model."""

from __future__ import annotations

import argparse
import time

from kvguard.cli.common import add_model, csv, fmt_bytes
from kvguard.cli.evaluate import DEFAULT_METHODS


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="main job: generate through the quantized cache, show memory saved and quality")
    add_model(p)
    p.add_argument("--precision", default="int4", choices=["fp16", "int8", "int4", "int2"],
                   help="cache precision for the generation demo (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens for the evaluation table (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="methods in the evaluation table (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Decode through the quantized cache and show memory saved and quality kept."""
    import torch

    from kvguard import data, models
    from kvguard.cache import KVGuardCache
    from kvguard.cli.generate import prompt_ids, token_printer
    from kvguard.control.decoding import CacheDecoder, generate
    from kvguard.evaluation import harness

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = models.load(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s "
          f"(fingerprint {models.fingerprint(model)[:19]}...)", flush=True)
    doc = data.documents("prose", "eval", limit=1, max_chars=1500)[0]
    ids = prompt_ids(tok, f"Summarize this article in two sentences.\n\n{doc.text}", raw=False)
    cache = KVGuardCache(model.config, args.precision)
    print(f"\n--- generating through an all-{args.precision} KVGuardCache "
          f"(prompt: {ids.numel()} tokens, from eval article {doc.doc_id!r}) ---", flush=True)
    t0 = time.perf_counter()
    out = generate(CacheDecoder(model, cache), ids, args.max_new_tokens, eos_token_id=tok.eos_token_id,
                   on_token=token_printer(tok))
    dt = time.perf_counter() - t0
    print(f"\n--- {len(out.tokens)} tokens in {dt:.1f} s ({len(out.tokens) / dt:.1f} tok/s); KV cache "
          f"{fmt_bytes(cache.nbytes())} vs {fmt_bytes(cache.fp16_nbytes())} in FP16: "
          f"{100 * (1 - cache.bytes_ratio()):.1f} % saved ---\n")
    print(f"evaluation: {args.tokens} tokens of held-out Wikipedia text, decoded token by token through each cache "
          f"(static methods by the exact parallel simulation), side by side with transformers' own quantized caches",
          flush=True)
    rows = harness.evaluate_stream(model, data.token_stream("prose", "eval", tok, args.tokens), "prose", csv(args.methods))
    print(harness.markdown_table(rows))
    return 0
