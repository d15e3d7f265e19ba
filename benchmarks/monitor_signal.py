"""Does the monitor's signal work? ROC AUC of each signal for real error, within each plan, on the evaluation split.

    .venv/bin/python benchmarks/monitor_signal.py --model smollm2-135m --profile P [--tokens 2048] \\
        [--aggressive 0.22] [--json F]

For each eval corpus the text is decoded (exact simulation, chunk 1) under four plans: the profile's calibrated
plan (``plan``), its aggressive frontier plan ``kvguard@<aggressive>`` (resolved by
:mod:`kvguard.evaluation.methods`, exactly as ``kvguard eval --methods kvguard@0.22`` does), and all-INT4 and
all-INT2 in the profile's cache layout. Per token and layer it records what the run-time monitor sees
(:mod:`kvguard.calibration.signals`) and the next-token ``KL(fp16 || plan)``. At the monitor's refresh points
(32-token windows every 8 tokens) a window is *bad* when its mean KL exceeds the classifier's threshold (0.01
nats, about a 1 % local perplexity cost). It prints:

- per corpus and plan, the ROC AUC of every signal for that plan's bad windows (``n/a`` when the plan has no
  bad window or no good one): whether a signal ranks a plan's own bad windows above its good ones, which is what
  a loop running that one plan needs;
- per corpus and plan, the same AUC for the plan's *worst quarter* of windows (window KL at or above the plan's
  own 75th percentile): under an aggressive plan nearly every window is bad by the absolute threshold, so this
  asks what a loop over that plan needs to know, which of its windows are the worst;
- the AUC pooled over ``plan``, all-INT4 and all-INT2, as calibration pools them (it mostly says that INT2
  windows carry both more quantization error and more KL);
- the alarms at the operating point, per corpus and plan: the entropy alarm (a warning or trigger in a
  monitored layer, replayed with the policy's own rules on the recorded drops, before the once-per-episode
  rule) and the risk alarm of dynamic precision (the classifier at or above ``promote_risk`` in a monitored
  layer), each with precision (bad among alarmed), recall (alarmed among bad) and rate (alarmed among windows);
- how often the entropy alarms fire under an FP16 cache (false alarms by construction).

Nothing here is tuned: thresholds, monitored layers and the classifier come from the profile (calibration split).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kvguard loads lazily, so --help answers at once
    from kvguard.calibration.signals import TokenSignals
    from kvguard.config import MonitorConfig
    from kvguard.entropy import EntropyBaseline
    from kvguard.plan import Plan, StaticScales
    from kvguard.risk import RiskClassifier

# (column, description) of every signal scored, in table order.
SIGNALS = (
    ("drop mean", "entropy drop (sequence level), mean of monitored layers"),
    ("drop max", "entropy drop (sequence level), max of monitored layers"),
    ("static drop", "entropy drop (calibrated baseline only), mean of all layers"),
    ("either way", "entropy deviation either way, mean of all layers"),  # no "|" (a Markdown cell)
    ("K error", "attention-weighted key error, mean of layers"),
    ("V error", "attention-weighted value error, mean of layers"),
    ("risk", "risk classifier, max of layers"),
)
POOLED = ("plan", "int4", "int2")  # the plans the pooled AUC mixes (calibration's training mix)
Alarmed = dict[str, torch.Tensor]  # alarm ("entropy", "risk") -> [W] bool: it fired at that refresh point


@dataclass(frozen=True)
class Setup:
    """What every pass shares: the model, the profile's monitor settings and the plans compared."""

    model: object
    tok: object
    cfg: MonitorConfig
    baseline: EntropyBaseline
    clf: RiskClassifier | None
    scales: StaticScales | None
    monitored: list[int]
    start: int  # where the session starts monitoring the profile's layout (the FP16 pass)
    num_layers: int
    fp16: Plan
    plans: dict[str, Plan]
    descriptions: dict[str, str]

    @property
    def kl_threshold(self) -> float:
        return self.clf.kl_threshold if self.clf is not None else 0.01


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--corpus", default="prose,code,dialog")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--aggressive", type=float, default=0.22,
                        help="FP16 bytes ratio of the aggressive frontier plan (method kvguard@<ratio>)")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def _setup(args: argparse.Namespace) -> Setup:
    from kvguard import models
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.profile import Profile
    from kvguard.simulate import first_quantized_query

    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    arch = Architecture.from_config(model.config)
    cfg, layout = profile.meta.monitor, profile.plan.cache
    # The profile methods resolve through the eval registry, so "kvguard@0.22" is the plan `kvguard eval` scores;
    # both carry the profile's static scales, which every pass below uses (uniform plans have no INT8 heads).
    chosen, frontier = methods.get("kvguard", profile), methods.get(f"kvguard@{args.aggressive:g}", profile)
    plans = {"plan": chosen.plan(arch), frontier.name: frontier.plan(arch),
             "int4": Plan.uniform(arch, "int4", layout), "int2": Plan.uniform(arch, "int2", layout)}
    descriptions = {"plan": chosen.description, frontier.name: frontier.description,
                    "int4": "kvguard INT4 on every layer, the profile's cache layout",
                    "int2": "kvguard INT2 on every layer, the profile's cache layout"}
    monitored = list(cfg.layers) if cfg.layers is not None else list(range(arch.num_layers))
    return Setup(model, tok, cfg, profile.entropy_baseline(), profile.meta.risk_classifier, profile.static_scales(),
                 monitored, first_quantized_query(profile.plan), arch.num_layers,
                 Plan.uniform(arch, "fp16", layout), plans, descriptions)


def _count_false_alarms(ref_sig, s: Setup, totals: dict) -> None:
    """Add the FP16 pass's entropy alarms to ``totals`` (drop against the sequence level and the baseline alone)."""
    from kvguard.calibration.monitor_fit import replay_alarms

    for adaptive in (True, False):
        a = replay_alarms(ref_sig.drop(s.baseline, s.cfg.baseline_tokens, adaptive=adaptive), s.cfg, s.start)
        fired = a["warning"] | a["trigger"]  # [steps, layers]
        key = "sequence level" if adaptive else "calibrated baseline only"
        entry = totals.setdefault(key, {"steps": 0, "any_layer": 0, "monitored": 0})
        entry["steps"] += int(fired.shape[0])
        entry["any_layer"] += int(fired.any(1).sum())
        entry["monitored"] += int(fired[:, s.monitored].any(1).sum()) if s.monitored else 0


def _windows(sig: TokenSignals, s: Setup, start: int
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, Alarmed]:
    """One pass's windows at the refresh points from sequence length ``start`` on (where the session starts
    monitoring the plan): ``(score per signal [W], bad [W], worst quarter [W], alarmed [W] per alarm)``; no
    risk alarm without a classifier."""
    from kvguard.calibration import signals
    from kvguard.calibration.monitor_fit import replay_alarms

    w = lambda x: signals.window_means(x, s.cfg.window_tokens, s.cfg.refresh_tokens)  # noqa: E731
    ends = torch.arange(s.cfg.refresh_tokens, sig.kl.shape[0] + 1, s.cfg.refresh_tokens)
    keep = ends >= start  # the same refresh points replay_alarms keeps
    feats = w(sig.features(s.baseline, s.cfg.baseline_tokens))[keep]  # [W, L, 4]
    static_drop = w(sig.drop(s.baseline, adaptive=False))[keep]  # [W, L]
    window_kl = w(sig.kl)[keep]
    bad = window_kl > s.kl_threshold
    worst = window_kl >= torch.quantile(window_kl, 0.75) if window_kl.numel() else bad
    m = s.monitored
    columns = [feats[:, m, 0].mean(1), feats[:, m, 0].amax(1), static_drop.mean(1), feats[:, :, 1].mean(1),
               feats[:, :, 2].mean(1), feats[:, :, 3].mean(1)]
    risk = s.clf.predict(feats) if s.clf is not None else None  # [W, L]
    if risk is not None:
        columns.append(risk.amax(1))
    scores = {description: col for (_, description), col in zip(SIGNALS, columns)}
    a = replay_alarms(sig.drop(s.baseline, s.cfg.baseline_tokens), s.cfg, start)
    none = torch.zeros_like(bad)
    alarmed = {"entropy": (a["warning"] | a["trigger"])[:, m].any(1) if m else none}
    if risk is not None:
        # The policy acts on the max (policy.decide). This replay reads the monitored layers only, as the session
        # did before it observed every layer (d7cca6f); the live session's risk alarm can fire more often.
        alarmed["risk"] = risk[:, m].amax(1) >= s.cfg.promote_risk if m else none
    return scores, bad, worst, alarmed


def _auc(scores: torch.Tensor, bad: torch.Tensor) -> float | None:
    from kvguard.metrics import roc_auc

    value = roc_auc(scores, bad)
    return None if math.isnan(value) else value


def _measure(args: argparse.Namespace, s: Setup) -> tuple[list[dict], dict, dict]:
    """``(rows per corpus and plan, pooled AUC, FP16 false alarms)``."""
    from kvguard import data
    from kvguard.calibration import signals
    from kvguard.metrics import alarm_quality
    from kvguard.simulate import first_quantized_query, simulate_logits

    rows, pooled, false_alarms = [], {description: ([], []) for _, description in SIGNALS}, {}
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, "eval", s.tok, args.tokens)
        print(f"[monitor_signal] {corpus}: {args.tokens} tokens", file=sys.stderr, flush=True)
        ref = torch.log_softmax(simulate_logits(s.model, ids[:-1], s.fp16), -1)
        _count_false_alarms(signals.record(s.model, ids, s.fp16, s.scales, reference_logprobs=ref), s, false_alarms)
        for name, plan in s.plans.items():
            sig = signals.record(s.model, ids, plan, s.scales, reference_logprobs=ref)
            scores, bad, worst, alarmed = _windows(sig, s, first_quantized_query(plan))
            if name in POOLED:
                for signal, score in scores.items():
                    pooled[signal][0].append(score)
                    pooled[signal][1].append(bad)
            rows.append({"corpus": corpus, "plan": name, "mean_kl": float(sig.kl.mean()), "windows": int(bad.numel()),
                         "bad_windows": int(bad.sum()),
                         "auc": {signal: _auc(score, bad) for signal, score in scores.items()},
                         "auc_worst_quarter": {signal: _auc(score, worst) for signal, score in scores.items()},
                         "alarms": {kind: asdict(alarm_quality(fired, bad)) for kind, fired in alarmed.items()}})
    auc = {signal: _auc(torch.cat(sc), torch.cat(lab)) for signal, (sc, lab) in pooled.items() if sc}
    return rows, auc, false_alarms


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _print_plans(s: Setup) -> None:
    print("| plan | what |\n|---|---|")
    for name, description in s.descriptions.items():
        print(f"| {name} | {description} |")


def _print_rows(rows: list[dict], threshold: float) -> None:
    print(f"\n| corpus | plan | mean KL | windows | bad windows (KL > {threshold:g}) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['corpus']} | {r['plan']} | {r['mean_kl']:.5f} | {r['windows']} | {r['bad_windows']} |")


def _print_within(rows: list[dict], key: str = "auc") -> None:
    shown = [(name, description) for name, description in SIGNALS if description in rows[0][key]]
    if key == "auc":
        print("\nROC AUC for bad windows within each plan (n/a: the plan has no bad window, or no good one):\n")
    else:
        print("\nROC AUC for each plan's worst quarter of windows (window KL >= the plan's own 75th percentile):\n")
    print("| corpus | plan | bad / windows | " + " | ".join(name for name, _ in shown) + " |\n|---|---|---|"
          + "---|" * len(shown))
    for r in rows:
        cells = " | ".join(_fmt(r[key][description]) for _, description in shown)
        bad = r["bad_windows"] if key == "auc" else "quarter"
        print(f"| {r['corpus']} | {r['plan']} | {bad} / {r['windows']} | {cells} |")
    print("\n" + "; ".join(f"{name}: {description}" for name, description in shown) + ".")


def _print_pooled(auc: dict) -> None:
    print(f"\n| signal | ROC AUC for bad windows (pooled over {', '.join(POOLED)}) |\n|---|---|")
    for _, description in SIGNALS:
        if description in auc:
            print(f"| {description} | {_fmt(auc[description])} |")


def _print_alarms(rows: list[dict], s: Setup) -> None:
    print(f"\nAlarms at the operating point (the profile's thresholds; {len(s.monitored)} monitored layers): entropy = "
          f"a warning (window drop >= {s.cfg.warn_drop:g}) or trigger ({s.cfg.trigger_consecutive} tokens >= "
          f"{s.cfg.trigger_drop:g} below) in a monitored layer; risk = classifier >= {s.cfg.promote_risk:g} in a "
          f"monitored layer. Precision = bad among alarmed, recall = alarmed among bad, rate = alarmed / windows.\n")
    print("| corpus | plan | alarm | windows | bad | alarmed | precision | recall | rate |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for kind, q in r["alarms"].items():
            print(f"| {r['corpus']} | {r['plan']} | {kind} | {q['windows']} | {q['bad']} | {q['alarmed']} | "
                  f"{_fmt(q['precision'])} | {_fmt(q['recall'])} | {_fmt(q['alarm_rate'])} |")


def _print_false_alarms(false_alarms: dict, s: Setup) -> None:
    print(f"\nFP16 cache (no quantization error): monitoring steps where an entropy alarm (warning or trigger) fires "
          f"({len(s.monitored)} of {s.num_layers} layers monitored by the profile):")
    print("| drop measured against | steps | any layer | monitored layers |\n|---|---|---|---|")
    for key, e in false_alarms.items():
        print(f"| {key} | {e['steps']} | {100 * e['any_layer'] / e['steps']:.1f} % | "
              f"{100 * e['monitored'] / e['steps']:.1f} % |")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    s = _setup(args)
    rows, auc, false_alarms = _measure(args, s)
    _print_plans(s)
    _print_rows(rows, s.kl_threshold)
    _print_within(rows)
    _print_within(rows, "auc_worst_quarter")
    _print_pooled(auc)
    _print_alarms(rows, s)
    _print_false_alarms(false_alarms, s)
    if args.json:
        from kvguard.evaluation.harness import write_json

        write_json(args.json, {"model": args.model, "tokens": args.tokens, "aggressive": args.aggressive,
                               "plans": s.descriptions, "kl_threshold": s.kl_threshold,
                               "rows": rows, "auc": auc, "pooled_plans": list(POOLED),
                               "fp16_false_alarms": false_alarms, "monitored_layers": s.monitored})
    return 0


if __name__ == "__main__":
    sys.exit(main())
