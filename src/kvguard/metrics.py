"""Next-token quality metrics, accumulated over a token stream.

- ``nll``: mean negative log-likelihood of the true next token (nats); ``ppl = exp(nll)``.
- ``kl``: mean ``KL(p_ref || p)`` of the method's next-token distribution ``p`` from the reference's
  ``p_ref`` (the FP16 cache on the same tokens), in nats.
- ``kl_p99``, ``kl_p999``, ``kl_max``: the tail of the same per-token KL (:func:`quantile`): a mean can hide a few
  tokens where the method's prediction came apart, which is what a reader of the output notices.
- ``top1_agree``: fraction of positions where the method's arg-max equals the reference's.

and :func:`roc_auc`, how well a score separates two classes (the monitor's signals against real error), and
:func:`alarm_quality`, precision and recall of yes/no alarms against the windows that really were bad.

Core, not evaluation's: calibration scores its held-out text and its monitor with the same numbers that
``kvguard eval`` reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Rows per step: a few MiB per [rows, vocab] temporary even at 262k-token vocabularies, so the softmax, the
# subtraction and the product stay in cache and reuse freed memory instead of faulting in fresh pages (about
# 3x faster at Gemma 3's vocabulary); each row's numbers are the same at any row count.
_ROWS = 8


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``values`` (any shape, at least one) by linear interpolation between order statistics,
    as ``numpy.quantile`` and ``torch.quantile`` define it by default: the sorted values at rank ``q * (n - 1)``.
    At 2,047 predictions ``0.999`` lies between the third- and fourth-largest value, ``0.99`` near the 21st."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q is a fraction in [0, 1], got {q}")
    ordered = values.reshape(-1).double().sort().values
    if ordered.numel() == 0:
        raise ValueError("no values to take a quantile of")
    rank = q * (ordered.numel() - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, ordered.numel() - 1)
    return float(ordered[lo] + (rank - lo) * (ordered[hi] - ordered[lo]))


class TokenMetrics:
    """Running sums; feed it ``[N, vocab]`` logits slice by slice. The per-token KL is kept (one float per compared
    position) for its tail."""

    def __init__(self) -> None:
        self.count = 0
        self._nll = 0.0
        self._kl = 0.0
        self._agree = 0
        self._compared = 0
        self._token_kl: list[torch.Tensor] = []  # [n] float32 per slice, in order

    def add(self, logits: torch.Tensor, targets: torch.Tensor, reference_logprobs: torch.Tensor | None = None,
            reference_top1: torch.Tensor | None = None) -> None:
        """``logits`` ``[N, V]`` predicting ``targets`` ``[N]``; ``reference_logprobs`` ``[N, V]`` (log-softmax);
        ``reference_top1`` ``[N]``: its arg-max, when the caller keeps it across passes (the same number, computed
        once instead of once per pass)."""
        if logits.shape[0] != targets.shape[0]:
            raise ValueError(f"{logits.shape[0]} predictions for {targets.shape[0]} targets")
        if reference_logprobs is not None and reference_logprobs.shape != logits.shape:
            raise ValueError(f"reference shape {tuple(reference_logprobs.shape)} != logits shape {tuple(logits.shape)}")
        if reference_top1 is not None and reference_top1.shape != targets.shape:
            raise ValueError(f"reference top-1 shape {tuple(reference_top1.shape)} "
                             f"!= targets shape {tuple(targets.shape)}")
        for i in range(0, logits.shape[0], _ROWS):
            ref = None if reference_logprobs is None else reference_logprobs[i:i + _ROWS].float()
            top1 = None if reference_top1 is None else reference_top1[i:i + _ROWS]
            self._add_rows(logits[i:i + _ROWS].float(), targets[i:i + _ROWS], ref, top1)

    def _add_rows(self, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None,
                  top1: torch.Tensor | None) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)  # [n, V], a new tensor: the in-place steps below may reuse it
        self._nll += -logprobs.gather(-1, targets.reshape(-1, 1)).double().sum().item()
        self.count += targets.numel()
        if ref is None:
            return
        top1 = ref.argmax(-1) if top1 is None else top1
        self._agree += int((top1 == logprobs.argmax(-1)).sum())
        diff = logprobs.neg_().add_(ref)  # ref - logprobs, in place (the same rounding as a subtraction)
        token_kl = diff.mul_(ref.exp()).sum(-1)  # [n]
        self._kl += token_kl.double().sum().item()
        self._token_kl.append(token_kl.cpu())
        self._compared += targets.numel()

    @property
    def nll(self) -> float:
        return self._nll / self.count

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def kl(self) -> float | None:
        return self._kl / self._compared if self._compared else None

    @property
    def top1_agree(self) -> float | None:
        return self._agree / self._compared if self._compared else None

    @property
    def token_kl(self) -> torch.Tensor | None:
        """``[compared positions]`` float32: the KL at each position, in the order fed."""
        return torch.cat(self._token_kl) if self._token_kl else None

    @property
    def kl_p99(self) -> float | None:
        return self._kl_quantile(0.99)

    @property
    def kl_p999(self) -> float | None:
        return self._kl_quantile(0.999)

    @property
    def kl_max(self) -> float | None:
        return self._kl_quantile(1.0)

    def _kl_quantile(self, q: float) -> float | None:
        values = self.token_kl
        return None if values is None else quantile(values, q)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count half); NaN without both
    classes."""
    scores, labels = scores.reshape(-1).double(), labels.reshape(-1).bool()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


@dataclass(frozen=True)
class AlarmQuality:
    """How yes/no alarms match the windows that were bad.

    Attributes:
        windows, alarmed, bad, hits: window counts: all, alarmed, bad, and both alarmed and bad.
        precision: bad among alarmed (``hits / alarmed``); ``None`` when nothing was alarmed.
        recall: alarmed among bad (``hits / bad``); ``None`` when nothing was bad.
        alarm_rate: alarmed among all windows; ``None`` without windows.
    """

    windows: int
    alarmed: int
    bad: int
    hits: int
    precision: float | None
    recall: float | None
    alarm_rate: float | None


def alarm_quality(alarmed: torch.Tensor, bad: torch.Tensor) -> AlarmQuality:
    """Precision, recall and rate of the boolean ``alarmed`` against the boolean ``bad`` (same shape, one entry
    per window); undefined ratios are ``None`` rather than 0, so an empty class cannot pass for a perfect
    or a useless alarm."""
    alarmed, bad = alarmed.bool(), bad.bool()
    if alarmed.shape != bad.shape:
        raise ValueError(f"alarmed shape {tuple(alarmed.shape)} != bad shape {tuple(bad.shape)}")
    n, fired, positive = alarmed.numel(), int(alarmed.sum()), int(bad.sum())
    hits = int((alarmed & bad).sum())
    return AlarmQuality(n, fired, positive, hits, hits / fired if fired else None,
                        hits / positive if positive else None, fired / n if n else None)
