"""vLLM's dynamic per-token-head KV caches, ``--kv-cache-dtype int8_per_token_head`` / ``int4_per_token_head``.

Both formats keep, for every cached token and KV head, the ``head_dim`` values as integer codes and one float32
scale computed from that vector alone when it is written (no calibration, nothing to export). Reproduced from
vLLM's write kernels (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``,
``_reshape_cache_per_token_head``, and ``vllm/v1/attention/ops/int4_per_token_head.py``,
``_reshape_cache_int4_kernel`` and ``single_rht``), operation by operation in float32:

``int8_per_token_head`` (symmetric)::

    scale = max(absmax(x) / 127, 1e-6)
    q     = int8(trunc(clamp(round_half_away(x * (1 / scale)), -128, 127)))
    x'    = q * scale

``int4_per_token_head`` (asymmetric, after a randomized Hadamard rotation)::

    r     = H_b (s * x)                     # s: vLLM's fixed +-1 signs, H_b: unnormalized Walsh-Hadamard,
                                            # block-diagonal over b = the largest power of two dividing head_dim
    scale = max((max(r) - min(r)) / 15, 1e-6)
    zp    = clamp(round_half_away(-min(r) / scale), 0, 15)
    q     = clamp(round_half_away(r * (1 / scale) + zp), 0, 15)      # two codes per byte, even index low nibble
    stored scale = float32 bits of scale with the low 4 mantissa bits replaced by zp
    r'    = (q - zp) * scale_read           # scale_read: the stored bits with the low 4 cleared
    x'    = s * H_b r' / b                  # the inverse rotation (H_b H_b = b I)

``round_half_away`` is vLLM's ``where(v >= 0, v + 0.5, v - 0.5)`` followed by truncation toward zero. vLLM
attends over the rotated codes with a rotated query (``q . k = (H s q) . (H s k) / b``); kvguard hands
attention the de-rotated ``x'``, the same numbers up to float32 rounding of the dot products. Like vLLM, the
new tokens are written first and attention reads them back from the cache. What these tests cannot see: on a
GPU, Triton's float32 division and fused multiply-add may move a value that sits exactly on a rounding
boundary by one code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvguard.architecture import Architecture
from kvguard.fp8 import MeasuredCache, parse_choice

INT8_MAX, INT8_MIN = 127.0, -128.0
INT4_LEVELS = 15.0
MIN_SCALE = 1e-6  # vLLM's floor on a scale (a constant vector would divide by zero)
SCALE_BYTES = 4  # one float32 scale per token, head and K/V side
FP_DTYPE = torch.float16  # skipped layers (--kv-cache-dtype-skip-layers) keep the model's 16-bit dtype
_RHT_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)
_ZP_BITS = 0xF


class TokenHeadFormat(str, Enum):
    """vLLM's per-token-head KV-cache dtypes (the ``--kv-cache-dtype`` values)."""

    INT8 = "int8_per_token_head"
    INT4 = "int4_per_token_head"

    @classmethod
    def parse(cls, value: "TokenHeadFormat | str") -> "TokenHeadFormat":
        return parse_choice(cls, value, "per-token-head format")

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one token's K (or V) vector of one head takes: codes plus the float32 scale."""
        return (head_dim if self is TokenHeadFormat.INT8 else head_dim // 2) + SCALE_BYTES


@dataclass(frozen=True)
class TokenHeadCodes:
    """K or V vectors as vLLM stores them.

    Attributes:
        qdata: ``[..., D]`` int8 (INT8) or ``[..., D / 2]`` uint8 (INT4: code ``2i`` in the low nibble of byte
            ``i``, code ``2i + 1`` in the high one).
        scale: ``[..., 1]`` float32 as stored (INT4: the zero point in its low 4 mantissa bits).
        format: which of the two.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    format: TokenHeadFormat

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values attention reads, ``[..., D]`` in ``dtype``."""
        if self.format is TokenHeadFormat.INT8:
            return (self.qdata.to(torch.float32) * self.scale).to(dtype)
        bits = self.scale.view(torch.int32)
        zp = (bits & _ZP_BITS).to(torch.float32)
        scale = (bits & ~_ZP_BITS).view(torch.float32)
        codes = torch.stack([self.qdata & 0xF, self.qdata >> 4], dim=-1).flatten(-2).to(torch.float32)
        return (rht((codes - zp) * scale, inverse=True) / _block(codes.shape[-1])).to(dtype)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0, v + 0.5, v - 0.5).trunc()


def _block(d: int) -> int:
    return d & -d  # the largest power of two dividing d


def rht_signs(d: int) -> torch.Tensor:
    """vLLM's deterministic +-1 sign vector of length ``d`` (its ``_get_rht_signs(d, 0)``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last (power-of-two) axis, vLLM's CPU butterfly."""
    d, h = x.shape[-1], 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's ``single_rht``: ``H (s * x)`` (``inverse``: ``s * H x``), block-diagonal in blocks of the largest
    power of two dividing the last axis. Unnormalized: applying both gives ``b * x``."""
    d = x.shape[-1]
    b = _block(d)
    blocks = x.reshape(*x.shape[:-1], d // b, b)
    signs = rht_signs(b).to(x.device, x.dtype)
    out = _hadamard(blocks) * signs if inverse else _hadamard(blocks * signs)
    return out.reshape(x.shape)


def quantize(x: torch.Tensor, fmt: TokenHeadFormat | str) -> TokenHeadCodes:
    """``x`` (``[..., D]``, one vector per token and head on the last axis) in vLLM's per-token-head format."""
    fmt = TokenHeadFormat.parse(fmt)
    if fmt is TokenHeadFormat.INT8:
        x32 = x.to(torch.float32)
        scale = torch.clamp_min(x32.abs().amax(-1, keepdim=True) / INT8_MAX, MIN_SCALE)
        q = _round_half_away(x32 * (1.0 / scale)).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
        return TokenHeadCodes(q, scale, fmt)
    if x.shape[-1] % 2:
        raise ValueError(f"int4_per_token_head packs two codes per byte: head_dim must be even, got {x.shape[-1]}")
    # vLLM rotates in float32 and hands the kernel the result in the model's dtype.
    r = rht(x.to(torch.float32)).to(x.dtype).to(torch.float32)
    lo, hi = r.amin(-1, keepdim=True), r.amax(-1, keepdim=True)
    scale = torch.clamp_min((hi - lo) / INT4_LEVELS, MIN_SCALE)
    zp = _round_half_away(-lo / scale).clamp(0.0, INT4_LEVELS)
    q = _round_half_away(r * (1.0 / scale) + zp).clamp(0.0, INT4_LEVELS).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    stored = ((scale.view(torch.int32) & ~_ZP_BITS) | zp.to(torch.int32)).view(torch.float32)
    return TokenHeadCodes(packed, stored, fmt)


class _TokenHeadStorage:
    """Keeps what ``update`` receives as codes + scales (or float16 in a skipped layer) and hands attention the
    decoded past and new tokens, as the engine does (it writes new K/V to its cache, then attends over it).
    Each token is quantized once from its own values, so any chunking of a stream gives the same inputs."""

    def __init__(self, fmt: TokenHeadFormat | None, **kwargs):
        super().__init__(**kwargs)
        self.format = fmt  # None: a skipped layer
        self.key_scales: torch.Tensor | None = None  # [B, H_kv, T, 1] float32, parallel to self.keys
        self.value_scales: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        dtype = key_states.dtype
        if self.format is None:
            keys, values = super().update(key_states.to(FP_DTYPE), value_states.to(FP_DTYPE), *args, **kwargs)
            return keys.to(dtype), values.to(dtype)
        k, v = quantize(key_states, self.format), quantize(value_states, self.format)
        keys, values = super().update(k.qdata, v.qdata, *args, **kwargs)
        # Scales follow their codes: attention gets past + new; the stored ones follow a sliding window's cut.
        key_scales, value_scales = self._cat(self.key_scales, k.scale), self._cat(self.value_scales, v.scale)
        self.key_scales = key_scales[..., key_scales.shape[-2] - self.keys.shape[-2]:, :]
        self.value_scales = value_scales[..., value_scales.shape[-2] - self.values.shape[-2]:, :]
        return (TokenHeadCodes(keys, key_scales[..., -keys.shape[-2]:, :], self.format).dequantize(dtype),
                TokenHeadCodes(values, value_scales[..., -values.shape[-2]:, :], self.format).dequantize(dtype))

    @staticmethod
    def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new if old is None else torch.cat([old, new], dim=-2)

    def nbytes(self) -> int:
        """Bytes of the stored codes and scales (float16 in a skipped layer)."""
        if not self.is_initialized:
            return 0
        total = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        if self.format is not None:
            total += sum(t.numel() * t.element_size() for t in (self.key_scales, self.value_scales))
        return total

    def fp16_nbytes(self) -> int:
        """Bytes the same tokens take in an FP16 cache (2 per element; INT4 stores two elements per byte)."""
        if not self.is_initialized:
            return 0
        elements = self.keys.numel() * (2 if self.format is TokenHeadFormat.INT4 else 1)
        return 2 * 2 * elements


class TokenHeadLayer(_TokenHeadStorage, DynamicLayer):
    """A full-attention layer of :class:`TokenHeadCache`."""


class TokenHeadSlidingLayer(_TokenHeadStorage, DynamicSlidingWindowLayer):
    """A sliding-window layer of :class:`TokenHeadCache` (keeps the last ``sliding_window - 1`` tokens)."""


class TokenHeadCache(MeasuredCache):
    """A ``transformers`` cache that stores K/V the way vLLM's per-token-head cache does.

    Args:
        config: the model's config or an :class:`~kvguard.architecture.Architecture`.
        fmt: ``int8_per_token_head`` or ``int4_per_token_head``.
        skip_layers: layers kept in float16 (vLLM's ``--kv-cache-dtype-skip-layers``).
    """

    def __init__(self, config, fmt: TokenHeadFormat | str, skip_layers: tuple[int, ...] = ()):
        arch = Architecture.from_config(config)
        fmt = TokenHeadFormat.parse(fmt)
        bad = [i for i in skip_layers if not 0 <= i < arch.num_layers]
        if bad:
            raise ValueError(f"skip_layers {bad} are outside the model's {arch.num_layers} layers")
        self.format, self.skip_layers = fmt, tuple(sorted(skip_layers))
        layers = []
        for idx in range(arch.num_layers):
            layer_fmt = None if idx in self.skip_layers else fmt
            if arch.is_sliding(idx):
                layers.append(TokenHeadSlidingLayer(layer_fmt, sliding_window=arch.sliding_window))
            else:
                layers.append(TokenHeadLayer(layer_fmt))
        super().__init__(layers=layers)

