"""Capacity: the largest batch x context each method fits in a process-memory budget, and the real peak RSS of a
batch x context run (8 x 4,096 by default) per method, each measured in a fresh process.

The run is what ``kvguard serve`` does with that many requests: each sequence has its own cache, prompts are fed
:data:`CHUNK` tokens per forward (one sequence's chunk at a time, only the last position's logits computed),
reading the stored history through the reads' attention (:func:`kvguard.attention.fused_reads`: a tile of it at a
time, never a copy of all of it), then :data:`DECODE_STEPS` decode steps advance every sequence in one packed
forward each (:mod:`kvguard.packed`). transformers' own caches (the peers), which cannot be packed, are prefilled as
one batch of ``B`` rows instead, ``B x`` :data:`CHUNK` tokens per forward.

The prediction is arithmetic over measured quantities (:class:`Footprint`)::

    peak(B, T) = max(load_peak, model_rss + B * kv(T) + act(T))

- ``model_rss``: the process's resident memory once the model is loaded and every weight has been read once
  (weights, torch, tokenizer);
  ``load_peak``: its high-water mark while loading (safetensors and the float copy may overlap).
- ``kv(T) = kv0 + kv1 * T``: bytes one sequence's cache stores after ``T`` tokens, read from a real cache
  after every chunk of a real prefill and fitted by least squares (exactly linear for kvguard's layouts once
  the FP window is full: every later token is stored once, at its tier).
- ``act(T) = a0 + a1 * T``: the transient above model and caches while a chunk is fed at context ``T`` (the chunk's
  hidden states and MLP, a tile of attention over ``T`` keys), measured as the chunk's RSS high-water mark minus model
  and stored caches, fitted over the chunks: one forward's worth, whatever the batch (for the peers, whose forward
  holds every row, it is fitted per sequence instead).

Both are measured by :func:`probe` at a small batch and context (:data:`FIT_BATCH` x :data:`FIT_CONTEXT`), and
the prediction is checked twice, each time by really running it in a fresh process: at the reported point (batch 8 x
4,096: there the KV cache dominates), whose peak RSS is the table's measured column, and at the largest batch the fit
predicts for the budget (``largest``: ``fp16`` and ``int4`` by default), whose peak must lie under the budget and
near the prediction (``kvguard eval --no-check`` skips both: they prefill hundreds of thousands of tokens, many
minutes on a few CPU cores).

    python -m kvguard.evaluation.capacity --model smollm2-135m --method int4 --batch 2 --context 1024   # one JSON line

The high-water marks come from Linux's ``/proc/self/status`` (``VmHWM``), reset before each chunk through
``/proc/self/clear_refs``; elsewhere :func:`probe` refuses, saying so. On ``--device cuda`` the model, cache and
activations live in GPU memory, so the same quantities are read from torch's CUDA allocator instead
(``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``) and the budget is GPU memory.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

GIB = 1024 ** 3
MIB = 1024 ** 2
CHUNK = 256
DECODE_STEPS = 64
FIT_BATCH = 2
FIT_CONTEXT = 1024
DEFAULT_BUDGET_GIB = 4.0


# ------------------------------------------------------------------------------------------- the arithmetic
@dataclass(frozen=True)
class Linear:
    """``intercept + slope * x``."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "Linear":
        """Least squares through ``(x, y)`` points (a single point: a constant)."""
        if not points:
            raise ValueError("a line needs at least one point, got none")
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        if sxx == 0:
            return cls(my, 0.0)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        return cls(my - slope * mx, slope)


@dataclass(frozen=True)
class Footprint:
    """One method's memory model (bytes): see the module docstring."""

    method: str
    model_rss: float
    load_peak: float
    kv: Linear  # per sequence, of context
    act: Linear  # of context: per forward, or per sequence where ``act_per_sequence``
    act_per_sequence: bool = False

    def per_sequence(self, context: int) -> float:
        """Bytes one more sequence of ``context`` tokens adds at the peak."""
        return max(0.0, self.kv(context)) + (max(0.0, self.act(context)) if self.act_per_sequence else 0.0)

    def peak(self, batch: int, context: int) -> float:
        shared = 0.0 if self.act_per_sequence else max(0.0, self.act(context))
        return max(self.load_peak, self.model_rss + batch * self.per_sequence(context) + shared)

    def max_batch(self, budget: float, context: int) -> int:
        """The largest batch whose predicted peak fits ``budget`` bytes at ``context`` (0: not even one)."""
        if self.peak(1, context) > budget:
            return 0
        per = self.per_sequence(context)
        shared = 0.0 if self.act_per_sequence else max(0.0, self.act(context))
        return int((budget - self.model_rss - shared) // per) if per > 0 else sys.maxsize

    @classmethod
    def from_probe(cls, row: dict) -> "Footprint":
        """The fit of one :func:`probe` row (its ``points`` are per-chunk ``[tokens of the sequence fed, its cache's
        bytes, every cache's bytes, peak RSS]``)."""
        model, per_sequence = row["model_rss"], row.get("act_per_sequence", False)
        kv = Linear.fit([(t, b) for t, b, _, _ in row["points"]])
        scale = row["batch"] if per_sequence else 1
        act = Linear.fit([(t, (peak - model - total) / scale) for t, _, total, peak in row["points"]])
        return cls(row["method"], model, row["load_peak"], kv, act, per_sequence)


# ------------------------------------------------------------------------------------------- the measurement
def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class _Meter:
    """Current and peak memory where the model lives: the process's RSS on the CPU, the CUDA allocator's on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if not self.cuda:
            try:
                _rss("VmHWM")
                self.reset()
            except (OSError, AttributeError) as err:
                raise RuntimeError(f"the capacity probe reads and resets the peak RSS through /proc/self (Linux); "
                                   f"here it cannot: {err}") from None

    def current(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else _rss("VmRSS")

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else _rss("VmHWM")

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one


@torch.no_grad()
def probe(model_name: str, method_name: str, batch: int, context: int, *, chunk: int = CHUNK,
          decode: int = DECODE_STEPS, profile_path: str | None = None, device: str = "cpu") -> dict:
    """Feed ``batch`` sequences of ``context`` held-out tokens through the method's caches in ``chunk``-token pieces,
    then ``decode`` greedy decode steps (see the module docstring); per chunk the tokens of the sequence fed, its
    cache's bytes, every cache's bytes and the chunk's RSS high-water mark, and the decode steps' high-water mark."""
    from kvguard import data, models
    from kvguard.cache import KVGuardCache
    from kvguard.evaluation import methods
    from kvguard.profile import Profile

    from kvguard.device import resolve

    meter = _Meter(resolve(device))  # before the load: its peak is the load's
    base_rss = meter.current()
    model, tok = models.load(model_name, device=device)
    _page_in(model)
    method = methods.get(method_name, Profile.load(profile_path, model) if profile_path else None)
    if method.live or method.llamacpp is not None:
        raise ValueError(f"method {method_name!r} has no bare transformers cache to size; capacity takes the static "
                         f"methods and the peers")
    ids = data.token_stream("long", "eval", tok, batch * context).view(batch, context).to(model.device)  # [B, T]
    caches = [method.make_cache(model)]
    served = isinstance(caches[0], KVGuardCache)
    caches += [method.make_cache(model) for _ in range(batch - 1)] if served else []
    gc.collect()
    load_peak, model_rss = meter.peak(), meter.current()
    run = _served if served else _batched
    points, decode_peak = run(model, caches, ids, chunk, decode, meter)
    stored = sum(methods.kv_bytes(c)[0] for c in caches)
    fp16 = sum(methods.kv_bytes(c)[1] for c in caches)
    return {"method": method_name, "batch": batch, "context": context, "chunk": chunk, "decode": decode,
            "act_per_sequence": not served, "base_rss": base_rss, "model_rss": model_rss, "load_peak": load_peak,
            "points": points, "decode_peak": decode_peak, "kv_bytes": stored, "kv_bytes_ratio": stored / fp16,
            "peak_rss": max(load_peak, decode_peak, max(p[3] for p in points))}


def _served(model, caches, ids, chunk: int, decode: int, meter) -> tuple[list, int]:
    """As the server feeds them: one sequence's chunk per forward, then every sequence one token per packed forward."""
    from kvguard import attention, packed
    from kvguard.evaluation import methods

    points, last = [], []
    with attention.fused_reads(model):
        for row, cache in zip(ids, caches):
            for start in range(0, row.numel(), chunk):
                meter.reset()
                # logits_to_keep=1: the chunk's [chunk, vocab] logits would otherwise be the largest activation.
                logits = model(input_ids=row[start:start + chunk].view(1, -1), cache=cache, use_cache=True,
                               logits_to_keep=1).logits
                total = sum(methods.kv_bytes(c)[0] for c in caches)
                points.append([min(start + chunk, row.numel()), methods.kv_bytes(cache)[0], total, meter.peak()])
            last.append(logits[0, -1])
    meter.reset()
    tokens = torch.stack(last).argmax(-1)  # [B]
    for _ in range(decode):
        logits = packed.forward(model, [packed.Piece(c, t.view(1)) for c, t in zip(caches, tokens)])
        tokens = logits.argmax(-1)
    return points, meter.peak() if decode else 0


def _batched(model, caches, ids, chunk: int, decode: int, meter) -> tuple[list, int]:
    """A transformers cache: every row in one forward, ``chunk`` tokens of each."""
    from kvguard import attention
    from kvguard.evaluation import methods

    cache, points = caches[0], []
    with attention.fused_reads(model):
        for start in range(0, ids.shape[1], chunk):
            meter.reset()
            logits = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits
            total = methods.kv_bytes(cache)[0]
            points.append([min(start + chunk, ids.shape[1]), total / ids.shape[0], total, meter.peak()])
        meter.reset()
        for _ in range(decode):
            logits = model(input_ids=logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True).logits
    return points, meter.peak() if decode else 0


def _page_in(model: torch.nn.Module) -> None:
    """Read every weight once. Loaded weights can be views of the safetensors file's memory map, resident only
    once touched: unread, they would become resident during the first chunk and the fit would count them as that
    chunk's activations (SmolLM2-135M: model RSS 520 MiB instead of 1,026, and act. ~260 MiB per sequence)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        t.detach().sum()


def probe_subprocess(model_name: str, method_name: str, batch: int, context: int, chunk: int,
                     profile_path: str | None, device: str, decode: int = DECODE_STEPS) -> dict:
    """:func:`probe` in a fresh Python process (so its peak RSS is its own); ``{"error": ...}`` if it failed."""
    cmd = [sys.executable, "-m", "kvguard.evaluation.capacity", "--model", model_name, "--method", method_name,
           "--batch", str(batch), "--context", str(context), "--chunk", str(chunk), "--device", device,
           "--decode", str(decode)]
    cmd += ["--profile", str(profile_path)] if profile_path else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip() or "no output").splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(model_name: str, method_names: list[str], *, budget_gib: float = DEFAULT_BUDGET_GIB,
        contexts: tuple[int, ...] = (1024, 4096), batch: int = 8, context: int = 4096, chunk: int = CHUNK,
        check: bool = True, largest: tuple[str, ...] = ("fp16", "int4"), profile_path: str | None = None,
        device: str = "cpu", progress: bool = True) -> list[dict]:
    """Per method: the fit (a :data:`FIT_BATCH` x :data:`FIT_CONTEXT` probe), the largest batch at each of
    ``contexts`` within ``budget_gib``, and (``check``) the predicted against the measured peak of a real
    ``batch`` x ``context`` run; ``peak_rss_ratio`` against ``fp16``. For the methods in ``largest``, ``check`` also
    runs the largest batch predicted at ``context`` and reports its measured peak (``largest_check``)."""
    from kvguard.device import name as device_name

    device = device_name(device)
    budget = budget_gib * GIB
    names = ["fp16"] + [n for n in method_names if n != "fp16"]
    rows, base = [], None
    for name in names:
        if progress:
            print(f"[kvguard eval] capacity: {name}: fit at {FIT_BATCH} x {FIT_CONTEXT}"
                  + (f", then {batch} x {context}" if check else ""), file=sys.stderr, flush=True)
        fit_row = probe_subprocess(model_name, name, FIT_BATCH, FIT_CONTEXT, chunk, profile_path, device)
        if "error" in fit_row:
            rows.append({"method": name, "error": fit_row["error"]})
            continue
        row = capacity_row(Footprint.from_probe(fit_row), budget, contexts, batch, context)
        row["kv_bytes_ratio"] = fit_row["kv_bytes_ratio"]
        if check:
            measured = probe_subprocess(model_name, name, batch, context, chunk, profile_path, device)
            row["measured_peak_mb"] = measured.get("peak_rss", float("nan")) / MIB
            row["kv_bytes_ratio"] = measured.get("kv_bytes_ratio", row["kv_bytes_ratio"])
            if "error" in measured:
                row["check_error"] = measured["error"]
            base = base or row
            row["peak_rss_ratio"] = row["measured_peak_mb"] / base["measured_peak_mb"]
            if name in largest:
                if progress:
                    print(f"[kvguard eval] capacity: {name}: the largest batch predicted, "
                          f"{row['max_batch'][str(context)]} x {context}", file=sys.stderr, flush=True)
                row["largest_check"] = largest_check(model_name, name, Footprint.from_probe(fit_row), budget, context,
                                                     chunk, profile_path, device)
        if progress:  # each method's figures as they come: a long run interrupted still shows what it measured
            print(f"[kvguard eval] capacity: {json.dumps(row)}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def largest_check(model_name: str, method_name: str, fp: Footprint, budget: float, context: int, chunk: int,
                  profile_path: str | None, device: str) -> dict:
    """Run the largest batch ``fp`` predicts at ``context`` within ``budget`` in a fresh process: its measured peak
    against the prediction and the budget (``within_budget``; ``error_pct``: measured over predicted, minus 1)."""
    n = fp.max_batch(budget, context)
    if n < 1:
        return {"batch": 0, "error": "not even one sequence fits the budget"}
    measured = probe_subprocess(model_name, method_name, n, context, chunk, profile_path, device)
    if "error" in measured:
        return {"batch": n, "error": measured["error"]}
    predicted = fp.peak(n, context)
    return {"batch": n, "predicted_mb": predicted / MIB, "measured_mb": measured["peak_rss"] / MIB,
            "budget_mb": budget / MIB, "within_budget": measured["peak_rss"] <= budget,
            "error_pct": 100 * (measured["peak_rss"] / predicted - 1),
            "kv_mb": measured["kv_bytes"] / MIB, "model_rss_mb": measured["model_rss"] / MIB}


def capacity_row(fp: Footprint, budget: float, contexts: tuple[int, ...], batch: int, context: int) -> dict:
    """What the table shows of one footprint: sizes in MiB, the largest batch per context, the predicted peak."""
    return {
        "method": fp.method,
        "model_rss_mb": fp.model_rss / MIB,
        "kv_mb_per_seq": fp.kv(context) / MIB,
        "act_mb": fp.act(context) / MIB,
        "act_per_sequence": fp.act_per_sequence,
        "max_batch": {str(t): fp.max_batch(budget, t) for t in contexts},
        "batch": batch,
        "context": context,
        "predicted_peak_mb": fp.peak(batch, context) / MIB,
        # The fitted lines themselves (bytes per sequence; per token for the slopes), to predict other points.
        "kv_line": [fp.kv.intercept, fp.kv.slope],
        "act_line": [fp.act.intercept, fp.act.slope],
        "load_peak_mb": fp.load_peak / MIB,
    }


def markdown_table(rows: list[dict], budget_gib: float) -> str:
    contexts = next((list(r["max_batch"]) for r in rows if "max_batch" in r), [])
    point = next((f"{r['batch']} x {r['context']}" for r in rows if "batch" in r), "")
    head = (["method", "model RSS MiB", "KV MiB / seq", "act. MiB (per seq: peers)"]
            + [f"max batch @ {t} ({budget_gib:g} GiB)" for t in contexts]
            + [f"peak {point} predicted MiB", "measured MiB", "vs fp16", "kv_bytes_ratio"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | unsupported: {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = [r["method"], f"{r['model_rss_mb']:.0f}", f"{r['kv_mb_per_seq']:.1f}",
                 f"{r['act_mb']:.1f}" + (" / seq" if r["act_per_sequence"] else "")]
        cells += [str(r["max_batch"][t]) for t in contexts]
        cells += [f"{r['predicted_peak_mb']:.0f}"]
        if "measured_peak_mb" in r:
            cells += [f"{r['measured_peak_mb']:.0f}", f"{r['peak_rss_ratio']:.2f}"]
        else:
            cells += ["", ""]
        cells.append(f"{r['kv_bytes_ratio']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    checks = [(r["method"], r["largest_check"]) for r in rows if "largest_check" in r]
    if checks:
        lines += ["", f"The largest batch predicted, run ({budget_gib:g} GiB budget):", "",
                  "| method | batch | predicted peak MiB | measured peak MiB | measured / predicted | under the budget |",
                  "|---|---|---|---|---|---|"]
        for name, c in checks:
            if "error" in c:
                lines.append(f"| {name} | {c['batch']} | failed: {c['error']} | | | |")
            else:
                lines.append(f"| {name} | {c['batch']} | {c['predicted_mb']:.0f} | {c['measured_mb']:.0f} | "
                             f"{1 + c['error_pct'] / 100:.3f} | {'yes' if c['within_budget'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard.evaluation.capacity",
                                     description="one capacity probe (a chunked prefill), as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--decode", type=int, default=DECODE_STEPS, help="decode steps after the prefill")
    parser.add_argument("--profile", help="calibration profile (for the kvguard method)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(probe(args.model, args.method, args.batch, args.context, chunk=args.chunk, decode=args.decode,
                           profile_path=args.profile, device=args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
