"""The run-time monitor's evidence, measured exactly and in one pass by the decoding simulation.

Per query token and attention layer, the monitor (:mod:`kvguard.monitor`) sees:

- ``entropy``: the attention entropy of the query against the cache as the model sees it (nats, mean over
  query heads), and ``n_keys``, how many keys it attended to;
- ``werr_k`` / ``werr_v``: the attention-weighted relative quantization error of what it read,
  ``sum_j p_j * ||x_q,j - x_j|| / ||x_j||`` (mean over query heads), 0 where every key read is full precision.

:func:`record` collects these for a token stream under a plan with the simulation's observer hook, next to
the per-token ``KL(fp16 || plan)`` of the next-token distribution. Calibration trains the risk classifier on
them (held-out calibration text); ``benchmarks/monitor_signal.py`` measures on the evaluation split how well
each signal predicts real error (:func:`roc_auc`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvguard.entropy import EntropyBaseline, SequenceReference, baseline_ratio
from kvguard.models import Architecture
from kvguard.plan import Plan, StaticScales
from kvguard.simulate import OBSERVER, simulate_logits

FEATURES = ("drop", "abs_drop", "werr_k", "werr_v")


def relative_error(x: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """``||x_q - x|| / ||x||`` over the last dimension: ``[..., D]`` -> ``[...]`` (float32)."""
    x, x_q = x.float(), x_q.float()
    return (x_q - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)


@dataclass(frozen=True)
class TokenSignals:
    """Evidence per query token (rows) and layer (columns), and the per-token KL it should predict.

    Attributes:
        entropy, werr_k, werr_v: ``[T, layers]`` float32.
        n_keys: ``[T, layers]`` keys each query attended to.
        kl: ``[T]`` next-token ``KL(fp16 || plan)`` of each query.
    """

    entropy: torch.Tensor
    n_keys: torch.Tensor
    werr_k: torch.Tensor
    werr_v: torch.Tensor
    kl: torch.Tensor

    def ratio(self, baseline: EntropyBaseline) -> torch.Tensor:
        """Entropy over the calibrated length-aware baseline, ``[T, layers]``."""
        return baseline_ratio(self.entropy, baseline.expected_mean(self.n_keys))

    def drop(self, baseline: EntropyBaseline, baseline_tokens: int = 256, *, adaptive: bool = True) -> torch.Tensor:
        """Each query's entropy drop as the monitor computes it: against this sequence's own level
        (:class:`~kvguard.entropy.SequenceReference`), or with ``adaptive=False`` against the calibrated
        baseline alone (``1 - ratio``)."""
        ratio = self.ratio(baseline)
        return SequenceReference.drops(ratio, baseline_tokens) if adaptive else 1.0 - ratio

    def features(self, baseline: EntropyBaseline, baseline_tokens: int = 256) -> torch.Tensor:
        """``[T, layers, len(FEATURES)]``: the classifier's inputs per token and layer."""
        d = self.drop(baseline, baseline_tokens)
        return torch.stack([d, d.abs(), self.werr_k, self.werr_v], dim=-1)

    def since(self, start: int) -> "TokenSignals":
        return TokenSignals(*(t[start:] for t in (self.entropy, self.n_keys, self.werr_k, self.werr_v, self.kl)))


class _Observer:
    def __init__(self, num_layers: int) -> None:
        self.rows: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_layers = num_layers

    def __call__(self, layer, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask) -> None:
        b, hq, t, _ = probs.shape
        rep = hq // k_fp.shape[1]
        entropy = torch.special.entr(probs).sum(-1).mean(1)[0]  # [T]
        if attention_mask is None:
            n_keys = torch.arange(1, t + 1)
        else:
            n_keys = (attention_mask[0, 0, :, :t] > torch.finfo(attention_mask.dtype).min / 2).sum(-1).cpu()
        read_q = probs.masked_fill(~quantized, 0.0)  # attention on keys read in their quantized form
        werr = []
        for x, x_q in ((k_fp, k_q), (v_fp, v_q)):
            err = relative_error(x, x_q).repeat_interleave(rep, dim=1)  # [B, Hq, T_k]
            werr.append((read_q * err.unsqueeze(2)).sum(-1).mean(1)[0])  # [T_q]
        self.rows[layer] = (entropy.cpu(), n_keys, werr[0].cpu(), werr[1].cpu())

    def stacked(self) -> tuple[torch.Tensor, ...]:
        missing = [i for i in range(self.num_layers) if i not in self.rows]
        if missing:
            raise RuntimeError(f"the simulation did not reach layers {missing}")
        return tuple(torch.stack([self.rows[i][k] for i in range(self.num_layers)], dim=-1) for k in range(4))


@torch.no_grad()
def record(model, ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
           reference_logprobs: torch.Tensor | None = None) -> TokenSignals:
    """The monitor's evidence and the per-token KL for ``ids`` (``[T]``) decoded under ``plan``.
    ``reference_logprobs``: the FP16 cache's ``[T - 1, vocab]`` log-probabilities (computed when omitted).
    Rows are the ``T - 1`` query tokens that predict a next token."""
    arch = Architecture.from_config(model.config)
    ids = ids.reshape(-1)
    if reference_logprobs is None:
        reference_logprobs = torch.log_softmax(simulate_logits(model, ids[:-1], Plan.uniform(arch, "fp16")), -1)
    observer = _Observer(arch.num_layers)
    token = OBSERVER.set(observer)
    try:
        logits = simulate_logits(model, ids[:-1], plan, scales)
    finally:
        OBSERVER.reset(token)
    kl = torch.empty(logits.shape[0])
    for i in range(0, logits.shape[0], 256):  # slices bound memory for 262k-token vocabularies
        ref = reference_logprobs[i:i + 256].float()
        kl[i:i + 256] = (ref.exp() * (ref - torch.log_softmax(logits[i:i + 256], -1))).sum(-1).cpu()
    entropy, n_keys, werr_k, werr_v = observer.stacked()
    return TokenSignals(entropy, n_keys, werr_k, werr_v, kl)


def window_means(x: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """Means of ``x`` (``[T, ...]``) over the ``window`` rows ending at every ``stride``-th row (the monitor's
    refresh points: rows ``stride - 1, 2 * stride - 1, ...``; early windows hold the rows seen so far)."""
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got {window}, {stride}")
    ends = torch.arange(stride, x.shape[0] + 1, stride)
    csum = torch.cat([torch.zeros_like(x[:1]), x.cumsum(0)])
    starts = (ends - window).clamp_min(0)
    count = (ends - starts).view(-1, *([1] * (x.dim() - 1))).to(x.dtype)
    return (csum[ends] - csum[starts]) / count


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count half); NaN without both
    classes."""
    scores, labels = scores.reshape(-1).double(), labels.reshape(-1).bool()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def alarms(drop: torch.Tensor, config, start: int) -> dict[str, torch.Tensor]:
    """What the monitor's alarms would do on per-token drops ``[T, layers]`` at its refresh points from
    sequence length ``start`` on: ``warning`` / ``trigger`` / ``severe`` ``[steps, layers]`` booleans and
    ``ends``, the sequence length at each step."""
    run = torch.zeros(drop.shape[1], dtype=torch.long)
    runs = []
    for d in drop:
        run = torch.where(d >= config.trigger_drop, run + 1, torch.zeros_like(run))
        runs.append(run)
    runs = torch.stack(runs) if runs else torch.zeros(0, drop.shape[1], dtype=torch.long)
    window = window_means(drop, config.window_tokens, config.refresh_tokens)
    ends = torch.arange(config.refresh_tokens, drop.shape[0] + 1, config.refresh_tokens)
    keep = ends >= start
    window, ends = window[keep], ends[keep]
    consecutive = runs[ends - 1] if ends.numel() else runs[:0]
    return {"warning": window >= config.warn_drop, "trigger": consecutive >= config.trigger_consecutive,
            "severe": window >= config.heavy_drop, "window_drop": window, "ends": ends}


def fit_monitor(model, streams: dict[str, torch.Tensor], references: dict[str, torch.Tensor], plan: Plan,
                scales: StaticScales | None, baseline: EntropyBaseline, config, *, progress: bool = True) -> dict:
    """Calibrate the run-time monitor on held-out calibration streams (with their FP16 reference
    log-probabilities):

    - **monitored layers**: the layers whose entropy alarms stay quiet (at most 1 % of monitoring steps)
      under an FP16 cache, i.e. where a drop of SPEC's size is abnormal for this model;
    - **risk classifier**: logistic regression from one layer's window features to "the window's next-token
      KL exceeds ``kl_threshold``", on windows decoded under the plan, all-INT4 and all-INT2 (same layout);
    - the held-out ROC AUC of each signal, for the record.
    """
    from tqdm.auto import tqdm

    from kvguard.risk import RiskClassifier
    from kvguard.simulate import first_quantized_query

    arch = Architecture.from_config(model.config)
    start = first_quantized_query(plan)
    plans = {"fp16": Plan.uniform(arch, "fp16", plan.cache), "plan": plan,
             "int4": Plan.uniform(arch, "int4", plan.cache), "int2": Plan.uniform(arch, "int2", plan.cache)}
    recorded: dict[str, list[TokenSignals]] = {name: [] for name in plans}
    with tqdm(total=len(plans) * len(streams), desc="monitor", unit="pass", disable=not progress) as bar:
        for domain, ids in streams.items():
            for name, p in plans.items():
                recorded[name].append(record(model, ids, p, scales, reference_logprobs=references[domain]))
                bar.update()
    steps = quiet = None
    for sig in recorded["fp16"]:
        a = alarms(sig.drop(baseline, config.baseline_tokens), config, start)
        fired = (a["warning"] | a["trigger"]).sum(0)
        steps = a["ends"].numel() + (steps or 0)
        quiet = fired if quiet is None else quiet + fired
    fp16_rate = (quiet.double() / max(steps, 1)).tolist()
    monitored = [l for l, r in enumerate(fp16_rate) if r <= 0.01]
    kl_threshold = 0.01
    xs, ys, per_plan = [], [], {}
    for name in ("plan", "int4", "int2"):
        for sig in recorded[name]:
            feats = window_means(sig.features(baseline, config.baseline_tokens), config.window_tokens, config.refresh_tokens)
            kl = window_means(sig.kl, config.window_tokens, config.refresh_tokens)
            ends = torch.arange(config.refresh_tokens, sig.kl.shape[0] + 1, config.refresh_tokens)
            keep = ends >= start
            feats, label = feats[keep], kl[keep] > kl_threshold
            xs.append(feats.reshape(-1, len(FEATURES)))
            ys.append(label[:, None].expand(-1, arch.num_layers).reshape(-1))
            per_plan.setdefault(name, []).append((feats, label))
    classifier = RiskClassifier.fit(torch.cat(xs), torch.cat(ys), FEATURES, kl_threshold)
    auc = {}
    feats = torch.cat([f for v in per_plan.values() for f, _ in v])  # [W, L, F]
    label = torch.cat([lab for v in per_plan.values() for _, lab in v])
    cols = monitored or list(range(arch.num_layers))
    auc["entropy_drop_mean"] = roc_auc(feats[:, cols, 0].mean(1), label)
    auc["entropy_drop_max"] = roc_auc(feats[:, cols, 0].amax(1), label)
    auc["entropy_deviation_mean"] = roc_auc(feats[:, cols, 1].mean(1), label)
    auc["werr_k_mean"] = roc_auc(feats[:, :, 2].mean(1), label)
    auc["werr_v_mean"] = roc_auc(feats[:, :, 3].mean(1), label)
    auc["risk_max"] = roc_auc(classifier.predict(feats).amax(1), label)
    return {"layers": monitored, "fp16_alarm_rate": [round(r, 4) for r in fp16_rate], "start": start,
            "windows": int(label.numel()), "positive_windows": int(label.sum()), "heldout_auc": auc,
            "risk_classifier": classifier.to_dict()}
