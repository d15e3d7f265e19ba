"""Re-ranking the closest low-bit candidates on longer calibration text.

Every candidate is scored on the held-out slice: 512 tokens per domain, a few seconds a plan. At the frontier's
mid budgets the closest plans differ by less than that short context can tell, most of all plans in different
formats (one-byte or float16 scales, an 8- or 16-bit window, with or without the softmax-bias correction): on both
models' calibration text (``benchmarks/heldout_ranking.py``, in the history: commit 8e580c2), the plan with the lowest held-out KL under 0.60 /
0.75 x B4 (B4: the default layout's all-INT4 bytes) was 13-22 % above the best candidate's KL on 2,048 tokens in
three of four cases, whichever documents the 512 tokens came from; among the three lowest held-out KLs within
0.02 x B4 under the budget, 1,024 tokens found that best or came within 0.4 % of it in three.

So at each of :data:`RANKED_TARGETS` those :data:`RANKED_CANDIDATES` closest candidates, and every candidate
below them with a lower held-out KL than one of them, are scored again on the ranking streams
(``ranking_tokens`` from calibration documents no sample or held-out slice read). The profile keeps those KLs
(:class:`~kvguard.profile.RankedBudget`), and ``kvguard@<bytes>``, where its held-out pick was ranked, runs the
lowest ranking KL among those ranked with it that fit the bytes where it beats the held-out pick's by more than
:data:`~kvguard.profile.RANKING_MARGIN` (:meth:`~kvguard.profile.ProfileMeta.frontier_pick`): one stream per domain
cannot tell closer plans apart (``benchmarks/ranking_noise.py``, in the history: commit e534271).
The held-out scores stay in the search log as measured; the chosen plan is still decided by them.
"""

from __future__ import annotations

from kvguard.calibration.heldout import HeldOut
from kvguard.plan import StaticScales
from kvguard.profile import Candidate, RankedBudget

# Shares of B4 re-ranked: the mid budgets, where the held-out slice picked worse than longer text. At 0.45 x B4
# the plans are mostly INT2 and their KLs several times apart; above 0.75 the candidates are fewer and closer to
# all-INT4. The closest: within RANKED_BAND x B4 under the budget (the plans allocated at it), the three lowest
# held-out KLs (the 2,048-token best was among them in all four cases measured).
RANKED_TARGETS = (0.75, 0.60)
RANKED_BAND = 0.02
RANKED_CANDIDATES = 3


def closest(log: list[Candidate], b4: float) -> list[tuple[float, list[Candidate]]]:
    """Per share of :data:`RANKED_TARGETS`, in held-out order: the :data:`RANKED_CANDIDATES` lowest held-out KLs
    within ``[share - RANKED_BAND, share] x b4``, and every candidate below that band with a held-out KL lower
    than the highest of them (so that the held-out pick at the budget is always among them). Shares with fewer
    than two are left out: nothing to rank."""
    out = []
    for share in RANKED_TARGETS:
        within = sorted((c for c in log if c.memory <= share * b4), key=lambda c: (c.quality.kl, c.memory, c.name))
        band = [c for c in within if c.memory >= (share - RANKED_BAND) * b4][:RANKED_CANDIDATES]
        if not band:
            continue
        group = [c for c in within if c in band or c.quality.kl < band[-1].quality.kl]
        if len(group) >= 2:
            out.append((share, group))
    return out


def rerank(executor, ranking: HeldOut, log: list[Candidate], b4: float, scales: StaticScales | None,
           progress=None) -> list[RankedBudget]:
    """Score the :func:`closest` candidates on ``ranking`` (each plan once, together on ``executor``).
    ``progress``: wraps the plans' iterator (a progress bar), or ``None``."""
    groups = closest(log, b4)
    plans = {c.name: c.plan for _, group in groups for c in group}
    scores = executor.score(ranking, list(plans.values()), scales)
    kl = dict(zip(plans, (s.kl for s in (progress(scores, total=len(plans)) if progress else scores))))
    return [RankedBudget(share, share * b4, {c.name: kl[c.name] for c in group}) for share, group in groups]
