"""The layers an engine keeps unquantized (``--kv-cache-dtype-skip-layers``): its dtypes, their bytes, the choice.

An engine's KV dtype is one format for every layer; its only per-layer control is the skip list, which keeps
whole layers in the model's 16-bit dtype. This module is the engine's side of that: the dtypes kvguard plans
for (:class:`EngineDtype`), the KV memory a skip list costs (:func:`memory_ratio`), a cache that stores K/V as
the engine does (:func:`engine_cache`, through :mod:`kvguard.fp8` and :mod:`kvguard.per_token_head`), and the
record of a choice (:class:`SkipChoice`) with the engine arguments it gives. Which skip list to choose is
measured on held-out calibration text, which is calibration's to do (:mod:`kvguard.calibration.engine_skip`);
the export only carries the choice (:func:`kvguard.export.export.export`'s ``skip_choice``).

Memory is counted as the engine allocates it at the profile's context: per token, layer and KV head, 2 bytes per
element in a skipped layer, 1 per element plus nothing (FP8, static scales), plus a float32 scale
(``int8_per_token_head``), or half a byte plus a float32 scale (``int4_per_token_head``); a sliding layer holds
its window, a global one the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvguard.architecture import Architecture
from kvguard.fp8 import FP8Scales, parse_choice
from kvguard.per_token_head import TokenHeadCache, TokenHeadFormat


class EngineDtype(str, Enum):
    """vLLM's ``--kv-cache-dtype`` values kvguard can plan for."""

    FP8 = "fp8"
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"

    @classmethod
    def parse(cls, value: "EngineDtype | str") -> "EngineDtype":
        return parse_choice(cls, value, "engine KV dtype")

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one token's K (or V) vector of one KV head takes in the engine's cache."""
        if self is EngineDtype.FP8:
            return head_dim
        return TokenHeadFormat(self.value).bytes_per_vector(head_dim)


def memory_ratio(arch: Architecture, dtype: EngineDtype, skip: tuple[int, ...], context: int) -> float:
    """KV bytes of the engine's cache over an FP16 cache's, at ``context`` tokens."""
    stored = full = 0.0
    for i in range(arch.num_layers):
        tokens = min(context, arch.sliding_window - 1) if arch.is_sliding(i) else context
        fp16 = 2 * arch.head_dim
        stored += tokens * (fp16 if i in skip else dtype.bytes_per_vector(arch.head_dim))
        full += tokens * fp16
    return stored / full


def engine_cache(config, dtype: EngineDtype, skip: tuple[int, ...], scales: FP8Scales | None = None):
    """A cache that stores K/V as the engine does with ``skip`` unquantized (FP8: with ``scales``)."""
    if dtype is EngineDtype.FP8:
        if scales is None:
            raise ValueError("the fp8 engine dtype needs the exported FP8 scales")
        return FP8Scales(scales.key, scales.value, scales.granularity, skip, scales.rounding).make_cache(config)
    return TokenHeadCache(config, TokenHeadFormat(dtype.value), skip)


@dataclass(frozen=True)
class SkipCandidate:
    """One skip list, scored on held-out text: memory over FP16, KL, worst-domain perplexity increase (%)."""

    skip: tuple[int, ...]
    memory: float
    kl: float
    ppl_increase_pct: float
    top1_agree: float


@dataclass(frozen=True)
class SkipChoice:
    """The candidates of one engine dtype and the chosen one (``None``: nothing fits the budget)."""

    dtype: EngineDtype
    budget: float
    candidates: tuple[SkipCandidate, ...]
    chosen: SkipCandidate | None

    def engine_args(self) -> list[str]:
        """vLLM's arguments for the chosen plan (the skip list space-separated: vLLM's flag takes a list)."""
        if self.chosen is None:
            raise ValueError(f"no skip list of {self.dtype.value} fits the memory budget {self.budget}")
        args = ["--kv-cache-dtype", self.dtype.value]
        if self.chosen.skip:
            args += ["--kv-cache-dtype-skip-layers", *map(str, self.chosen.skip)]
        return args

    def to_dict(self) -> dict:
        return {"dtype": self.dtype.value, "budget": self.budget, "engine_args": self.engine_args() if self.chosen else None,
                "chosen": None if self.chosen is None else list(self.chosen.skip),
                "candidates": [{"skip": list(c.skip), "memory": c.memory, "kl": c.kl,
                                "ppl_increase_pct": c.ppl_increase_pct, "top1_agree": c.top1_agree}
                               for c in self.candidates]}

    def table(self) -> str:
        lines = [f"| {self.dtype.value}: skipped layers | KV memory / FP16 | held-out KL | worst ppl +% | top-1 | chosen |",
                 "|---|---|---|---|---|---|"]
        for c in self.candidates:
            skip = ",".join(map(str, c.skip)) or "none"
            lines.append(f"| {skip} | {c.memory:.3f} | {c.kl:.5f} | {c.ppl_increase_pct:+.2f} | {c.top1_agree:.3f} | "
                         f"{'yes' if c is self.chosen else ''} |")
        return "\n".join(lines)
