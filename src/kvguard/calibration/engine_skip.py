"""Which skip list an engine should use under a memory budget, measured on held-out calibration text.

Per engine dtype (:class:`~kvguard.export.skip_list.EngineDtype`), the candidates are the first ``k`` layers of
the profile's sensitivity ranking (calibration's *alone* measurement, most sensitive first), for every ``k`` whose
KV memory (:func:`~kvguard.export.skip_list.memory_ratio`) fits the budget; each is scored on the profile's
held-out calibration text (never evaluation text) through a cache that stores K/V exactly as the engine does
(:func:`~kvguard.export.skip_list.engine_cache`). The chosen skip list has the lowest held-out KL among those that
fit; ``kvguard export --memory-budget`` writes it into the export (:mod:`kvguard.export`).

The measuring is calibration's (held-out text, sensitivity), the vocabulary the export's: this module imports
:mod:`kvguard.export.skip_list`, and nothing in the export imports calibration.
"""

from __future__ import annotations

import math

from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.export.skip_list import EngineDtype, SkipCandidate, SkipChoice, engine_cache, memory_ratio
from kvguard.fp8 import FP8Scales, fp8_scales
from kvguard.scoring import score_stream

ONE_PASS = 256  # the engine caches are chunk-invariant: long chunks score chunk-1 decoding exactly


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
