"""Selective recomputation: full-precision K/V for chosen positions, computed against the quantized cache.

The chosen tokens are fed again at their own positions through a read-only view of the cache
(:class:`RecomputeView`: each layer returns the stored past followed by the re-fed tokens, and stores
nothing), with an attention hook that lets each re-fed token see only the stored keys before its position (and
inside its sliding window). The K/V the model computes for them are the full-precision values the session
writes into the cache's overlay (``KVGuardCache.write_fp``).

When the cache keeps a backing tier (:mod:`kvguard.backing`), :func:`restore_then_recompute` first puts back the
originals it holds (bit for bit, ``KVGuardCache.restore``) and recomputes only the (layer, position) pairs it
is missing. A backed position needs no context, so positions a sliding layer no longer holds the context of
(before :func:`first_recomputable`) can still be compensated in every layer whose backing holds them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvguard import attention


@dataclass(frozen=True)
class RecomputeSpec:
    """What the recomputation pass re-feeds and what each re-fed token may see.

    Attributes:
        positions: ``[P]`` absolute positions, ascending.
        offsets: per layer, the absolute position of its first stored token.
        sliding_window: keys a sliding layer's query sees (``None`` without sliding layers).
        sliding: the sliding layers.
    """

    positions: torch.Tensor
    offsets: tuple[int, ...]
    sliding_window: int | None
    sliding: frozenset[int]

    @classmethod
    def of(cls, cache, positions: torch.Tensor, sliding_window: int | None) -> "RecomputeSpec":
        return cls(positions, tuple(layer.offset for layer in cache.layers), sliding_window,
                   frozenset(i for i, layer in enumerate(cache.layers) if layer.is_sliding))


class _RecomputeHook:
    """Each re-fed token attends to the stored keys strictly before its position, and to itself."""

    def __init__(self, spec: RecomputeSpec) -> None:
        self.spec = spec

    def __call__(self, module, query, key, value, attention_mask, *, scaling, softcap):
        spec, layer = self.spec, module.layer_idx
        p = query.shape[2]
        stored = key.shape[2] - p
        first = spec.offsets[layer]
        pos = spec.positions.to(query.device)
        absolute = torch.arange(first, first + stored, device=query.device)
        allowed = absolute[None, :] < pos[:, None]  # [P, stored]: keys strictly before each re-fed token
        if layer in spec.sliding and spec.sliding_window is not None:
            allowed &= absolute[None, :] > pos[:, None] - spec.sliding_window
        mask = torch.cat([allowed, torch.eye(p, dtype=torch.bool, device=query.device)], dim=1)
        return attention.attend(query, key, value, mask, scaling=scaling, softcap=softcap)


@contextlib.contextmanager
def recomputing(model, spec: RecomputeSpec):
    """Within this block (and this thread), ``model``'s attention runs the recomputation pass of ``spec``."""
    with attention.hooked(model, _RecomputeHook(spec)):
        yield


class _ViewLayer(CacheLayerMixin):
    """Reads a cache layer's stored past and returns it with the new tokens, storing nothing; keeps the new
    tokens' K/V (the recomputed full-precision values)."""

    is_compileable = False

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer
        self.is_sliding = layer.is_sliding
        self.is_initialized = True
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never uninitialised
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.captured = (key_states, value_states)
        past_k, past_v = self.layer.materialize(key_states.dtype)
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.layer.get_max_length()


class RecomputeView(Cache):
    """A read-only view of a KVGuardCache for the recomputation pass."""

    def __init__(self, cache) -> None:
        super().__init__(layers=[_ViewLayer(layer) for layer in cache.layers])

    def captured(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.layers[layer].captured
        if got is None:
            raise RuntimeError(f"the recomputation pass did not reach layer {layer}")
        return got


def ceil_fraction(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` (at least 1 when ``n > 0``)."""
    return 0 if n <= 0 else max(1, math.ceil(fraction * n - 1e-9))


def first_recomputable(cache) -> int:
    """The first position whose K/V can be recomputed from ``cache``: a sliding-window layer that has dropped old
    tokens no longer holds the context of positions less than a window after its first stored token, and their
    recomputed K/V would be wrong in every layer above it."""
    first = 0
    for layer in cache.layers:
        if layer.is_sliding and layer.offset > 0:
            first = max(first, layer.offset + layer.sliding_window - 1)
    return first


def select_positions(cache, monitor, layers: Sequence[int], end: int, fraction: float, cap: float) -> torch.Tensor:
    """The quantized positions to recompute for ``layers``: the top ``fraction`` of a layer's quantized
    positions by attention mass received x quantization error (summed over the layers), excluding positions
    already at full precision and those before :func:`first_recomputable` that the backing tier does not hold
    for every one of ``layers``, within the overlay ``cap``."""
    score = torch.zeros(end)
    quantized = 0
    room = []
    for l in layers:
        layer = cache.layers[l]
        q = layer.quantized_positions().cpu()
        n_q = int(q.numel())
        held = int(layer.overlay_positions().numel())
        room.append(ceil_fraction(cap, n_q) - held)
        quantized = max(quantized, n_q)
        if n_q == 0:
            continue
        err = layer.error_evidence(end).mean(0).sum(-1).cpu()  # [end]: K + V error, mean over heads
        mass = monitor.attention_mass(l, end).cpu()
        layer_score = torch.zeros(end)
        layer_score[q] = mass[q] * err[q]
        score += layer_score
    first = first_recomputable(cache)
    if first:
        score[:first] = torch.where(_backed_everywhere(cache, layers, first), score[:first], torch.zeros(()))
    k = min(ceil_fraction(fraction, quantized), max(room, default=0), int((score > 0).sum()))
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.topk(score, k).indices.sort().values


def _backed_everywhere(cache, layers: Sequence[int], end: int) -> torch.Tensor:
    """``[end]`` bool: positions whose originals the backing tier holds in every one of ``layers``."""
    held = torch.ones(end, dtype=torch.bool)
    for l in layers:
        backed = cache.layers[l].backed_positions().cpu()
        mask = torch.zeros(end, dtype=torch.bool)
        mask[backed[backed < end]] = True
        held &= mask
    return held


@torch.no_grad()
def recompute(model, cache, ids: Sequence[int], layers: Sequence[int], positions: torch.Tensor,
              sliding_window: int | None, *, wanted: Mapping[int, torch.Tensor] | None = None) -> int:
    """Recompute full-precision K/V of ``positions`` (absolute, ascending) by running ``model`` on those tokens
    of ``ids`` at their positions against ``cache``, and write them into ``layers`` (only the positions
    ``wanted[layer]`` of a layer, when given). Returns the (layer, position) pairs written. Positions before
    :func:`first_recomputable` are refused."""
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1).sort().values
    if positions.numel() == 0:
        return 0
    if int(positions[-1]) >= len(ids) or int(positions[0]) < 0:
        raise ValueError(f"positions must lie in [0, {len(ids)})")
    first = first_recomputable(cache)
    if int(positions[0]) < first:
        raise ValueError(f"positions before {first} cannot be recomputed: the sliding-window layers no longer hold "
                         "their context")
    device = model.device
    fed = torch.tensor(ids, device=device)[positions.to(device)].view(1, -1)
    view = RecomputeView(cache)
    dummy_mask = torch.zeros(1, 1, positions.numel(), 1, device=device)  # 4-D: taken as-is; the hook builds its own
    with recomputing(model, RecomputeSpec.of(cache, positions, sliding_window)):
        model.base_model(input_ids=fed, position_ids=positions.view(1, -1).to(device), cache=view,
                         attention_mask=dummy_mask, use_cache=True)
    written = 0
    for l in layers:
        layer = cache.layers[l]
        keep = positions >= layer.offset
        if wanted is not None:
            keep &= torch.isin(positions, torch.as_tensor(wanted[l], dtype=torch.long).cpu())
        if not bool(keep.any()):
            continue
        k, v = view.captured(l)
        idx = keep.nonzero().view(-1).to(k.device)
        cache.write_fp(l, positions[keep], k.index_select(2, idx), v.index_select(2, idx))
        written += int(keep.sum())
    return written


@torch.no_grad()
def restore_then_recompute(model, cache, ids: Sequence[int], layers: Sequence[int], positions: torch.Tensor,
                           sliding_window: int | None) -> tuple[int, int]:
    """Full-precision K/V for ``positions`` of ``layers``: the originals where ``cache``'s backing tier holds them,
    restored first (so the recomputation then reads them), recomputed (:func:`recompute`) where it does not.
    Missing positions before :func:`first_recomputable` are left quantized. Returns ``(restored, recomputed)``
    (layer, position) pairs."""
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1).sort().values
    first = first_recomputable(cache)
    restored, missing = 0, {}
    for l in layers:
        got = cache.restore(l, positions)
        restored += int(got.numel())
        rest = positions[~torch.isin(positions, got) & (positions >= max(first, cache.layers[l].offset))]
        if rest.numel():
            missing[l] = rest
    if not missing:
        return restored, 0
    rest = torch.cat(list(missing.values())).unique()  # sorted
    return restored, recompute(model, cache, ids, list(missing), rest, sliding_window, wanted=missing)
