"""Attention entropy: the signal the run-time monitor watches, and its calibrated baseline.

Raw entropy grows with the number of keys a query sees (uniform attention over ``n`` keys has entropy
``log n``), so the baseline is stored per layer, query head and **length bin** (bin ``b`` holds queries that
see ``n`` keys with ``2**b <= n < 2**(b+1)``), plus the length-free normalised entropy ``H / log n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NUM_BINS = 17  # up to 2**16 keys; longer contexts share the last bin


def attention_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of attention rows ``[..., T_k]`` -> ``[...]`` (``0 * log 0`` counts as 0)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def length_bin(n_keys: torch.Tensor | int) -> torch.Tensor:
    """The baseline bin of queries that see ``n_keys`` keys (``floor(log2 n)``, clamped to the bins)."""
    n = torch.as_tensor(n_keys).clamp_min(1).to(torch.float64)
    return torch.floor(torch.log2(n)).long().clamp(0, NUM_BINS - 1)


@dataclass(frozen=True)
class EntropyBaseline:
    """Calibrated attention entropy of the FP16 cache.

    Attributes:
        mean, std, count: ``[layers, query heads, NUM_BINS]``; ``mean``/``std`` in nats, NaN where a bin saw
            no query.
        normalized: ``[layers, query heads]`` mean of ``H / log n`` over queries with ``n >= 2`` keys.
    """

    mean: torch.Tensor
    std: torch.Tensor
    count: torch.Tensor
    normalized: torch.Tensor

    def expected(self, layer: int, n_keys: int) -> torch.Tensor:
        """Baseline entropy ``[query heads]`` of ``layer`` for queries seeing ``n_keys`` keys: the bin's mean
        where calibration saw that length, else the normalised entropy times ``log n``."""
        b = int(length_bin(n_keys))
        mean = self.mean[layer, :, b]
        fallback = self.normalized[layer] * math.log(max(n_keys, 2))
        return torch.where(torch.isnan(mean), fallback, mean)

    def tensors(self, prefix: str = "entropy.") -> dict[str, torch.Tensor]:
        return {f"{prefix}{k}": getattr(self, k).contiguous() for k in ("mean", "std", "count", "normalized")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "entropy.") -> "EntropyBaseline":
        return cls(*(tensors[f"{prefix}{k}"] for k in ("mean", "std", "count", "normalized")))


class EntropyAccumulator:
    """Running sums behind an :class:`EntropyBaseline`."""

    def __init__(self, num_layers: int, num_heads: int) -> None:
        shape = (num_layers, num_heads, NUM_BINS)
        self.sum = torch.zeros(shape, dtype=torch.float64)
        self.sumsq = torch.zeros(shape, dtype=torch.float64)
        self.count = torch.zeros(shape, dtype=torch.float64)
        self.norm_sum = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self.norm_count = torch.zeros(num_layers, num_heads, dtype=torch.float64)

    def add(self, layer: int, entropy: torch.Tensor, n_keys: torch.Tensor) -> None:
        """``entropy`` ``[B, H, T]`` of queries that saw ``n_keys`` ``[T]`` keys."""
        e = entropy.detach().to("cpu", torch.float64).sum(0)  # [H, T] summed over the batch
        e2 = (entropy.detach().to("cpu", torch.float64) ** 2).sum(0)
        batch = entropy.shape[0]
        bins = length_bin(n_keys.cpu())  # [T]
        self.sum[layer].index_add_(1, bins, e)
        self.sumsq[layer].index_add_(1, bins, e2)
        self.count[layer] += batch * torch.bincount(bins, minlength=NUM_BINS).to(torch.float64)  # same for every head
        n = n_keys.cpu().to(torch.float64)
        keep = n >= 2
        if bool(keep.any()):
            self.norm_sum[layer] += (e[:, keep] / torch.log(n[keep])).sum(1)
            self.norm_count[layer] += batch * int(keep.sum())

    def finish(self) -> EntropyBaseline:
        count = self.count
        mean = torch.where(count > 0, self.sum / count.clamp_min(1), torch.full_like(count, float("nan")))
        var = torch.where(count > 0, self.sumsq / count.clamp_min(1) - mean.nan_to_num() ** 2, torch.full_like(count, float("nan")))
        normalized = self.norm_sum / self.norm_count.clamp_min(1)
        return EntropyBaseline(mean.float(), var.clamp_min(0).sqrt().float(), count.float(), normalized.float())
