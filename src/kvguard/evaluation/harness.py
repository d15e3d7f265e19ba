"""The evaluation harness behind ``kvguard eval``: methods side by side on the same tokens, in one run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from kvguard import atomic
from kvguard.architecture import Architecture
from kvguard.evaluation import methods as methods_mod
from kvguard.logprob_file import LogprobFile
from kvguard.peers import PeerUnsupported, llamacpp
from kvguard.metrics import quantile
from kvguard.plan import Plan
from kvguard.scoring import StreamScore, score_live, score_simulated, score_stream


@dataclass
class Row:
    """One method on one text. Ratios are against the FP16 bytes of the same tokens; deltas, KL and top-1 against
    the method's reference in the same run (``fp16``; ``llamacpp-f16`` for llama.cpp's types). ``kl`` is the mean
    per-token KL, ``kl_p99`` / ``kl_p999`` / ``kl_max`` its tail (:func:`kvguard.metrics.quantile`); ``token_kl``, the
    per-token values the tail comes from, stays out of the JSON."""

    method: str
    corpus: str
    # "simulated" (parallel passes, exact chunk-1 semantics), "streamed", "live" (feedback loop), or "llama.cpp"
    mode: str
    kv_bytes: int | None = None
    kv_bytes_ratio: float | None = None  # the cache's own tensors (hot tier and overlay) at the end of the text
    ppl: float | None = None
    ppl_delta_pct: float | None = None
    kl: float | None = None
    kl_p99: float | None = None
    kl_p999: float | None = None
    kl_max: float | None = None
    top1_agree: float | None = None
    tok_s: float | None = None
    trigger_rate: float | None = None
    recompute_fraction: float | None = None
    ram_bytes_ratio: float | None = None  # every tier resident in RAM (the live loop: averaged over the run)
    disk_bytes_ratio: float | None = None  # the backing tier on disk (the live loop: averaged over the run)
    error: str | None = None
    token_kl: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [predictions] float32


def _log(message: str) -> None:
    print(f"[kvguard eval] {message}", file=sys.stderr, flush=True)


# Tokens per forward pass when a chunk-invariant cache (the ``fp8`` methods) scores chunk-1 decoding: any chunking
# is exact for it, and this bounds the logits held at once ([chunk, vocab], 262k wide for Gemma 3).
ONE_PASS_CHUNK = 256


def _use_simulation(method: methods_mod.Method, chunk: int, simulate: str) -> bool:
    return simulate != "off" and chunk == 1 and (method.simulatable or method.chunk_invariant)


def _ordered(method_names: list[str]) -> list[str]:
    """``fp16`` first; ``llamacpp-f16`` first among the llama.cpp methods (added when one is asked for): each
    reference is scored before the rows measured against it."""
    names = ["fp16"] + [n for n in method_names if n != "fp16"]
    first = next((i for i, n in enumerate(names) if methods_mod.reference_of(n) == llamacpp.REFERENCE), None)
    if first is None:
        return names
    names = [n for n in names if n != llamacpp.REFERENCE]
    return names[:first] + [llamacpp.REFERENCE] + names[first:]


def evaluate_stream(model, ids: torch.Tensor, corpus: str, method_names: list[str], *, chunk: int = 1,
                    simulate: str = "auto", progress: bool = True, profile=None, gguf: Path | None = None) -> list[Row]:
    """Score every method on ``ids`` (``[T]``); the first row is ``fp16``, the reference for kvguard's methods and
    the peers, and ``llamacpp-f16`` is the reference of the llama.cpp rows. ``profile``: the calibration profile
    behind the ``kvguard`` method; ``gguf``: the GGUF file the model comes from (the llama.cpp methods run on it;
    without one their rows say so)."""
    if simulate not in ("auto", "on", "off"):
        raise ValueError(f"simulate has to be one of ['auto', 'on', 'off'] but got {simulate!r}")
    names = _ordered(method_names)
    resolved = [methods_mod.get(n, profile) for n in names]  # unknown names fail before any work
    if simulate == "on":
        bad = [m.name for m in resolved if not (m.simulatable or m.chunk_invariant)]
        if bad or chunk != 1:
            raise ValueError(f"--simulate on needs chunk 1 and static methods; not simulatable: {bad}")
    if chunk != 1:
        live = [m.name for m in resolved if m.live]
        if live:
            raise ValueError(f"{live[0]} decodes token by token: use chunk 1")
    rows: list[Row] = []
    # name -> [T - 1, vocab] log-probabilities on disk: 5 GB for Qwen2.5 at 8,192 tokens, more than RAM can spare
    references: dict[str, LogprobFile] = {}
    last_use = {m.reference: i for i, m in enumerate(resolved)}
    with contextlib.ExitStack() as cleanup:  # the files go whatever happens
        for i, method in enumerate(resolved):
            keep = cleanup.enter_context(LogprobFile(ids.numel() - 1)) if method.name == method.reference else None
            rows.append(_method_row(model, ids, corpus, method, chunk, simulate, references.get(method.reference),
                                    keep, progress, gguf))
            if keep is not None and rows[-1].error is None:
                references[method.name] = keep
            for name in [n for n, last in last_use.items() if last == i and n in references]:
                references.pop(name).close()  # no row needs it any more
    return _with_deltas(rows)


def _method_row(model, ids, corpus: str, method: methods_mod.Method, chunk: int, simulate: str,
                reference: LogprobFile | None, keep: LogprobFile | None, progress: bool, gguf: Path | None) -> Row:
    """One method's row; a reference method (``keep``) writes its log-probabilities there and scores KL 0 against
    itself."""
    simulated = _use_simulation(method, chunk, simulate)
    row = Row(method.name, corpus, _mode(method, simulated))
    if progress:
        how = {"live": "live, chunk 1", "simulated": "simulated"}.get(row.mode, f"{row.mode}, chunk {chunk}")
        _log(f"{corpus}: {method.name} ({how}, {ids.numel()} tokens)")
    try:
        score, stored, fp16 = _score(model, ids, method, simulated, chunk, reference, keep, row, progress, gguf)
    except PeerUnsupported as err:  # a peer refusing a model is a result, not a crash
        row.error = str(err)
        return row
    if keep is not None:
        score = StreamScore(score.nll, score.tokens, 0.0, 1.0, score.seconds, token_kl=torch.zeros(score.tokens - 1))
    _fill(row, score, stored, fp16)
    return row


def _mode(method: methods_mod.Method, simulated: bool) -> str:
    if method.llamacpp is not None:
        return "llama.cpp"
    return "simulated" if simulated else ("live" if method.live else "streamed")


def _score(model, ids, method, simulated: bool, chunk: int, reference: LogprobFile | None, keep: LogprobFile | None,
           row: Row, progress: bool, gguf: Path | None) -> tuple[StreamScore, int, int]:
    """``(score, stored bytes, FP16 bytes)`` of one method, its log-probabilities written to ``keep`` where it is a
    reference; the loop's rates go into ``row``."""
    if method.llamacpp is not None:
        score = llamacpp.score(gguf, ids, method.llamacpp, chunk=chunk, reference=reference, keep_logprobs=keep,
                               progress=progress)
        # kvguard's FP16 count of these tokens (a sliding layer: its window) in GGML's blocks, comparable with the
        # other rows; llama.cpp's own allocation (cells padded, a sliding layer's window plus a batch) is not compared.
        fp16 = Plan.uniform(Architecture.from_config(model.config), "fp16").kv_bytes(model.config, ids.numel() - 1)[1]
        return score, llamacpp.kv_bytes(method.llamacpp, fp16), fp16
    if method.live:
        session = method.session(model, sequence_id=f"{row.corpus}-{method.name}")
        score = score_live(session, ids, reference=reference, keep_logprobs=keep, progress=progress, desc=method.name)
        row.trigger_rate = session.trigger_rate
        row.recompute_fraction = session.recompute_fraction()
        row.ram_bytes_ratio, row.disk_bytes_ratio = session.held_ratios()
        return score, session.cache.nbytes(), session.cache.fp16_nbytes()
    if simulated and not method.chunk_invariant:
        plan = method.plan(Architecture.from_config(model.config))
        score = score_simulated(model, ids, plan, reference=reference, keep_logprobs=keep, scales=method.scales)
        return score, *plan.kv_bytes(model.config, ids.numel() - 1, method.scales)
    cache = method.make_cache(model)
    score = score_stream(model, ids, cache, chunk=ONE_PASS_CHUNK if simulated else chunk, reference=reference,
                         keep_logprobs=keep, progress=progress, desc=method.name)
    return score, *methods_mod.kv_bytes(cache)


def _with_deltas(rows: list[Row]) -> list[Row]:
    """Set ``ppl_delta_pct`` of every row against its reference row (``fp16``, or ``llamacpp-f16`` for the
    llama.cpp rows); none where the reference has no perplexity (it could not run)."""
    ppl = {row.method: row.ppl for row in rows}
    for row in rows:
        ref_ppl = ppl.get(methods_mod.reference_of(row.method))
        if row.ppl is not None and ref_ppl is not None:
            row.ppl_delta_pct = 100.0 * (row.ppl / ref_ppl - 1.0)
    return rows


def combine_windows(windows: list[list[Row]]) -> list[Row]:
    """Rows of several equal-length windows of one corpus (each from :func:`evaluate_stream`) as one row per
    method: perplexity from the mean NLL, KL / top-1 / bytes / speed averaged, the KL's tail over every window's tokens
    together, deltas against the combined reference row (``fp16``, or ``llamacpp-f16``). More text makes the small
    perplexity differences between good methods measurable."""
    if not windows:
        raise ValueError("no windows to combine")
    combined = []
    for rows in zip(*windows):
        first = rows[0]
        if any(r.method != first.method for r in rows):
            raise ValueError("windows must list the same methods in the same order")
        row = Row(first.method, first.corpus, first.mode, error=first.error)
        if first.error is None:
            n = len(rows)
            row.kv_bytes = round(sum(r.kv_bytes for r in rows) / n)
            row.kv_bytes_ratio = sum(r.kv_bytes_ratio for r in rows) / n
            row.ppl = math.exp(sum(math.log(r.ppl) for r in rows) / n)
            row.kl = sum(r.kl for r in rows) / n
            if all(r.token_kl is not None for r in rows):
                _set_tail(row, torch.cat([r.token_kl for r in rows]))
            row.top1_agree = sum(r.top1_agree for r in rows) / n
            row.tok_s = sum(r.tok_s for r in rows) / n if all(r.tok_s for r in rows) else None
            for name in ("trigger_rate", "recompute_fraction", "ram_bytes_ratio", "disk_bytes_ratio"):
                values = [getattr(r, name) for r in rows]
                if all(v is not None for v in values):
                    setattr(row, name, sum(values) / n)
        combined.append(row)
    return _with_deltas(combined)


def _fill(row: Row, score: StreamScore, stored: int, fp16: int) -> None:
    row.kv_bytes = stored
    row.kv_bytes_ratio = stored / fp16 if fp16 else None
    if row.ram_bytes_ratio is None:  # a static cache: nothing beyond its own tensors, nothing on disk
        row.ram_bytes_ratio, row.disk_bytes_ratio = row.kv_bytes_ratio, 0.0
    row.ppl = score.perplexity
    row.kl = score.kl
    if score.token_kl is not None:
        _set_tail(row, score.token_kl)
    row.top1_agree = score.top1_agree
    row.tok_s = (score.tokens - 1) / score.seconds if score.seconds else None


def _set_tail(row: Row, token_kl: torch.Tensor) -> None:
    row.token_kl = token_kl
    row.kl_p99, row.kl_p999, row.kl_max = (quantile(token_kl, q) for q in (0.99, 0.999, 1.0))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[Row]) -> str:
    """The rows as a markdown table (what ``kvguard eval`` prints)."""
    head = ("| corpus | method | mode | kv_bytes_ratio | ram_bytes_ratio | disk_bytes_ratio | ppl | ppl_delta_pct | kl "
            "| kl_p99 | kl_p999 | kl_max | top1_agree | tok_s | trigger_rate | recompute_fraction |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    notes: list[str] = []
    for r in rows:
        if r.error:
            if r.error not in notes:
                notes.append(r.error)
            lines.append(f"| {r.corpus} | {r.method} | {r.mode} | unsupported [{notes.index(r.error) + 1}] |"
                         + " |" * (head.count("|") - 5))
            continue
        lines.append(
            f"| {r.corpus} | {r.method} | {r.mode} | {_fmt(r.kv_bytes_ratio, '.3f')} | {_fmt(r.ram_bytes_ratio, '.3f')} | "
            f"{_fmt(r.disk_bytes_ratio, '.3f')} | {_fmt(r.ppl, '.3f')} | "
            f"{_fmt(r.ppl_delta_pct, '+.2f')} | {_fmt(r.kl, '.5f')} | {_fmt(r.kl_p99, '.4f')} | {_fmt(r.kl_p999, '.4f')} | "
            f"{_fmt(r.kl_max, '.4f')} | {_fmt(r.top1_agree, '.4f')} | "
            f"{_fmt(r.tok_s, '.1f')} | {_fmt(r.trigger_rate, '.4f')} | {_fmt(r.recompute_fraction, '.4f')} |"
        )
    lines += [""] * bool(notes) + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """Write ``payload`` as JSON atomically (a temporary file renamed into place)."""
    atomic.write_text(path, json.dumps(payload, indent=2) + "\n")


def rows_payload(model_name: str, tokens: int, chunk: int, rows: list[Row]) -> dict:
    """The rows as ``kvguard eval --json`` writes them (every field but the per-token KL)."""
    results = [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "token_kl"} for r in rows]
    return {"model": model_name, "tokens": tokens, "chunk": chunk, "results": results}
