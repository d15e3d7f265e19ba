"""Configuration of the quantized KV cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_FP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "model": None}


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
        fp_dtype: storage dtype of full-precision parts (window, sinks, ``fp16`` tiers, recomputed overlay):
            ``float16`` (what a serving engine stores), ``bfloat16``, ``float32``, or ``model`` (the dtype
            the model computes in; bit-exact with ``DynamicCache``).
        key_clip / value_clip: default clipping ratios (calibration sets per-layer ones).
    """

    residual: int = 64
    sinks: int = 4
    group_size: int = 32
    fp_dtype: str = "float16"
    key_clip: float = 1.0
    value_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.residual < 0 or self.sinks < 0:
            raise ValueError(f"residual and sinks must be >= 0, got residual={self.residual}, sinks={self.sinks}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.fp_dtype not in _FP_DTYPES:
            raise ValueError(f"fp_dtype has to be one of {list(_FP_DTYPES)} but got {self.fp_dtype!r}")
        for name in ("key_clip", "value_clip"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype full-precision parts are stored in, for a model computing in ``model_dtype``."""
        return _FP_DTYPES[self.fp_dtype] or model_dtype

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CacheConfig":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown CacheConfig fields {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)
