"""Which layers an engine should keep unquantized (``--kv-cache-dtype-skip-layers``) under a memory budget.

An engine's KV dtype is one format for every layer; its only per-layer control is the skip list, which keeps
whole layers in the model's 16-bit dtype. Per engine dtype, the candidates are the first ``k`` layers of the
profile's sensitivity ranking (calibration's *alone* measurement, most sensitive first), for every ``k`` whose
KV memory fits the budget; each is scored on the profile's held-out calibration text (never evaluation text)
through a cache that stores K/V exactly as the engine does (:mod:`kvguard.fp8`, :mod:`kvguard.per_token_head`).
The chosen skip list has the lowest held-out KL among those that fit.

Memory is counted as the engine allocates it at the profile's context: per token, layer and KV head, 2 bytes per
element in a skipped layer, 1 per element plus nothing (FP8, static scales), plus a float32 scale
(``int8_per_token_head``), or half a byte plus a float32 scale (``int4_per_token_head``); a sliding layer holds
its window, a global one the whole context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvguard.architecture import Architecture
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.fp8 import FP8Scales, fp8_scales, parse_choice
from kvguard.per_token_head import TokenHeadCache, TokenHeadFormat
from kvguard.scoring import score_stream

ONE_PASS = 256  # the engine caches are chunk-invariant: long chunks score chunk-1 decoding exactly


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


def engine_cache(config, dtype: EngineDtype, skip: tuple[int, ...], scales: FP8Scales | None = None):
    """A cache that stores K/V as the engine does with ``skip`` unquantized (FP8: with ``scales``)."""
    if dtype is EngineDtype.FP8:
        if scales is None:
            raise ValueError("the fp8 engine dtype needs the exported FP8 scales")
        return FP8Scales(scales.key, scales.value, scales.granularity, skip, scales.rounding).make_cache(config)
    return TokenHeadCache(config, TokenHeadFormat(dtype.value), skip)


def score(heldout: HeldOut, dtype: EngineDtype, skip: tuple[int, ...], scales: FP8Scales | None, context: int) -> SkipCandidate:
    """``skip`` under ``dtype`` on every held-out stream, against the FP16 reference."""
    kl = agree = weight = 0.0
    worst = -math.inf
    for domain, ids in heldout.streams.items():
        cache = engine_cache(heldout.model.config, dtype, skip, scales)
        s = score_stream(heldout.model, ids, cache, chunk=ONE_PASS, reference=heldout.references[domain])
        n = ids.numel() - 1
        kl, agree, weight = kl + s.kl * n, agree + s.top1_agree * n, weight + n
        worst = max(worst, 100.0 * (math.exp(s.nll - heldout.reference_nll[domain]) - 1.0))
    return SkipCandidate(skip, memory_ratio(heldout.arch, dtype, skip, context), kl / weight, worst, agree / weight)


def choose(heldout: HeldOut, sensitivity: Sensitivity, dtype: EngineDtype | str, budget: float, *, context: int,
           scales: FP8Scales | None = None, max_skip: int | None = None) -> SkipChoice:
    """Score the sensitivity ranking's prefixes that fit ``budget`` (at most ``max_skip`` layers) and choose the
    one with the lowest held-out KL."""
    dtype = EngineDtype.parse(dtype)
    if not 0 < budget <= 1:
        raise ValueError(f"the memory budget is a fraction of FP16 in (0, 1], got {budget}")
    ranking = sensitivity.layer_ranking()
    limit = len(ranking) if max_skip is None else max_skip
    candidates = []
    for k in range(limit + 1):
        skip = tuple(sorted(ranking[:k]))
        if memory_ratio(heldout.arch, dtype, skip, context) > budget:
            break  # each further layer only adds bytes
        candidates.append(score(heldout, dtype, skip, scales, context))
    chosen = min(candidates, key=lambda c: c.kl) if candidates else None
    return SkipChoice(dtype, budget, tuple(candidates), chosen)


def heldout_of(profile, model, tokenizer) -> HeldOut:
    """The held-out calibration streams ``profile`` was scored on, rebuilt from its data manifest (the ``calib``
    split's first documents of each domain; never evaluation text), with their FP16 reference."""
    from kvguard.calibration.samples import calibration_text

    domains = tuple(profile.meta.data.domains)
    heldout_tokens = sum(d.heldout_tokens for d in profile.meta.data.domains.values())
    text = calibration_text(tokenizer, domains, len(domains), profile.meta.data.max_tokens, heldout_tokens)
    return HeldOut(model, text.streams)


def choose_for_profile(profile, model, tokenizer, dtype: EngineDtype | str, budget: float, *,
                       max_skip: int | None = None) -> SkipChoice:
    """:func:`choose` with the profile's sensitivity, held-out text, context and (FP8) exported scales."""
    dtype = EngineDtype.parse(dtype)
    record = profile.meta.record.get("sensitivity")
    if record is None:
        raise ValueError(f"profile {profile.path} has no sensitivity analysis; recalibrate it with `kvguard calibrate`")
    sensitivity = Sensitivity.from_parts(record, profile.tensors)
    profile.check_model(model)
    scales = fp8_scales(profile) if dtype is EngineDtype.FP8 else None
    return choose(heldout_of(profile, model, tokenizer), sensitivity, dtype, budget,
                  context=profile.meta.settings.context, scales=scales, max_skip=max_skip)
