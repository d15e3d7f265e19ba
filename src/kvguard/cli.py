"""The ``kvguard`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvguard import __version__

# Subcommands that later work adds; listed so `kvguard --help` shows the whole shape of the tool.
_PLANNED = {
    "eval": "quality, memory and speed through the cache, side by side with peers (planned)",
    "calibrate": "model-specific calibration: statistics, sensitivity, mixed-precision plan (planned)",
    "generate": "decode with live entropy monitoring and compensation (planned)",
    "serve": "OpenAI-compatible server with Prometheus metrics (planned)",
    "report": "plots and an HTML page for a calibration profile (planned)",
    "export": "calibrated scales for vLLM / SGLang (planned)",
}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def cmd_models(args: argparse.Namespace) -> int:
    from kvguard import models

    rows = []
    for name, info in models.EMBEDDED.items():
        try:
            arch = models.describe(name)
        except models.ModelNotFoundError as err:
            rows.append([name, "not installed", "-", "-", "-", "-", str(err).split("; ")[-1]])
            continue
        converted = "yes" if (models.converted_dir(name) / "config.json").is_file() else "no (first load converts)"
        rows.append([
            name, arch.model_type, str(arch.num_layers), f"{arch.num_query_heads} / {arch.num_kv_heads}",
            str(arch.head_dim), arch.layer_type_summary() + (f" (window {arch.sliding_window})" if arch.sliding_window else ""),
            converted,
        ])
    _print_table(["model", "type", "layers", "query / KV heads", "head_dim", "attention layers", "converted"], rows)
    print(f"\nconverted models live under {models.kvguard_home() / 'models'} (set KVGUARD_HOME to move them)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: decode through the quantized cache and show memory saved and quality kept."""
    import torch
    from transformers import TextStreamer

    from kvguard import data, models
    from kvguard.cache import KVGuardCache
    from kvguard.evaluate import score_stream

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = models.load(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s "
          f"(fingerprint {models.fingerprint(model)[:19]}...)", flush=True)

    doc = data.documents("prose", "eval", limit=1, max_chars=1500)[0]
    question = f"Summarize this article in two sentences.\n\n{doc.text}"
    if tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    else:
        prompt = question + "\n\nSummary:"
    inputs = tok(prompt, return_tensors="pt", add_special_tokens=not tok.chat_template)
    cache = KVGuardCache(model.config, args.precision)
    print(f"\n--- generating through an all-{args.precision} KVGuardCache "
          f"(prompt: {inputs.input_ids.shape[1]} tokens, from eval article {doc.doc_id!r}) ---", flush=True)
    t0 = time.perf_counter()
    out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                         streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    new = out.shape[1] - inputs.input_ids.shape[1]
    dt = time.perf_counter() - t0
    print(f"--- {new} tokens in {dt:.1f} s ({new / dt:.1f} tok/s); KV cache {_fmt_bytes(cache.nbytes())} "
          f"vs {_fmt_bytes(cache.fp16_nbytes())} in FP16: {100 * (1 - cache.bytes_ratio()):.1f} % saved ---\n")

    ids = data.token_stream("prose", "eval", tok, args.tokens)
    print(f"perplexity through the cache: {args.tokens} tokens of held-out Wikipedia text, "
          f"fed in chunks of {args.chunk} so each chunk attends to the stored (quantized) past", flush=True)
    rows, ref = [], None
    for precision in ("fp16", "int8", "int4", "int2"):
        cache = KVGuardCache(model.config, precision)
        t0 = time.perf_counter()
        score = score_stream(model, ids, cache, chunk=args.chunk, progress=True, desc=precision)
        ref = score.perplexity if ref is None else ref
        rows.append([
            precision, _fmt_bytes(cache.nbytes()), f"{cache.bytes_ratio():.3f}", f"{100 * (1 - cache.bytes_ratio()):.1f} %",
            f"{score.perplexity:.3f}", f"{100 * (score.perplexity / ref - 1):+.2f} %", f"{time.perf_counter() - t0:.1f} s",
        ])
    _print_table(["cache", "KV bytes", "vs FP16", "saved", "ppl", "ppl delta", "time"], rows)
    return 0


def _planned(name: str):
    def run(args: argparse.Namespace) -> int:
        print(f"kvguard {name}: not available in kvguard {__version__} yet ({_PLANNED[name]})", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Calibrated KV-cache quantization for LLM inference, with real-time error compensation.",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("models", help="list the embedded models and their attention layout")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("run", help="main job: generate through the quantized cache, show memory saved and quality")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local model folder (default: %(default)s)")
    p.add_argument("--precision", default="int4", choices=["fp16", "int8", "int4", "int2"],
                   help="cache precision for the generation demo (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens for the perplexity table (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward pass when scoring (default: %(default)s)")
    p.set_defaults(func=cmd_run)

    for name, text in _PLANNED.items():
        sub.add_parser(name, help=text).set_defaults(func=_planned(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from kvguard.data import CorpusNotInstalledError
    from kvguard.models import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, CorpusNotInstalledError) as err:
        print(f"kvguard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
