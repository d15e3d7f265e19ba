"""Teacher-forced scoring of a token stream, the way decoding sees it: one family, three ways to run it.

- :func:`score_stream`: through a cache, ``chunk`` tokens per forward pass (1: true decoding);
- :func:`score_simulated`: a static plan, by the exact parallel simulation of chunk-1 decoding
  (:mod:`kvguard.simulate`), in one forward pass;
- :func:`score_live`: token by token through a :class:`~kvguard.control.session.LiveSession` (the feedback
  loop acting as it goes);
- :func:`score_logits`: the logits another engine computed (llama.cpp, :mod:`kvguard.peers.llamacpp`).

All four feed the logits to one :class:`_Scorer`, so the metrics are computed the same way whichever produced
them. Core, not evaluation's: calibration's held-out scoring and ``kvguard eval`` share it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from kvguard.logprob_file import LogprobFile
from kvguard.metrics import TokenMetrics, quantile

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
        logits: ``[tokens - 1, vocab]`` float32 next-token logits when kept in memory (``keep_logits``), else
            ``None`` (a :class:`~kvguard.logprob_file.LogprobFile` passed as ``keep_logprobs`` holds their
            log-softmax on disk instead).
        token_kl: ``[tokens - 1]`` float32, the KL at each prediction when a reference was given, else ``None``
            (its tail: :attr:`kl_p99`, :attr:`kl_p999`, :attr:`kl_max`).
    """

    nll: float
    tokens: int
    kl: float | None = None
    top1_agree: float | None = None
    seconds: float = 0.0
    logits: torch.Tensor | None = None
    token_kl: torch.Tensor | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def kl_p99(self) -> float | None:
        return None if self.token_kl is None else quantile(self.token_kl, 0.99)

    @property
    def kl_p999(self) -> float | None:
        return None if self.token_kl is None else quantile(self.token_kl, 0.999)

    @property
    def kl_max(self) -> float | None:
        return None if self.token_kl is None else quantile(self.token_kl, 1.0)


def _check(ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to score, got {ids.numel()}")
    return ids


class _Scorer:
    """Next-token metrics of ``ids`` (``[T]``), fed the predictions in order, any number at a time. ``reference``:
    ``[T - 1, vocab]`` log-probabilities, a tensor or a :class:`~kvguard.logprob_file.LogprobFile` (read a slice at a
    time either way); ``keep_logits`` keeps the logits in memory, ``keep_logprobs`` appends their log-softmax to a
    file (a reference for later passes, however long the text)."""

    def __init__(self, ids: torch.Tensor, reference: torch.Tensor | LogprobFile | None, keep_logits: bool,
                 keep_logprobs: LogprobFile | None = None) -> None:
        self.ids, self.reference = ids, reference
        self.metrics = TokenMetrics()
        self.kept: list[torch.Tensor] | None = [] if keep_logits else None
        self.sink = keep_logprobs
        self.done = 0
        self.t0 = time.perf_counter()

    def add(self, logits: torch.Tensor) -> None:
        """``logits`` ``[N, vocab]``: the predictions for positions ``done + 1 .. done + N``."""
        for i in range(0, logits.shape[0], _SLICE):
            piece = logits[i:i + _SLICE]
            start = self.done + i
            targets = self.ids[start + 1:start + 1 + piece.shape[0]].to(piece.device)
            ref = None if self.reference is None else self.reference[start:start + piece.shape[0]]
            self.metrics.add(piece, targets, ref)
            if self.sink is not None:
                self.sink.append(piece)
        if self.kept is not None:
            self.kept.append(logits.cpu())
        self.done += logits.shape[0]

    def result(self, seconds: float | None = None) -> StreamScore:
        seconds = time.perf_counter() - self.t0 if seconds is None else seconds
        logits = torch.cat(self.kept) if self.kept else None
        m = self.metrics
        return StreamScore(m.nll, self.ids.numel(), m.kl, m.top1_agree, seconds, logits, m.token_kl)


@torch.no_grad()
def score_stream(model, input_ids: torch.Tensor, cache: Cache, *, chunk: int = 1,
                 reference: torch.Tensor | LogprobFile | None = None, keep_logits: bool = False,
                 keep_logprobs: LogprobFile | None = None, progress: bool = False,
                 desc: str = "scoring") -> StreamScore:
    """Feed ``input_ids`` (``[T]`` or ``[1, T]``) through ``model`` in chunks of ``chunk`` tokens, each chunk
    attending to the cached (possibly quantized) past, and score every next-token prediction.

    ``reference``: ``[T - 1, vocab]`` reference log-probabilities for KL and top-1 agreement; ``keep_logits`` /
    ``keep_logprobs``: see :class:`_Scorer` (the same in every ``score_*`` function).
    """
    ids = _check(input_ids).to(model.device)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    scorer = _Scorer(ids, reference, keep_logits, keep_logprobs)
    total = ids.numel()
    for start in tqdm(range(0, total - 1, chunk), desc=desc, unit="chunk", disable=not progress, leave=False):
        piece = ids[start:min(start + chunk, total - 1)].view(1, -1)
        scorer.add(model(input_ids=piece, cache=cache, use_cache=True).logits[0].float())
    return scorer.result()


@torch.no_grad()
def score_simulated(model, input_ids: torch.Tensor, plan, *, reference: torch.Tensor | LogprobFile | None = None,
                    keep_logits: bool = False, keep_logprobs: LogprobFile | None = None, scales=None) -> StreamScore:
    """Like ``score_stream(..., chunk=1)`` through ``plan.make_cache``, in one simulated forward pass
    (see :mod:`kvguard.simulate`); ``scales``: calibrated INT8 :class:`~kvguard.plan.StaticScales`. The output head
    runs :data:`_SLICE` positions at a time, so no ``[T, vocab]`` logits are held at once."""
    from kvguard.simulate import simulate_logit_slices

    ids = _check(input_ids)
    scorer = _Scorer(ids, reference, keep_logits, keep_logprobs)
    seconds = 0.0
    t0 = time.perf_counter()
    for logits in simulate_logit_slices(model, ids[:-1], plan, scales, rows=_SLICE):
        seconds += time.perf_counter() - t0  # the model's time, not the scoring's
        scorer.add(logits)
        t0 = time.perf_counter()
    return scorer.result(seconds)


@torch.no_grad()
def score_live(session, input_ids: torch.Tensor, *, reference: torch.Tensor | LogprobFile | None = None,
               keep_logits: bool = False, keep_logprobs: LogprobFile | None = None, progress: bool = False,
               desc: str = "live") -> StreamScore:
    """Teacher-forced scoring through ``session`` (a :class:`~kvguard.control.session.LiveSession`) token by
    token, the loop acting as it goes."""
    ids = _check(input_ids)
    scorer = _Scorer(ids, reference, keep_logits, keep_logprobs)
    pending: list[torch.Tensor] = []
    for token in tqdm(ids[:-1].tolist(), desc=desc, unit="tok", disable=not progress, leave=False):
        pending.append(session.step(token))
        if len(pending) == _SLICE:
            scorer.add(torch.stack(pending))
            pending = []
    if pending:
        scorer.add(torch.stack(pending))
    return scorer.result()


def score_logits(input_ids: torch.Tensor, chunks: Iterable[torch.Tensor], *,
                 reference: torch.Tensor | LogprobFile | None = None, keep_logits: bool = False,
                 keep_logprobs: LogprobFile | None = None) -> StreamScore:
    """Score the next-token logits of ``input_ids`` (``[T]``) that ``chunks`` yields in order, ``[N, vocab]``
    at a time (predictions for positions 1 .. T - 1 in all); ``seconds`` times the iteration, so an engine
    that computes each chunk as it is asked for is timed like :func:`score_stream`."""
    ids = _check(input_ids)
    scorer = _Scorer(ids, reference, keep_logits, keep_logprobs)
    for logits in chunks:
        scorer.add(logits)
    if scorer.done != ids.numel() - 1:
        raise ValueError(f"{scorer.done} predictions for a stream of {ids.numel()} tokens (expected {ids.numel() - 1})")
    return scorer.result()
