"""Ablation: the calibration's scoring pass, as it is and with its former hot spots swapped back in.

Calibration's sensitivity, search and ranking stages score every candidate plan with the exact chunk-1 simulation
on calibration streams (``kvguard.calibration.heldout``). Four of its steps were rewritten for speed, each to
compute the same numbers bit for bit:

- the simulated attention blends the quantized and full-precision reads with 0 / 1 factors instead of
  ``torch.where`` / ``masked_fill`` with a broadcast boolean mask (several times slower on CPU over ``[B, H, T, T]``);
- the range search (``CacheConfig.range_search``) measures its eight shrinkings of every group in one batch of
  tensor ops instead of one candidate at a time;
- the Hadamard butterflies write both halves into one buffer instead of stacking them;
- the simulated attention runs 128 queries at a time (``simulate._QUERY_BLOCK``) instead of all ``T`` at once, so
  its ``[B, H, 128, T]`` temporaries stay in cache.

This script scores plans from a profile's search log both ways, one after the other in one process (this machine's
speed drifts between runs), checks that both ways give the same KL, perplexity change and top-1 agreement, and prints
the median seconds per scoring pass. ``--former all`` swaps all four back (the blend by products with the whole
``[T, T]`` at once), ``--former blocks`` only the last:

    python benchmarks/simulation_speed.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512
    python benchmarks/simulation_speed.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512 \
        --former blocks --tokens 2048
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch


def _old_fwht(x: torch.Tensor) -> torch.Tensor:
    """The butterflies as they were: each round stacks its two halves into a new tensor."""
    *lead, d = x.shape
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)  # [..., blocks, (top, bottom), h]
        top, bottom = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((top + bottom, top - bottom), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def _old_searched_grid(grouped, lo, hi, spec):
    """The range search as it was: one pass over the tensor per candidate range."""
    from kvguard import quantizer as qz

    best = None
    for i in range(qz.RANGE_CANDIDATES):
        grid = qz._grid(*qz._shrink(lo, hi, 1 - i * 0.28 / spec.levels), spec)
        u = (grouped - qz._expand(grid[3], spec)).div_(qz._expand(grid[2], spec))
        err = u.round().clamp_(0, spec.levels - 1).sub_(u).square_().sum(dim=qz._group_dim(spec)) * grid[2].square()
        if best is None:
            best = [*grid, err]
            continue
        better = err < best[4]
        best = [torch.where(better, new, old) for new, old in zip((*grid, err), best)]
    return tuple(best[:4])


def _old_call(self, module, query, key, value, attention_mask, *, scaling, softcap):
    """``simulate._SimulationHook.__call__`` as it was: the reads picked by ``torch.where`` / ``masked_fill``."""
    from kvguard import attention, simulate

    plan, layer_idx, t = self.plan, module.layer_idx, query.shape[2]
    k_fp, v_fp, k_q, v_q, end, switch = self.stored(layer_idx, key, value)
    rep = query.shape[1] // key.shape[1]
    q32 = query.to(torch.float32)
    positions = torch.arange(t, device=query.device)
    quantized = positions[:, None] >= switch.to(query.device)[None, :]  # [T_q, T_k]
    diagonal = torch.eye(t, dtype=torch.bool, device=query.device)
    scores = torch.where(quantized, q32 @ attention.expand_kv(k_q, rep).transpose(-1, -2),
                         q32 @ attention.expand_kv(k_fp, rep).transpose(-1, -2)) * scaling
    exact_self = (q32 * attention.expand_kv(key.to(torch.float32), rep)).sum(-1) * scaling  # [B, Hq, T]
    scores = torch.where(diagonal, exact_self.unsqueeze(-1), scores)
    if plan.cache.score_correction:
        q2, var = simulate._score_noise(q32 * scaling, k_fp, plan, layer_idx, end)
        scores = scores + (-0.5 * (q2 @ var.transpose(-1, -2))).masked_fill(~quantized, 0.0)
    scores = attention.softcapped(scores, softcap)
    if attention_mask is not None:
        scores = scores + attention_mask.to(torch.float32)
    probs = torch.softmax(scores, dim=-1)
    off_diag_fp = probs.masked_fill(quantized | diagonal, 0.0)
    out = probs.masked_fill(~quantized, 0.0) @ attention.expand_kv(v_q, rep) + off_diag_fp @ attention.expand_kv(v_fp, rep)
    out = out + probs.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * attention.expand_kv(value.to(torch.float32), rep)
    return out.to(query.dtype)


@contextlib.contextmanager
def former_code():
    """Within this block the scoring pass runs the four former implementations."""
    from kvguard import quantizer, rotation, simulate

    kept = simulate._SimulationHook.__call__, quantizer._searched_grid, rotation._fwht
    simulate._SimulationHook.__call__, quantizer._searched_grid, rotation._fwht = _old_call, _old_searched_grid, _old_fwht
    try:
        yield
    finally:
        simulate._SimulationHook.__call__, quantizer._searched_grid, rotation._fwht = kept


@contextlib.contextmanager
def whole_matrix():
    """Within this block the simulated attention runs every query at once (one block of all ``T``)."""
    from kvguard import simulate

    kept = simulate._QUERY_BLOCK
    simulate._QUERY_BLOCK = 1 << 30
    try:
        yield
    finally:
        simulate._QUERY_BLOCK = kept


def _plans(profile_dir: str, count: int) -> dict:
    """Up to ``count`` level-2 plans of the profile's search log, spread over it (low-bit ones and ``+sb`` twins
    included), with their names."""
    from kvguard.profile import Profile

    log = [c for c in Profile.load(profile_dir).meta.search_log if c.level == 2]
    step = max(1, len(log) // count)
    return {c.name: c.plan for c in log[::step][:count]}


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.calibration.heldout import HeldOut
    from kvguard.profile import Profile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", required=True)
    p.add_argument("--tokens", type=int, default=512, help="tokens per calibration corpus (the held-out slice's)")
    p.add_argument("--plans", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--former", choices=("all", "blocks"), default="all",
                   help="all: the four former hot spots; blocks: only all queries at once")
    args = p.parse_args(argv)
    swap = former_code if args.former == "all" else whole_matrix
    model, tok = models.load(args.model)
    streams = {c: data.token_stream(c, "calib", tok, args.tokens) for c in ("prose", "dialog", "code")}
    heldout = HeldOut(model, streams)
    scales = Profile.load(args.profile).static_scales()
    times: dict[tuple[str, str], list[float]] = {}
    for name, plan in _plans(args.profile, args.plans).items():
        scores = {}
        for _ in range(args.repeats):
            for way, block in (("now", contextlib.nullcontext), ("former", swap)):
                with block():
                    start = time.perf_counter()
                    scores[way] = heldout.score(plan, scales)
                    times.setdefault((name, way), []).append(time.perf_counter() - start)
        if scores["now"] != scores["former"]:
            raise SystemExit(f"{name}: the two ways scored differently: {scores['now']} != {scores['former']}")
        now, former = statistics.median(times[name, "now"]), statistics.median(times[name, "former"])
        print(f"{name}: {now:.2f} s now, {former:.2f} s former ({now / former:.2f}x), same scores", flush=True)
    now = sum(statistics.median(v) for (_, way), v in times.items() if way == "now")
    former = sum(statistics.median(v) for (_, way), v in times.items() if way == "former")
    print(f"\n| plans | now, s | former, s | now / former |\n|---|---|---|---|\n"
          f"| {len(times) // 2} | {now:.1f} | {former:.1f} | {now / former:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
