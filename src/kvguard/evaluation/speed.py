"""Decode speed and peak memory per method, side by side.

Each (method, context) runs in a fresh Python process so its peak resident memory is its own; the processes
run one after another on the same machine, and ratios are taken against ``fp16`` from the same run.

    python -m kvguard.evaluation.speed --model smollm2-135m --method int4 --context 1024 --new-tokens 64   # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


@torch.no_grad()
def measure(model_name: str, method_name: str, context: int, new_tokens: int, profile_path: str | None = None) -> dict:
    """Prefill ``context`` tokens of held-out text, then time ``new_tokens`` greedy decode steps (the feedback
    loop's monitoring steps and any compensation they trigger included, for live methods)."""
    from kvguard import data, models
    from kvguard.control.decoding import CacheDecoder, generate
    from kvguard.evaluation import methods
    from kvguard.profile import Profile

    model, tok = models.load(model_name)
    method = methods.get(method_name, Profile.load(profile_path, model) if profile_path else None)
    ids = data.token_stream("long", "eval", tok, context)
    decoder = method.session(model) if method.live else CacheDecoder(model, method.make_cache(model))
    started: list[float] = []
    # new_tokens + 1 tokens: the clock starts at the first (the prefill's), then new_tokens steps follow.
    generate(decoder, ids, new_tokens + 1, on_token=lambda _: started.append(time.perf_counter()) if not started else None)
    seconds = time.perf_counter() - started[0]
    cache = decoder.cache
    extra = {}
    if method.live:
        extra = {"monitoring_steps": decoder.counters.steps, "acted_steps": decoder.counters.acted_steps}
    return _row(method_name, context, new_tokens, seconds, *methods.kv_bytes(cache), **extra)


def _row(method_name: str, context: int, new_tokens: int, seconds: float, stored: int, fp16: int, **extra) -> dict:
    return {
        "method": method_name,
        "context": context,
        "new_tokens": new_tokens,
        "tok_s": new_tokens / seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "kv_bytes": stored,
        "kv_bytes_ratio": stored / fp16,
        **extra,
    }


def run(model_name: str, method_names: list[str], contexts: list[int], new_tokens: int, progress: bool = True,
        profile_path: str | None = None) -> list[dict]:
    """One subprocess per (context, method); adds ``tok_s_ratio`` and ``peak_rss_ratio`` against ``fp16``."""
    names = ["fp16"] + [n for n in method_names if n != "fp16"]
    rows = []
    for context in contexts:
        base = None
        for name in names:
            if progress:
                print(f"[kvguard eval] speed: {name} at {context} tokens", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "kvguard.evaluation.speed", "--model", model_name, "--method", name,
                   "--context", str(context), "--new-tokens", str(new_tokens)]
            cmd += ["--profile", str(profile_path)] if profile_path else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if proc.returncode != 0:
                lines = (proc.stderr.strip() or "no output").splitlines()
                rows.append({"method": name, "context": context, "error": lines[-1]})
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            base = base or row
            row["tok_s_ratio"] = row["tok_s"] / base["tok_s"]
            row["peak_rss_ratio"] = row["peak_rss_mb"] / base["peak_rss_mb"]
            rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| context | method | tok/s | vs fp16 | peak RSS MiB | vs fp16 | kv_bytes_ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['method']} | unsupported: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['context']} | {r['method']} | {r['tok_s']:.2f} | {r['tok_s_ratio']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_ratio']:.2f} | {r['kv_bytes_ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard.evaluation.speed", description="one speed measurement, as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile", help="calibration profile (for the kvguard method)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(measure(args.model, args.method, args.context, args.new_tokens, args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
