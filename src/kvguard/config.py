"""Typed configuration: the cache layout, the feedback loop's thresholds, and the objective calibration optimises."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from enum import Enum

import torch

from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantSpec, static_int8_scale

_FP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "model": None}
# An 8-bit window's range: twice the calibrated absmax. Recent keys exceed calibration's absmax by up to 2.8x on
# 0.02-0.3 % of values (Gemma 3, calibration code), and saturating them costs more than a coarser step: all-INT3 on
# that text, KL +22 % over a 16-bit window at 1x, +12 % at 2x.
WINDOW_HEADROOM = 2.0


def window_scale(absmax: torch.Tensor) -> torch.Tensor:
    """An 8-bit window's scale for the calibrated ``absmax`` ``[H, D]``: ``[1, H, 1, D]``, shared by every token."""
    return static_int8_scale(absmax * WINDOW_HEADROOM)[None, :, None, :]


@dataclass(frozen=True)
class CacheConfig:
    """Layout knobs shared by every layer of a :class:`~kvguard.cache.KVGuardCache`.

    Attributes:
        residual: the most recent tokens kept at full precision. Tokens are quantized in whole groups once
            they leave this window, so between ``residual`` and ``residual + group_size - 1`` recent tokens
            are full precision at any time. 64: recent tokens get most of the attention, and this keeps
            all-INT4 storage near 1/3 of FP16 at 2k tokens (KIVI uses 128).
        sinks: the first tokens kept at full precision (attention sinks draw large attention mass; 4 as in
            StreamingLLM).
        group_size: elements per quantization group: tokens per channel for keys, channels per token for
            values. 32 as in KIVI.
        value_group_size: channels per value scale when values group differently from keys (``None``: as
            ``group_size``). Values are quantized per token, so a wider group adds no full-precision tokens: it
            only thins the scales (with the values rotated, measured on Gemma 3's calibration text at INT3, 64
            channels instead of 32 cost at most 4 % more KL for 5 % fewer bytes; ``benchmarks/DECISIONS.md``).
        window_bits: 16 keeps the window in ``fp_dtype``; 8 stores it as the INT8 tier does (one calibrated scale
            per KV head and channel, symmetric, over :data:`WINDOW_HEADROOM` times the calibrated range: 8 bits a
            value and no scale bytes per token), which needs calibrated static scales. The newest token is still
            read as computed; tokens leave the window from their 8-bit copy. Below 4 bits a 16-bit window is a
            large share of the bytes (13 % of all-INT3 on Gemma 3 at 2,048 tokens); the 8-bit one adds a nearly
            fixed error, since the recent tokens draw most of the attention (``benchmarks/DECISIONS.md``).
        fp_dtype: storage dtype of full-precision parts (window, sinks, ``fp16`` tiers, recomputed overlay):
            ``float16`` (what a serving engine stores), ``bfloat16``, ``float32``, or ``model`` (the dtype
            the model computes in; bit-exact with ``DynamicCache``).
        scale_bits: 16 stores every group's scale and zero point in float16; 8 stores those of the INT3 and INT2
            tiers in one byte each (:mod:`kvguard.scale_codes`): at INT2 with groups of 32 that is 2.5 bits a
            value instead of 3. INT4 keeps float16 (its narrow steps need a finer zero point).
        range_search: each group of the INT2 tier, and of the INT3 tier when its scales take one byte, picks the
            range that reads it back with the smallest squared error among a few shrinkings of its ``[min, max]``
            (:mod:`kvguard.quantizer`); the format is unchanged, quantizing takes a few times longer. INT4 and
            float16-scaled INT3 keep ``[min, max]``: there the searched grid clips the large values attention
            needs, and on SmolLM2's calibration text (rotated, fixed uniform plans) it raised the KL by 3-19 %
            (``benchmarks/scale_bytes.py``, in the history: commit 84c46f2), while it cut INT2's by 27-46 % and one-byte INT3's by 7-28 %.
        key_clip / value_clip: default clipping ratios (calibration sets per-layer ones).
        score_correction: subtract the softmax bias that rounding noise adds to the scores of keys stored below
            INT8 (:mod:`kvguard.score_bias`; no storage). Applied where attention reads the codes: the fused
            decode attention and the decoding simulation; a multi-token chunk that reads dequantized keys is not
            corrected.
        prerope_keys: store key heads below INT8 before RoPE (:mod:`kvguard.rope`), as KVQuant does: the cache
            undoes each key's turn before quantizing it and turns what it reads back again, so a per-channel group
            no longer mixes the two channels of a fast-turning pair. Same bytes; needs the model's RoPE (the cache
            is built from the model's config). The fused C++ decode kernel turns such keys as it reads them; the
            Triton kernel reads post-RoPE codes only. Not with ``score_correction``, whose noise model is post-RoPE.
    """

    residual: int = 64
    sinks: int = 4
    group_size: int = 32
    value_group_size: int | None = None
    window_bits: int = 16
    scale_bits: int = 16
    range_search: bool = False
    fp_dtype: str = "float16"
    key_clip: float = 1.0
    value_clip: float = 1.0
    score_correction: bool = False
    prerope_keys: bool = False

    def __post_init__(self) -> None:
        if self.residual < 0 or self.sinks < 0:
            raise ValueError(f"residual and sinks must be >= 0, got residual={self.residual}, sinks={self.sinks}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.value_group_size is not None and self.value_group_size < 1:
            raise ValueError(f"value_group_size must be >= 1 (or None: as group_size), got {self.value_group_size}")
        if self.window_bits not in (8, 16):
            raise ValueError(f"window_bits must be 16 (fp_dtype) or 8 (the INT8 tier's format), got {self.window_bits}")
        if self.scale_bits not in (8, 16):
            raise ValueError(f"scale_bits must be 16 (float16 scales) or 8 (one byte for INT3 / INT2), got {self.scale_bits}")
        if self.fp_dtype not in _FP_DTYPES:
            raise ValueError(f"fp_dtype has to be one of {list(_FP_DTYPES)} but got {self.fp_dtype!r}")
        for name in ("key_clip", "value_clip"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.prerope_keys and self.score_correction:
            raise ValueError("prerope_keys and score_correction cannot be combined: the correction models the "
                             "rounding noise of keys stored after RoPE")

    @property
    def value_group(self) -> int:
        """Channels per value scale."""
        return self.group_size if self.value_group_size is None else self.value_group_size

    def quant_spec(self, precision: Precision, axis: Axis, clip: float, static: bool = False) -> QuantSpec:
        """How this layout quantizes keys (``Axis.CHANNEL``) or values (``Axis.TOKEN``) at ``precision``."""
        group = self.group_size if axis is Axis.CHANNEL else self.value_group
        if precision.symmetric:
            return QuantSpec(precision, axis, group, clip, static)
        scale_bits = self.scale_bits if precision.bits <= 3 else 16
        search = self.range_search and (precision.bits == 2 or scale_bits == 8)  # where it lowered the KL
        return QuantSpec(precision, axis, group, clip, static, scale_bits, search)

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype full-precision parts are stored in, for a model computing in ``model_dtype``."""
        return _FP_DTYPES[self.fp_dtype] or model_dtype

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.score_correction:
            del out["score_correction"]  # off: profiles read the same as before it existed
        if self.value_group_size is None:
            del out["value_group_size"]  # likewise
        if self.window_bits == 16:
            del out["window_bits"]  # likewise
        if self.scale_bits == 16:
            del out["scale_bits"]  # likewise
        if not self.range_search:
            del out["range_search"]  # likewise
        if not self.prerope_keys:
            del out["prerope_keys"]  # likewise
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CacheConfig":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown CacheConfig fields {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


class Demotion(str, Enum):
    """When the loop takes a promoted layer back down.

    ``budget``: only when the hot cache runs out of its memory budget (the least risky promoted layer first).
    ``risk``: also after ``demote_steps`` quiet steps at or below ``demote_risk``. The classifier reads the
    layer's K/V error at the tier it is stored at now, so a promotion lowers the very risk this rule watches:
    measured on calibration dialog over SmolLM2's aggressive plan, demoting on low risk gave back 2-4 points of
    the KL gap the loop had recovered (benchmarks/DECISIONS.md, "Should a promotion stay")."""

    BUDGET = "budget"
    RISK = "risk"


@dataclass(frozen=True)
class MonitorConfig:
    """Thresholds of the feedback loop (the founding design's defaults; a profile stores them, any can be
    overridden).

    Attributes:
        window_tokens, refresh_tokens: window mean over the last 32 tokens, refreshed every 8 (one
            *monitoring step*).
        baseline_tokens: time constant of the sequence's own entropy level the drop is measured against
            (:class:`~kvguard.entropy.SequenceReference`).
        warn_drop: window-mean entropy drop that warns and triggers light compensation (recompute the alarming
            layer's KV at the selected positions). A layer's warning or trigger acts once per episode: it
            re-arms when the layer's window drop is back under half of ``warn_drop``.
        trigger_drop, trigger_consecutive: that many consecutive tokens this far below baseline trigger
            light compensation too.
        alarm_risk: with a risk classifier, a warning or trigger acts only in a layer whose risk is at least
            this: even odds that the window's quantization error costs a 1 % local perplexity. Ordinary text
            moves a layer's entropy by 20 % and more with no quantization at all; the drop alone does not say
            quantization caused it. Severe drops and non-finite reads always act.
        heavy_drop, heavy_layers: a severe alarm: heavy compensation over the ``heavy_layers`` layers up to
            the alarming one, and one step up the rollback ladder.
        recompute_fraction: ``[base, max]`` share of a layer's quantized positions recomputed per action, and
            the most its full-precision overlay may hold (the ladder doubles both).
        max_trigger_rate, trigger_rate_steps: above this share of acting steps over the last
            ``trigger_rate_steps`` steps, a "recalibration recommended" event.
        promote_risk, promote_layer_risk, promote_steps: dynamic precision on the risk classifier's output:
            ``promote_steps`` steps in a row at or above ``promote_risk`` (or, while some layer is there, at or
            above ``promote_layer_risk``) promote a layer one tier for new tokens.
        demotion, demote_risk, demote_steps: when a promoted layer goes back (:class:`Demotion`): ``budget``
            (the default), only under memory pressure; ``risk``, also after ``demote_steps`` steps at or below
            ``demote_risk`` (hysteresis). Never below the plan.
        max_promotion_tiers: at most this many tiers above the plan (the risk
            reflects old tokens too, which a promotion fixes only as far as the backing tier holds them: without
            a cap a layer would climb to FP16 on the strength of tokens it cannot fix). A promotion also restores
            or recomputes the layer's top positions.
        reencode_history, min_saving_kept: with a backing tier (:mod:`kvguard.backing`), a promotion also
            stores the layer's history again at the promoted tiers, from the originals the tier holds, as long
            as the hot cache keeps at least ``min_saving_kept`` of the memory the plan saves (at the same
            length); past that, promotions change new tokens only.
        prompt_check: the last token of a prefilled prompt is a monitoring step of its own (risk only), so layers
            at risk are promoted before the first decoded token; ``False``: the first step comes after
            ``refresh_tokens`` decoded tokens (the ablation).
        cooldown_steps: steps without a severe alarm before the ladder steps down from level 1; doubles with
            every level.
        layers: the monitored layers (``None``: all).
    """

    window_tokens: int = 32
    refresh_tokens: int = 8
    baseline_tokens: int = 64
    warn_drop: float = 0.20
    trigger_drop: float = 0.25
    trigger_consecutive: int = 3
    alarm_risk: float = 0.5
    heavy_drop: float = 0.35
    heavy_layers: int = 4
    recompute_fraction: tuple[float, float] = (0.02, 0.05)
    max_trigger_rate: float = 0.05
    trigger_rate_steps: int = 256
    promote_risk: float = 0.9
    promote_layer_risk: float = 0.3
    promote_steps: int = 2
    demotion: Demotion = Demotion.BUDGET
    demote_risk: float = 0.2
    demote_steps: int = 32
    max_promotion_tiers: int = 1
    cooldown_steps: int = 4
    reencode_history: bool = True
    min_saving_kept: float = 0.8
    prompt_check: bool = True
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute_fraction", tuple(float(x) for x in self.recompute_fraction))
        try:
            object.__setattr__(self, "demotion", Demotion(self.demotion))
        except ValueError:
            raise ValueError(f"monitor setting demotion must be one of {[d.value for d in Demotion]}, "
                             f"got {self.demotion!r}") from None
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        for name in ("window_tokens", "refresh_tokens", "baseline_tokens", "trigger_consecutive", "heavy_layers", "trigger_rate_steps",
                     "promote_steps", "demote_steps", "max_promotion_tiers", "cooldown_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"monitor setting {name} must be >= 1, got {getattr(self, name)}")
        for name in ("warn_drop", "trigger_drop", "heavy_drop", "max_trigger_rate", "promote_risk", "promote_layer_risk",
                     "demote_risk", "alarm_risk"):
            if not 0.0 < float(getattr(self, name)) <= 1.0:
                raise ValueError(f"monitor setting {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 <= float(self.min_saving_kept) <= 1.0:
            raise ValueError(f"monitor setting min_saving_kept must be in [0, 1], got {self.min_saving_kept}")
        lo, hi = self.recompute_fraction if len(self.recompute_fraction) == 2 else (None, None)
        if lo is None or not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"recompute_fraction must be [base, max] with 0 < base <= max <= 1, got {self.recompute_fraction}")
        if self.demote_risk > self.promote_risk:
            raise ValueError("demote_risk must not exceed promote_risk (hysteresis)")

    @classmethod
    def from_dict(cls, data: dict, **overrides) -> "MonitorConfig":
        """From a profile's ``monitor`` block (keys this kvguard does not know are ignored, so older and newer
        profiles load) plus ``overrides`` (unknown names are an error)."""
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown monitor settings {sorted(unknown)}; valid: {sorted(names)}")
        merged = {k: v for k, v in data.items() if k in names}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**merged)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["recompute_fraction"] = list(self.recompute_fraction)
        out["layers"] = None if self.layers is None else list(self.layers)
        out["demotion"] = self.demotion.value
        return out


@dataclass(frozen=True)
class Objective:
    """The user's trade-off, ``Score = alpha * Memory + beta * Latency + gamma * PerplexityPenalty``, and hard
    constraints. Memory is KV bytes / FP16 bytes, Latency the decode-time ratio to FP16, PerplexityPenalty the
    perplexity increase in percent that a next-token KL predicts (:func:`penalty`)."""

    alpha: float = 1.0
    beta: float = 0.2
    gamma: float = 5.0
    max_ppl_increase: float | None = 1.0
    memory_budget: float | None = 0.40

    def __post_init__(self) -> None:
        # ``not x >= 0`` rather than ``x < 0``: NaN compares false with everything and would slip through.
        for name in ("alpha", "beta", "gamma"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.memory_budget is not None and not 0 < self.memory_budget <= 1.5:
            raise ValueError(f"memory_budget is a fraction of the FP16 KV bytes in (0, 1.5], got {self.memory_budget}")
        if self.max_ppl_increase is not None and not (math.isfinite(self.max_ppl_increase) and self.max_ppl_increase >= 0):
            raise ValueError(f"max_ppl_increase is a finite percentage >= 0, got {self.max_ppl_increase}")

    def score(self, memory: float, latency: float, kl: float) -> float:
        return self.alpha * memory + self.beta * latency + self.gamma * penalty(kl)

    def feasible(self, memory: float, ppl_increase_pct: float) -> bool:
        return ((self.memory_budget is None or memory <= self.memory_budget + 1e-9)
                and (self.max_ppl_increase is None or ppl_increase_pct <= self.max_ppl_increase))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Objective":
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def penalty(kl: float) -> float:
    """PerplexityPenalty in percent: the perplexity increase a next-token KL of ``kl`` nats implies."""
    return 100.0 * math.expm1(max(kl, 0.0))
