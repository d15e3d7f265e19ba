"""One layer of the KVGuard cache.

A layer stores the tokens it has seen, in order, as::

    [ sinks | run 0 | run 1 | ... | window ]      (+ a sparse full-precision overlay)

- **sinks**: the first ``CacheConfig.sinks`` tokens, full precision.
- **runs**: quantized tokens. A run is a stretch of tokens stored under one layout (which precision each KV
  head uses, clip ratios, static scales); ``set_precision`` starts a new run, earlier runs keep their format.
  Within a run the heads sharing a precision form one *part*. Tokens enter a run in whole groups of
  ``group_size`` when they leave the window, are quantized exactly once, and are never re-quantized. A part's
  codes live in preallocated buffers with room for more rows: a group is written behind the stored ones, not
  concatenated onto them (see ``_extend_rows``).
- **window**: the most recent ``residual`` to ``residual + group_size - 1`` tokens, full precision, or with
  ``CacheConfig.window_bits == 8`` INT8 codes under the calibrated static scales (``[1, H, 1, D]``, the INT8 tier's
  format): ``_win_k`` / ``_win_v`` then hold the codes and :meth:`KVGuardLayer.window_tensors` decodes them.
- **rotation** (optional, per side): heads below INT8 can store ``quantize(x @ R)`` with ``R`` an orthonormal
  randomized Hadamard matrix per KV head (:mod:`kvguard.rotation`), read back as ``dequantize(...) @ R.T``.
- **pre-RoPE keys** (optional, ``CacheConfig.prerope_keys``): key heads below INT8 store their keys turned back by
  RoPE (:mod:`kvguard.rope`; before the rotation, if any) and turn them to their positions again when read. The
  fused CPU kernel turns them as it reads the codes (``stored_read`` hands it RoPE's rows); the Triton kernel
  reads post-RoPE codes only and refuses such a layer.
- **overlay**: full-precision K/V for chosen quantized positions (selective recomputation writes it through
  :meth:`KVGuardLayer.write_fp`); it wins over the codes when the layer is read.
- **backing** (optional, off by default): every group ``_store`` quantizes also goes, as the window held it, to
  the cache's :class:`~kvguard.backing.BackingStore` (host memory, a byte cap, oldest first evicted);
  :meth:`KVGuardLayer.restore` writes those originals back into the overlay bit for bit, and
  :meth:`KVGuardLayer.reencode` stores the history again from them in a promoted layout (the one time a token
  is quantized twice: from its original, never from its codes). Its bytes are not the layer's (``nbytes``
  leaves them out; ``backing_nbytes`` reports them). It follows the layer: ``reset`` clears it, batch reorders
  / selections apply to it, a sliding layer drops the groups it drops.

Every tensor is ``[B, H_kv, T, D]`` (batch, KV heads, tokens, head_dim). ``update`` returns the stored past
(dequantized, overlay applied) followed by the new tokens at the precision the model computed them in.

**Fused decode reads.** Inside :func:`kvguard.attention.fused_reads` (which :class:`~kvguard.control.decoding.CacheDecoder`
enters), an update of at most ``fused_attention.MAX_QUERY`` tokens with no attention hook active does not
materialize: it records a :class:`~kvguard.fused_attention.StoredRead` (references to the stored segments as
they are before the new tokens are appended, see :meth:`KVGuardLayer.stored_read`) with the harness, returns
only the new tokens, and the harness's attention function attends over both through the C++ kernels, reading
the codes directly. The numbers are today's up to float summation order; the columns (and so the mask) are the
same. Everything else (prefill, hooks, a missing kernel build) keeps the materialized read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

from kvguard import attention, fused_attention, rotation
from kvguard.backing import BackingStore
from kvguard.config import CacheConfig, window_scale
from kvguard.precision import Precision, value_tiers
from kvguard.quantizer import Axis, QuantizedTensor, QuantSpec, quantize, static_int8_codes
from kvguard.rope import Rope, rerope, unrope

_UNCORRECTED = ("score_correction is on, but this read dequantizes the stored keys (a chunk of more than "
                f"{fused_attention.MAX_QUERY} tokens, or a cache off the CPU): the softmax-bias correction applies "
                "only where the fused CPU decode attention reads the codes, so these scores are uncorrected")


def _nbytes(t: "QuantizedTensor | torch.Tensor | None") -> int:
    if t is None:
        return 0
    if isinstance(t, QuantizedTensor):
        return t.nbytes
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class _PartLayout:
    """How one group of heads is stored in a run."""

    heads: tuple[int, ...]
    precision: Precision
    key_spec: QuantSpec | None  # None for fp16 heads
    value_spec: QuantSpec | None
    key_rotated: bool = False  # stored as quantize(k @ R); only below INT8
    value_rotated: bool = False
    key_prerope: bool = False  # keys stored before RoPE (turned back by their position); only below INT8


@dataclass
class _Part:
    layout: _PartLayout
    index: torch.Tensor  # LongTensor of the head indices, for index_select / index_copy
    keys: "QuantizedTensor | torch.Tensor | None" = None  # [B, h, T, D]
    values: "QuantizedTensor | torch.Tensor | None" = None
    rotation: torch.Tensor | None = None  # [h, D] signs of the part's heads, when a side is rotated
    rotation_matrix: torch.Tensor | None = None  # [h, D, D] the same rotation R, for the fused read's matmuls
    room: dict = field(default_factory=dict)  # the preallocated buffers keys / values are views of (_extend)

    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


@dataclass
class _Run:
    layout: tuple[_PartLayout, ...]
    parts: list[_Part]
    length: int = 0


class KVGuardLayer(CacheLayerMixin):
    """A full-attention cache layer with per-head precision, sinks, an FP window and an FP overlay."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        precision: "Precision | str | Sequence[Precision | str]" = Precision.INT4,
        config: CacheConfig | None = None,
        layer_idx: int = 0,
        backing: BackingStore | None = None,
        rope: Rope | None = None,
    ):
        super().__init__()
        self.config = config or CacheConfig()
        self.layer_idx = layer_idx
        if self.config.prerope_keys and rope is None:
            raise ValueError(f"layer {layer_idx}: prerope_keys needs the model's RoPE (build the cache from the model's "
                             "config, or pass rope=kvguard.rope.Rope.from_config(config))")
        self.rope = rope
        self.backing = backing  # originals of quantized groups (shared by the cache's layers); None: not kept
        self._requested = self._parse_precision(precision)
        self.key_clip = self.config.key_clip
        self.value_clip = self.config.value_clip
        # Calibrated INT8 absmax per KV head and channel, [H_kv, D]; None = dynamic scales.
        self.key_absmax: torch.Tensor | None = None
        self.value_absmax: torch.Tensor | None = None
        self._win_scale: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V [1, H, 1, D] of an 8-bit window
        self.key_rotation = self.value_rotation = False  # Hadamard-rotate heads below INT8 before quantizing
        self.value_drop: tuple[int, ...] = ()  # per head, values this many tiers below the keys (empty: none)
        self.num_heads: int | None = None  # known at the first update
        # Error evidence for the run-time monitor (off unless it asks: it costs a decode per stored group).
        self.track_error = False
        self._clear()

    # ------------------------------------------------------------------ state
    @staticmethod
    def _parse_precision(precision) -> "Precision | tuple[Precision, ...]":
        if isinstance(precision, (str, Precision)):
            return Precision.parse(precision)
        parsed = tuple(Precision.parse(p) for p in precision)
        if not parsed:
            raise ValueError("a per-head precision list must not be empty")
        return parsed

    def _clear(self) -> None:
        if self.backing is not None:
            self.backing.clear(self.layer_idx)
        self._sinks_k = self._sinks_v = None
        self._runs: list[_Run] = []
        self._win_k = self._win_v = None
        self._overlay_pos: torch.Tensor | None = None  # [P] absolute positions, ascending
        self._overlay_k = self._overlay_v = None  # [B, H, P, D]
        self.offset = 0  # absolute position of the first stored token
        self.read_fp_from = 0  # positions from here on were read at full precision by the last update
        self.stored_last_update = False  # the last update quantized a group
        self.length = 0  # tokens seen so far
        self.is_initialized = False
        self._error: torch.Tensor | None = None  # [H, capacity, 2] relative K/V error per absolute position
        self.out_of_range = [0, 0]  # K, V values quantized outside the calibrated range
        self.quantized_values = [0, 0]  # K, V values quantized (tracked only)
        self.running_absmax: list[torch.Tensor | None] = [None, None]  # K, V [H, D] over quantized tokens
        self._rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE's cos / sin [T, D] from position 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.fp_dtype = self.config.storage_dtype(key_states.dtype)
        self._check_heads(self._requested)
        self._check_drops(self.value_drop)
        empty = key_states.new_zeros((self.batch_size, self.num_heads, 0, self.head_dim), dtype=self.fp_dtype)
        self._sinks_k = self._sinks_v = empty
        if self.config.window_bits == 8:
            if self.key_absmax is None or self.value_absmax is None:
                raise ValueError(f"layer {self.layer_idx}: window_bits=8 stores the window under the calibrated INT8 "
                                 "scales, and none are set (pass a profile's static scales to make_cache)")
            self._win_scale = tuple(window_scale(a.to(self.device)) for a in (self.key_absmax, self.value_absmax))
            empty = empty.to(torch.int8)
        self._win_k = self._win_v = empty
        self.is_initialized = True

    def reset(self) -> None:
        self._clear()

    def _check_heads(self, requested) -> None:
        if isinstance(requested, tuple) and self.num_heads is not None and len(requested) != self.num_heads:
            raise ValueError(
                f"layer {self.layer_idx} has {self.num_heads} KV heads but {len(requested)} per-head precisions were given"
            )

    @property
    def head_precisions(self) -> tuple[Precision, ...]:
        """The precision each KV head stores newly quantized tokens in (known once the first tokens arrive)."""
        if isinstance(self._requested, tuple):
            return self._requested
        return (self._requested,) * (self.num_heads or 1)

    @property
    def precision(self) -> "Precision | tuple[Precision, ...]":
        """The requested precision: one for the whole layer, or one per KV head."""
        return self._requested

    def set_precision(self, precision: "Precision | str | Sequence[Precision | str]") -> None:
        """Store tokens quantized from now on in ``precision`` (one, or one per KV head).

        Tokens already stored keep their format; tokens still in the full-precision window take the new one
        when they leave it.
        """
        parsed = self._parse_precision(precision)
        self._check_heads(parsed)
        self._requested = parsed

    def set_clip(self, key_clip: float | None = None, value_clip: float | None = None) -> None:
        """Clipping ratios for tokens quantized from now on."""
        for name, value in (("key_clip", key_clip), ("value_clip", value_clip)):
            if value is not None:
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"{name} must be in (0, 1], got {value}")
                setattr(self, name, float(value))

    def set_rotation(self, keys: bool, values: bool) -> None:
        """Rotate keys / values of heads stored below INT8 from now on (see :mod:`kvguard.rotation`)."""
        self.key_rotation, self.value_rotation = bool(keys), bool(values)

    def set_value_drop(self, drop: Sequence[int] = ()) -> None:
        """Store the values of each head ``drop[h]`` tiers below its keys from now on (heads whose keys are
        below INT8; :meth:`Precision.below`); ``()`` stores both at the keys' tier. The drop stays when
        :meth:`set_precision` moves the keys: the values move with them."""
        drop = tuple(int(d) for d in drop)
        if any(d < 0 for d in drop):
            raise ValueError(f"value drops must be >= 0, got {list(drop)}")
        self._check_drops(drop)
        self.value_drop = drop if any(drop) else ()

    def _check_drops(self, drop: tuple[int, ...]) -> None:
        if drop and self.num_heads is not None and len(drop) != self.num_heads:
            raise ValueError(f"layer {self.layer_idx} has {self.num_heads} KV heads but {len(drop)} value drops were given")

    def set_static_scales(self, key_absmax: torch.Tensor | None, value_absmax: torch.Tensor | None) -> None:
        """Calibrated INT8 ``absmax`` per KV head and channel (``[H_kv, D]``), used by ``int8`` heads."""
        for t in (key_absmax, value_absmax):
            if t is not None and (t.dim() != 2 or not bool(torch.isfinite(t).all()) or bool((t < 0).any())):
                raise ValueError(f"static absmax must be a finite, non-negative [H_kv, D] tensor, got {tuple(t.shape)}")
        self.key_absmax, self.value_absmax = key_absmax, value_absmax

    # ------------------------------------------------------------------ layout
    def _layout(self) -> tuple[_PartLayout, ...]:
        """How tokens quantized now are stored: heads grouped by their key and value precisions."""
        groups: dict[tuple[Precision, Precision], list[int]] = {}
        tiers = self.head_precisions
        for h, pair in enumerate(zip(tiers, value_tiers(tiers, self.value_drop))):
            groups.setdefault(pair, []).append(h)
        layout = []
        for (precision, value_precision), heads in groups.items():
            if not precision.is_quantized:
                layout.append(_PartLayout(tuple(heads), precision, None, None))
                continue
            static = precision is Precision.INT8
            low = precision.bits < 8  # INT8 is near-lossless already; its static scales are unrotated
            layout.append(
                _PartLayout(
                    tuple(heads),
                    precision,
                    self.config.quant_spec(precision, Axis.CHANNEL, self.key_clip, static and self.key_absmax is not None),
                    self.config.quant_spec(value_precision, Axis.TOKEN, self.value_clip,
                                           static and self.value_absmax is not None),
                    low and self.key_rotation,
                    low and self.value_rotation,
                    low and self.config.prerope_keys,
                )
            )
        return tuple(layout)

    def _static_absmax(self, absmax: torch.Tensor | None, spec: QuantSpec, index: torch.Tensor):
        if not spec.static:
            return None
        # [H, D] -> [1, h, 1, D]: one scale per head and channel, shared by every token.
        return absmax.to(self.device).index_select(0, index).unsqueeze(0).unsqueeze(2)

    def _encode(self, x: torch.Tensor, spec: QuantSpec | None, absmax: torch.Tensor | None):
        if spec is None:
            return x.to(self.fp_dtype)
        return quantize(x, spec, absmax)

    def _store(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Quantize whole groups of tokens leaving the window (absolute positions from ``first``) into the
        current run."""
        layout = self._layout()
        if not self._runs or self._runs[-1].layout != layout:
            self._runs.append(self._new_run(layout))
        self._encode_into(self._runs[-1], keys, values, first)
        self.stored_last_update = True
        if self.backing is not None and any(pl.key_spec is not None for pl in layout):
            # keys / values are the window's own tensors (fp_dtype): what the overlay would hold for them.
            self.backing.put(self.layer_idx, first, keys, values, self.config.group_size)

    def _new_run(self, layout: tuple[_PartLayout, ...]) -> _Run:
        return _Run(layout, [self._new_part(pl) for pl in layout])

    def _encode_into(self, run: _Run, keys: torch.Tensor, values: torch.Tensor, first: int, *,
                     track: bool = True) -> None:
        """Append ``keys`` / ``values`` (``[B, H, n, D]``, whole groups, positions from ``first``) to ``run``,
        each part encoding its heads in its layout."""
        turn = self._turn(run, first, keys.shape[-2])
        for part in run.parts:
            pl = part.layout
            k, v = self._heads(keys, part), self._heads(values, part)
            k_in = unrope(k.float(), *turn) if pl.key_prerope else k
            k_in = rotation.rotate(k_in, part.rotation) if pl.key_rotated else k_in
            v_in = rotation.rotate(v, part.rotation) if pl.value_rotated else v
            k_new = self._encode(k_in, pl.key_spec, pl.key_spec and self._static_absmax(self.key_absmax, pl.key_spec, part.index))
            v_new = self._encode(
                v_in, pl.value_spec, pl.value_spec and self._static_absmax(self.value_absmax, pl.value_spec, part.index)
            )
            part.keys = _extend(part.room, "keys", part.keys, k_new)
            part.values = _extend(part.room, "values", part.values, v_new)
            if track and self.track_error and pl.key_spec is not None:
                self._track(part, first, (k, v), (_read_new(part, k_new, True, turn), _read_new(part, v_new, False)))
        run.length += keys.shape[-2]

    def _turn(self, run: _Run, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's ``(cos, sin)`` ``[n, D]`` at absolute positions ``first ..`` when ``run`` holds pre-RoPE keys:
        rows of one table from position 0, grown by doubling, since every decode step reads the whole history
        (a row depends only on its position, so the rows are what ``Rope.tables`` gives for any start)."""
        if not any(p.layout.key_prerope for p in run.parts):
            return None
        end = first + n
        if self._rope_rows is None or self._rope_rows[0].shape[0] < end:
            held = 0 if self._rope_rows is None else self._rope_rows[0].shape[0]
            self._rope_rows = self.rope.tables(self.layer_idx, 0, max(end, 2 * held), self.device)
        cos, sin = self._rope_rows
        return cos[first:end], sin[first:end]

    def _heads(self, x: torch.Tensor, part: _Part) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` restricted to ``part``'s heads ``[B, h, n, D]``."""
        return x if len(part.layout.heads) == self.num_heads else x.index_select(1, part.index)

    def _new_part(self, pl: _PartLayout) -> _Part:
        index = torch.tensor(pl.heads, device=self.device)
        r = m = None
        if pl.key_rotated or pl.value_rotated:
            r = rotation.signs(self.head_dim, self.num_heads, self.layer_idx, self.device).index_select(0, index)
            m = rotation.matrix(self.head_dim, self.num_heads, self.layer_idx).to(self.device).index_select(0, index)
        return _Part(pl, index, rotation=r, rotation_matrix=m)

    def _track(self, part: _Part, first: int, originals, encoded, *, count: bool = True) -> None:
        """Record the evidence a quantization leaves: per-position relative error, values outside the
        calibrated range, and the running range of what was quantized (``count=False``: the error only, for
        tokens quantized before)."""
        n = originals[0].shape[-2]
        self._error = _grow(self._error, self.num_heads, first + n, self.device)
        for i, (x, x_read, absmax) in enumerate(zip(originals, encoded, (self.key_absmax, self.value_absmax))):
            x = x.float()
            err = (x_read - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)  # [B, h, n]
            self._error[part.index, first:first + n, i] = err.mean(0)
            if not count:
                continue
            amax = x.abs().amax((0, 2))  # [h, D]
            if self.running_absmax[i] is None:
                self.running_absmax[i] = torch.zeros(self.num_heads, self.head_dim, device=self.device)
            self.running_absmax[i][part.index] = torch.maximum(self.running_absmax[i][part.index], amax)
            if absmax is not None:
                limit = absmax.to(self.device).index_select(0, part.index).view(1, len(part.index), 1, -1)
                self.out_of_range[i] += int((x.abs() > limit).sum())
            self.quantized_values[i] += x.numel()

    def error_evidence(self, end: int | None = None) -> torch.Tensor:
        """Relative quantization error of the K (``[..., 0]``) and V (``[..., 1]``) the model reads at every
        absolute position ``[0, end)``, ``[H, end, 2]``: 0 for full-precision tokens (sinks, window, overlay,
        ``fp16`` heads). Tracked only while ``track_error`` is set."""
        end = self.length if end is None else end
        self._error = _grow(self._error, self.num_heads or 1, end, getattr(self, "device", None))
        return self._error[:, :end]

    # ------------------------------------------------------------------ update / read
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return (past as stored + new tokens as computed), each ``[B, H, T, D]`` (only the
        new tokens when the read is deferred to the fused decode attention; see the module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.read_fp_from = self.window_start()  # this read sees positions from here on at full precision
        if self._defers(key_states):
            # The harness attends over the past as stored now (the snapshot keeps it while tokens are appended).
            attention.defer_read(key_states, self.stored_read())
            self.stored_last_update = False
            self._append(key_states, value_states)
            self._trim()
            return key_states, value_states
        if self.config.score_correction and self._runs:
            warnings.warn(_UNCORRECTED, RuntimeWarning, stacklevel=2)
        past_k, past_v = self.materialize(key_states.dtype)
        self.stored_last_update = False
        self._append(key_states, value_states)
        self._trim()
        if past_k.shape[-2] == 0:
            return key_states, value_states
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def _defers(self, key_states: torch.Tensor) -> bool:
        """Whether this update hands its read to the fused decode attention instead of materializing."""
        return (self.stored_tokens > 0 and key_states.shape[-2] <= fused_attention.MAX_QUERY
                and attention.fused_reads_active() and fused_attention.available(key_states.device))

    def holds_prerope_keys(self) -> bool:
        """Whether some stored run holds keys before RoPE (which the Triton kernel cannot read)."""
        return any(p.layout.key_prerope for run in self._runs for p in run.parts)

    def stored_read(self) -> fused_attention.StoredRead:
        """The stored past as segments of codes and full-precision tensors, for the fused decode attention
        (references to the stored tensors, which appending never modifies in place). Keys stored before RoPE come
        with RoPE's rows at their absolute positions, which the kernel turns them by."""
        segments, column = [], self._sinks_k.shape[-2]
        if column:
            segments.append(fused_attention.StoredSegment(0, column, None, self._sinks_k, self._sinks_v))
        for run in self._runs:
            turn = self._turn(run, self.offset + column, run.length)
            for part in run.parts:
                pl = part.layout
                heads = None if len(pl.heads) == self.num_heads else part.index
                turned = pl.key_prerope
                segments.append(fused_attention.StoredSegment(
                    column, run.length, heads, part.keys, part.values,
                    part.rotation_matrix if pl.key_rotated and not turned else None,
                    part.rotation_matrix if pl.value_rotated else None,
                    turn if turned else None,
                    part.rotation.contiguous() if turned and pl.key_rotated else None))
            column += run.length
        if self._win_k.shape[-2]:
            segments.append(fused_attention.StoredSegment(column, self._win_k.shape[-2], None, *self.window_tensors()))
            column += self._win_k.shape[-2]
        correct = self.config.score_correction
        if self._overlay_pos is None or not self._overlay_pos.numel():
            return fused_attention.StoredRead(tuple(segments), column, score_correction=correct)
        return fused_attention.StoredRead(tuple(segments), column, self._overlay_pos - self.offset,
                                          self._overlay_k, self._overlay_v, correct)

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        into_sinks = min(max(self.config.sinks - self.length, 0), n)
        self.length += n
        if into_sinks:
            self._sinks_k = torch.cat([self._sinks_k, keys[..., :into_sinks, :].to(self.fp_dtype)], dim=-2)
            self._sinks_v = torch.cat([self._sinks_v, values[..., :into_sinks, :].to(self.fp_dtype)], dim=-2)
        if into_sinks < n:
            self._win_k = torch.cat([self._win_k, self._window_codes(keys[..., into_sinks:, :], 0)], dim=-2)
            self._win_v = torch.cat([self._win_v, self._window_codes(values[..., into_sinks:, :], 1)], dim=-2)
        g, r = self.config.group_size, self.config.residual
        leaving = (self._win_k.shape[-2] - r) // g * g
        if leaving > 0:
            first = self.window_start()
            k, v = self.window_tensors(end=leaving)
            self._win_k, self._win_v = self._win_k[..., leaving:, :], self._win_v[..., leaving:, :]
            self._store(k, v, first)

    def _window_codes(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` as the window stores it: ``fp_dtype``, or INT8 codes under side ``side``'s (0: K,
        1: V) calibrated scale, rounded from the ``fp_dtype`` value so that the simulation can do the same."""
        x = x.to(self.fp_dtype)
        if self._win_scale is None:
            return x
        return static_int8_codes(x, self._win_scale[side]).to(torch.int8)

    def window_tensors(self, dtype: torch.dtype | None = None, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's first ``end`` tokens (all: ``None``) as keys and values ``[B, H, n, D]`` in ``dtype``
        (``fp_dtype``: ``None``), decoded when the window holds INT8 codes."""
        dtype = dtype or self.fp_dtype
        k, v = self._win_k[..., :end, :], self._win_v[..., :end, :]
        if self._win_scale is None:
            return k.to(dtype), v.to(dtype)
        # Through fp_dtype first: what a 16-bit window would have held after rounding, so the tokens leaving the
        # window are quantized from the same numbers the simulation uses.
        return tuple((c.to(torch.float32) * s).to(self.fp_dtype).to(dtype) for c, s in zip((k, v), self._win_scale))

    def _trim(self) -> None:
        """Full-attention layers keep everything; sliding layers override this."""

    def _run_tensors(self, run: _Run, dtype: torch.dtype, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A run's keys and values ``[B, H, n, D]`` as the model reads them (``first``: its first absolute
        position)."""
        turn = self._turn(run, first, run.length)
        if len(run.parts) == 1:
            part = run.parts[0]
            return _read(part, True, dtype, turn), _read(part, False, dtype)
        shape = (self.batch_size, self.num_heads, run.length, self.head_dim)
        k = torch.empty(shape, dtype=dtype, device=self.device)
        v = torch.empty(shape, dtype=dtype, device=self.device)
        for part in run.parts:
            k.index_copy_(1, part.index, _read(part, True, dtype, turn))
            v.index_copy_(1, part.index, _read(part, False, dtype))
        return k, v

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored past as the model sees it, ``[B, H, T_stored, D]`` each (overlay applied)."""
        if not self.is_initialized:
            raise RuntimeError(f"layer {self.layer_idx} holds no tokens yet")
        dtype = dtype or self.fp_dtype
        ks, vs = [self._sinks_k.to(dtype)], [self._sinks_v.to(dtype)]
        pos = self.offset + self._sinks_k.shape[-2]
        for run in self._runs:
            k, v = self._run_tensors(run, dtype, pos)
            ks.append(k)
            vs.append(v)
            pos += run.length
        win_k, win_v = self.window_tensors(dtype)
        ks.append(win_k)
        vs.append(win_v)
        keys, values = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
        if self._overlay_pos is not None and self._overlay_pos.numel():
            idx = self._overlay_pos - self.offset
            keys.index_copy_(2, idx, self._overlay_k.to(dtype))
            values.index_copy_(2, idx, self._overlay_v.to(dtype))
        return keys, values

    # ------------------------------------------------------------------ positions
    @property
    def stored_tokens(self) -> int:
        return self.length - self.offset

    def window_start(self) -> int:
        """Absolute position of the first full-precision window token."""
        return self.length - self._win_k.shape[-2]

    def quantized_positions(self) -> torch.Tensor:
        """Absolute positions currently held as codes in a quantized (non-fp16) part of some head."""
        start = self.offset + self._sinks_k.shape[-2]
        spans, pos = [], start
        for run in self._runs:
            if any(p.layout.precision.is_quantized for p in run.parts):
                spans.append(torch.arange(pos, pos + run.length, device=self.device))
            pos += run.length
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=self.device)

    def write_fp(self, positions, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the stored K/V at absolute ``positions`` (``[P]``) by full-precision ``keys``/``values``
        (``[B, H, P, D]``). Positions in the sinks or the window are overwritten in place; quantized ones go
        to the overlay, which wins over their codes from then on.
        """
        if not self.is_initialized:
            raise RuntimeError(f"layer {self.layer_idx} holds no tokens yet")
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        expected = (self.batch_size, self.num_heads, pos.numel(), self.head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(f"write_fp expects keys and values of shape {expected}, got {tuple(keys.shape)}, {tuple(values.shape)}")
        if pos.numel() == 0:
            return
        if pos.unique().numel() != pos.numel():
            raise ValueError("write_fp positions must be unique")
        if int(pos.min()) < self.offset or int(pos.max()) >= self.length:
            raise ValueError(
                f"write_fp positions must lie in [{self.offset}, {self.length}) (the tokens layer {self.layer_idx} "
                f"holds), got {int(pos.min())}..{int(pos.max())}"
            )
        if not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
            raise ValueError("write_fp values must be finite")
        keys, values = keys.to(self.fp_dtype), values.to(self.fp_dtype)
        sinks_end = self.offset + self._sinks_k.shape[-2]
        win_start = self.window_start()
        in_sinks, in_window = pos < sinks_end, pos >= win_start
        if bool(in_sinks.any()):
            idx = pos[in_sinks] - self.offset
            self._sinks_k[:, :, idx] = keys[:, :, in_sinks]
            self._sinks_v[:, :, idx] = values[:, :, in_sinks]
        if bool(in_window.any()):
            idx = pos[in_window] - win_start
            self._win_k[:, :, idx] = self._window_codes(keys[:, :, in_window], 0)
            self._win_v[:, :, idx] = self._window_codes(values[:, :, in_window], 1)
        rest = ~(in_sinks | in_window)
        if bool(rest.any()):
            self._merge_overlay(pos[rest], keys[:, :, rest], values[:, :, rest])
            if self._error is not None:
                tracked = pos[rest][pos[rest] < self._error.shape[1]]
                self._error[:, tracked] = 0.0  # read at full precision from now on

    def _merge_overlay(self, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self._overlay_pos is not None:
            keep = ~torch.isin(self._overlay_pos, pos)
            pos = torch.cat([self._overlay_pos[keep], pos])
            keys = torch.cat([self._overlay_k[:, :, keep], keys], dim=2)
            values = torch.cat([self._overlay_v[:, :, keep], values], dim=2)
        order = torch.argsort(pos)
        self._overlay_pos = pos[order]
        self._overlay_k, self._overlay_v = keys[:, :, order], values[:, :, order]

    def restore(self, positions) -> torch.Tensor:
        """Write the backed originals of quantized absolute ``positions`` into the overlay, bit for bit; returns
        the positions restored (``[R]``, ascending). Positions the backing does not hold (evicted, never
        quantized, or none kept) are left as they are."""
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if self.backing is None or not self.is_initialized or pos.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        found = self.backing.restore(self.layer_idx, pos[pos >= self.offset], self.device)
        if found.positions.numel():
            self.write_fp(found.positions, found.keys, found.values)
        return found.positions

    def backed_positions(self) -> torch.Tensor:
        """Absolute positions whose originals the backing holds for this layer (``[N]``, ascending)."""
        if self.backing is None:
            return torch.zeros(0, dtype=torch.long)
        return self.backing.positions(self.layer_idx)

    def overlay_nbytes(self) -> int:
        """Bytes of the full-precision overlay and its positions (part of :meth:`nbytes`)."""
        return sum(_nbytes(t) for t in (self._overlay_pos, self._overlay_k, self._overlay_v))

    def overlay_positions(self) -> torch.Tensor:
        """Absolute positions currently served from the full-precision overlay."""
        if self._overlay_pos is None:
            return torch.zeros(0, dtype=torch.long)
        return self._overlay_pos.clone()

    # ------------------------------------------------------------------ escalation from the backing tier
    def reencodable(self) -> tuple[int, int]:
        """``(first, end)``: the stretch of quantized history, ending where the window starts, whose originals the
        backing tier holds (``first == end``: none). Eviction takes the oldest groups first, so it is the
        whole history until the tier's cap is reached."""
        end = self.window_start() if self.is_initialized else 0
        held = self.backed_positions()
        if not self._runs or held.numel() == 0 or int(held[-1]) != end - 1:
            return end, end
        n = held.numel()
        gaps = (held != torch.arange(end - n, end)).nonzero()  # positions before the last gap are not contiguous
        return (end - n if gaps.numel() == 0 else int(held[int(gaps[-1]) + 1])), end

    def reencode(self, max_extra_bytes: int | None = None) -> int:
        """Store the backed stretch of history (:meth:`reencodable`) again, from its originals, in the layout new
        tokens get now (after ``set_precision`` promoted the layer, say). Returns the positions re-encoded: 0
        when nothing is held, or when it would add more than ``max_extra_bytes`` bytes (then nothing changes).

        This is the one place a token is quantized a second time, and it is quantized from its original, never
        from its codes, so no error compounds; heads whose layout did not change get the same codes again (the
        groups start at the same positions). The overlay still wins over the new codes."""
        first, end = self.reencodable()
        if first == end:
            return 0
        originals = self.backing.restore(self.layer_idx, torch.arange(first, end), self.device)
        run = self._new_run(self._layout())
        self._encode_into(run, originals.keys, originals.values, first, track=False)
        extra = run_nbytes(run) - self._history_nbytes_from(first)
        if max_extra_bytes is not None and extra > max_extra_bytes:
            return 0
        self._cut_history(first)
        self._runs.append(run)
        if self.track_error:
            self._retrack(run, first, originals.keys, originals.values)
        return end - first

    def _history_nbytes_from(self, first: int) -> int:
        """Bytes of the stored runs' tokens at absolute positions ``first`` and later (a run's bytes shared out
        per token: a calibrated INT8 scale, shared by every token, is counted pro rata)."""
        total, pos = 0, self.offset + self._sinks_k.shape[-2]
        for run in self._runs:
            overlap = pos + run.length - max(pos, first)
            if overlap > 0 and run.length:
                total += run_nbytes(run) * min(overlap, run.length) // run.length
            pos += run.length
        return total

    def _cut_history(self, first: int) -> None:
        """Forget the stored runs' tokens from absolute position ``first`` (a group boundary) on."""
        pos, kept = self.offset + self._sinks_k.shape[-2], []
        for run in self._runs:
            keep, length = min(run.length, max(0, first - pos)), run.length
            if 0 < keep < length:
                for part in run.parts:
                    part.keys, part.values = _keep(part.keys, keep), _keep(part.values, keep)
                    part.room = {}  # a cut run takes no more tokens: the new run comes after it
                run.length = keep
            if keep:
                kept.append(run)
            pos += length
        self._runs = kept

    def _retrack(self, run: _Run, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The error evidence of re-encoded positions: what their new codes read back (0 for full-precision
        heads and for overlay positions, which are read at full precision)."""
        n = keys.shape[-2]
        self._error = _grow(self._error, self.num_heads, first + n, self.device)
        self._error[:, first:first + n] = 0.0
        turn = self._turn(run, first, n)
        for part in run.parts:
            if part.layout.key_spec is not None:
                k, v = self._heads(keys, part), self._heads(values, part)
                read = (_read(part, True, torch.float32, turn), _read(part, False, torch.float32))
                self._track(part, first, (k, v), read, count=False)
        if self._overlay_pos is not None and self._overlay_pos.numel():
            held = self._overlay_pos[self._overlay_pos < self._error.shape[1]]
            self._error[:, held] = 0.0

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of every stored tensor: sinks, codes, scales, zero points, window, overlay and its indices."""
        if not self.is_initialized:
            return 0
        total = sum(_nbytes(t) for t in (self._sinks_k, self._sinks_v, self._win_k, self._win_v))
        if self._win_scale is not None:  # float16 like every scale, whatever dtype it is kept in for the arithmetic
            total += sum(s.numel() * 2 for s in self._win_scale)
        return total + self.overlay_nbytes() + self.history_nbytes()

    def history_nbytes(self) -> int:
        """Bytes of the stored runs (codes, scales, zero points, full-precision heads) and their rotation signs:
        the part of :meth:`nbytes` a plan's tiers decide (the sinks, window and overlay are not)."""
        if not self.is_initialized:
            return 0
        total = sum(run_nbytes(run) for run in self._runs)
        # A rotated side costs its sign bits (rebuilt here from a seed; an engine without it would store them).
        sides = {side for run in self._runs for part in run.parts
                 for side, on in (("k", part.layout.key_rotated), ("v", part.layout.value_rotated)) if on}
        return total + len(sides) * rotation.sign_bytes(self.head_dim, self.num_heads)

    def history_tokens(self) -> int:
        """Tokens held in the stored runs (between the sinks and the window)."""
        return sum(run.length for run in self._runs)

    def backing_nbytes(self) -> int:
        """Bytes of this layer's originals in the backing tier (not part of ``nbytes``)."""
        return 0 if self.backing is None else self.backing.nbytes(self.layer_idx)

    def reference_tokens(self) -> int:
        """Tokens an FP16 cache of this layer type would hold now."""
        return self.length

    def fp16_nbytes(self) -> int:
        """Bytes an FP16 cache of the same shape would take (keys and values, 2 bytes per element)."""
        if not self.is_initialized:
            return 0
        return 2 * 2 * self.batch_size * self.num_heads * self.head_dim * self.reference_tokens()

    # ------------------------------------------------------------------ transformers' Cache protocol
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored_tokens + query_length, self.offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self._sinks_k, self._sinks_v = fn(self._sinks_k), fn(self._sinks_v)
        self._win_k, self._win_v = fn(self._win_k), fn(self._win_v)
        for run in self._runs:
            for part in run.parts:
                part.keys, part.values = _map(part.keys, fn), _map(part.values, fn)
        if self._overlay_k is not None:
            self._overlay_k, self._overlay_v = fn(self._overlay_k), fn(self._overlay_v)
        if self.backing is not None:
            self.backing.map_batch(self.layer_idx, fn)
        self.batch_size = self._win_k.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "KVGuardCache cannot be cropped (assisted or speculative decoding): quantized groups cannot be rolled back"
        )

    def offload(self):
        raise NotImplementedError("KVGuardCache does not support offloading; its quantized storage is already small")

    prefetch = offload


class KVGuardSlidingLayer(KVGuardLayer):
    """A sliding-window layer: keeps what the next query can still see (``sliding_window - 1`` tokens), plus
    fewer than ``group_size`` older ones, since stored tokens are dropped in whole groups (quantized keys share
    scales across a group). The attention mask hides the extra tokens (``get_mask_sizes`` reports where the
    stored tokens start); an FP16 sliding layer therefore stores up to ``group_size - 1`` tokens more than
    transformers' ``DynamicSlidingWindowLayer``, and ``fp16_nbytes`` counts against the latter."""

    is_sliding = True

    def __init__(self, precision=Precision.INT4, config: CacheConfig | None = None, layer_idx: int = 0, *, sliding_window: int,
                 backing: BackingStore | None = None, rope: Rope | None = None):
        super().__init__(precision, config, layer_idx, backing, rope)
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def get_max_length(self) -> int:
        return self.sliding_window

    def reference_tokens(self) -> int:
        return min(self.length, self.sliding_window - 1)

    def _trim(self) -> None:
        keep_from = max(0, self.length - (self.sliding_window - 1))
        if keep_from <= self.offset:
            return
        sinks = self._sinks_k.shape[-2]
        if sinks:
            drop = min(sinks, keep_from - self.offset)
            self._sinks_k, self._sinks_v = self._sinks_k[..., drop:, :], self._sinks_v[..., drop:, :]
            self.offset += drop
            if drop < sinks:
                return
        # Whole groups only, whatever the precision: every sliding layer must hold the same tokens, since
        # transformers builds one sliding-window mask from the first sliding layer's get_mask_sizes.
        g = self.config.group_size
        while self._runs:
            run = self._runs[0]
            drop = min(run.length, (keep_from - self.offset) // g * g)
            if drop <= 0:
                break
            for part in run.parts:
                part.keys, part.values = _drop(part.keys, drop), _drop(part.values, drop)
            run.length -= drop
            self.offset += drop
            if run.length:
                break
            self._runs.pop(0)
        if not self._runs:
            drop = min(self._win_k.shape[-2], keep_from - self.offset)
            if drop > 0:
                self._win_k, self._win_v = self._win_k[..., drop:, :], self._win_v[..., drop:, :]
                self.offset += drop
        if self._overlay_pos is not None:
            keep = self._overlay_pos >= self.offset
            self._overlay_pos = self._overlay_pos[keep]
            self._overlay_k, self._overlay_v = self._overlay_k[:, :, keep], self._overlay_v[:, :, keep]
        if self.backing is not None:
            self.backing.drop_before(self.layer_idx, self.offset)


def _grow(buffer: torch.Tensor | None, heads: int, size: int, device=None) -> torch.Tensor:
    """``buffer`` (``[heads, capacity, 2]``, zeros beyond what was written) with room for ``size`` positions."""
    if buffer is not None and buffer.shape[1] >= size:
        return buffer
    capacity = max(size, 2 * (0 if buffer is None else buffer.shape[1]), 256)
    grown = torch.zeros(heads, capacity, 2, device=device if buffer is None else buffer.device)
    if buffer is not None:
        grown[:, :buffer.shape[1]] = buffer
    return grown


# Tokens are appended into preallocated buffers rather than concatenated: a part's codes, scales and zero points
# (and an FP16 part's tensors) are views of the first T rows (axis -2) of buffers with room for more, and a
# group leaving the window is written into the free rows behind them. A full buffer is replaced by one with
# room for max(_MIN_ROOM, T / _ROOM_DIVISOR) more rows: an appended row costs T / 256 copied rows amortized up to
# 4,096 tokens and 16 beyond, instead of T, while the free rows stay a few percent of the cache. Doubling
# copied less but cost more memory than it saved time: freed buffers return to the allocator's heap, later
# buffers reuse those touched pages, so free rows were resident after all (8 x 4,096 FP16 on SmolLM2-135M:
# peak RSS 3,442 MiB doubling, 2,345 this rule).
# The views handed out (StoredRead, materialize) cover rows that are never written again: appending leaves
# them as they were.
_MIN_ROOM = 256
_ROOM_DIVISOR = 16


def _extend_rows(room: dict, key: str, stored: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``stored`` followed by ``new`` along axis -2, written into ``room[key]`` when ``stored`` is the view of
    its first rows that the last call returned (anything else: a batch reorder or a dropped front gave new
    tensors) and it has the free rows; otherwise into a new buffer with room for a few percent more rows."""
    n, m = (0 if stored is None else stored.shape[-2]), new.shape[-2]
    buffer = room.get(key)
    reusable = (buffer is not None and stored is not None and stored.data_ptr() == buffer.data_ptr()
                and stored.stride() == buffer.stride() and stored.shape[:-2] == buffer.shape[:-2]
                and n + m <= buffer.shape[-2])
    if not reusable:
        rows = n + m + max(_MIN_ROOM, (n + m) // _ROOM_DIVISOR)
        buffer = new.new_empty(*new.shape[:-2], rows, new.shape[-1])
        if n:
            buffer[..., :n, :].copy_(stored)
        room[key] = buffer
    buffer[..., n:n + m, :].copy_(new)
    return buffer[..., :n + m, :]


def _extend(room: dict, side: str, stored, new):
    """A part's ``stored`` keys or values (``None``, a :class:`QuantizedTensor` or an FP16 tensor) followed by
    ``new``, through :func:`_extend_rows`."""
    if not isinstance(new, QuantizedTensor):
        return _extend_rows(room, side, stored, new)
    if stored is not None and (stored.spec != new.spec or stored.shape[:-2] != new.shape[:-2]):
        raise ValueError(f"cannot append {new.spec}/{new.shape} to {stored.spec}/{stored.shape}")
    qdata = _extend_rows(room, side + ".codes", None if stored is None else stored.qdata, new.qdata)
    scale, zero = new.scale, new.zero_point
    if not new.spec.static:  # a calibrated scale is shared by every token: one copy
        scale = _extend_rows(room, side + ".scale", None if stored is None else stored.scale, new.scale)
        if zero is not None:
            zero = _extend_rows(room, side + ".zero", None if stored is None else stored.zero_point, zero)
    tokens = new.shape[-2] + (0 if stored is None else stored.shape[-2])
    return QuantizedTensor(qdata, scale, zero, new.spec, (*new.shape[:-2], tokens, new.shape[-1]))


def _decode(t, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t.to(dtype)


def _read_new(part: _Part, encoded: QuantizedTensor, keys: bool, turn=None) -> torch.Tensor:
    """Freshly encoded tokens as they will be read (float32), for the error evidence (``turn``: RoPE's
    ``(cos, sin)`` at their positions, for keys stored before it)."""
    rotated = part.layout.key_rotated if keys else part.layout.value_rotated
    x = encoded.dequantize(torch.float32)
    x = rotation.unrotate(x, part.rotation) if rotated else x
    return rerope(x, *turn) if keys and part.layout.key_prerope else x


def _read(part: _Part, keys: bool, dtype: torch.dtype, turn=None) -> torch.Tensor:
    """A part's stored keys or values as the model sees them: dequantized, rotated back when stored rotated,
    turned to their positions (``turn``: RoPE's ``(cos, sin)`` ``[n, D]``) when keys are stored before RoPE."""
    rotated = part.layout.key_rotated if keys else part.layout.value_rotated
    turned = keys and part.layout.key_prerope
    stored = part.keys if keys else part.values
    if not (rotated or turned):
        return _decode(stored, dtype)
    x = _decode(stored, torch.float32)
    x = rotation.unrotate(x, part.rotation) if rotated else x
    return (rerope(x, *turn) if turned else x).to(dtype)


def run_nbytes(run: _Run) -> int:
    """Bytes of a run's codes, scales, zero points (and full-precision heads)."""
    return sum(part.nbytes() for part in run.parts)


def _keep(t, tokens: int):
    return t.keep_front(tokens) if isinstance(t, QuantizedTensor) else t[..., :tokens, :]


def _drop(t, tokens: int):
    return t.drop_front(tokens) if isinstance(t, QuantizedTensor) else t[..., tokens:, :]


def _map(t, fn):
    return t.map_batch(fn) if isinstance(t, QuantizedTensor) else fn(t)
