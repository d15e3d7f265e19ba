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

    def expected_mean(self, n_keys: torch.Tensor) -> torch.Tensor:
        """Baseline entropy per layer, averaged over query heads, for queries that see ``n_keys`` keys:
        ``n_keys`` ``[..., layers]`` (one count per layer: sliding layers see fewer) -> ``[..., layers]``."""
        n = torch.as_tensor(n_keys, dtype=torch.long)
        layers = torch.arange(self.mean.shape[0]).expand_as(n)
        mean = self.mean[layers, :, length_bin(n)]  # [..., layers, heads]
        fallback = self.normalized[layers] * torch.log(n.clamp_min(2).to(torch.float32)).unsqueeze(-1)
        return torch.where(torch.isnan(mean), fallback, mean).mean(-1)

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

    def merge(self, other: "EntropyAccumulator") -> "EntropyAccumulator":
        """Add ``other``'s sums into this one (in place; returns ``self``).

        Float addition is not associative, so a merge is exact only against the same merges in the same
        order: :func:`kvguard.calibration.kv_statistics.merge` folds one accumulator per batch, in batch order, whichever
        process collected each batch."""
        if self.sum.shape != other.sum.shape:
            raise ValueError(f"cannot merge entropy sums of shape {tuple(other.sum.shape)} into {tuple(self.sum.shape)}")
        for name in ("sum", "sumsq", "count", "norm_sum", "norm_count"):
            getattr(self, name).add_(getattr(other, name))
        return self

    def finish(self) -> EntropyBaseline:
        count = self.count
        mean = torch.where(count > 0, self.sum / count.clamp_min(1), torch.full_like(count, float("nan")))
        var = torch.where(count > 0, self.sumsq / count.clamp_min(1) - mean.nan_to_num() ** 2, torch.full_like(count, float("nan")))
        normalized = self.norm_sum / self.norm_count.clamp_min(1)
        return EntropyBaseline(mean.float(), var.clamp_min(0).sqrt().float(), count.float(), normalized.float())


def baseline_ratio(entropy: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``entropy / expected`` where the baseline is meaningful (a query seeing one key has entropy 0 either
    way: ratio 1 there)."""
    return torch.where(expected > 1e-3, entropy / expected.clamp_min(1e-3), torch.ones_like(entropy))


class SequenceReference:
    """The level a sequence's attention entropy runs at, relative to the calibrated baseline.

    Texts differ: on real prose most layers spend long stretches 20 % above or below a baseline averaged over
    all calibration text, with or without quantization. The monitor therefore measures each token's drop
    against this sequence's own level: the running mean of ``entropy / baseline`` over its first ``tokens``
    tokens, an exponential mean with that time constant after. A sudden drop (what drowned key information
    looks like) stands out; a text that simply attends more sharply does not.
    """

    def __init__(self, num_layers: int, tokens: int = 256) -> None:
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        self.tokens = tokens
        self.level = torch.ones(num_layers)
        self.count = 0

    def drop(self, ratio: torch.Tensor) -> torch.Tensor:
        """This token's drop ``1 - ratio / level`` per layer (``ratio`` from :func:`baseline_ratio`), then
        fold the token into the level (non-finite ratios are not folded in)."""
        drop = 1.0 - ratio / self.level.clamp_min(1e-6)
        self.count += 1
        rate = 1.0 / min(self.count, self.tokens)
        self.level = torch.where(torch.isfinite(ratio), self.level + (ratio - self.level) * rate, self.level)
        return drop

    @staticmethod
    def drops(ratio: torch.Tensor, tokens: int = 256) -> torch.Tensor:
        """:meth:`drop` over a whole sequence: ``ratio`` ``[T, layers]`` -> ``[T, layers]``."""
        ref = SequenceReference(ratio.shape[1], tokens)
        return torch.stack([ref.drop(r) for r in ratio]) if ratio.shape[0] else ratio.clone()
