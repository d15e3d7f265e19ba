"""The run-time monitor's evidence, measured exactly and in one pass by the decoding simulation.

Per query token and attention layer, the monitor (:mod:`kvguard.control.monitor`) sees:

- ``entropy``: the attention entropy of the query against the cache as the model sees it (nats, mean over
  query heads), and ``n_keys``, how many keys it attended to;
- ``werr_k`` / ``werr_v``: the attention-weighted relative quantization error of what it read,
  ``sum_j p_j * ||x_q,j - x_j|| / ||x_j||`` (mean over query heads), 0 where every key read is full precision.

:func:`record` collects these for a token stream under a plan with the simulation's observer hook, next to
the per-token ``KL(fp16 || plan)`` of the next-token distribution. Calibration trains the risk classifier on
them (held-out calibration text, :mod:`kvguard.calibration.monitor_fit`); ``benchmarks/monitor_signal.py`` (in the history: commit 84c46f2)
measures on the evaluation split how well each signal predicts real error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvguard.architecture import Architecture
from kvguard.entropy import EntropyBaseline, SequenceReference, baseline_ratio
from kvguard.plan import Plan, StaticScales
from kvguard.simulate import simulate_logits

FEATURES = ("drop", "abs_drop", "werr_k", "werr_v")


def relative_error(x: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """``||x_q - x|| / ||x||`` over the last dimension: ``[..., D]`` -> ``[...]`` (float32)."""
    x, x_q = x.float(), x_q.float()
    return (x_q - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)


@dataclass(frozen=True)
class TokenSignals:
    """Evidence per query token (rows) and layer (columns), and the per-token KL it should predict.

    Attributes:
        entropy, werr_k, werr_v: ``[T, layers]`` float32.
        n_keys: ``[T, layers]`` keys each query attended to.
        kl: ``[T]`` next-token ``KL(fp16 || plan)`` of each query.
    """

    entropy: torch.Tensor
    n_keys: torch.Tensor
    werr_k: torch.Tensor
    werr_v: torch.Tensor
    kl: torch.Tensor

    def ratio(self, baseline: EntropyBaseline) -> torch.Tensor:
        """Entropy over the calibrated length-aware baseline, ``[T, layers]``."""
        return baseline_ratio(self.entropy, baseline.expected_mean(self.n_keys))

    def drop(self, baseline: EntropyBaseline, baseline_tokens: int = 256, *, adaptive: bool = True) -> torch.Tensor:
        """Each query's entropy drop as the monitor computes it: against this sequence's own level
        (:class:`~kvguard.entropy.SequenceReference`), or with ``adaptive=False`` against the calibrated
        baseline alone (``1 - ratio``)."""
        ratio = self.ratio(baseline)
        return SequenceReference.drops(ratio, baseline_tokens) if adaptive else 1.0 - ratio

    def features(self, baseline: EntropyBaseline, baseline_tokens: int = 256) -> torch.Tensor:
        """``[T, layers, len(FEATURES)]``: the classifier's inputs per token and layer."""
        d = self.drop(baseline, baseline_tokens)
        return torch.stack([d, d.abs(), self.werr_k, self.werr_v], dim=-1)

    def since(self, start: int) -> "TokenSignals":
        return TokenSignals(*(t[start:] for t in (self.entropy, self.n_keys, self.werr_k, self.werr_v, self.kl)))


class _Observer:
    def __init__(self, num_layers: int) -> None:
        self.rows: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_layers = num_layers

    def __call__(self, layer, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask) -> None:
        b, hq, t, _ = probs.shape
        rep = hq // k_fp.shape[1]
        entropy = torch.special.entr(probs).sum(-1).mean(1)[0]  # [T]
        if attention_mask is None:
            n_keys = torch.arange(1, t + 1)
        else:
            n_keys = (attention_mask[0, 0, :, :t] > torch.finfo(attention_mask.dtype).min / 2).sum(-1).cpu()
        read_q = probs.masked_fill(~quantized, 0.0)  # attention on keys read in their quantized form
        werr = []
        for x, x_q in ((k_fp, k_q), (v_fp, v_q)):
            err = relative_error(x, x_q).repeat_interleave(rep, dim=1)  # [B, Hq, T_k]
            werr.append((read_q * err.unsqueeze(2)).sum(-1).mean(1)[0])  # [T_q]
        self.rows[layer] = (entropy.cpu(), n_keys, werr[0].cpu(), werr[1].cpu())

    def stacked(self) -> tuple[torch.Tensor, ...]:
        missing = [i for i in range(self.num_layers) if i not in self.rows]
        if missing:
            raise RuntimeError(f"the simulation did not reach layers {missing}")
        return tuple(torch.stack([self.rows[i][k] for i in range(self.num_layers)], dim=-1) for k in range(4))


@torch.no_grad()
def record(model, ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
           reference_logprobs: torch.Tensor | None = None) -> TokenSignals:
    """The monitor's evidence and the per-token KL for ``ids`` (``[T]``) decoded under ``plan``.
    ``reference_logprobs``: the FP16 cache's ``[T - 1, vocab]`` log-probabilities (computed when omitted).
    Rows are the ``T - 1`` query tokens that predict a next token."""
    arch = Architecture.from_config(model.config)
    ids = ids.reshape(-1)
    if reference_logprobs is None:
        reference_logprobs = torch.log_softmax(simulate_logits(model, ids[:-1], Plan.uniform(arch, "fp16")), -1)
    observer = _Observer(arch.num_layers)
    logits = simulate_logits(model, ids[:-1], plan, scales, observer=observer)
    kl = torch.empty(logits.shape[0])
    for i in range(0, logits.shape[0], 256):  # slices bound memory for 262k-token vocabularies
        ref = reference_logprobs[i:i + 256].float()
        kl[i:i + 256] = (ref.exp() * (ref - torch.log_softmax(logits[i:i + 256], -1))).sum(-1).cpu()
    entropy, n_keys, werr_k, werr_v = observer.stacked()
    return TokenSignals(entropy, n_keys, werr_k, werr_v, kl)


def window_means(x: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """Means of ``x`` (``[T, ...]``) over the ``window`` rows ending at every ``stride``-th row (the monitor's
    refresh points: rows ``stride - 1, 2 * stride - 1, ...``; early windows hold the rows seen so far)."""
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got {window}, {stride}")
    ends = torch.arange(stride, x.shape[0] + 1, stride)
    csum = torch.cat([torch.zeros_like(x[:1]), x.cumsum(0)])
    starts = (ends - window).clamp_min(0)
    count = (ends - starts).view(-1, *([1] * (x.dim() - 1))).to(x.dtype)
    return (csum[ends] - csum[starts]) / count
