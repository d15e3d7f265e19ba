"""The backing tier: the full-precision originals of quantized tokens, kept in a bounded, slower store.

When a layer quantizes a group of tokens (:meth:`KVGuardLayer._store <kvguard.cache_layer.KVGuardLayer>`), it
hands the group's K/V, exactly as its full-precision window held them (``CacheConfig.fp_dtype``, float16 by
default), to the cache's :class:`BackingStore`. The store copies them to host memory (the slower tier: on an
accelerator the hot cache stays on the device) and :meth:`BackingStore.restore` gives them back bit for bit,
so the feedback loop can put a token's original K/V into the overlay instead of recomputing an approximation of
it against the already-quantized past (:mod:`kvguard.control.recompute`).

The store is bounded. ``BackingConfig.max_bytes`` caps the bytes it holds over all layers of one cache, and it
evicts **oldest first**: the group of the lowest absolute position goes first, over all layers (the lowest
layer first among equal positions), so every layer keeps the same most recent positions. Not the order of
storing: a forward pass stores all of layer 0's groups before layer 1's, and first-stored-first-evicted would
empty the lower layers on a long prompt. Whole groups are the unit (``group_size`` tokens of one layer, as
they were quantized); a group larger than the whole cap is not kept. Positions evicted, never quantized, or dropped by a sliding layer are
reported *missing* and fall back to recomputation.

Layout: a layer's entry is a list of chunks in ascending position order, each ``[B, H_kv, group_size, D]``
keys and values plus its first absolute position. Every layer of one cache shares one store (and so one cap);
a store's bytes are not the hot cache's (``KVGuardCache.nbytes`` leaves them out, ``backing_bytes`` reports
them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class BackingConfig:
    """Whether a cache keeps the full-precision originals of the tokens it quantizes, and how many bytes.

    Attributes:
        enabled: off by default: the store costs host memory and a copy per quantized group.
        max_bytes: cap over all layers of one cache (keys and values); oldest groups are evicted first.
            256 MiB holds SmolLM2-135M's 30 layers for about 11,600 tokens at float16 (22.5 KiB per token).
    """

    enabled: bool = False
    max_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if int(self.max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0 (a byte count), got {self.max_bytes}")


@dataclass(frozen=True)
class Restored:
    """What :meth:`BackingStore.restore` found for one layer.

    Attributes:
        positions: ``[R]`` the absolute positions held, ascending.
        keys, values: ``[B, H_kv, R, D]`` their original K/V, on the device asked for.
        missing: ``[M]`` the positions asked for that the store does not hold, ascending.
    """

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    missing: torch.Tensor


@dataclass
class _Chunk:
    first: int  # absolute position of its first token
    keys: torch.Tensor  # [B, H_kv, n, D], host memory
    values: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class _LayerEntry:
    chunks: list[_Chunk] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)  # chunks[i].first, for bisect


class BackingStore:
    """The originals of one cache's quantized tokens, per layer, under one byte cap (see the module doc)."""

    def __init__(self, config: BackingConfig, *, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._layers: dict[int, _LayerEntry] = {}
        self._bytes = 0
        self.evicted_tokens = 0  # (layer, position) pairs evicted by the cap since creation

    # ---------------------------------------------------------------- writing
    def put(self, layer: int, first: int, keys: torch.Tensor, values: torch.Tensor, group_size: int) -> None:
        """Keep ``keys`` / ``values`` (``[B, H_kv, n, D]``, positions ``first .. first + n - 1`` of ``layer``) in
        chunks of ``group_size`` tokens, evicting the oldest chunks over the cap."""
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"put expects keys and values of one [B, H_kv, n, D] shape, got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}")
        entry = self._layers.setdefault(layer, _LayerEntry())
        if entry.chunks and first < entry.chunks[-1].first + entry.chunks[-1].length:
            raise ValueError(f"layer {layer}: positions must be stored in ascending order; got {first} after "
                             f"{entry.chunks[-1].first + entry.chunks[-1].length - 1}")
        for start in range(0, keys.shape[-2], group_size):
            # Copies (not views): a view would keep the whole block alive after its neighbours are evicted.
            k = keys[..., start:start + group_size, :].to(self.device, copy=True).contiguous()
            v = values[..., start:start + group_size, :].to(self.device, copy=True).contiguous()
            chunk = _Chunk(first + start, k, v)
            if chunk.nbytes > self.config.max_bytes:
                continue
            entry.chunks.append(chunk)
            entry.firsts.append(chunk.first)
            self._bytes += chunk.nbytes
            self._evict()

    def _evict(self) -> None:
        while self._bytes > self.config.max_bytes:
            # A layer's chunks ascend, so its first is its oldest.
            layer = min((l for l, e in self._layers.items() if e.chunks), key=lambda l: (self._layers[l].chunks[0].first, l))
            self.evicted_tokens += self._pop_front(layer)

    def _pop_front(self, layer: int) -> int:
        """Drop ``layer``'s oldest chunk; returns its token count."""
        entry = self._layers[layer]
        chunk = entry.chunks.pop(0)
        entry.firsts.pop(0)
        self._bytes -= chunk.nbytes
        return chunk.length

    def drop_before(self, layer: int, position: int) -> None:
        """Forget ``layer``'s chunks that end before ``position`` (a sliding layer no longer holds them)."""
        entry = self._layers.get(layer)
        while entry is not None and entry.chunks and entry.chunks[0].first + entry.chunks[0].length <= position:
            self._pop_front(layer)

    def clear(self, layer: int | None = None) -> None:
        """Forget one layer's originals (its cache layer was reset), or everything."""
        for l in [layer] if layer is not None else list(self._layers):
            entry = self._layers.pop(l, None)
            if entry is not None:
                self._bytes -= sum(c.nbytes for c in entry.chunks)

    def map_batch(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch reorder / selection ``fn`` (on dimension 0) to ``layer``'s originals, as the cache
        layer applies it to its own tensors, so the store stays aligned with the batch."""
        entry = self._layers.get(layer)
        if entry is None:
            return
        for chunk in entry.chunks:
            self._bytes -= chunk.nbytes
            chunk.keys, chunk.values = fn(chunk.keys), fn(chunk.values)
            self._bytes += chunk.nbytes
        self._evict()

    # ---------------------------------------------------------------- reading
    def positions(self, layer: int) -> torch.Tensor:
        """``[N]`` the absolute positions held for ``layer``, ascending."""
        entry = self._layers.get(layer)
        if entry is None or not entry.chunks:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(c.first, c.first + c.length) for c in entry.chunks])

    def restore(self, layer: int, positions, device: torch.device | str | None = None) -> Restored:
        """The originals of ``layer`` at absolute ``positions`` (``[P]``, unique), bit for bit, moved to
        ``device``; positions not held come back in ``Restored.missing``."""
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1).cpu().unique()  # sorted
        device = torch.device(device) if device is not None else self.device
        entry = self._layers.get(layer) or _LayerEntry()
        found, ks, vs, missing = [], [], [], []
        for p in pos.tolist():
            i = bisect.bisect_right(entry.firsts, p) - 1
            if i >= 0 and p < entry.chunks[i].first + entry.chunks[i].length:
                chunk = entry.chunks[i]
                found.append(p)
                ks.append(chunk.keys[..., p - chunk.first, :])
                vs.append(chunk.values[..., p - chunk.first, :])
            else:
                missing.append(p)
        if not found:
            empty = torch.zeros(0, device=device)  # nothing held: no batch or head shape to give
            return Restored(_long(found), empty, empty, _long(missing))
        keys = torch.stack(ks, dim=-2).to(device)  # [B, H_kv, R, D]
        values = torch.stack(vs, dim=-2).to(device)
        return Restored(_long(found), keys, values, _long(missing))

    def nbytes(self, layer: int | None = None) -> int:
        """Bytes of the originals held, for one layer or the whole store."""
        if layer is None:
            return self._bytes
        entry = self._layers.get(layer)
        return 0 if entry is None else sum(c.nbytes for c in entry.chunks)


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
