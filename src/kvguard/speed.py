"""Decode speed and peak memory per method, side by side.

Each (method, context) runs in a fresh Python process so its peak resident memory is its own; the processes
run one after another on the same machine, and ratios are taken against ``fp16`` from the same run.

    python -m kvguard.speed --model smollm2-135m --method int4 --context 1024 --new-tokens 64   # one JSON line
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
    """Prefill ``context`` tokens of held-out text, then time ``new_tokens`` greedy decode steps."""
    from kvguard import data, methods, models
    from kvguard.profile import Profile

    model, tok = models.load(model_name)
    method = methods.get(method_name, Profile.load(profile_path, model) if profile_path else None)
    ids = data.token_stream("long", "eval", tok, context).unsqueeze(0)
    if method.live:
        return _measure_live(method, model, ids, new_tokens, method_name, context)
    cache = method.make_cache(model)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    nxt = logits.argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    seconds = time.perf_counter() - t0
    return _row(method_name, context, new_tokens, seconds, *methods.kv_bytes(cache))


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


def _measure_live(method, model, ids, new_tokens: int, method_name: str, context: int) -> dict:
    """Decode speed under the feedback loop: prefill, then ``new_tokens`` greedy steps through the session
    (monitoring steps and any compensation they trigger included)."""
    session = method.session(model)
    nxt = int(session.prefill(ids[0]).argmax())
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = int(session.step(nxt).argmax())
    seconds = time.perf_counter() - t0
    return _row(method_name, context, new_tokens, seconds, session.cache.nbytes(), session.cache.fp16_nbytes(),
                monitoring_steps=session.counters.steps, acted_steps=session.counters.acted_steps)


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
            cmd = [sys.executable, "-m", "kvguard.speed", "--model", model_name, "--method", name,
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
    parser = argparse.ArgumentParser(prog="python -m kvguard.speed", description="one speed measurement, as JSON")
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
