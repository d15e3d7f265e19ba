"""``kvguard calibrate``: model-specific calibration, stage by stage, resumable.

Stages (each checkpointed in ``<out>.partial/`` so ``--resume`` continues after the last finished one):

1. ``statistics`` — K/V statistics per batch and the attention-entropy baseline over the calibration samples;
2. ``latency`` — the decode-time cost model (bytes read per decode step, per tier: counted, not timed);
3. ``level1`` — global precision x cache layout;
4. ``sensitivity`` — per layer, then per KV head for the most sensitive layers;
5. ``level2`` — per-layer / per-head tiers allocated from the sensitivity;
6. ``level3`` — clipping ratios for the most sensitive quantized layers;
7. ``monitor`` — the run-time monitor: which layers' entropy alarms are meaningful (quiet under FP16) and the
   risk classifier (:func:`kvguard.calibration.monitor_fit.fit_monitor`);

then the profile is assembled and written atomically. Stages 1, 3-6 hand their independent pieces (batches,
trials, candidate plans) to an executor (:mod:`kvguard.calibration.distributed`): this process, or Ray workers
with ``ray=``, with the same result. Calibration text comes from the ``calib`` split only
(:mod:`kvguard.calibration.samples`); the evaluation split is never read.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from kvguard import __version__
from kvguard.calibration import outliers
from kvguard.calibration.checkpoints import Checkpoints
from kvguard.calibration.distributed import RayConfig, open_executor, require_ray
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.kv_statistics import KVStatistics, batches_by_length, merge
from kvguard.calibration.latency import LatencyModel, count_latency
from kvguard.calibration.monitor_fit import fit_monitor
from kvguard.calibration.output import check_out, locked
from kvguard.calibration.ranking import rerank
from kvguard.calibration.samples import CalibrationText, calibration_text
from kvguard.calibration.search import LAYOUTS, Searcher, best, int4_bytes, level2_targets, pareto_front
from kvguard.calibration.sensitivity import Sensitivity, measure, ranking_table
from kvguard.calibration.settings import RECOMMENDED_SAMPLES, CalibrationConfig, Search
from kvguard.config import MonitorConfig
from kvguard.entropy import EntropyBaseline
from kvguard.plan import StaticScales
from kvguard.precision import Precision
from kvguard.profile import Candidate, ModelInfo, Profile, ProfileMeta, RankedBudget

STAGES = ("statistics", "latency", "level1", "sensitivity", "level2", "level3", "monitor")


def _log(message: str) -> None:
    print(f"[kvguard calibrate] {message}", file=sys.stderr, flush=True)


def _library_versions() -> dict:
    import safetensors
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}


class _Run:
    """One calibration run: the model, its text, the checkpoints, and the stages in order."""

    def __init__(self, cfg: CalibrationConfig, resume: bool, progress: bool, log=_log) -> None:
        from kvguard import models
        from kvguard.architecture import Architecture

        self.cfg, self.progress, self.log = cfg, progress, log
        self.checkpoints = Checkpoints(cfg.out, cfg.key(), resume)
        self.seconds: dict[str, float] = {}
        self.resumed: list[str] = []
        t0 = time.perf_counter()
        self.model, self.tok = models.load(cfg.model, device=cfg.device, settle_heap=False)  # holds no cache
        self.arch = Architecture.from_config(self.model.config)
        self.fingerprint = models.fingerprint(self.model)
        self.seconds["load"] = time.perf_counter() - t0
        self.log(f"model {cfg.model}: {self.arch.num_layers} layers, {self.arch.num_kv_heads} KV heads, head_dim "
             f"{self.arch.head_dim}; fingerprint {self.fingerprint[:19]}...")
        self.text: CalibrationText = calibration_text(self.tok, cfg.domains, cfg.samples, cfg.max_tokens,
                                                      cfg.heldout_tokens, cfg.settings().ranking_tokens)
        m = self.text.manifest
        self.log(f"data: {m.samples} samples ({m.tokens} tokens) from {', '.join(cfg.domains)}; held-out slice "
             f"{sum(s.numel() for s in self.text.streams.values())} tokens; ranking streams "
             f"{sum(s.numel() for s in self.text.ranking.values())} tokens")

    def stage(self, name: str, run) -> tuple[dict, dict[str, torch.Tensor]]:
        """``run()`` -> ``(meta, tensors)``, or the checkpoint of an earlier run of this stage."""
        done = self.checkpoints.load(name)
        if done is not None:
            self.resumed.append(name)
            self.log(f"stage {name}: resumed from {self.checkpoints.dir}")
            self.seconds[name] = done[0].get("seconds", 0.0)
            return done
        self.log(f"stage {name} ...")
        t = time.perf_counter()
        meta, tensors = run()
        meta["seconds"] = self.seconds[name] = time.perf_counter() - t
        self.checkpoints.save(name, meta, tensors)
        self.log(f"stage {name}: done in {meta['seconds']:.1f} s")
        return meta, tensors

    def search_stage(self, name: str, run) -> list[Candidate]:
        meta = self.stage(name, lambda: ({"candidates": [c.to_dict() for c in run()]}, None))[0]
        return [Candidate.from_dict(c) for c in meta["candidates"]]

    def statistics(self, executor) -> dict[str, torch.Tensor]:
        def run():
            batches = batches_by_length(self.text.samples, self.cfg.batch_size)
            collected = tqdm(executor.statistics(batches), total=len(batches), desc="statistics", unit="batch",
                             disable=not self.progress)
            stats, entropy = merge(collected)
            return {"manifest": self.text.manifest.to_dict(), "batches": len(batches)}, {**stats.tensors(), **entropy.tensors()}

        return self.stage("statistics", run)[1]

    def latency(self) -> LatencyModel:
        def run():
            return count_latency(self.model, LAYOUTS["window-64"], context=self.cfg.latency_context).to_dict(), None

        latency = LatencyModel.from_dict(self.stage("latency", run)[0])
        self.log(f"latency model (bytes read per decode step / FP16 at {latency.context} tokens): "
             + ", ".join(f"{t} {r:.2f}" for t, r in latency.ratios.items()))
        return latency

    def sensitivity(self, heldout: HeldOut, layout, executor) -> tuple[Sensitivity, dict[str, torch.Tensor]]:
        def run():
            # The quick search leaves out the rotation trials (half the stage): its low-bit plans are not rotated.
            rotation = self.cfg.low_bit and self.cfg.search is Search.FULL
            sens = measure(heldout, layout, head_layers=self.cfg.head_layers, rotation=rotation,
                           progress=self.progress, executor=executor)
            return sens.to_dict(), sens.tensors()

        meta, tensors = self.stage("sensitivity", run)
        sens = Sensitivity.from_parts(meta, tensors)
        self.log("sensitivity ranking (held-out calibration text; most sensitive first):\n"
                 + ranking_table(sens, self.arch.layer_types, limit=12))
        return sens, tensors

    def search(self, searcher: Searcher, heldout: HeldOut, executor) -> tuple[list[Candidate], dict]:
        """Levels 1-3 and the sensitivity between them: the search log and the sensitivity tensors."""
        level1 = self.search_stage("level1", lambda: searcher.level1(self.cfg.low_bit))
        l1_best = best(level1)
        layout = l1_best.plan.cache
        int8 = [c for c in level1 if c.plan.layers[0].uniform is Precision.INT8]
        int8_kl = min(c.quality.kl for c in int8 if c.plan.cache == layout)
        self.log("level 1:\n" + "\n".join(f"  {c.name}: memory {c.memory:.3f}, ppl {c.ppl_increase_pct:+.2f} %, "
                                       f"KL {c.quality.kl:.5f}, score {c.score:.3f}" for c in level1))
        self.log(f"level 1 choice: {l1_best.name}")
        # Sensitivity trials run without the calibrated scales (so that they can resume from recorded passes), and
        # an 8-bit window needs them: they measure per-layer costs, which the window's format does not change.
        sens, sens_tensors = self.sensitivity(heldout, replace(layout, window_bits=16), executor)
        # Level 2 allocates tiers in the two layouts whose all-INT4 plan scored best.
        int4 = sorted((c for c in level1 if c.plan.layers[0].uniform is Precision.INT4), key=lambda c: (c.score, c.quality.kl))

        def run_level2():
            out = []
            for c in int4[:2]:
                targets = level2_targets(c, self.cfg.objective, min(c.memory for c in int8))
                out += searcher.level2(sens, c.plan.cache, int8_kl, targets)
            if self.cfg.low_bit:
                out += searcher.level2_low_bit(sens, int8_kl, level1)
            return out

        level2 = self.search_stage("level2", run_level2)
        l2_best = best(level1 + level2)
        level3 = self.search_stage("level3", lambda: searcher.level3(l2_best, sens))
        return level1 + level2 + level3, {"sensitivity": sens, "tensors": sens_tensors}

    def ranking(self, executor, log: list[Candidate], scales: StaticScales) -> list[RankedBudget]:
        """The closest candidates at the mid budgets re-scored on the ranking streams
        (:mod:`kvguard.calibration.ranking`); none without ranking streams."""
        if not self.text.ranking:
            return []
        b4 = int4_bytes(log)

        def run():
            bar = None if not self.progress else lambda it, total: tqdm(it, total=total, desc="ranking", unit="plan")
            budgets = rerank(executor, HeldOut(self.model, self.text.ranking), log, b4, scales, bar)
            return {"budgets": [b.to_dict() for b in budgets]}, None

        budgets = [RankedBudget.from_dict(b) for b in self.stage("ranking", run)[0]["budgets"]]
        held = {c.name: c.quality.kl for c in log}
        for b in budgets:
            self.log(f"ranking <= {b.share} x B4 ({b.memory:.3f}): " + "; ".join(
                f"{name}: held-out KL {held[name]:.5f}, ranking KL {kl:.5f}" for name, kl in b.kl.items())
                + f"; pick {b.pick}")
        return budgets

    def monitor(self, heldout: HeldOut, chosen: Candidate, scales: StaticScales, baseline: EntropyBaseline) -> dict:
        def run():
            return fit_monitor(self.model, heldout.streams, heldout.references, chosen.plan, scales, baseline,
                               MonitorConfig(), progress=self.progress), None

        fit = self.stage("monitor", run)[0]
        self.log(f"monitor: {len(fit['layers'])} of {self.arch.num_layers} layers monitored (quiet under FP16); held-out "
             "ROC AUC for window KL > 0.01: " + ", ".join(f"{k} {v:.3f}" for k, v in fit["heldout_auc"].items()))
        return fit


def calibrate(cfg: CalibrationConfig, *, resume: bool = False, progress: bool = True,
              ray: RayConfig | None = None, log: Callable[[str], None] = _log) -> Profile:
    """Run (or resume) the calibration and write the profile to ``cfg.out``.

    ``ray``: run the statistics, sensitivity and search stages on Ray workers
    (:mod:`kvguard.calibration.distributed`) instead of in this process; the profile is the same bit for bit.
    ``log``: where the progress lines go (default: stderr); the progress bars stay on stderr."""
    from kvguard.device import name

    if ray is not None and name(cfg.device) != "cpu":
        raise ValueError(f"calibration on Ray runs its workers on the CPU (each loads the model there, and the profile "
                         f"is the same bit for bit as a CPU run); device {cfg.device!r} resolves to "
                         f"{name(cfg.device)!r}: use device cpu with Ray, or drop Ray to calibrate on the GPU")
    if ray is not None:
        require_ray()  # fail before minutes of loading, not after
    check_out(cfg.out)
    with locked(cfg.out):
        return _calibrate(cfg, resume, progress, ray, log)


def _calibrate(cfg: CalibrationConfig, resume: bool, progress: bool, ray: RayConfig | None,
               log: Callable[[str], None]) -> Profile:
    if cfg.samples < RECOMMENDED_SAMPLES:
        log(f"warning: {cfg.samples} samples is below the {RECOMMENDED_SAMPLES} recommended; statistics and the "
            f"entropy baseline will be noisier (use --samples {RECOMMENDED_SAMPLES} for a production profile)")
    torch.manual_seed(cfg.seed)
    run = _Run(cfg, resume, progress, log)
    # Statistics, sensitivity and search run on the executor; the latency and monitor stages in this process.
    executor = open_executor(cfg.model, run.model, ray, log=log)
    try:
        stats_tensors = run.statistics(executor)
        for kind in ("key", "value"):
            log(outliers.summary(outliers.find(stats_tensors, kind)))
        agg = KVStatistics.aggregate_from(stats_tensors)
        latency = run.latency()
        heldout = HeldOut(run.model, run.text.streams)
        scales = StaticScales(agg["key.absmax"], agg["value.absmax"])
        searcher = Searcher(run.model, heldout, cfg.objective, latency, scales=scales, context=cfg.context,
                            progress=progress, executor=executor, quick=cfg.search is Search.QUICK)
        search_log, sens = run.search(searcher, heldout, executor)
        ranked = run.ranking(executor, search_log, scales)
    finally:
        executor.close()
    chosen = best(search_log)
    fit = run.monitor(heldout, chosen, scales, EntropyBaseline.from_tensors(stats_tensors))
    if not chosen.feasible:
        log(f"warning: no candidate met the constraints (memory <= {cfg.objective.memory_budget}, ppl increase <= "
        f"{cfg.objective.max_ppl_increase} %); keeping the lowest score")
    log(f"chosen: {chosen.name}: memory {chosen.memory:.3f} of FP16, ppl increase {chosen.ppl_increase_pct:+.2f} % "
        f"(worst domain), KL {chosen.quality.kl:.5f}, score {chosen.score:.3f}")
    log(f"plan: {chosen.plan.summary()}")
    meta = _meta(run, chosen, search_log, latency, sens["sensitivity"], fit, ranked)
    profile = Profile(meta, {**stats_tensors, **sens["tensors"], **_calibrated_scales(agg)})
    profile.save(cfg.out)
    run.checkpoints.remove()
    log(f"profile written to {cfg.out} ({sum(run.seconds.values()):.0f} s)")
    return profile


def _meta(run: _Run, chosen: Candidate, log: list[Candidate], latency: LatencyModel, sens: Sensitivity,
          fit: dict, ranked: list[RankedBudget]) -> ProfileMeta:
    cfg, arch = run.cfg, run.arch
    from kvguard.risk import RiskClassifier

    ranking = {"ranking": {"tokens_per_domain": cfg.settings().ranking_tokens // len(cfg.domains),
                           "budgets": [b.to_dict() for b in ranked]}} if ranked else {}

    return ProfileMeta(
        model=ModelInfo(cfg.model, run.fingerprint, arch.model_type, arch.num_layers, arch.num_kv_heads,
                        arch.head_dim, arch.layer_types),
        plan=chosen.plan, monitor=MonitorConfig(layers=tuple(fit["layers"])),
        risk_classifier=RiskClassifier.from_dict(fit["risk_classifier"]), objective=cfg.objective,
        settings=cfg.settings(), data=run.text.manifest, chosen=chosen, constraints_met=chosen.feasible,
        search_log=tuple(log), pareto_front=tuple(c.name for c in pareto_front(log)), kvguard_version=__version__,
        libraries=_library_versions(),
        record={"latency_model": latency.to_dict(), "sensitivity": sens.to_dict(),
                "monitor_calibration": {k: v for k, v in fit.items() if k not in ("risk_classifier", "seconds")},
                **ranking,
                "run": {"seconds": run.seconds, "total_seconds": sum(run.seconds.values()),
                        "resumed_stages": run.resumed, "search": cfg.search.value}})


def refit_monitor(out: str | os.PathLike, *, progress: bool = True, device: str = "cpu") -> Profile:
    """Calibrate only the run-time monitor (stage ``monitor``) of the existing profile at ``out``, on the same
    held-out slice, with the model on ``device``, and rewrite the profile atomically; the plan, statistics and
    search are kept."""
    with locked(Path(out)):
        return _refit_monitor(Path(out), progress, device)


def _refit_monitor(out: Path, progress: bool, device: str = "cpu") -> Profile:
    from kvguard import models
    from kvguard.risk import RiskClassifier

    profile = Profile.load(out)
    model, tok = models.load(profile.model_name, device=device)
    profile.check_model(model)
    meta = profile.meta
    torch.manual_seed(meta.settings.seed)
    text = calibration_text(tok, tuple(meta.data.domains), meta.data.samples, meta.data.max_tokens,
                            meta.settings.heldout_tokens)
    heldout = HeldOut(model, text.streams)
    t0 = time.perf_counter()
    fit = fit_monitor(model, heldout.streams, heldout.references, profile.plan, profile.static_scales(),
                      profile.entropy_baseline(), MonitorConfig(), progress=progress)
    record = dict(meta.record)
    record["monitor_calibration"] = {k: v for k, v in fit.items() if k != "risk_classifier"}
    run_record = dict(record.get("run", {}))
    run_record["seconds"] = dict(run_record.get("seconds", {}), monitor=time.perf_counter() - t0)
    record["run"] = run_record
    refreshed = Profile(replace(meta, monitor=MonitorConfig(layers=tuple(fit["layers"])),
                                risk_classifier=RiskClassifier.from_dict(fit["risk_classifier"]), record=record),
                        profile.tensors)
    refreshed.save(out)
    _log(f"monitor: {len(fit['layers'])} of {len(fit['fp16_alarm_rate'])} layers monitored; held-out ROC AUC for "
         "window KL > 0.01: " + ", ".join(f"{k} {v:.3f}" for k, v in fit["heldout_auc"].items()))
    _log(f"profile {out} rewritten with the new monitor")
    return refreshed


def _calibrated_scales(agg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The static ranges run time loads: per layer, KV head and channel ``absmax``, from which INT8 heads
    quantize with ``clip * absmax / 127`` and the FP8 export takes its scales."""
    # Copies: safetensors refuses two names for one storage (these alias the saved aggregates).
    return {"calibrated.key.absmax": agg["key.absmax"].clone(), "calibrated.value.absmax": agg["value.absmax"].clone()}
