"""Calibrating the run-time monitor on held-out calibration text (stage ``monitor`` of ``kvguard calibrate``).

- **monitored layers**: the layers whose entropy alarms stay quiet (at most 1 % of monitoring steps) under an
  FP16 cache, i.e. where a drop of the configured size is abnormal for this model. The alarms are replayed
  offline with the policy's own rules (:func:`kvguard.control.policy.raw_alarms`) at the monitor's refresh
  points, so what calibration counts is what the online loop would see.
- **risk classifier**: logistic regression from one layer's window features to "the window's next-token KL
  exceeds ``kl_threshold``", on windows decoded under the plan, all-INT4 and all-INT2 (same layout).
- the held-out ROC AUC of each signal, for the record.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from kvguard.architecture import Architecture
from kvguard.calibration.signals import FEATURES, TokenSignals, record, window_means
from kvguard.config import MonitorConfig
from kvguard.control.policy import raw_alarms
from kvguard.entropy import EntropyBaseline
from kvguard.metrics import roc_auc
from kvguard.plan import Plan, StaticScales
from kvguard.risk import RiskClassifier
from kvguard.simulate import first_quantized_query

KL_THRESHOLD = 0.01  # window KL that counts as "at risk": about a 1 % local perplexity cost
QUIET_ALARM_RATE = 0.01  # a layer is monitored when FP16 text raises its alarms at most this often


def consecutive_runs(drop: torch.Tensor, trigger_drop: float) -> torch.Tensor:
    """``[T, layers]``: tokens in a row up to each token at least ``trigger_drop`` below baseline (what the
    monitor counts online)."""
    run = torch.zeros(drop.shape[1], dtype=torch.long)
    runs = []
    for d in drop:
        run = torch.where(d >= trigger_drop, run + 1, torch.zeros_like(run))
        runs.append(run)
    return torch.stack(runs) if runs else torch.zeros(0, drop.shape[1], dtype=torch.long)


def replay_alarms(drop: torch.Tensor, config: MonitorConfig, start: int) -> dict[str, torch.Tensor]:
    """The policy's alarm rules on per-token drops ``[T, layers]`` at the monitor's refresh points from sequence
    length ``start`` on: ``warning`` / ``trigger`` / ``severe`` ``[steps, layers]`` booleans, the
    ``window_drop`` they saw and ``ends``, the sequence length at each step."""
    runs = consecutive_runs(drop, config.trigger_drop)
    window = window_means(drop, config.window_tokens, config.refresh_tokens)
    ends = torch.arange(config.refresh_tokens, drop.shape[0] + 1, config.refresh_tokens)
    keep = ends >= start
    window, ends = window[keep], ends[keep]
    consecutive = runs[ends - 1] if ends.numel() else runs[:0]
    every = (True,) * drop.shape[1]
    flags = [raw_alarms(config, w.tolist(), c.tolist(), every) for w, c in zip(window, consecutive)]

    def stack(name: str) -> torch.Tensor:
        rows = [getattr(f, name) for f in flags]
        return torch.tensor(rows, dtype=torch.bool) if rows else torch.zeros(0, drop.shape[1], dtype=torch.bool)

    return {"warning": stack("warning"), "trigger": stack("trigger"), "severe": stack("severe"),
            "window_drop": window, "ends": ends}


def _record_all(model, streams, references, plans, scales, progress) -> dict[str, list[TokenSignals]]:
    recorded: dict[str, list[TokenSignals]] = {name: [] for name in plans}
    with tqdm(total=len(plans) * len(streams), desc="monitor", unit="pass", disable=not progress) as bar:
        for domain, ids in streams.items():
            for name, p in plans.items():
                recorded[name].append(record(model, ids, p, scales, reference_logprobs=references[domain]))
                bar.update()
    return recorded


def quiet_layers(signals: list[TokenSignals], baseline: EntropyBaseline, config: MonitorConfig,
                 start: int) -> tuple[list[int], list[float]]:
    """``(monitored layers, FP16 alarm rate per layer)``: the layers whose warnings and triggers fire on at most
    :data:`QUIET_ALARM_RATE` of the monitoring steps of FP16 text."""
    steps, quiet = 0, None
    for sig in signals:
        a = replay_alarms(sig.drop(baseline, config.baseline_tokens), config, start)
        fired = (a["warning"] | a["trigger"]).sum(0)
        steps += a["ends"].numel()
        quiet = fired if quiet is None else quiet + fired
    rate = (quiet.double() / max(steps, 1)).tolist()
    return [l for l, r in enumerate(rate) if r <= QUIET_ALARM_RATE], rate


def _windows(signals: list[TokenSignals], baseline, config: MonitorConfig, start: int):
    """Window features ``[W, L, F]`` and labels ``[W]`` (window KL above :data:`KL_THRESHOLD`)."""
    for sig in signals:
        feats = window_means(sig.features(baseline, config.baseline_tokens), config.window_tokens, config.refresh_tokens)
        kl = window_means(sig.kl, config.window_tokens, config.refresh_tokens)
        ends = torch.arange(config.refresh_tokens, sig.kl.shape[0] + 1, config.refresh_tokens)
        keep = ends >= start
        yield feats[keep], kl[keep] > KL_THRESHOLD


def fit_monitor(model, streams: dict[str, torch.Tensor], references: dict[str, torch.Tensor], plan: Plan,
                scales: StaticScales | None, baseline: EntropyBaseline, config: MonitorConfig, *,
                progress: bool = True) -> dict:
    """Calibrate the run-time monitor on held-out calibration streams (with their FP16 reference
    log-probabilities): monitored layers, risk classifier and held-out signal AUCs (see module docstring)."""
    arch = Architecture.from_config(model.config)
    start = first_quantized_query(plan)
    plans = {"fp16": Plan.uniform(arch, "fp16", plan.cache), "plan": plan,
             "int4": Plan.uniform(arch, "int4", plan.cache), "int2": Plan.uniform(arch, "int2", plan.cache)}
    recorded = _record_all(model, streams, references, plans, scales, progress)
    monitored, fp16_rate = quiet_layers(recorded["fp16"], baseline, config, start)
    windows = [w for name in ("plan", "int4", "int2") for w in _windows(recorded[name], baseline, config, start)]
    xs = [f.reshape(-1, len(FEATURES)) for f, _ in windows]
    ys = [label[:, None].expand(-1, arch.num_layers).reshape(-1) for _, label in windows]
    classifier = RiskClassifier.fit(torch.cat(xs), torch.cat(ys), FEATURES, KL_THRESHOLD)
    feats = torch.cat([f for f, _ in windows])  # [W, L, F]
    label = torch.cat([lab for _, lab in windows])
    cols = monitored or list(range(arch.num_layers))
    auc = {"entropy_drop_mean": roc_auc(feats[:, cols, 0].mean(1), label),
           "entropy_drop_max": roc_auc(feats[:, cols, 0].amax(1), label),
           "entropy_deviation_mean": roc_auc(feats[:, cols, 1].mean(1), label),
           "werr_k_mean": roc_auc(feats[:, :, 2].mean(1), label),
           "werr_v_mean": roc_auc(feats[:, :, 3].mean(1), label),
           "risk_max": roc_auc(classifier.predict(feats).amax(1), label)}
    return {"layers": monitored, "fp16_alarm_rate": [round(r, 4) for r in fp16_rate], "start": start,
            "windows": int(label.numel()), "positive_windows": int(label.sum()), "heldout_auc": auc,
            "risk_classifier": classifier.to_dict()}

