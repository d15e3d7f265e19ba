"""Decode speed and peak memory per method, side by side.

Each (method, context) runs in a fresh Python process so its peak resident memory is its own; the processes
run one after another on the same machine, and ratios are taken against ``fp16`` from the same run.

    python -m kvguard.evaluation.speed --model smollm2-135m --method int4 --context 1024 --new-tokens 64   # one JSON line

Every method is timed the same way, by :func:`time_decode`: prefill the same ``context`` tokens of held-out
text, then ``rounds`` consecutive blocks of ``new_tokens`` greedy steps through
:func:`kvguard.control.decoding.generate`, each block timed from its first token to its last, and the fastest
block counts (``kvguard eval --rounds``, 3 by default: this is a shared machine, and a block another process
interrupted measures that process, not the cache). ``kvguard eval --passes`` runs the whole list of methods that
many times in turn, since the machine's speed also drifts from one process to the next. The feedback loop's rows add ``tok_s_watching``: the same
with the time its compensation took left out (the loop watching, nothing acting). llama.cpp's own caches
(``llamacpp-*``) run that loop over
:func:`kvguard.peers.llamacpp.decoder` on the embedded model's GGUF, in a process that never loads the
transformers model (so its peak RSS is llama.cpp's alone); their rows also carry ``tok_s_vs_reference``,
the ratio to ``llamacpp-f16`` in the same run, the llama.cpp counterpart of kvguard's ``vs fp16``.
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


def time_decode(decoder, ids: torch.Tensor, new_tokens: int, rounds: int = 1,
                compensation_s=lambda: 0.0) -> list[tuple[float, float]]:
    """``(seconds, compensation seconds)`` of each of ``rounds`` consecutive blocks of ``new_tokens`` greedy
    decode steps after prefilling ``ids`` (prefill not counted). ``compensation_s()`` reads the decoder's
    cumulative time spent compensating (the feedback loop's recomputation and restores), sampled at the
    block boundaries."""
    from kvguard.control.decoding import generate

    marks: list[tuple[float, float]] = []
    drawn = [0]

    def mark(_) -> None:
        # Tokens 0, new_tokens, 2 * new_tokens, ... start the blocks (token 0 is the prefill's).
        if drawn[0] % new_tokens == 0:
            marks.append((time.perf_counter(), compensation_s()))
        drawn[0] += 1

    generate(decoder, ids, rounds * new_tokens + 1, on_token=mark)
    return [(t1 - t0, c1 - c0) for (t0, c0), (t1, c1) in zip(marks, marks[1:])]


PREFILL_CHUNK = 256  # the server's and the capacity probe's prompt chunk


def time_prefill(decoder, ids: torch.Tensor, chunk: int = PREFILL_CHUNK) -> float:
    """Seconds to feed ``ids`` through ``decoder`` in chunks of ``chunk`` tokens (a chunked prefill: each chunk
    attends to the stored history through the cache's reads)."""
    t0 = time.perf_counter()
    for start in range(0, ids.numel(), chunk):
        decoder.prefill(ids[start:start + chunk])
    return time.perf_counter() - t0


@torch.no_grad()
def measure(model_name: str, method_name: str, context: int, new_tokens: int, profile_path: str | None = None,
            device: str = "cpu", rounds: int = 1) -> dict:
    """Prefill ``context`` tokens of held-out text, then time ``rounds`` blocks of ``new_tokens`` greedy decode
    steps (the feedback loop's monitoring steps and any compensation they trigger included, for live methods)
    on ``device``; the row's ``tok_s`` is the fastest block's (see :func:`_row`). A cache without the loop is also
    timed over a chunked prefill of the same tokens into a fresh cache first (``prefill_tok_s``,
    :func:`time_prefill`)."""
    from kvguard import data, models
    from kvguard.control.decoding import CacheDecoder
    from kvguard.evaluation import methods
    from kvguard.peers import llamacpp
    from kvguard.profile import Profile

    if methods.reference_of(method_name) == llamacpp.REFERENCE:
        return _measure_llamacpp(model_name, llamacpp.SPECS[method_name], context, new_tokens, device, rounds)
    model, tok = models.load(model_name, device=device)
    method = methods.get(method_name, Profile.load(profile_path, model) if profile_path else None)
    ids = data.token_stream("long", "eval", tok, context)
    if not method.live:
        prefill_s = time_prefill(CacheDecoder(model, method.make_cache(model)), ids)
        decoder = CacheDecoder(model, method.make_cache(model))
        blocks = time_decode(decoder, ids, new_tokens, rounds)
        return _row(method_name, context, new_tokens, blocks, *methods.kv_bytes(decoder.cache),
                    prefill_tok_s=context / prefill_s)
    decoder = method.session(model)
    blocks = time_decode(decoder, ids, new_tokens, rounds, lambda: decoder.counters.recompute_ms / 1000)
    return _row(method_name, context, new_tokens, blocks, *methods.kv_bytes(decoder.cache),
                monitoring_steps=decoder.counters.steps, acted_steps=decoder.counters.acted_steps)


def _measure_llamacpp(model_name: str, spec, context: int, new_tokens: int, device: str, rounds: int) -> dict:
    """:func:`measure` for a llama.cpp cache: the same tokens and loop, in llama.cpp on the model's GGUF; bytes
    from GGML's blocks over the FP16 bytes kvguard counts for the same tokens (as the ppl rows do)."""
    from transformers import AutoConfig

    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.device import resolve
    from kvguard.evaluation import methods
    from kvguard.peers import llamacpp
    from kvguard.plan import Plan

    tok = models.load_tokenizer(model_name)
    ids = data.token_stream("long", "eval", tok, context)
    gguf = models.gguf_path(model_name) if model_name in models.EMBEDDED else None
    gpu = resolve(device).type == "cuda"
    with llamacpp.decoder(gguf, spec, n_ctx=context + rounds * new_tokens + 1, gpu=gpu) as engine:
        blocks = time_decode(engine, ids, new_tokens, rounds)
    config = AutoConfig.from_pretrained(models.resolve(model_name))
    # The cache holds the context and every decoded token but the last (which was never fed back).
    _, fp16 = Plan.uniform(Architecture.from_config(config), "fp16").kv_bytes(config, context + rounds * new_tokens)
    return _row(spec.name, context, new_tokens, blocks, llamacpp.kv_bytes(spec, fp16), fp16)


def _row(method_name: str, context: int, new_tokens: int, blocks: list[tuple[float, float]], stored: int, fp16: int,
         **extra) -> dict:
    """One method's row from its timed blocks (:func:`time_decode`). ``tok_s`` is the fastest block's: the
    blocks decode the same kind of steps at nearly the same context, so the slower ones measure what else the
    machine was doing. Live methods also get ``tok_s_watching``: the block with the least time outside
    compensation, its compensation time left out (the loop watching, nothing acting)."""
    row = {
        "method": method_name,
        "context": context,
        "new_tokens": new_tokens,
        "tok_s": new_tokens / min(s for s, _ in blocks),
        "block_tok_s": [new_tokens / s for s, _ in blocks],
        "all_blocks_tok_s": len(blocks) * new_tokens / sum(s for s, _ in blocks),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "kv_bytes": stored,
        "kv_bytes_ratio": stored / fp16,
        **extra,
    }
    if "acted_steps" in extra:
        row["compensation_s"] = sum(c for _, c in blocks)
        row["tok_s_watching"] = new_tokens / min(s - c for s, c in blocks)
    return row


def _measure_in_process(model_name: str, name: str, context: int, new_tokens: int, profile_path: str | None,
                        device: str, rounds: int) -> dict:
    """One (method, context) measurement in a fresh Python process: its row, or an error row."""
    cmd = [sys.executable, "-m", "kvguard.evaluation.speed", "--model", model_name, "--method", name,
           "--context", str(context), "--new-tokens", str(new_tokens), "--device", device, "--rounds", str(rounds)]
    cmd += ["--profile", str(profile_path)] if profile_path else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or "no output").splitlines()
        return {"method": name, "context": context, "error": lines[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def merge_passes(rows: list[dict]) -> dict:
    """One method's rows from several passes as one row: every pass's blocks, the fastest block's ``tok_s``
    (and ``tok_s_watching``), the highest peak RSS, the compensation and step counts summed."""
    errors = [r for r in rows if "error" in r]
    if errors or len(rows) == 1:
        return (errors or rows)[0]
    row = dict(rows[0])
    new_tokens = row["new_tokens"]
    blocks = [b for r in rows for b in r["block_tok_s"]]
    row.update(tok_s=max(blocks), block_tok_s=blocks, passes=len(rows),
               all_blocks_tok_s=len(blocks) * new_tokens / sum(new_tokens / b for b in blocks),
               peak_rss_mb=max(r["peak_rss_mb"] for r in rows))
    if "prefill_tok_s" in row:
        row["prefill_tok_s"] = max(r["prefill_tok_s"] for r in rows)
    if "tok_s_watching" in row:
        row["tok_s_watching"] = max(r["tok_s_watching"] for r in rows)
        for key in ("compensation_s", "monitoring_steps", "acted_steps"):
            row[key] = sum(r[key] for r in rows)
    return row


def run(model_name: str, method_names: list[str], contexts: list[int], new_tokens: int, progress: bool = True,
        profile_path: str | None = None, device: str = "cpu", rounds: int = 1, passes: int = 1) -> list[dict]:
    """One subprocess per (pass, context, method); adds ``tok_s_ratio`` and ``peak_rss_ratio`` against
    ``fp16``, and for llama.cpp's caches ``tok_s_vs_reference`` against ``llamacpp-f16`` (run first among
    them). With ``passes`` > 1 the whole list of methods runs that many times in turn, so a machine whose speed
    drifts from one process to the next (it does, idle or not) gives every method its fast and slow turns;
    :func:`merge_passes` keeps each method's fastest block."""
    from kvguard.device import name as device_name
    from kvguard.evaluation import methods
    from kvguard.peers import llamacpp

    in_llamacpp = [n for n in method_names if methods.reference_of(n) == llamacpp.REFERENCE]
    names = ["fp16"] + [n for n in method_names if n != "fp16" and n not in in_llamacpp]
    names += [llamacpp.REFERENCE] + [n for n in in_llamacpp if n != llamacpp.REFERENCE] if in_llamacpp else []
    device = device_name(device)  # auto resolved once here: every subprocess runs on the same device
    rows = []
    for context in contexts:
        measured: dict[str, list[dict]] = {name: [] for name in names}
        for turn in range(passes):
            for name in names:
                if progress:
                    what = f" (pass {turn + 1} of {passes})" if passes > 1 else ""
                    print(f"[kvguard eval] speed: {name} at {context} tokens{what}", file=sys.stderr, flush=True)
                measured[name].append(_measure_in_process(model_name, name, context, new_tokens, profile_path,
                                                          device, rounds))
        rows += _with_ratios([merge_passes(measured[name]) for name in names], in_llamacpp, llamacpp.REFERENCE)
    return rows


def _with_ratios(rows: list[dict], in_llamacpp: list[str], reference_name: str) -> list[dict]:
    """One context's rows (``fp16`` first) with their ratios to ``fp16`` and, for llama.cpp's, to its f16."""
    ok = [r for r in rows if "error" not in r]
    base = ok[0] if ok else None
    reference = next((r for r in ok if r["method"] == reference_name), None)
    for row in ok:
        row["tok_s_ratio"] = row["tok_s"] / base["tok_s"]
        row["peak_rss_ratio"] = row["peak_rss_mb"] / base["peak_rss_mb"]
        if "prefill_tok_s" in row and "prefill_tok_s" in base:
            row["prefill_ratio"] = row["prefill_tok_s"] / base["prefill_tok_s"]
        if "tok_s_watching" in row:
            row["tok_s_watching_ratio"] = row["tok_s_watching"] / base["tok_s"]
        if row["method"] in in_llamacpp and reference is not None:
            row["tok_s_vs_reference"] = row["tok_s"] / reference["tok_s"]
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table; llama.cpp's decode ratios to ``llamacpp-f16`` on lines below it."""
    lines = ["| context | method | tok/s (fastest block) | vs fp16 | all blocks tok/s | peak RSS MiB | vs fp16 | kv_bytes_ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['method']} | unsupported: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['context']} | {r['method']} | {r['tok_s']:.2f} | {r['tok_s_ratio']:.2f} | "
            f"{r.get('all_blocks_tok_s', r['tok_s']):.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_ratio']:.2f} | {r['kv_bytes_ratio']:.3f} |"
        )
    lines += [f"\n{r['method']} at {r['context']} tokens, chunked prefill ({PREFILL_CHUNK}-token chunks): "
              f"{r['prefill_tok_s']:.0f} tok/s, {r['prefill_ratio']:.2f} of fp16's" for r in rows if "prefill_ratio" in r]
    lines += [f"\n{r['method']} at {r['context']} tokens, compensation time left out ({r['acted_steps']} of "
              f"{r['monitoring_steps']} monitoring steps acted, {r['compensation_s']:.2f} s): {r['tok_s_watching']:.2f} "
              f"tok/s, {r['tok_s_watching_ratio']:.2f} of fp16" for r in rows if "tok_s_watching_ratio" in r]
    lines += [f"\n{r['method']} / llamacpp-f16 decode speed at {r['context']} tokens: {r['tok_s_vs_reference']:.2f}"
              for r in rows if "tok_s_vs_reference" in r and r["method"] != "llamacpp-f16"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard.evaluation.speed", description="one speed measurement, as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile", help="calibration profile (for the kvguard method)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="timed blocks of --new-tokens steps; the fastest counts")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(measure(args.model, args.method, args.context, args.new_tokens, args.profile, args.device,
                             args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
