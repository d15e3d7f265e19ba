"""Scoring candidate plans on held-out calibration text (never the evaluation split).

Every candidate of the sensitivity analysis and the search is scored the same way: the exact parallel
simulation of token-by-token decoding (:mod:`kvguard.simulate`) on one stream per calibration domain,
against the FP16 cache's predictions on the same tokens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvguard.architecture import Architecture
from kvguard.calibration import prefix
from kvguard.calibration.logit_buffer import LogitBuffer
from kvguard.metrics import TokenMetrics, quantile
from kvguard.plan import Plan, StaticScales
from kvguard.profile import PlanScore
from kvguard.scoring import score_simulated
from kvguard.simulate import first_quantized_query, simulate_logits


_SLICE = 256  # positions turned into metrics at a time (bounds memory for 262k-token vocabularies)
TAIL = 0.99  # the quantile of the per-token KL a score records next to the mean (PlanScore.kl_p99)


@dataclass(frozen=True)
class Reference:
    """The FP16 cache's predictions on the held-out streams, per domain.

    Attributes:
        logprobs: ``[T - 1, vocab]`` next-token log-probabilities (float32: ``T * vocab * 4`` bytes).
        nll: mean next-token NLL.
        token_nll: ``[T - 1]`` NLL of each actual next token.
        top1: ``[T - 1]`` arg-max of each prediction (kept: every scored pass compares with it).
    """

    logprobs: dict[str, torch.Tensor]
    nll: dict[str, float]
    token_nll: dict[str, torch.Tensor]
    top1: dict[str, torch.Tensor]

    @classmethod
    def measure(cls, model, streams: dict[str, torch.Tensor]) -> "Reference":
        fp16 = Plan.uniform(Architecture.from_config(model.config), "fp16")
        logprobs, nll, token_nll, top1 = {}, {}, {}, {}
        for domain, ids in streams.items():
            score = score_simulated(model, ids, fp16, keep_logits=True)
            logprobs[domain] = torch.log_softmax(score.logits, dim=-1)
            nll[domain] = score.nll
            targets = ids[1:].to(score.logits.device)
            token_nll[domain] = -logprobs[domain].gather(-1, targets[:, None])[:, 0]
            top1[domain] = logprobs[domain].argmax(-1)
        return cls(logprobs, nll, token_nll, top1)


class HeldOut:
    """Held-out streams with their FP16 reference, ready to score plans.

    ``reference``: the :class:`Reference` of the same model on the same streams, measured elsewhere (another
    process reuses the driver's instead of running the FP16 pass again); measured here when omitted."""

    def __init__(self, model, streams: dict[str, torch.Tensor], reference: Reference | None = None) -> None:
        if not streams:
            raise ValueError("no held-out streams")
        self.model = model
        self.arch = Architecture.from_config(model.config)
        self.streams = streams
        self.reference = Reference.measure(model, streams) if reference is None else reference
        if set(self.reference.logprobs) != set(streams):
            raise ValueError(f"the reference covers {sorted(self.reference.logprobs)}, the streams {sorted(streams)}")
        self.references = self.reference.logprobs
        self.reference_nll = self.reference.nll
        self.reference_token_nll = self.reference.token_nll
        # Per anchor plan (see :meth:`score`), per domain: each decoder layer's input in a pass under it.
        self._recorded: dict[Plan, dict[str, list[torch.Tensor]]] = {}
        self._logits = LogitBuffer()  # one buffer for every pass's logits (see kvguard.calibration.logit_buffer)

    @property
    def tokens(self) -> int:
        return sum(int(ids.numel()) for ids in self.streams.values())

    def _record(self, anchor: Plan) -> dict[str, list[torch.Tensor]]:
        if anchor not in self._recorded:
            passes = {}
            for domain, ids in self.streams.items():
                with prefix.recording(self.model) as seen:
                    simulate_logits(self.model, ids[:-1], anchor, keep_from=ids.numel() - 2)
                passes[domain] = seen
            self._recorded[anchor] = passes
        return self._recorded[anchor]

    def _resume_point(self, plan: Plan, scales: StaticScales | None,
                      anchors: Sequence[Plan]) -> tuple[int, dict[str, list[torch.Tensor]] | None]:
        """The layer to start ``plan``'s passes at and the recorded inputs to start from (``0, None``: a full pass)."""
        shared = [(prefix.shared_layers(plan, a, scales), a) for a in anchors]
        layer, anchor = max(shared, key=lambda s: s[0], default=(0, None))
        layer = min(layer, self.arch.num_layers - 1)  # a plan equal to the anchor still runs its last layer
        return (layer, self._record(anchor)) if layer > 0 else (0, None)

    def score(self, plan: Plan, scales: StaticScales | None = None, anchors: Sequence[Plan] = ()) -> PlanScore:
        """Simulate ``plan`` on every stream and compare with the FP16 reference.

        Predictions before :func:`~kvguard.simulate.first_quantized_query` equal the reference exactly (no
        quantized key is visible yet), so only the later ones go through the output head: the same numbers
        as scoring every position, for less work (the head dominates for 262k-token vocabularies).
        ``anchors``: plans (without static scales) that ``plan`` may share leading layers with; a pass under
        each is recorded once, here, and ``plan``'s passes skip the layers it shares with the closest one
        (:mod:`kvguard.calibration.prefix`): the same numbers, for less work."""
        kl = agree = weight = 0.0
        increase = {}
        token_kl = []  # per stream: [n] KL of every prediction, 0 before the first quantized key is visible
        layer, recorded = self._resume_point(plan, scales, anchors)
        # The head writes every pass's logits into one kept buffer: each pass's become metrics before the next.
        with self._logits.installed(self.model):
            for domain, ids in self.streams.items():
                n = ids.numel() - 1
                start = min(first_quantized_query(plan), n - 1)
                ref, ref_top1 = self.references[domain][start:], self.reference.top1[domain][start:]
                metrics = TokenMetrics()
                resumed = prefix.resumed(self.model, layer, recorded[domain][layer]) if recorded else None
                with resumed or contextlib.nullcontext():
                    logits = simulate_logits(self.model, ids[:-1], plan, scales, keep_from=start)  # [n - start, vocab]
                for i in range(0, logits.shape[0], _SLICE):
                    metrics.add(logits[i:i + _SLICE], ids[start + 1 + i:start + 1 + i + _SLICE].to(logits.device),
                                ref[i:i + _SLICE], ref_top1[i:i + _SLICE])
                tail = n - start
                kl += metrics.kl * tail  # the first `start` predictions contribute KL 0 and agree
                token_kl += [torch.zeros(start), metrics.token_kl]
                agree += metrics.top1_agree * tail + start
                weight += n
                nll = (float(self.reference_token_nll[domain][:start].sum()) + metrics.nll * tail) / n
                increase[domain] = 100.0 * (math.exp(nll - self.reference_nll[domain]) - 1.0)
        return PlanScore(kl / weight, increase, agree / weight, quantile(torch.cat(token_kl), TAIL))
