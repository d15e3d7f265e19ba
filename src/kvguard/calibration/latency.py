"""The decode-time cost model behind the score's Latency term.

One decode step per tier (an all-FP16, all-INT8, ... cache) is timed at ``context`` tokens and the ratio to
FP16 kept, rounded to 0.05 so that timing noise does not change which plan a rerun picks. A plan's latency is
its layers' tier ratios weighted by each layer's share of the FP16 KV bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kvguard.architecture import Architecture
from kvguard.config import CacheConfig
from kvguard.plan import Plan
from kvguard.precision import Precision

TIERS = (Precision.FP16, Precision.INT8, Precision.INT4, Precision.INT2)


@dataclass(frozen=True)
class LatencyModel:
    """Decode-step time of an all-``precision`` cache over an FP16 cache, measured at ``context`` tokens and
    rounded to 0.05 (so that timing noise does not change which plan a rerun picks)."""

    ratios: dict[str, float]
    context: int
    step_ms: dict[str, float] = field(default_factory=dict)

    def plan_latency(self, plan: Plan, weights: torch.Tensor) -> float:
        """``weights`` ``[layers]``: each layer's share of the FP16 KV bytes."""
        total = 0.0
        for w, lp in zip(weights.tolist(), plan.layers):
            total += w * sum(self.ratios[p.value] for p in lp.precision) / len(lp.precision)
        return total

    def to_dict(self) -> dict:
        return {"ratios": self.ratios, "context": self.context, "step_ms": self.step_ms}

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyModel":
        return cls(dict(data["ratios"]), int(data["context"]), dict(data.get("step_ms", {})))


@torch.no_grad()
def measure_latency(model, cache_config: CacheConfig, *, context: int = 1024, steps: int = 16,
                    progress: bool = True) -> LatencyModel:
    """Time ``steps`` single-token decode steps after a ``context``-token prefill, for each tier."""
    arch = Architecture.from_config(model.config)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=g).to(model.device)
    step_ms = {}
    for tier in tqdm(TIERS, desc="latency", unit="tier", disable=not progress):
        cache = Plan.uniform(arch, tier, cache_config).make_cache(model.config)
        out = model(input_ids=prompt, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            token = out.logits[:, -1:].argmax(-1)
        step_ms[tier.value] = 1000 * sorted(times)[len(times) // 2]
    ratios = {t: round(20 * ms / step_ms["fp16"]) / 20 for t, ms in step_ms.items()}
    return LatencyModel(ratios, context, step_ms)
