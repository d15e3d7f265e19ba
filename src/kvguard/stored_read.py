"""The one seam between the stored K/V format and everything that reads it.

A layer's :class:`~kvguard.store.Store` hands out a :class:`StoredRead`: its stored past as segments, in column
order ``[ sinks | run 0 parts | run 1 parts | ... | window ]``, each a :class:`StoredSegment` holding references to
the stored tensors (codes or full-precision) and what it takes to read them back: the heads it covers, the
rotation its sides are stored under, RoPE's rows for keys stored before it. The overlay (full-precision K/V of
chosen positions, which win over their codes) comes with the read.

Every reader takes a ``StoredRead`` and nothing else of the store:

- :meth:`StoredRead.materialize`: the whole past as the model sees it, ``[B, H_kv, N, D]``;
- :meth:`StoredRead.tiles`: the same, a bounded stretch of columns at a time (the chunked prefill's attention,
  :mod:`kvguard.chunk_attention`, never holds more than one tile of dequantized history);
- the fused C++ decode attention (:mod:`kvguard.fused_attention`) and the Triton kernel
  (:mod:`kvguard.triton_attention`), which read the codes of each segment in place;
- the decoding simulation (:mod:`kvguard.simulate`), which stores a whole stream in a store and materializes it.

How a segment reads back (:meth:`StoredSegment.read_keys`): dequantize the codes; rotate back where the side is
stored rotated (``x = x_r R^T``, :mod:`kvguard.rotation`); turn keys stored before RoPE to their positions
(:func:`kvguard.rope.rerope`). Appending to the store never modifies the tensors a read refers to, so a read
taken before an update stays valid after it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import torch

from kvguard import rotation
from kvguard.quantizer import Axis, QuantizedTensor
from kvguard.rope import rerope


def _decode(t: "QuantizedTensor | torch.Tensor", dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t.to(dtype)


def _slice(t: "QuantizedTensor | torch.Tensor", lo: int, hi: int):
    if isinstance(t, QuantizedTensor):
        return t.drop_front(lo).keep_front(hi - lo)
    return t[..., lo:hi, :]


@dataclass(frozen=True)
class StoredSegment:
    """Stored tokens at columns ``[start, start + length)`` (positions minus the layer's offset) of some heads.

    Attributes:
        heads: the layer's KV heads it holds (``LongTensor``), ``None`` for all of them.
        keys / values: ``[B, h, length, D]``: a :class:`QuantizedTensor` or a full-precision tensor.
        key_signs / value_signs: the heads' ``[h, D]`` rotation signs where that side is stored rotated
            (``x @ R``, :mod:`kvguard.rotation`), else ``None``.
        rotation: the same rotation as ``[h, D, D]`` matrices ``R`` where a side is rotated (readers that rotate
            the query or the output once by a small matmul instead of every key back).
        key_turn: for keys stored before RoPE, RoPE's ``(cos, sin)`` ``[length, D]`` at their positions.
    """

    start: int
    length: int
    heads: torch.Tensor | None
    keys: "QuantizedTensor | torch.Tensor"
    values: "QuantizedTensor | torch.Tensor"
    key_signs: torch.Tensor | None = None
    value_signs: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    key_turn: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def stop(self) -> int:
        return self.start + self.length

    @property
    def quantized(self) -> bool:
        return isinstance(self.keys, QuantizedTensor)

    @property
    def device(self) -> torch.device:
        return (self.keys.qdata if self.quantized else self.keys).device

    def read_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """The keys as the model reads them, ``[B, h, length, D]`` in ``dtype``."""
        if self.key_signs is None and self.key_turn is None:
            return _decode(self.keys, dtype)
        x = _decode(self.keys, torch.float32)
        x = x if self.key_signs is None else rotation.unrotate(x, self.key_signs)
        return (x if self.key_turn is None else rerope(x, *self.key_turn)).to(dtype)

    def read_values(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as the model reads them, ``[B, h, length, D]`` in ``dtype``."""
        if self.value_signs is None:
            return _decode(self.values, dtype)
        return rotation.unrotate(_decode(self.values, torch.float32), self.value_signs).to(dtype)

    def token_step(self) -> int:
        """Tiles of this segment must start at multiples of this (keys share scales over groups of tokens)."""
        keys = self.keys
        if isinstance(keys, QuantizedTensor) and keys.spec.axis is Axis.CHANNEL and not keys.spec.static:
            return keys.spec.group_size
        return 1

    def slice(self, lo: int, hi: int) -> "StoredSegment":
        """Its tokens ``[lo, hi)`` (relative to ``start``; ``lo`` a multiple of :meth:`token_step`)."""
        if lo == 0 and hi == self.length:
            return self
        turn = None if self.key_turn is None else (self.key_turn[0][lo:hi], self.key_turn[1][lo:hi])
        return replace(self, start=self.start + lo, length=hi - lo, keys=_slice(self.keys, lo, hi),
                       values=_slice(self.values, lo, hi), key_turn=turn)


@dataclass(frozen=True)
class StoredRead:
    """What a layer's attention reads: its stored past (before the tokens of the current update).

    Attributes:
        segments: every stored stretch, in column order (sinks, each run's parts, window).
        length: stored tokens (columns ``[0, length)``; the new tokens' columns follow).
        batch / num_heads / head_dim: the shape ``[B, H_kv, ., D]`` every segment shares (but for its heads).
        overlay_columns: ``[P]`` columns served from the full-precision overlay (``None``: no overlay), with
            ``overlay_keys`` / ``overlay_values`` ``[B, H_kv, P, D]``.
        score_correction: correct the scores of keys read from codes below INT8 (:mod:`kvguard.score_bias`);
            applied by the fused decode kernel only.
    """

    segments: tuple[StoredSegment, ...]
    length: int
    batch: int
    num_heads: int
    head_dim: int
    overlay_columns: torch.Tensor | None = None
    overlay_keys: torch.Tensor | None = None
    overlay_values: torch.Tensor | None = None
    score_correction: bool = False

    def with_overlay(self, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> "StoredRead":
        """This read with the overlay's ``[P]`` columns served from ``keys`` / ``values`` ``[B, H_kv, P, D]``."""
        if not columns.numel():
            return self
        return replace(self, overlay_columns=columns, overlay_keys=keys, overlay_values=values)

    def materialize(self, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole stored past as the model sees it, keys and values ``[B, H_kv, length, D]`` in ``dtype``."""
        return self._columns(self.segments, 0, self.length, dtype, device)

    def tiles(self, max_tokens: int, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The stored past in order, a stretch of at most ``max_tokens`` columns at a time (rounded to whole key
        groups, at least one): ``(start, keys, values)`` with keys and values ``[B, H_kv, n, D]`` as
        :meth:`materialize` has them at columns ``[start, start + n)``."""
        for group in self._column_groups():
            start, stop = group[0].start, group[0].stop
            step = max(seg.token_step() for seg in group)
            size = max(step, max_tokens // step * step)
            for lo in range(0, stop - start, size):
                hi = min(lo + size, stop - start)
                k, v = self._columns(tuple(seg.slice(lo, hi) for seg in group), start + lo, start + hi, dtype)
                yield start + lo, k, v

    def _column_groups(self) -> list[list[StoredSegment]]:
        """The segments grouped by the columns they cover (a run's parts share their columns)."""
        groups: list[list[StoredSegment]] = []
        for seg in self.segments:
            if seg.length == 0:
                continue
            if groups and groups[-1][0].start == seg.start:
                groups[-1].append(seg)
            else:
                groups.append([seg])
        return groups

    def _columns(self, segments, start: int, stop: int, dtype: torch.dtype, device=None):
        """Keys and values at columns ``[start, stop)``, covered by ``segments``, overlay applied."""
        if len(segments) == 1 and segments[0].heads is None and segments[0].start == start and segments[0].stop == stop:
            k, v = segments[0].read_keys(dtype), segments[0].read_values(dtype)  # one segment: no copy to assemble
            if self.overlay_columns is not None:
                k, v = k.clone(), v.clone()  # never write the overlay into the stored tensors
        else:
            device = device if device is not None else self._device()
            shape = (self.batch, self.num_heads, stop - start, self.head_dim)
            k = torch.empty(shape, dtype=dtype, device=device)
            v = torch.empty(shape, dtype=dtype, device=device)
            for seg in segments:
                cols = slice(seg.start - start, seg.stop - start)
                if seg.heads is None:
                    k[:, :, cols], v[:, :, cols] = seg.read_keys(dtype), seg.read_values(dtype)
                else:
                    k[:, :, cols].index_copy_(1, seg.heads, seg.read_keys(dtype))
                    v[:, :, cols].index_copy_(1, seg.heads, seg.read_values(dtype))
        if self.overlay_columns is not None:
            inside = (self.overlay_columns >= start) & (self.overlay_columns < stop)
            if bool(inside.any()):
                cols = self.overlay_columns[inside] - start
                k.index_copy_(2, cols, self.overlay_keys[:, :, inside].to(dtype))
                v.index_copy_(2, cols, self.overlay_values[:, :, inside].to(dtype))
        return k, v

    def _device(self):
        return self.segments[0].device if self.segments else None
