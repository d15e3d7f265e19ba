"""The decode-time cost model behind the score's Latency term: bytes read per decode step, counted, not timed.

A decode step of a small model on a CPU or GPU is bound by memory traffic: it reads every weight once and the
whole KV cache once. So the cost of an all-``tier`` cache is ``(weight bytes + KV bytes of the tier at
context tokens) / (weight bytes + FP16 KV bytes)``. It is counted from shapes alone, so the same settings give
the same ratios, and the same plan, on an idle or a loaded machine (a wall-clock measurement moved the INT4 /
FP16 ratio between 0.75 and 3.25 under load and flipped the chosen plan). What it leaves out, the
dequantization arithmetic, costs time on a CPU that no byte count sees: ``kvguard eval --task speed`` measures
the real decode speed of a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvguard.architecture import Architecture
from kvguard.config import CacheConfig
from kvguard.plan import Plan
from kvguard.precision import Precision

TIERS = (Precision.FP16, Precision.INT8, Precision.INT4, Precision.INT3, Precision.INT2)  # most precise first
FP16_BYTES = 2  # weights as an engine serves them


@dataclass(frozen=True)
class LatencyModel:
    """Bytes read per decode step with an all-``precision`` cache over those with an FP16 cache, at
    ``context`` tokens.

    Attributes:
        ratios: per tier, the ratio above.
        context: the context length the KV bytes are counted at.
        step_bytes: per tier, the bytes one decode step reads (weights + KV cache); empty in profiles written
            before the latency model was counted (those timed one step, ``step_ms``, which is kept as written).
    """

    ratios: dict[str, float]
    context: int
    step_bytes: dict[str, int] = field(default_factory=dict)
    step_ms: dict[str, float] = field(default_factory=dict)

    def plan_latency(self, plan: Plan, weights: torch.Tensor) -> float:
        """``weights`` ``[layers]``: each layer's share of the FP16 KV bytes."""
        total = 0.0
        for w, lp in zip(weights.tolist(), plan.layers):
            total += w * sum(self.ratios[p.value] for p in lp.precision) / len(lp.precision)
        return total

    def to_dict(self) -> dict:
        out = {"ratios": self.ratios, "context": self.context, "step_bytes": self.step_bytes, "method": "bytes read"}
        if self.step_ms:
            out["step_ms"] = self.step_ms
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyModel":
        return cls(dict(data["ratios"]), int(data["context"]), {k: int(v) for k, v in data.get("step_bytes", {}).items()},
                   dict(data.get("step_ms", {})))


def count_latency(model, cache_config: CacheConfig, *, context: int = 1024) -> LatencyModel:
    """The bytes one decode step reads after ``context`` tokens, per tier, and their ratios to FP16."""
    arch = Architecture.from_config(model.config)
    weight_bytes = FP16_BYTES * sum(p.numel() for p in model.parameters())  # tied weights counted once
    step_bytes = {}
    for tier in TIERS:
        kv, _ = Plan.uniform(arch, tier, cache_config).kv_bytes(model.config, context)
        step_bytes[tier.value] = weight_bytes + kv
    ratios = {t: b / step_bytes["fp16"] for t, b in step_bytes.items()}
    return LatencyModel(ratios, context, step_bytes)
