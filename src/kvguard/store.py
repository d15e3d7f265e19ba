"""One layer's stored tokens, and the one rule of how they are laid out.

A store holds the tokens a layer has seen, in order, as::

    [ sinks | run 0 | run 1 | ... | window ]

- **sinks**: the first ``CacheConfig.sinks`` tokens, full precision (``fp_dtype``).
- **runs**: quantized tokens. A run is a stretch of tokens stored under one layout (which precision each KV
  head uses, clip ratios, static scales, rotation, RoPE placement); changing the :class:`Format` starts a new run
  with the next group, earlier runs keep theirs. Within a run the heads sharing a precision pair form one
  :class:`Part`. Tokens enter a run in whole groups of ``group_size`` when they leave the window, are quantized
  exactly once, and are never re-quantized from their codes. A part's tensors are views of growable buffers
  (:mod:`kvguard.rows`).
- **window**: the most recent ``residual`` to ``residual + group_size - 1`` tokens, full precision, or with
  ``CacheConfig.window_bits == 8`` INT8 codes under the calibrated static scales (``[1, H, 1, D]``, the INT8
  tier's format), decoded when read.
- **rotation** (per side, heads below INT8): ``quantize(x @ R)`` with ``R`` an orthonormal randomized Hadamard
  matrix per KV head (:mod:`kvguard.rotation`), read back as ``dequantize(...) @ R.T``.
- **pre-RoPE keys** (``CacheConfig.prerope_keys``, heads below INT8): keys turned back by RoPE (:mod:`kvguard.rope`;
  before the rotation, if any) when stored, turned to their positions again when read.

Everything that reads the stored format reads it through :meth:`Store.read` (a
:class:`~kvguard.stored_read.StoredRead`); everything that writes it writes through :meth:`Store.append` (new
tokens) or :meth:`Store.encode` (a promoted history, from its originals). The overlay and the backing tier are
objects of their own (:mod:`kvguard.overlay`, :mod:`kvguard.backing`); the layer composes the three
(:mod:`kvguard.cache_layer`).

Every tensor is ``[B, H_kv, T, D]`` (batch, KV heads, tokens, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvguard import rotation
from kvguard.config import CacheConfig, window_scale
from kvguard.precision import Precision, value_tiers
from kvguard.quantizer import Axis, QuantizedTensor, QuantSpec, quantize, static_int8_codes
from kvguard.rope import Rope, rerope, unrope
from kvguard.rows import MIN_ROOM, extend_rows
from kvguard.stored_read import StoredRead, StoredSegment


@dataclass(frozen=True)
class Format:
    """How the tokens a store quantizes from now on are stored (the layer's ``set_*`` methods replace it).

    Attributes:
        tiers: one precision for every KV head, or one per head.
        key_clip / value_clip: clipping ratios.
        key_rotation / value_rotation: Hadamard-rotate that side of heads below INT8.
        value_drop: per head, values this many tiers below the keys (empty: at the keys' tier).
    """

    tiers: "Precision | tuple[Precision, ...]" = Precision.INT4
    key_clip: float = 1.0
    value_clip: float = 1.0
    key_rotation: bool = False
    value_rotation: bool = False
    value_drop: tuple[int, ...] = ()

    def head_tiers(self, num_heads: int) -> tuple[Precision, ...]:
        return self.tiers if isinstance(self.tiers, tuple) else (self.tiers,) * num_heads


@dataclass(frozen=True)
class PartLayout:
    """How one group of heads is stored in a run."""

    heads: tuple[int, ...]
    precision: Precision
    key_spec: QuantSpec | None  # None for fp16 heads
    value_spec: QuantSpec | None
    key_rotated: bool = False  # stored as quantize(k @ R); only below INT8
    value_rotated: bool = False
    key_prerope: bool = False  # keys stored before RoPE (turned back by their position); only below INT8


@dataclass
class Part:
    """The tensors of one :class:`PartLayout` in a run."""

    layout: PartLayout
    index: torch.Tensor  # LongTensor of the head indices, for index_select / index_copy
    keys: "QuantizedTensor | torch.Tensor | None" = None  # [B, h, T, D]
    values: "QuantizedTensor | torch.Tensor | None" = None
    signs: torch.Tensor | None = None  # [h, D] rotation signs of the part's heads, when a side is rotated
    rotation_matrix: torch.Tensor | None = None  # [h, D, D] the same rotation R, for the matmul readers
    room: dict = field(default_factory=dict)  # the growable buffers keys / values are views of (kvguard.rows)

    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


@dataclass
class Run:
    layout: tuple[PartLayout, ...]
    parts: list[Part]
    length: int = 0

    def nbytes(self) -> int:
        """Bytes of its codes, scales, zero points (and full-precision heads)."""
        return sum(part.nbytes() for part in self.parts)


@dataclass(frozen=True)
class Leaving:
    """Tokens that left the window in one append and were stored: absolute positions from ``first``, their K/V
    ``[B, H, n, D]`` as the window held them (``fp_dtype``), and whether any head quantized them."""

    first: int
    keys: torch.Tensor
    values: torch.Tensor
    quantized: bool


# observe(part, first, originals (k, v), read back (k, v)): the error evidence of freshly encoded heads.
Observer = Callable[[Part, int, tuple, tuple], None]


class Store:
    """One layer's sinks, runs and window (see the module docstring)."""

    def __init__(self, config: CacheConfig, layer_idx: int = 0, rope: Rope | None = None,
                 format: Format | None = None) -> None:
        self.config = config
        self.layer_idx = layer_idx
        self.rope = rope
        self.format = format or Format(key_clip=config.key_clip, value_clip=config.value_clip)
        # Calibrated INT8 absmax per KV head and channel, [H_kv, D]; None = dynamic scales.
        self.key_absmax: torch.Tensor | None = None
        self.value_absmax: torch.Tensor | None = None
        self.num_heads: int | None = None  # known at the first append
        self.clear()

    def clear(self) -> None:
        self.sinks_k = self.sinks_v = None
        self.runs: list[Run] = []
        self.win_k = self.win_v = None
        self.offset = 0  # absolute position of the first stored token
        self.length = 0  # tokens seen so far
        self.initialized = False
        self._win_scale: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V [1, H, 1, D] of an 8-bit window
        self._rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE's cos / sin [T, D] from position 0

    def initialize(self, key_states: torch.Tensor) -> None:
        """Learn batch, heads, head_dim, device and dtype from the first tokens."""
        self.device = key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.fp_dtype = self.config.storage_dtype(key_states.dtype)
        empty = key_states.new_zeros((self.batch_size, self.num_heads, 0, self.head_dim), dtype=self.fp_dtype)
        self.sinks_k = self.sinks_v = empty
        if self.config.window_bits == 8:
            if self.key_absmax is None or self.value_absmax is None:
                raise ValueError(f"layer {self.layer_idx}: window_bits=8 stores the window under the calibrated INT8 "
                                 "scales, and none are set (pass a profile's static scales to make_cache)")
            self._win_scale = tuple(window_scale(a.to(self.device)) for a in (self.key_absmax, self.value_absmax))
            empty = empty.to(torch.int8)
        self.win_k = self.win_v = empty
        self.initialized = True

    # ------------------------------------------------------------------ the layout rule
    def layout(self) -> tuple[PartLayout, ...]:
        """How tokens quantized now are stored: heads grouped by their key and value precisions."""
        fmt = self.format
        groups: dict[tuple[Precision, Precision], list[int]] = {}
        tiers = fmt.head_tiers(self.num_heads or 1)
        for h, pair in enumerate(zip(tiers, value_tiers(tiers, fmt.value_drop))):
            groups.setdefault(pair, []).append(h)
        layout = []
        for (precision, value_precision), heads in groups.items():
            if not precision.is_quantized:
                layout.append(PartLayout(tuple(heads), precision, None, None))
                continue
            static = precision is Precision.INT8
            low = precision.bits < 8  # INT8 is near-lossless already; its static scales are unrotated
            layout.append(PartLayout(
                tuple(heads), precision,
                self.config.quant_spec(precision, Axis.CHANNEL, fmt.key_clip, static and self.key_absmax is not None),
                self.config.quant_spec(value_precision, Axis.TOKEN, fmt.value_clip,
                                       static and self.value_absmax is not None),
                low and fmt.key_rotation, low and fmt.value_rotation, low and self.config.prerope_keys))
        return tuple(layout)

    def new_run(self, layout: tuple[PartLayout, ...]) -> Run:
        return Run(layout, [self._new_part(pl) for pl in layout])

    def _new_part(self, pl: PartLayout) -> Part:
        index = torch.tensor(pl.heads, device=self.device)
        signs = matrix = None
        if pl.key_rotated or pl.value_rotated:
            signs = rotation.signs(self.head_dim, self.num_heads, self.layer_idx, self.device).index_select(0, index)
            matrix = rotation.matrix(self.head_dim, self.num_heads, self.layer_idx).to(self.device).index_select(0, index)
        return Part(pl, index, signs=signs, rotation_matrix=matrix)

    # ------------------------------------------------------------------ writing
    def append(self, keys: torch.Tensor, values: torch.Tensor, observe: Observer | None = None) -> Leaving | None:
        """Store new tokens ``[B, H, n, D]``: into the sinks, then the window; whole groups leaving the window
        are quantized into the current run. Returns what left the window, if anything did."""
        n = keys.shape[-2]
        into_sinks = min(max(self.config.sinks - self.length, 0), n)
        self.length += n
        if into_sinks:
            self.sinks_k = torch.cat([self.sinks_k, keys[..., :into_sinks, :].to(self.fp_dtype)], dim=-2)
            self.sinks_v = torch.cat([self.sinks_v, values[..., :into_sinks, :].to(self.fp_dtype)], dim=-2)
        if into_sinks < n:
            self.win_k = torch.cat([self.win_k, self.window_codes(keys[..., into_sinks:, :], 0)], dim=-2)
            self.win_v = torch.cat([self.win_v, self.window_codes(values[..., into_sinks:, :], 1)], dim=-2)
        g, r = self.config.group_size, self.config.residual
        leaving = (self.win_k.shape[-2] - r) // g * g
        if leaving <= 0:
            return None
        first = self.window_start()
        k, v = self.window_tensors(end=leaving)
        # A copy of the rows that stay: a view would keep the leaving rows' storage (a prefill chunk's 256 of them
        # per layer) alive beside the codes they became.
        self.win_k, self.win_v = self.win_k[..., leaving:, :].clone(), self.win_v[..., leaving:, :].clone()
        layout = self.layout()
        if not self.runs or self.runs[-1].layout != layout:
            self.runs.append(self.new_run(layout))
        self.encode(self.runs[-1], k, v, first, observe)
        return Leaving(first, k, v, any(pl.key_spec is not None for pl in layout))

    def encode(self, run: Run, keys: torch.Tensor, values: torch.Tensor, first: int,
               observe: Observer | None = None) -> None:
        """Append ``keys`` / ``values`` (``[B, H, n, D]``, whole groups, absolute positions from ``first``) to
        ``run``, each part encoding its heads in its layout (``observe``: see :data:`Observer`)."""
        turn = self.turn(run, first, keys.shape[-2])
        for part in run.parts:
            pl = part.layout
            k, v = self.heads(keys, part), self.heads(values, part)
            k_in = unrope(k.float(), *turn) if pl.key_prerope else k
            k_in = rotation.rotate(k_in, part.signs) if pl.key_rotated else k_in
            v_in = rotation.rotate(v, part.signs) if pl.value_rotated else v
            k_new = self._encode(k_in, pl.key_spec, self._static_absmax(self.key_absmax, pl.key_spec, part.index))
            v_new = self._encode(v_in, pl.value_spec, self._static_absmax(self.value_absmax, pl.value_spec, part.index))
            part.keys = _extend(part.room, "keys", part.keys, k_new)
            part.values = _extend(part.room, "values", part.values, v_new)
            if observe is not None and pl.key_spec is not None:
                fresh = StoredSegment(0, k.shape[-2], None, k_new, v_new, part.signs if pl.key_rotated else None,
                                      part.signs if pl.value_rotated else None, None, turn if pl.key_prerope else None)
                observe(part, first, (k, v), (fresh.read_keys(torch.float32), fresh.read_values(torch.float32)))
        run.length += keys.shape[-2]

    def _encode(self, x: torch.Tensor, spec: QuantSpec | None, absmax: torch.Tensor | None):
        if spec is None:
            return x.to(self.fp_dtype)
        return quantize(x, spec, absmax)

    def _static_absmax(self, absmax: torch.Tensor | None, spec: QuantSpec | None, index: torch.Tensor):
        if spec is None or not spec.static:
            return None
        # [H, D] -> [1, h, 1, D]: one scale per head and channel, shared by every token.
        return absmax.to(self.device).index_select(0, index).unsqueeze(0).unsqueeze(2)

    def window_codes(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` as the window stores it: ``fp_dtype``, or INT8 codes under side ``side``'s (0: K,
        1: V) calibrated scale, rounded from the ``fp_dtype`` value."""
        x = x.to(self.fp_dtype)
        if self._win_scale is None:
            return x
        return static_int8_codes(x, self._win_scale[side]).to(torch.int8)

    def _window_read(self, codes: torch.Tensor, side: int, dtype: torch.dtype) -> torch.Tensor:
        if self._win_scale is None:
            return codes.to(dtype)
        # Through fp_dtype first: what a 16-bit window would have held after rounding, so the tokens leaving the
        # window are quantized from the same numbers the window read gives.
        return (codes.to(torch.float32) * self._win_scale[side]).to(self.fp_dtype).to(dtype)

    def window_tensors(self, dtype: torch.dtype | None = None, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's first ``end`` tokens (all: ``None``) as keys and values ``[B, H, n, D]`` in ``dtype``
        (``fp_dtype``: ``None``), decoded when the window holds INT8 codes."""
        dtype = dtype or self.fp_dtype
        return (self._window_read(self.win_k[..., :end, :], 0, dtype),
                self._window_read(self.win_v[..., :end, :], 1, dtype))

    def as_window(self, x: torch.Tensor, side: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` as the window would hold and read it (side 0: keys, 1: values)."""
        return self._window_read(self.window_codes(x, side), side, dtype or self.fp_dtype)

    def turn(self, run: Run, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's ``(cos, sin)`` ``[n, D]`` at absolute positions ``first ..`` when ``run`` holds pre-RoPE keys:
        rows of one table from position 0, grown by doubling, since every decode step reads the whole history
        (a row depends only on its position)."""
        if not any(p.layout.key_prerope for p in run.parts):
            return None
        end = first + n
        if self._rope_rows is None or self._rope_rows[0].shape[0] < end:
            held = 0 if self._rope_rows is None else self._rope_rows[0].shape[0]
            self._rope_rows = self.rope.tables(self.layer_idx, 0, max(end, 2 * held), self.device)
        cos, sin = self._rope_rows
        return cos[first:end], sin[first:end]

    def heads(self, x: torch.Tensor, part: Part) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` restricted to ``part``'s heads ``[B, h, n, D]``."""
        return x if len(part.layout.heads) == self.num_heads else x.index_select(1, part.index)

    # ------------------------------------------------------------------ reading
    def segment(self, part: Part, start: int, length: int, turn=None) -> StoredSegment:
        """``part``'s tokens as a segment at columns ``[start, start + length)`` (``turn``: RoPE's rows at their
        positions, for keys stored before it; :meth:`turn`)."""
        pl = part.layout
        return StoredSegment(
            start, length, None if len(pl.heads) == self.num_heads else part.index, part.keys, part.values,
            part.signs if pl.key_rotated else None, part.signs if pl.value_rotated else None,
            part.rotation_matrix, turn if pl.key_prerope else None)

    def read(self, score_correction: bool = False) -> StoredRead:
        """The stored past as segments (references to the stored tensors, which appending never modifies in
        place). Keys stored before RoPE come with RoPE's rows at their absolute positions."""
        segments, column = [], self.sinks_k.shape[-2]
        if column:
            segments.append(StoredSegment(0, column, None, self.sinks_k, self.sinks_v))
        for run in self.runs:
            turn = self.turn(run, self.offset + column, run.length)
            segments.extend(self.segment(part, column, run.length, turn) for part in run.parts)
            column += run.length
        if self.win_k.shape[-2]:
            segments.append(StoredSegment(column, self.win_k.shape[-2], None, *self.window_tensors()))
            column += self.win_k.shape[-2]
        return StoredRead(tuple(segments), column, self.batch_size, self.num_heads, self.head_dim,
                          score_correction=score_correction)

    # ------------------------------------------------------------------ positions
    @property
    def stored_tokens(self) -> int:
        return self.length - self.offset

    def sinks_end(self) -> int:
        """Absolute position after the last sink held."""
        return self.offset + self.sinks_k.shape[-2]

    def window_start(self) -> int:
        """Absolute position of the first full-precision window token."""
        return self.length - self.win_k.shape[-2]

    def quantized_positions(self) -> torch.Tensor:
        """Absolute positions currently held as codes in a quantized (non-fp16) part of some head."""
        spans, pos = [], self.sinks_end()
        for run in self.runs:
            if any(p.layout.precision.is_quantized for p in run.parts):
                spans.append(torch.arange(pos, pos + run.length, device=self.device))
            pos += run.length
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=self.device)

    def holds_prerope_keys(self) -> bool:
        return any(p.layout.key_prerope for run in self.runs for p in run.parts)

    # ------------------------------------------------------------------ forgetting
    def drop_before(self, keep_from: int) -> None:
        """Forget tokens before absolute position ``keep_from`` (a sliding layer): sinks first, then whole groups
        of the runs (every sliding layer must hold the same tokens, since transformers builds one sliding-window
        mask from the first sliding layer's sizes), then the window once no run is left."""
        if keep_from <= self.offset:
            return
        sinks = self.sinks_k.shape[-2]
        if sinks:
            drop = min(sinks, keep_from - self.offset)
            self.sinks_k, self.sinks_v = self.sinks_k[..., drop:, :], self.sinks_v[..., drop:, :]
            self.offset += drop
            if drop < sinks:
                return
        g = self.config.group_size
        while self.runs:
            run = self.runs[0]
            drop = min(run.length, (keep_from - self.offset) // g * g)
            if drop <= 0:
                break
            for part in run.parts:
                part.keys, part.values = _drop(part.keys, drop), _drop(part.values, drop)
            run.length -= drop
            self.offset += drop
            if run.length:
                break
            self.runs.pop(0)
        if not self.runs:
            drop = min(self.win_k.shape[-2], keep_from - self.offset)
            if drop > 0:
                self.win_k, self.win_v = self.win_k[..., drop:, :], self.win_v[..., drop:, :]
                self.offset += drop

    def cut_from(self, first: int) -> None:
        """Forget the runs' tokens from absolute position ``first`` (a group boundary) on."""
        pos, kept = self.sinks_end(), []
        for run in self.runs:
            keep, length = min(run.length, max(0, first - pos)), run.length
            if 0 < keep < length:
                for part in run.parts:
                    part.keys, part.values = _keep(part.keys, keep), _keep(part.values, keep)
                    part.room = {}  # a cut run takes no more tokens: the new run comes after it
                run.length = keep
            if keep:
                kept.append(run)
            pos += length
        self.runs = kept

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch reorder / selection ``fn`` (on dimension 0) to every stored tensor."""
        self.sinks_k, self.sinks_v = fn(self.sinks_k), fn(self.sinks_v)
        self.win_k, self.win_v = fn(self.win_k), fn(self.win_v)
        for run in self.runs:
            for part in run.parts:
                part.keys, part.values = _map(part.keys, fn), _map(part.values, fn)
        self.batch_size = self.win_k.shape[0]

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of every stored tensor: sinks, runs (codes, scales, zero points, rotation signs), window."""
        if not self.initialized:
            return 0
        total = sum(_nbytes(t) for t in (self.sinks_k, self.sinks_v, self.win_k, self.win_v))
        if self._win_scale is not None:  # float16 like every scale, whatever dtype it is kept in for the arithmetic
            total += sum(s.numel() * 2 for s in self._win_scale)
        return total + self.history_nbytes()

    def history_nbytes(self) -> int:
        """Bytes of the runs (codes, scales, zero points, full-precision heads) and their rotation signs: the part
        of :meth:`nbytes` a plan's tiers decide (the sinks and window are not)."""
        if not self.initialized:
            return 0
        total = sum(run.nbytes() for run in self.runs)
        # A rotated side costs its sign bits (rebuilt here from a seed; an engine without it would store them).
        sides = {side for run in self.runs for part in run.parts
                 for side, on in (("k", part.layout.key_rotated), ("v", part.layout.value_rotated)) if on}
        return total + len(sides) * rotation.sign_bytes(self.head_dim, self.num_heads)

    def history_nbytes_from(self, first: int) -> int:
        """Bytes of the runs' tokens at absolute positions ``first`` and later (a run's bytes shared out per token:
        a calibrated INT8 scale, shared by every token, is counted pro rata)."""
        total, pos = 0, self.sinks_end()
        for run in self.runs:
            overlap = pos + run.length - max(pos, first)
            if overlap > 0 and run.length:
                total += run.nbytes() * min(overlap, run.length) // run.length
            pos += run.length
        return total

    def history_tokens(self) -> int:
        """Tokens held in the runs (between the sinks and the window)."""
        return sum(run.length for run in self.runs)


def _nbytes(t: "QuantizedTensor | torch.Tensor | None") -> int:
    if t is None:
        return 0
    if isinstance(t, QuantizedTensor):
        return t.nbytes
    return t.numel() * t.element_size()


def _extend(room: dict, side: str, stored, new):
    """A part's ``stored`` keys or values (``None``, a :class:`QuantizedTensor` or an FP16 tensor) followed by
    ``new``, through :func:`kvguard.rows.extend_rows`."""
    if not isinstance(new, QuantizedTensor):
        return extend_rows(room, side, stored, new)
    if stored is not None and (stored.spec != new.spec or stored.shape[:-2] != new.shape[:-2]):
        raise ValueError(f"cannot append {new.spec}/{new.shape} to {stored.spec}/{stored.shape}")
    qdata = extend_rows(room, side + ".codes", None if stored is None else stored.qdata, new.qdata)
    scale, zero = new.scale, new.zero_point
    if not new.spec.static:  # a calibrated scale is shared by every token: one copy
        # Keys have a scale row per group of tokens: room for as many tokens as the codes have, not 32x more.
        per_row = new.spec.group_size if new.spec.axis is Axis.CHANNEL else 1
        min_room = max(1, MIN_ROOM // per_row)
        scale = extend_rows(room, side + ".scale", None if stored is None else stored.scale, new.scale, min_room)
        if zero is not None:
            zero = extend_rows(room, side + ".zero", None if stored is None else stored.zero_point, zero, min_room)
    tokens = new.shape[-2] + (0 if stored is None else stored.shape[-2])
    return QuantizedTensor(qdata, scale, zero, new.spec, (*new.shape[:-2], tokens, new.shape[-1]))


def _keep(t, tokens: int):
    return t.keep_front(tokens) if isinstance(t, QuantizedTensor) else t[..., :tokens, :]


def _drop(t, tokens: int):
    return t.drop_front(tokens) if isinstance(t, QuantizedTensor) else t[..., tokens:, :]


def _map(t, fn):
    return t.map_batch(fn) if isinstance(t, QuantizedTensor) else fn(t)
