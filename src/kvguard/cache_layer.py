"""One layer of the KVGuard cache: transformers' cache-layer protocol over a store, an overlay and a backing tier.

A layer composes three objects, each with its own module:

- the **store** (:class:`~kvguard.store.Store`): sinks, quantized runs and the full-precision window, and the one
  rule of how tokens are laid out (tiers per head, rotation, RoPE placement, groups). Everything that reads the
  stored format reads a :class:`~kvguard.stored_read.StoredRead` the store hands out (:meth:`KVGuardLayer.stored_read`);
- the **overlay** (:class:`~kvguard.overlay.Overlay`): full-precision K/V for chosen quantized positions
  (selective recomputation writes it through :meth:`KVGuardLayer.write_fp`), which wins over their codes;
- the **backing tier** (:class:`~kvguard.backing.BackingStore`, optional, shared by the cache's layers): every
  group the store quantizes also goes there as the window held it; :meth:`KVGuardLayer.restore` writes those
  originals back into the overlay bit for bit, and :meth:`KVGuardLayer.reencode` stores the history again from
  them in a promoted layout (the one time a token is quantized twice: from its original, never from its codes).

This module keeps what is the layer's own: transformers' protocol (``update``, mask sizes, batch reorders), the
error evidence the run-time monitor reads, and the precision-switch interface (``set_precision`` and friends
change the store's :class:`~kvguard.store.Format` for tokens quantized from then on).

Every tensor is ``[B, H_kv, T, D]`` (batch, KV heads, tokens, head_dim). ``update`` returns the stored past
(dequantized, overlay applied) followed by the new tokens at the precision the model computed them in.

**Deferred reads.** Inside :func:`kvguard.attention.fused_reads` (which the decoders and the capacity probe enter),
an update with a stored past and no attention hook that reads full K/V does not materialize: it hands the harness a
:class:`~kvguard.stored_read.StoredRead` of its past as it is before the new tokens are appended, returns only the
new tokens, and the harness attends over both through the reads' attention (:func:`kvguard.fused_attention.attend`:
the C++ kernels reading the codes for a decode step, a tile of dequantized history at a time for a longer chunk), so
no update copies the whole history. Outside that block the materialized read is kept.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Callable, Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

from kvguard import attention, fused_attention, heap
from kvguard.backing import BackingStore
from kvguard.config import CacheConfig
from kvguard.overlay import Overlay
from kvguard.precision import Precision
from kvguard.rope import Rope
from kvguard.store import Format, Part, Store
from kvguard.stored_read import StoredRead


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
        tiers = self._parse_precision(precision)
        self.store = Store(self.config, layer_idx, rope,
                           Format(tiers, key_clip=self.config.key_clip, value_clip=self.config.value_clip))
        self.overlay = Overlay()
        # Error evidence for the run-time monitor (off unless it asks: it costs a decode per stored group).
        self.track_error = False
        self.restore_seconds = 0.0  # time spent reading originals back from the backing tier
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
        self.store.clear()
        self.overlay = Overlay()
        self.read_fp_from = 0  # positions from here on were read at full precision by the last update
        self.stored_last_update = False  # the last update quantized a group
        self.is_initialized = False
        self._error: torch.Tensor | None = None  # [H, capacity, 2] relative K/V error per absolute position
        self.out_of_range = [0, 0]  # K, V values quantized outside the calibrated range
        self.quantized_values = [0, 0]  # K, V values quantized (tracked only)
        self.running_absmax: list[torch.Tensor | None] = [None, None]  # K, V [H, D] over quantized tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.fp_dtype = self.config.storage_dtype(key_states.dtype)
        self._check_heads(self.store.format.tiers)
        self._check_drops(self.store.format.value_drop)
        self.store.initialize(key_states)
        self.is_initialized = True

    def reset(self) -> None:
        self._clear()

    @property
    def num_heads(self) -> int | None:
        return self.store.num_heads

    @num_heads.setter
    def num_heads(self, value: int | None) -> None:
        self.store.num_heads = value

    def _check_heads(self, requested) -> None:
        if isinstance(requested, tuple) and self.num_heads is not None and len(requested) != self.num_heads:
            raise ValueError(
                f"layer {self.layer_idx} has {self.num_heads} KV heads but {len(requested)} per-head precisions were given"
            )

    # ------------------------------------------------------------------ the precision-switch interface
    @property
    def head_precisions(self) -> tuple[Precision, ...]:
        """The precision each KV head stores newly quantized tokens in (known once the first tokens arrive)."""
        return self.store.format.head_tiers(self.num_heads or 1)

    @property
    def precision(self) -> "Precision | tuple[Precision, ...]":
        """The requested precision: one for the whole layer, or one per KV head."""
        return self.store.format.tiers

    @property
    def key_clip(self) -> float:
        return self.store.format.key_clip

    @property
    def value_clip(self) -> float:
        return self.store.format.value_clip

    @property
    def key_rotation(self) -> bool:
        return self.store.format.key_rotation

    @property
    def value_rotation(self) -> bool:
        return self.store.format.value_rotation

    @property
    def value_drop(self) -> tuple[int, ...]:
        return self.store.format.value_drop

    @property
    def key_absmax(self) -> torch.Tensor | None:
        return self.store.key_absmax

    @property
    def value_absmax(self) -> torch.Tensor | None:
        return self.store.value_absmax

    def _set_format(self, **changes) -> None:
        self.store.format = replace(self.store.format, **changes)

    def set_precision(self, precision: "Precision | str | Sequence[Precision | str]") -> None:
        """Store tokens quantized from now on in ``precision`` (one, or one per KV head).

        Tokens already stored keep their format; tokens still in the full-precision window take the new one
        when they leave it.
        """
        parsed = self._parse_precision(precision)
        self._check_heads(parsed)
        self._set_format(tiers=parsed)

    def set_clip(self, key_clip: float | None = None, value_clip: float | None = None) -> None:
        """Clipping ratios for tokens quantized from now on."""
        for name, value in (("key_clip", key_clip), ("value_clip", value_clip)):
            if value is not None:
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"{name} must be in (0, 1], got {value}")
                self._set_format(**{name: float(value)})

    def set_rotation(self, keys: bool, values: bool) -> None:
        """Rotate keys / values of heads stored below INT8 from now on (see :mod:`kvguard.rotation`)."""
        self._set_format(key_rotation=bool(keys), value_rotation=bool(values))

    def set_value_drop(self, drop: Sequence[int] = ()) -> None:
        """Store the values of each head ``drop[h]`` tiers below its keys from now on (heads whose keys are
        below INT8; :meth:`Precision.below`); ``()`` stores both at the keys' tier. The drop stays when
        :meth:`set_precision` moves the keys: the values move with them."""
        drop = tuple(int(d) for d in drop)
        if any(d < 0 for d in drop):
            raise ValueError(f"value drops must be >= 0, got {list(drop)}")
        self._check_drops(drop)
        self._set_format(value_drop=drop if any(drop) else ())

    def _check_drops(self, drop: tuple[int, ...]) -> None:
        if drop and self.num_heads is not None and len(drop) != self.num_heads:
            raise ValueError(f"layer {self.layer_idx} has {self.num_heads} KV heads but {len(drop)} value drops were given")

    def set_static_scales(self, key_absmax: torch.Tensor | None, value_absmax: torch.Tensor | None) -> None:
        """Calibrated INT8 ``absmax`` per KV head and channel (``[H_kv, D]``), used by ``int8`` heads."""
        for t in (key_absmax, value_absmax):
            if t is not None and (t.dim() != 2 or not bool(torch.isfinite(t).all()) or bool((t < 0).any())):
                raise ValueError(f"static absmax must be a finite, non-negative [H_kv, D] tensor, got {tuple(t.shape)}")
        self.store.key_absmax, self.store.value_absmax = key_absmax, value_absmax

    # ------------------------------------------------------------------ error evidence
    def _track(self, part: Part, first: int, originals, encoded, *, count: bool = True) -> None:
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

    def _observer(self, count: bool = True):
        if not self.track_error:
            return None
        return lambda part, first, originals, read: self._track(part, first, originals, read, count=count)

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
        new tokens when the read is deferred to the reads' attention; see the module docstring)."""
        if self.is_initialized and self.stored_tokens > 0 and attention.fused_reads_active():
            # The harness attends over the past as stored now (the read keeps it while tokens are appended).
            attention.defer_read(key_states, self.read_and_append(key_states, value_states))
            return key_states, value_states
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.read_fp_from = self.window_start()  # this read sees positions from here on at full precision
        if self.config.score_correction and self.store.runs:
            warnings.warn(fused_attention.UNCORRECTED, RuntimeWarning, stacklevel=2)
        past_k, past_v = self.materialize(key_states.dtype)
        self._append(key_states, value_states)
        if past_k.shape[-2] == 0:
            return key_states, value_states
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def read_and_append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> StoredRead | None:
        """The stored past as it is now (``None`` when nothing is stored yet), then the new tokens stored: what an
        update whose attention reads the past itself does (a deferred read, a packed forward)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.read_fp_from = self.window_start()  # this read sees positions from here on at full precision
        read = self.stored_read() if self.stored_tokens > 0 else None
        self._append(key_states, value_states)
        return read

    def stored_read(self) -> StoredRead:
        """The stored past, overlay included, as every reader takes it (see :mod:`kvguard.stored_read`)."""
        read = self.store.read(self.config.score_correction)
        columns = self.overlay.columns(self.offset)
        return read if columns is None else read.with_overlay(columns, self.overlay.keys, self.overlay.values)

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored past as the model sees it, ``[B, H, T_stored, D]`` each (overlay applied)."""
        if not self.is_initialized:
            raise RuntimeError(f"layer {self.layer_idx} holds no tokens yet")
        return self.stored_read().materialize(dtype or self.fp_dtype, self.device)

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.layer_idx == 0 and keys.shape[-2] > 1 and keys.device.type == "cpu":
            # A prefill chunk's activations are freed below the buffers the last chunk stored, so the C heap keeps
            # their pages: hand them back before the next chunk (2 x 4,096 INT4 tokens on SmolLM2: the process's
            # anonymous memory ended 32 MiB over the 59 MiB stored, 38 without; a trim costs about 3 ms a chunk).
            heap.release()
        left = self.store.append(keys, values, self._observer())
        self.stored_last_update = left is not None
        if left is not None and left.quantized and self.backing is not None:
            # The window's own tensors (fp_dtype): what the overlay would hold for them.
            self.backing.put(self.layer_idx, left.first, left.keys, left.values, self.config.group_size)
        self._trim()

    def window_tensors(self, dtype: torch.dtype | None = None, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's first ``end`` tokens (all: ``None``) as keys and values ``[B, H, n, D]`` in ``dtype``."""
        return self.store.window_tensors(dtype, end)

    def holds_prerope_keys(self) -> bool:
        """Whether some stored run holds keys before RoPE (which the Triton kernel cannot read)."""
        return self.store.holds_prerope_keys()

    def _trim(self) -> None:
        """Full-attention layers keep everything; sliding layers override this."""

    # ------------------------------------------------------------------ positions
    @property
    def offset(self) -> int:
        """Absolute position of the first stored token."""
        return self.store.offset

    @property
    def length(self) -> int:
        """Tokens seen so far."""
        return self.store.length

    @property
    def stored_tokens(self) -> int:
        return self.store.stored_tokens

    def window_start(self) -> int:
        """Absolute position of the first full-precision window token."""
        return self.store.window_start() if self.is_initialized else 0

    def quantized_positions(self) -> torch.Tensor:
        """Absolute positions currently held as codes in a quantized (non-fp16) part of some head."""
        return self.store.quantized_positions()

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
        store = self.store
        sinks_end, win_start = store.sinks_end(), store.window_start()
        in_sinks, in_window = pos < sinks_end, pos >= win_start
        if bool(in_sinks.any()):
            idx = pos[in_sinks] - self.offset
            store.sinks_k[:, :, idx] = keys[:, :, in_sinks]
            store.sinks_v[:, :, idx] = values[:, :, in_sinks]
        if bool(in_window.any()):
            idx = pos[in_window] - win_start
            store.win_k[:, :, idx] = store.window_codes(keys[:, :, in_window], 0)
            store.win_v[:, :, idx] = store.window_codes(values[:, :, in_window], 1)
        rest = ~(in_sinks | in_window)
        if bool(rest.any()):
            self.overlay.write(pos[rest], keys[:, :, rest], values[:, :, rest])
            if self._error is not None:
                tracked = pos[rest][pos[rest] < self._error.shape[1]]
                self._error[:, tracked] = 0.0  # read at full precision from now on

    def overlay_positions(self) -> torch.Tensor:
        """Absolute positions currently served from the full-precision overlay."""
        return torch.zeros(0, dtype=torch.long) if self.overlay.positions is None else self.overlay.positions.clone()

    # ------------------------------------------------------------------ the backing tier
    def restore(self, positions) -> torch.Tensor:
        """Write the backed originals of quantized absolute ``positions`` into the overlay, bit for bit; returns
        the positions restored (``[R]``, ascending). Positions the backing does not hold (evicted, never
        quantized, or none kept) are left as they are."""
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if self.backing is None or not self.is_initialized or pos.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        t0 = time.perf_counter()
        found = self.backing.restore(self.layer_idx, pos[pos >= self.offset], self.device)
        self.restore_seconds += time.perf_counter() - t0
        if found.positions.numel():
            self.write_fp(found.positions, found.keys, found.values)
        return found.positions

    def backed_positions(self) -> torch.Tensor:
        """Absolute positions whose originals the backing holds for this layer (``[N]``, ascending)."""
        if self.backing is None:
            return torch.zeros(0, dtype=torch.long)
        return self.backing.positions(self.layer_idx)

    def reencodable(self) -> tuple[int, int]:
        """``(first, end)``: the stretch of quantized history, ending where the window starts, whose originals the
        backing tier holds (``first == end``: none). Eviction takes the oldest groups first, so it is the
        whole history until the tier's cap is reached."""
        end = self.window_start()
        held = self.backed_positions()
        if not self.store.runs or held.numel() == 0 or int(held[-1]) != end - 1:
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
        t0 = time.perf_counter()
        originals = self.backing.restore(self.layer_idx, torch.arange(first, end), self.device)
        self.restore_seconds += time.perf_counter() - t0
        run = self.store.new_run(self.store.layout())
        self.store.encode(run, originals.keys, originals.values, first)
        extra = run.nbytes() - self.store.history_nbytes_from(first)
        if max_extra_bytes is not None and extra > max_extra_bytes:
            return 0
        self.store.cut_from(first)
        self.store.runs.append(run)
        if self.track_error:
            self._retrack(run, first, originals.keys, originals.values)
        return end - first

    def _retrack(self, run, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The error evidence of re-encoded positions: what their new codes read back (0 for full-precision
        heads and for overlay positions, which are read at full precision)."""
        n = keys.shape[-2]
        self._error = _grow(self._error, self.num_heads, first + n, self.device)
        self._error[:, first:first + n] = 0.0
        turn = self.store.turn(run, first, n)
        for part in run.parts:
            if part.layout.key_spec is None:
                continue
            seg = self.store.segment(part, 0, n, turn)
            k, v = self.store.heads(keys, part), self.store.heads(values, part)
            self._track(part, first, (k, v), (seg.read_keys(torch.float32), seg.read_values(torch.float32)), count=False)
        if len(self.overlay):
            held = self.overlay.positions[self.overlay.positions < self._error.shape[1]]
            self._error[:, held] = 0.0

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> int:
        """Bytes of every tensor the layer holds in its hot tier: sinks, codes, scales, zero points, window,
        overlay and its positions (the backing tier is :meth:`backing_nbytes`)."""
        return self.store.nbytes() + self.overlay_nbytes() if self.is_initialized else 0

    def history_nbytes(self) -> int:
        """Bytes of the stored runs and their rotation signs: the part of :meth:`nbytes` a plan's tiers decide
        (the sinks, window and overlay are not)."""
        return self.store.history_nbytes()

    def history_tokens(self) -> int:
        """Tokens held in the stored runs (between the sinks and the window)."""
        return self.store.history_tokens()

    def overlay_nbytes(self) -> int:
        """Bytes of the full-precision overlay and its positions (part of :meth:`nbytes`)."""
        return self.overlay.nbytes()

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
        self.store.map_batch(fn)
        self.overlay.map_batch(fn)
        if self.backing is not None:
            self.backing.map_batch(self.layer_idx, fn)
        self.batch_size = self.store.batch_size

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
        self.store.drop_before(keep_from)
        self.overlay.drop_before(self.offset)
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
