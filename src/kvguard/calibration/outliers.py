"""Outlier channels: the few key (or value) channels whose range dwarfs the rest of their head.

Qwen2 / 2.5's ``k_proj`` bias puts a large constant in a few key channels; a quantizer that shares one scale
across channels (per token, or after a rotation that mixes channels) spends its codes on them and rounds the
others to nothing. Calibration's statistics already hold every channel's ``absmax`` and ``mean`` over the
calibration text (``stats.*`` in the profile); this module reads them and says which layers carry outliers, how
large they are, and whether they are an offset (a bias: ``|mean|`` close to ``absmax``) or spikes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A channel is an outlier when its absmax exceeds this many times its head's median channel absmax.
OUTLIER_FACTOR = 8.0
# An outlier is an offset (a bias-like constant, not rare spikes) when |mean| is at least this share of its absmax.
OFFSET_SHARE = 0.5


@dataclass(frozen=True)
class LayerOutliers:
    """One layer's outliers on one side (keys or values).

    Attributes:
        layer: the layer.
        kind: ``key`` or ``value``.
        ratio: the largest channel absmax over its head's median channel absmax, over the layer's KV heads.
        absmax: the largest channel absmax of the layer.
        channels: ``(KV head, channel)`` of every outlier channel, largest first.
        offsets: how many of ``channels`` are offsets (``|mean| >= OFFSET_SHARE * absmax``).
    """

    layer: int
    kind: str
    ratio: float
    absmax: float
    channels: tuple[tuple[int, int], ...]
    offsets: int


def find(tensors: dict[str, torch.Tensor], kind: str = "key") -> list[LayerOutliers]:
    """Every layer's outliers on ``kind``, from a profile's ``stats.<kind>.absmax`` / ``.mean``
    ``[layers, KV heads, head_dim]``; layers without an outlier channel have ``channels == ()``."""
    absmax = tensors[f"stats.{kind}.absmax"].float()
    mean = tensors[f"stats.{kind}.mean"].float().abs()
    median = absmax.median(-1, keepdim=True).values.clamp_min(1e-12)  # [layers, heads, 1]
    ratio = absmax / median  # [layers, heads, head_dim]
    rows = []
    for layer in range(absmax.shape[0]):
        hits = (ratio[layer] > OUTLIER_FACTOR).nonzero().tolist()  # [[head, channel], ...]
        hits.sort(key=lambda hc: -float(ratio[layer, hc[0], hc[1]]))
        offsets = sum(1 for h, c in hits if mean[layer, h, c] >= OFFSET_SHARE * absmax[layer, h, c])
        rows.append(LayerOutliers(layer, kind, float(ratio[layer].max()), float(absmax[layer].max()),
                                  tuple((h, c) for h, c in hits), offsets))
    return rows


def summary(rows: list[LayerOutliers]) -> str:
    """One line for the calibration log: which layers hold outlier channels and how large the largest is."""
    hit = [r for r in rows if r.channels]
    if not hit:
        return f"no {rows[0].kind} outlier channels (none above {OUTLIER_FACTOR:g}x its head's median range)" if rows else ""
    worst = max(hit, key=lambda r: r.ratio)
    channels = sum(len(r.channels) for r in hit)
    offsets = sum(r.offsets for r in hit)
    return (f"{channels} outlier {worst.kind} channels (> {OUTLIER_FACTOR:g}x their head's median range; {offsets} "
            f"of them offsets) in {len(hit)} of {len(rows)} layers [{', '.join(str(r.layer) for r in hit)}]; the "
            f"largest: layer {worst.layer}, {worst.ratio:.0f}x, absmax {worst.absmax:.0f}")
