"""Group-wise integer quantization of KV tensors.

A tensor ``x`` of shape ``[..., T, D]`` (tokens, channels; in the cache ``[B, H_kv, T, D]``) is split into
groups of ``group_size`` elements that share one scale (and, for the asymmetric tiers, one zero point):

- ``Axis.CHANNEL`` (keys): every channel has its own scale per group of ``group_size`` **tokens**, so
  ``T`` must be a multiple of ``group_size``. Scale shape ``[..., T / G, D]``. Key outliers live in
  channels (KIVI, KVQuant), which this grouping isolates.
- ``Axis.TOKEN`` (values): every token has its own scale per group of ``group_size`` **channels**, so ``D``
  must be a multiple of ``group_size``. Scale shape ``[..., T, D / G]``.

Numerics (``s`` = scale, ``z`` = zero point; both are stored as float16 and the codes are computed with the
float16-rounded values, so that dequantization uses exactly the numbers quantization used):

- INT8, symmetric: ``s = clip * absmax / 127``, ``q = clamp(round(x / s), -127, 127)``, ``x' = q * s``.
  ``absmax`` is the group's own (dynamic) or given by calibration (static, any shape that broadcasts to
  ``x``; then ``scale`` keeps that shape and is shared by every token).
- INT4 / INT3 / INT2, asymmetric: the group's ``[min, max]`` (shrunk about its centre by ``clip``) is mapped onto
  ``2**bits`` levels: ``s = (max - min) / (2**bits - 1)``, ``z = min`` (the value of code 0),
  ``q = clamp(round((x - z) / s), 0, 2**bits - 1)``, ``x' = q * s + z``.

Two options of the asymmetric tiers (``QuantSpec``):

- ``scale_bits=8`` (INT3 / INT2): the scale and the zero point take one byte each instead of two
  (:mod:`kvguard.scale_codes`); the codes are computed with the decoded values.
- ``range_search``: instead of the group's ``[min, max]``, each group takes whichever of
  :data:`RANGE_CANDIDATES` shrinkings of it (about its centre, after ``clip``) gives the smallest squared error of
  the group itself. At 2 bits ``[min, max]`` is far from the best grid: the error-optimal 4-level grid of a
  Gaussian spans about 3 standard deviations, the range of 32 samples about 4. Measured on SmolLM2's calibration
  text (rotated, groups of 32, float16 scales, an earlier set of six shrinkings down to 0.75): squared error -35 %
  (INT2 keys), -34 % (INT2 values), -15 % / -15 % (INT3). Squared error is not attention's error: at INT4, and at
  INT3 with float16 scales, it raised the KL (``benchmarks/scale_bytes.py``, in the history: commit 84c46f2), so a cache layout applies it to INT2
  and one-byte INT3 only (``CacheConfig.quant_spec``). The stored format is the same; only the encoder chooses
  differently.

Rules: a scale is never below float16's smallest normal number (6.1e-5), which makes constant (zero-range)
groups exact instead of a division by zero; non-finite input raises ``ValueError``; ``round`` is
round-half-to-even (``torch.round``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from kvguard import packing, scale_codes
from kvguard.precision import Precision

SCALE_DTYPE = torch.float16
_MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny
_MAX_SCALE = torch.finfo(SCALE_DTYPE).max


class Axis(str, Enum):
    """Which way groups run; see the module docstring."""

    CHANNEL = "channel"
    TOKEN = "token"


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor.

    Attributes:
        precision: ``int8``, ``int4``, ``int3`` or ``int2``.
        axis: ``channel`` (keys) or ``token`` (values).
        group_size: elements sharing a scale (tokens for ``channel``, channels for ``token``).
        clip: fraction of the observed range kept; values beyond it saturate. ``1.0`` keeps the full range.
        static: INT8 only; the scale comes from calibration (``absmax`` passed to :func:`quantize`).
        scale_bits: 16 (float16 scale and zero point) or 8 (one byte each; INT3 / INT2 only, see the module
            docstring).
        range_search: each group picks its own range by its squared error (asymmetric tiers; module docstring).
    """

    precision: Precision
    axis: Axis
    group_size: int = 32
    clip: float = 1.0
    static: bool = False
    scale_bits: int = 16
    range_search: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        if not self.precision.is_quantized:
            raise ValueError("QuantSpec needs an integer precision [int8, int4, int3, int2], got fp16")
        try:
            object.__setattr__(self, "axis", Axis(self.axis))
        except ValueError:
            raise ValueError(f"axis has to be one of {[a.value for a in Axis]} but got {self.axis!r}") from None
        if self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size}")
        if not 0.0 < self.clip <= 1.0:
            raise ValueError(f"clip must be in (0, 1], got {self.clip}")
        if self.static and self.precision is not Precision.INT8:
            raise ValueError(f"static (calibrated) scales are for int8 only, got {self.precision.value}")
        if self.scale_bits not in (8, 16):
            raise ValueError(f"scale_bits must be 16 or 8, got {self.scale_bits}")
        if self.scale_bits == 8 and self.precision.bits > 3:
            raise ValueError(f"one-byte scales are for int3 and int2 only, got {self.precision.value}")
        if self.range_search and self.precision.symmetric:
            raise ValueError(f"range_search is for the asymmetric tiers [int4, int3, int2], got {self.precision.value}")

    @property
    def levels(self) -> int:
        return 2 ** self.precision.bits


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes plus what is needed to decode them.

    Attributes:
        qdata: ``int8`` codes for INT8; for INT4 / INT3 / INT2 ``uint8`` bytes packed along the last (channel)
            axis by :mod:`kvguard.packing` (low bits first).
        scale: float16, group shape (see module docstring), or the calibrated shape when ``spec.static``; with
            ``spec.scale_bits == 8`` the ``uint8`` codes of :mod:`kvguard.scale_codes` (read :meth:`scales`).
        zero_point: float16, same shape as ``scale``, for INT4 / INT3 / INT2; ``None`` for INT8; with
            ``spec.scale_bits == 8`` ``int8`` codes (read :meth:`zeros`).
        spec: the :class:`QuantSpec` used.
        shape: shape of the original tensor ``[..., T, D]``.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: QuantSpec
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor (codes, scales, zero points)."""
        total = self.qdata.numel() * self.qdata.element_size()
        total += self.scale.numel() * self.scale.element_size()
        if self.zero_point is not None:
            total += self.zero_point.numel() * self.zero_point.element_size()
        return total

    @property
    def num_tokens(self) -> int:
        return self.shape[-2]

    def scales(self) -> torch.Tensor:
        """The float16 scales, decoded where they are stored in one byte."""
        return scale_codes.decode_scale(self.scale) if self.spec.scale_bits == 8 else self.scale

    def zeros(self) -> torch.Tensor | None:
        """The float16 zero points (``None`` for INT8), decoded where they are stored in one byte."""
        if self.zero_point is None or self.spec.scale_bits != 8:
            return self.zero_point
        return scale_codes.decode_zero(self.zero_point, self.scales())

    def codes(self) -> torch.Tensor:
        """Unpacked integer codes, shape ``[..., T, D]`` (``int8`` for INT8, ``uint8`` otherwise)."""
        return packing.unpack(self.qdata, self.spec.precision.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reconstructed tensor ``[..., T, D]`` in ``dtype``."""
        q = self.codes().to(torch.float32)
        scale = self.scales().to(torch.float32)
        zero = self.zeros()
        zero = None if zero is None else zero.to(torch.float32)
        if self.spec.static:
            return (q * scale).to(dtype)
        grouped = _group(q, self.spec)
        scale, zero = _expand(scale, self.spec), None if zero is None else _expand(zero, self.spec)
        out = grouped * scale if zero is None else grouped * scale + zero
        return out.reshape(self.shape).to(dtype)

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Concatenate along the token axis (``-2``). All parts must share ``spec`` and leading shape."""
        if not parts:
            raise ValueError("cat needs at least one QuantizedTensor")
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            if p.spec != first.spec or p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1]:
                raise ValueError(f"cannot concatenate {p.spec}/{p.shape} onto {first.spec}/{first.shape}")
        tokens = sum(p.num_tokens for p in parts)
        qdata = torch.cat([p.qdata for p in parts], dim=-2)
        if first.spec.static:
            # A calibrated scale is shared by every token: keep one copy.
            scale, zero = first.scale, None
        else:
            scale = torch.cat([p.scale for p in parts], dim=-2)
            zero = None if first.zero_point is None else torch.cat([p.zero_point for p in parts], dim=-2)
        return QuantizedTensor(qdata, scale, zero, first.spec, (*first.shape[:-2], tokens, first.shape[-1]))

    def drop_front(self, tokens: int) -> "QuantizedTensor":
        """The same data without its first ``tokens`` tokens (whole groups for ``Axis.CHANNEL``)."""
        if tokens == 0:
            return self
        spec = self.spec
        if spec.axis is Axis.CHANNEL and tokens % spec.group_size:
            raise ValueError(f"can only drop whole groups of {spec.group_size} tokens, not {tokens}")
        qdata = self.qdata[..., tokens:, :]
        scale, zero = self.scale, self.zero_point
        if not spec.static:
            cut = tokens // spec.group_size if spec.axis is Axis.CHANNEL else tokens
            scale = scale[..., cut:, :]
            zero = None if zero is None else zero[..., cut:, :]
        return QuantizedTensor(qdata, scale, zero, spec, (*self.shape[:-2], self.shape[-2] - tokens, self.shape[-1]))

    def keep_front(self, tokens: int) -> "QuantizedTensor":
        """The same data restricted to its first ``tokens`` tokens (whole groups for ``Axis.CHANNEL``)."""
        spec = self.spec
        if spec.axis is Axis.CHANNEL and tokens % spec.group_size:
            raise ValueError(f"can only keep whole groups of {spec.group_size} tokens, not {tokens}")
        if not 0 <= tokens <= self.shape[-2]:
            raise ValueError(f"cannot keep {tokens} of {self.shape[-2]} tokens")
        qdata = self.qdata[..., :tokens, :]
        scale, zero = self.scale, self.zero_point
        if not spec.static:
            cut = tokens // spec.group_size if spec.axis is Axis.CHANNEL else tokens
            scale = scale[..., :cut, :]
            zero = None if zero is None else zero[..., :cut, :]
        return QuantizedTensor(qdata, scale, zero, spec, (*self.shape[:-2], tokens, self.shape[-1]))

    def map_batch(self, fn) -> "QuantizedTensor":
        """Apply ``fn`` (a batch-axis operation such as ``index_select(0, ...)``) to every per-sequence tensor."""
        qdata = fn(self.qdata)
        scale, zero = self.scale, self.zero_point
        if not self.spec.static:  # a calibrated scale belongs to the model, not to a sequence
            scale = fn(scale)
            zero = None if zero is None else fn(zero)
        return QuantizedTensor(qdata, scale, zero, self.spec, (qdata.shape[0], *self.shape[1:]))

    def select_heads(self, index: torch.Tensor) -> "QuantizedTensor":
        """The same data restricted to the given entries of axis 1 (KV heads in ``[B, H, T, D]``)."""
        if self.qdata.dim() != 4:
            raise ValueError("select_heads expects a [B, H, T, D] tensor")

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[1] == 1 else t.index_select(1, index)

        zero = None if self.zero_point is None else pick(self.zero_point)
        shape = (self.shape[0], int(index.numel()), *self.shape[2:])
        return QuantizedTensor(pick(self.qdata), pick(self.scale), zero, self.spec, shape)


def _group(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View ``[..., T, D]`` with the group as its own axis: ``[..., T/G, G, D]`` or ``[..., T, D/G, G]``."""
    *lead, t, d = x.shape
    g = spec.group_size
    if spec.axis is Axis.CHANNEL:
        if t % g:
            raise ValueError(f"per-channel quantization needs whole groups: {t} tokens is not a multiple of {g}")
        return x.reshape(*lead, t // g, g, d)
    if d % g:
        raise ValueError(f"per-token quantization needs whole groups: {d} channels is not a multiple of {g}")
    return x.reshape(*lead, t, d // g, g)


def _group_dim(spec: QuantSpec) -> int:
    return -2 if spec.axis is Axis.CHANNEL else -1


def _expand(stat: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """A per-group statistic, re-inserted as a size-1 axis so it broadcasts over its group."""
    return stat.unsqueeze(_group_dim(spec))


def _to_scale_dtype(x: torch.Tensor, what: str) -> torch.Tensor:
    if bool((x.abs() > _MAX_SCALE).any()):
        raise ValueError(f"{what} exceeds the float16 range ({_MAX_SCALE}); the input values are too large")
    return x.to(SCALE_DTYPE)


def static_int8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The scale static INT8 quantization uses for ``absmax`` at clip 1 (float16 values, as float32, same shape):
    for callers that keep their own codes under a calibrated range (the cache's 8-bit window)."""
    return _static_scale(absmax.to(torch.float32).abs()).to(torch.float32)


def _static_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 127`` in the scale dtype (float32 ``amax``, already clipped and non-negative)."""
    return _to_scale_dtype(amax / 127.0, "scale").clamp(min=_MIN_SCALE)


def static_int8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x``'s symmetric INT8 codes under ``scale`` (:func:`static_int8_scale`), as float32."""
    return torch.clamp(torch.round(x.to(torch.float32) / scale), -127, 127)


def quantize(x: torch.Tensor, spec: QuantSpec, absmax: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize ``x`` (``[..., T, D]``, floating point) according to ``spec``.

    ``absmax`` is required when ``spec.static`` (calibrated INT8; any shape broadcastable to ``x``) and
    refused otherwise.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"quantize expects [..., tokens, channels], got shape {tuple(x.shape)}")
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(f"cannot quantize non-finite values: {bad} NaN/Inf in a tensor of shape {tuple(x.shape)}")
    if spec.static != (absmax is not None):
        raise ValueError("absmax must be given exactly when spec.static is set (calibrated int8 scales)")
    bits = spec.precision.bits
    x32 = x.to(torch.float32)

    if spec.precision.symmetric:
        if spec.static:
            scale = _static_scale(spec.clip * absmax.to(device=x.device, dtype=torch.float32).abs())
            q = static_int8_codes(x32, scale.to(torch.float32))
        else:
            grouped = _group(x32, spec)
            amax = grouped.abs().amax(dim=_group_dim(spec))
            scale = _to_scale_dtype(spec.clip * amax / 127.0, "scale").clamp(min=_MIN_SCALE)
            q = torch.clamp(torch.round(grouped / _expand(scale, spec).to(torch.float32)), -127, 127)
        qdata = q.to(torch.int8).reshape(x.shape)
        return QuantizedTensor(qdata, scale, None, spec, tuple(x.shape))

    grouped = _group(x32, spec)
    lo = grouped.amin(dim=_group_dim(spec))
    hi = grouped.amax(dim=_group_dim(spec))
    if spec.clip < 1.0:
        lo, hi = _shrink(lo, hi, spec.clip)
    if spec.range_search:
        scale, zero, s32, z32 = _searched_grid(grouped, lo, hi, spec)
    else:
        scale, zero, s32, z32 = _grid(lo, hi, spec)
    codes = _codes(grouped, s32, z32, spec).to(torch.uint8).reshape(x.shape)
    return QuantizedTensor(packing.pack(codes, bits), scale, zero, spec, tuple(x.shape))


# Shrinkings of a group's range tried by ``range_search``: eight, ``1 - i * 0.28 / levels`` (INT2 down to 0.51,
# INT3 to 0.76, INT4 to 0.88), since the fewer the levels the narrower the error-optimal grid.
RANGE_CANDIDATES = 8


def _shrink(lo: torch.Tensor, hi: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[lo, hi]`` shrunk about its centre to ``factor`` of its width."""
    centre, half = (hi + lo) / 2, (hi - lo) / 2 * factor
    return centre - half, centre + half


def _grid(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec):
    """``(stored scale, stored zero, scale, zero)`` of the grids of ``spec``'s format that cover each group's
    ``[lo, hi]``: as stored (float16, or one-byte codes) and as float32 values."""
    if spec.scale_bits == 8:
        scale, zero = scale_codes.encode(lo, hi, spec.levels)
        s32 = scale_codes.decode_scale(scale).to(torch.float32)
        return scale, zero, s32, scale_codes.decode_zero(zero, s32).to(torch.float32)
    scale = _to_scale_dtype((hi - lo) / (spec.levels - 1), "scale").clamp(min=_MIN_SCALE)
    zero = _to_scale_dtype(lo, "zero point")
    return scale, zero, scale.to(torch.float32), zero.to(torch.float32)


def _codes(grouped: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """float32 codes of ``grouped`` on the grids ``scale`` / ``zero`` (float32, one per group)."""
    q = torch.round((grouped - _expand(zero, spec)) / _expand(scale, spec))
    return torch.clamp(q, 0, spec.levels - 1)


# Values the range search measures at once: up to this many (16 MiB per float32 temporary), its candidates go in one
# batch of tensor ops; a larger tensor (a long prefill) takes them a few at a time, down to one, so the search never
# holds much more than one candidate's copy of a large tensor.
SEARCH_BATCH_VALUES = 1 << 22


def _searched_grid(grouped: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec):
    """:func:`_grid` of the :data:`RANGE_CANDIDATES` shrinking of ``[lo, hi]`` that reads each group back with the
    smallest squared error (the widest on a tie)."""
    per_batch = max(1, SEARCH_BATCH_VALUES // max(1, grouped.numel()))
    best = None
    for first in range(0, RANGE_CANDIDATES, per_batch):
        # Candidates along a new leading axis [C, ...]: a handful of ops over C copies of the tensor instead of that
        # many ops per candidate (each group's numbers are the same as one candidate at a time).
        shrink = [1 - i * 0.28 / spec.levels for i in range(first, min(first + per_batch, RANGE_CANDIDATES))]
        factors = torch.tensor(shrink, device=lo.device).view(-1, *([1] * lo.dim()))  # [C, 1, ...]
        grids = _grid(*_shrink(lo[None], hi[None], factors), spec)  # each [C, *lo.shape]
        # (code - u) * scale is the read-back error of a value at u steps above the zero point.
        u = (grouped[None] - _expand(grids[3], spec)).div_(_expand(grids[2], spec))
        err = u.round().clamp_(0, spec.levels - 1).sub_(u).square_().sum(dim=_group_dim(spec)) * grids[2].square()
        pick = err.argmin(dim=0, keepdim=True)  # [1, *lo.shape]: the first (widest) of equal errors
        batch = [g.gather(0, pick)[0] for g in (*grids, err)]
        if best is not None:  # an earlier batch's candidate keeps its groups unless strictly beaten
            better = batch[4] < best[4]
            batch = [torch.where(better, new, old) for new, old in zip(batch, best)]
        best = batch
    return tuple(best[:4])
