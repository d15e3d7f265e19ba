"""Teacher-forced scoring of a token stream through a cache, the way decoding sees it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from kvguard.metrics import TokenMetrics

# Logits are turned into metrics this many positions at a time (bounds memory for 262k-token vocabularies).
_SLICE = 256


@dataclass(frozen=True)
class StreamScore:
    """Scores of one token stream.

    Attributes:
        nll: mean next-token negative log-likelihood (nats) over ``tokens - 1`` predictions.
        tokens: length of the stream.
        kl: mean ``KL(reference || method)`` when a reference was given, else ``None``.
        top1_agree: arg-max agreement with the reference, else ``None``.
        seconds: wall time of the model passes.
        logits: ``[tokens - 1, vocab]`` float32 next-token logits when kept, else ``None``.
    """

    nll: float
    tokens: int
    kl: float | None = None
    top1_agree: float | None = None
    seconds: float = 0.0
    logits: torch.Tensor | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def _check(ids: torch.Tensor) -> torch.Tensor:
    ids = ids.reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError(f"need at least 2 tokens to score, got {ids.shape[1]}")
    return ids


def _accumulate(metrics: TokenMetrics, logits: torch.Tensor, targets: torch.Tensor, start: int,
                reference: torch.Tensor | None) -> None:
    for i in range(0, logits.shape[0], _SLICE):
        piece = logits[i:i + _SLICE]
        ref = None if reference is None else reference[start + i:start + i + piece.shape[0]]
        metrics.add(piece, targets[i:i + _SLICE], ref)


def _result(metrics: TokenMetrics, total: int, seconds: float, kept: list[torch.Tensor] | None) -> StreamScore:
    logits = torch.cat(kept) if kept else None
    return StreamScore(metrics.nll, total, metrics.kl, metrics.top1_agree, seconds, logits)


@torch.no_grad()
def score_stream(model, input_ids: torch.Tensor, cache: Cache, *, chunk: int = 1,
                 reference: torch.Tensor | None = None, keep_logits: bool = False,
                 progress: bool = False, desc: str = "scoring") -> StreamScore:
    """Feed ``input_ids`` (``[T]`` or ``[1, T]``) through ``model`` in chunks of ``chunk`` tokens, each chunk
    attending to the cached (possibly quantized) past, and score every next-token prediction.

    ``reference``: ``[T - 1, vocab]`` reference log-probabilities for KL and top-1 agreement.
    """
    ids = _check(input_ids).to(model.device)
    total = ids.shape[1]
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    metrics, kept = TokenMetrics(), ([] if keep_logits else None)
    t0 = time.perf_counter()
    for start in tqdm(range(0, total - 1, chunk), desc=desc, unit="chunk", disable=not progress, leave=False):
        piece = ids[:, start:min(start + chunk, total - 1)]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()
        _accumulate(metrics, logits, ids[0, start + 1:start + 1 + piece.shape[1]], start, reference)
        if kept is not None:
            kept.append(logits.cpu())
    return _result(metrics, total, time.perf_counter() - t0, kept)


@torch.no_grad()
def score_simulated(model, input_ids: torch.Tensor, plan, *, reference: torch.Tensor | None = None,
                    keep_logits: bool = False, scales=None) -> StreamScore:
    """Like ``score_stream(..., chunk=1)`` through ``plan.make_cache``, in one simulated forward pass
    (see :mod:`kvguard.simulate`); ``scales``: calibrated INT8 :class:`~kvguard.plan.StaticScales`."""
    from kvguard.simulate import simulate_logits

    ids = _check(input_ids)
    total = ids.shape[1]
    t0 = time.perf_counter()
    logits = simulate_logits(model, ids[0, :-1], plan, scales)
    seconds = time.perf_counter() - t0
    metrics = TokenMetrics()
    _accumulate(metrics, logits, ids[0, 1:].to(logits.device), 0, reference)
    return _result(metrics, total, seconds, [logits.cpu()] if keep_logits else None)
