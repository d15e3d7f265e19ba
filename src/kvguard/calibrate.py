"""``kvguard calibrate``: model-specific calibration, stage by stage, resumable.

Stages (each checkpointed in ``<out>.partial/`` so ``--resume`` continues after the last finished one):

1. ``statistics`` — K/V statistics per batch and the attention-entropy baseline over the calibration samples;
2. ``latency`` — the decode-time cost model (one measured step time per tier);
3. ``level1`` — global precision x cache layout;
4. ``sensitivity`` — per layer, then per KV head for the most sensitive layers;
5. ``level2`` — per-layer / per-head tiers allocated from the sensitivity;
6. ``level3`` — clipping ratios for the most sensitive quantized layers;
7. ``monitor`` — the run-time monitor: which layers' entropy alarms are meaningful (quiet under FP16) and the
   risk classifier (:func:`kvguard.signals.fit_monitor`);

then the profile is assembled and written atomically. Stages 1, 3-6 hand their independent pieces (batches,
trials, candidate plans) to an executor (:mod:`kvguard.distributed`): this process, or Ray workers with
``ray=``, with the same result. Calibration text comes from the ``calib`` split only:
the first documents of each domain form the held-out slice that scores candidates, the following ones the
statistics samples; the evaluation split is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvguard import __version__, data
from kvguard.distributed import RayConfig, open_executor, require_ray
from kvguard.entropy import EntropyBaseline
from kvguard.heldout import HeldOut
from kvguard.monitor import MonitorConfig
from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision
from kvguard.profile import MONITOR_DEFAULTS, Profile
from kvguard.search import LAYOUTS, Candidate, LatencyModel, Objective, Searcher, best, level2_targets, measure_latency, pareto_front
from kvguard.sensitivity import Sensitivity, measure, ranking_table
from kvguard.signals import fit_monitor
from kvguard.statistics import KVStatistics, batches_by_length, merge

RECOMMENDED_SAMPLES = 5000
STAGES = ("statistics", "latency", "level1", "sensitivity", "level2", "level3", "monitor")
WINDOWS_PER_DOCUMENT = 8  # long documents (code files) give at most this many samples each


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``kvguard calibrate`` was asked for."""

    model: str
    out: Path
    samples: int = RECOMMENDED_SAMPLES
    domains: tuple[str, ...] = ("prose", "dialog", "code")
    max_tokens: int = 512
    batch_size: int = 16
    heldout_tokens: int = 1536
    context: int = 2048
    head_layers: int = 4
    latency_context: int = 1024
    seed: int = 0
    objective: Objective = field(default_factory=Objective)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "domains", tuple(self.domains))
        bad = [d for d in self.domains if d not in data.CORPORA]
        if bad or not self.domains:
            raise ValueError(f"domains have to be among {list(data.CORPORA)} but got {list(self.domains)}")
        for name in ("samples", "max_tokens", "batch_size", "heldout_tokens", "context", "latency_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_tokens < data.MIN_SAMPLE_TOKENS:
            raise ValueError(f"max_tokens must be at least {data.MIN_SAMPLE_TOKENS}, got {self.max_tokens}")
        if self.heldout_tokens // len(self.domains) < 256:
            raise ValueError(f"heldout_tokens gives each domain {self.heldout_tokens // len(self.domains)} tokens; "
                             f"at least 256 per domain are needed to see quantized keys")

    def key(self) -> str:
        """A digest of everything that decides the result (``--resume`` refuses a different one)."""
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self).items() if k != "out"}
        d["objective"] = self.objective.to_dict()
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _log(message: str) -> None:
    print(f"[kvguard calibrate] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- data
def calibration_data(tokenizer, cfg: CalibrationConfig) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict]:
    """``(samples, held-out streams, manifest)`` from the calibration split of each domain."""
    bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None
    sep = tokenizer(data.DOC_SEPARATOR, add_special_tokens=False)["input_ids"]
    per_domain = [cfg.samples // len(cfg.domains) + (i < cfg.samples % len(cfg.domains)) for i in range(len(cfg.domains))]
    heldout_per_domain = cfg.heldout_tokens // len(cfg.domains)
    samples, streams, manifest = [], {}, {"domains": {}, "split": "calib"}
    for domain, wanted in zip(cfg.domains, per_domain):
        docs = data.iter_documents(domain, "calib", tokenizer)
        stream: list[int] = [] if bos is None else [bos]
        held_docs = 0
        for doc in docs:
            ids = tokenizer(doc.text[: heldout_per_domain * 16], add_special_tokens=False)["input_ids"]
            stream.extend((sep if held_docs else []) + ids)
            held_docs += 1
            if len(stream) >= heldout_per_domain:
                break
        if len(stream) < heldout_per_domain:
            raise ValueError(f"domain {domain!r} has too little calibration text for a {heldout_per_domain}-token held-out slice")
        streams[domain] = torch.tensor(stream[:heldout_per_domain], dtype=torch.long)
        got, used_docs, tokens = [], 0, 0
        body = cfg.max_tokens - (bos is not None)
        for doc in docs:  # continues after the held-out documents
            ids = tokenizer(doc.text[: body * WINDOWS_PER_DOCUMENT * 8], add_special_tokens=False)["input_ids"]
            used_docs += 1
            for start in range(0, min(len(ids), body * WINDOWS_PER_DOCUMENT), body):
                window = ids[start:start + body]
                if len(window) < data.MIN_SAMPLE_TOKENS:
                    break
                got.append(torch.tensor(([] if bos is None else [bos]) + window, dtype=torch.long))
                tokens += got[-1].numel()
                if len(got) == wanted:
                    break
            if len(got) == wanted:
                break
        if len(got) < wanted:
            _log(f"warning: domain {domain!r} gave only {len(got)} of the {wanted} samples asked")
        samples += got
        manifest["domains"][domain] = {"samples": len(got), "tokens": tokens, "documents": used_docs,
                                       "heldout_documents": held_docs, "heldout_tokens": heldout_per_domain}
    manifest["samples"] = len(samples)
    manifest["tokens"] = sum(s.numel() for s in samples)
    manifest["max_tokens"] = cfg.max_tokens
    return samples, streams, manifest


# ---------------------------------------------------------------------- checkpoints
class _Checkpoints:
    """Finished stages under ``<out>.partial/``: ``<stage>.json`` (+ ``<stage>.safetensors``)."""

    def __init__(self, cfg: CalibrationConfig, resume: bool) -> None:
        self.dir = cfg.out.parent / f"{cfg.out.name}.partial"
        self.key = cfg.key()
        if self.dir.exists() and not resume:
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def load(self, stage: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        path = self.dir / f"{stage}.json"
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        if meta.get("config_key") != self.key:
            raise ValueError(f"--resume: {self.dir} holds a run with different settings; rerun without --resume")
        tensor_path = self.dir / f"{stage}.safetensors"
        return meta, (load_file(str(tensor_path)) if tensor_path.is_file() else {})

    def save(self, stage: str, meta: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        from safetensors.torch import save_file

        if tensors:
            tmp = self.dir / f".{stage}.safetensors.tmp"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, self.dir / f"{stage}.safetensors")
        tmp = self.dir / f".{stage}.json.tmp"
        tmp.write_text(json.dumps(dict(meta, config_key=self.key), indent=1))
        os.replace(tmp, self.dir / f"{stage}.json")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------- pipeline
def plan_summary(plan: Plan) -> str:
    """One token per layer: its tier, or the per-head tiers joined by ``/``; ``c`` marks a key clip < 1."""
    out = []
    for i, lp in enumerate(plan.layers):
        tiers = lp.uniform.value if lp.uniform else "/".join(p.value for p in lp.precision)
        out.append(f"{i}:{tiers}" + (f"c{lp.key_clip:g}" if lp.key_clip < 1 else ""))
    return " ".join(out)


def _library_versions() -> dict:
    import safetensors
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}


def calibrate(cfg: CalibrationConfig, *, resume: bool = False, progress: bool = True,
              ray: RayConfig | None = None) -> Profile:
    """Run (or resume) the calibration and write the profile to ``cfg.out``.

    ``ray``: run the statistics, sensitivity and search stages on Ray workers (:mod:`kvguard.distributed`)
    instead of in this process; the profile is the same bit for bit."""
    from kvguard import models

    if ray is not None:
        require_ray()  # fail before minutes of loading, not after
    if cfg.samples < RECOMMENDED_SAMPLES:
        _log(f"warning: {cfg.samples} samples is below the {RECOMMENDED_SAMPLES} recommended; statistics and the "
             f"entropy baseline will be noisier (use --samples {RECOMMENDED_SAMPLES} for a production profile)")
    torch.manual_seed(cfg.seed)
    checkpoints = _Checkpoints(cfg, resume)
    seconds: dict[str, float] = {}
    resumed: list[str] = []
    t0 = time.perf_counter()
    model, tok = models.load(cfg.model)
    arch = models.Architecture.from_config(model.config)
    fingerprint = models.fingerprint(model)
    seconds["load"] = time.perf_counter() - t0
    _log(f"model {cfg.model}: {arch.num_layers} layers, {arch.num_kv_heads} KV heads, head_dim {arch.head_dim}; "
         f"fingerprint {fingerprint[:19]}...")

    def stage(name: str, run):
        done = checkpoints.load(name)
        if done is not None:
            resumed.append(name)
            _log(f"stage {name}: resumed from {checkpoints.dir}")
            seconds[name] = done[0].get("seconds", 0.0)
            return done
        _log(f"stage {name} ...")
        t = time.perf_counter()
        meta, tensors = run()
        meta["seconds"] = time.perf_counter() - t
        seconds[name] = meta["seconds"]
        checkpoints.save(name, meta, tensors)
        _log(f"stage {name}: done in {meta['seconds']:.1f} s")
        return meta, tensors

    samples, streams, manifest = calibration_data(tok, cfg)
    _log(f"data: {manifest['samples']} samples ({manifest['tokens']} tokens) from {', '.join(cfg.domains)}; "
         f"held-out slice {sum(s.numel() for s in streams.values())} tokens")

    # Statistics, sensitivity and search run on the executor; the latency and monitor stages in this process.
    executor = open_executor(cfg.model, model, ray, log=_log)
    try:
        def run_statistics():
            batches = batches_by_length(samples, cfg.batch_size)
            collected = tqdm(executor.statistics(batches), total=len(batches), desc="statistics", unit="batch",
                             disable=not progress)
            stats, entropy = merge(collected)
            return {"manifest": manifest, "batches": len(batches)}, {**stats.tensors(), **entropy.tensors()}

        stats_meta, stats_tensors = stage("statistics", run_statistics)
        agg = KVStatistics.aggregate_from(stats_tensors)

        def run_latency():
            return measure_latency(model, LAYOUTS["window-64"], context=cfg.latency_context, progress=progress).to_dict(), None

        latency = LatencyModel.from_dict(stage("latency", run_latency)[0])
        _log(f"latency model (decode step / FP16 at {latency.context} tokens): "
             + ", ".join(f"{t} {r:.2f}" for t, r in latency.ratios.items()))

        heldout = HeldOut(model, streams)
        scales = StaticScales(agg["key.absmax"], agg["value.absmax"])
        searcher = Searcher(model, heldout, cfg.objective, latency, scales=scales, context=cfg.context, progress=progress,
                            executor=executor)

        def search_stage(name: str, run) -> list[Candidate]:
            meta = stage(name, lambda: ({"candidates": [c.to_dict() for c in run()]}, None))[0]
            return [Candidate.from_dict(c) for c in meta["candidates"]]

        level1 = search_stage("level1", searcher.level1)
        l1_best = best(level1)
        layout = l1_best.plan.cache
        int8 = [c for c in level1 if c.plan.layers[0].uniform is Precision.INT8]
        int8_kl = min(c.quality.kl for c in int8 if c.plan.cache == layout)
        _log("level 1:\n" + "\n".join(f"  {c.name}: memory {c.memory:.3f}, ppl {c.ppl_increase_pct:+.2f} %, "
                                       f"KL {c.quality.kl:.5f}, score {c.score:.3f}" for c in level1))
        _log(f"level 1 choice: {l1_best.name}")

        def run_sensitivity():
            sens = measure(heldout, layout, head_layers=cfg.head_layers, progress=progress, executor=executor)
            return sens.to_dict(), sens.tensors()

        sens_meta, sens_tensors = stage("sensitivity", run_sensitivity)
        sens = Sensitivity.from_parts(sens_meta, sens_tensors)
        print("\nSensitivity ranking (held-out calibration text; most sensitive first):")
        print(ranking_table(sens, arch.layer_types, limit=12))
        print(flush=True)

        # Level 2 allocates tiers in the two layouts whose all-INT4 plan scored best.
        int4 = sorted((c for c in level1 if c.plan.layers[0].uniform is Precision.INT4), key=lambda c: (c.score, c.quality.kl))

        def run_level2():
            out = []
            for c in int4[:2]:
                targets = level2_targets(c, cfg.objective, min(c.memory for c in int8))
                out += searcher.level2(sens, c.plan.cache, int8_kl, targets)
            return out

        level2 = search_stage("level2", run_level2)
        l2_best = best(level1 + level2)
        level3 = search_stage("level3", lambda: searcher.level3(l2_best, sens))
    finally:
        executor.close()
    searcher.log = level1 + level2 + level3
    chosen = best(searcher.log)
    baseline = EntropyBaseline.from_tensors(stats_tensors)
    defaults = MonitorConfig.from_dict(MONITOR_DEFAULTS)

    def run_monitor():
        return fit_monitor(model, heldout.streams, heldout.references, chosen.plan, scales, baseline, defaults,
                           progress=progress), None

    monitor_fit = stage("monitor", run_monitor)[0]
    _log(f"monitor: {len(monitor_fit['layers'])} of {arch.num_layers} layers monitored (quiet under FP16); held-out "
         "ROC AUC for window KL > 0.01: " + ", ".join(f"{k} {v:.3f}" for k, v in monitor_fit["heldout_auc"].items()))
    if not chosen.feasible:
        _log(f"warning: no candidate met the constraints (memory <= {cfg.objective.memory_budget}, ppl increase <= "
             f"{cfg.objective.max_ppl_increase} %); keeping the lowest score")
    front = pareto_front(searcher.log)
    _log(f"chosen: {chosen.name}: memory {chosen.memory:.3f} of FP16, ppl increase {chosen.ppl_increase_pct:+.2f} % "
         f"(worst domain), KL {chosen.quality.kl:.5f}, score {chosen.score:.3f}")
    _log(f"plan: {plan_summary(chosen.plan)}")

    tensors = {**stats_tensors, **sens_tensors, **_calibrated_scales(agg, chosen.plan, arch)}
    meta = {
        "kind": "kvguard-profile",
        "kvguard_version": __version__,
        "libraries": _library_versions(),
        "model": {"name": cfg.model, "fingerprint": fingerprint, "model_type": arch.model_type,
                  "num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
                  "layer_types": list(arch.layer_types)},
        "data": stats_meta["manifest"],
        "settings": {"seed": cfg.seed, "batch_size": cfg.batch_size, "heldout_tokens": cfg.heldout_tokens,
                     "context": cfg.context, "head_layers": cfg.head_layers, "latency_context": cfg.latency_context},
        "objective": cfg.objective.to_dict(),
        "plan": chosen.plan.to_dict(),
        "plan_summary": plan_summary(chosen.plan),
        "chosen": chosen.to_dict(),
        "constraints_met": chosen.feasible,
        "monitor": MonitorConfig.from_dict(MONITOR_DEFAULTS, layers=monitor_fit["layers"]).to_dict(),
        "risk_classifier": monitor_fit["risk_classifier"],
        "monitor_calibration": {k: v for k, v in monitor_fit.items() if k not in ("risk_classifier", "seconds")},
        "latency_model": latency.to_dict(),
        "sensitivity": sens.to_dict(),
        "pareto_front": [c.name for c in front],
        "search_log": [c.to_dict() for c in searcher.log],
        "run": {"seconds": seconds, "total_seconds": sum(seconds.values()), "resumed_stages": resumed},
    }
    profile = Profile(meta, tensors)
    profile.save(cfg.out)
    checkpoints.remove()
    _log(f"profile written to {cfg.out} ({sum(seconds.values()):.0f} s)")
    return profile


def refit_monitor(out: str | os.PathLike, *, progress: bool = True) -> Profile:
    """Calibrate only the run-time monitor (stage ``monitor``) of the existing profile at ``out``, on the same
    held-out slice, and rewrite the profile atomically; the plan, statistics and search are kept."""
    from kvguard import models

    profile = Profile.load(out)
    model, tok = models.load(profile.model_name)
    profile.check_model(model)
    settings, manifest = profile.meta["settings"], profile.meta["data"]
    cfg = CalibrationConfig(profile.model_name, Path(out), manifest["samples"], tuple(manifest["domains"]),
                            manifest.get("max_tokens", 512), settings["batch_size"], settings["heldout_tokens"],
                            settings["context"], settings["head_layers"], settings["latency_context"], settings["seed"])
    torch.manual_seed(cfg.seed)
    _, streams, _ = calibration_data(tok, cfg)
    heldout = HeldOut(model, streams)
    t0 = time.perf_counter()
    fit = fit_monitor(model, heldout.streams, heldout.references, profile.plan, profile.static_scales(),
                      profile.entropy_baseline(), MonitorConfig.from_dict(MONITOR_DEFAULTS), progress=progress)
    meta = dict(profile.meta)
    meta["monitor"] = MonitorConfig.from_dict(MONITOR_DEFAULTS, layers=fit["layers"]).to_dict()
    meta["risk_classifier"] = fit.pop("risk_classifier")
    meta["monitor_calibration"] = fit
    meta.setdefault("run", {}).setdefault("seconds", {})["monitor"] = time.perf_counter() - t0
    refreshed = Profile(meta, profile.tensors)
    refreshed.save(out)
    _log(f"monitor: {len(fit['layers'])} of {len(fit['fp16_alarm_rate'])} layers monitored; held-out ROC AUC for "
         "window KL > 0.01: " + ", ".join(f"{k} {v:.3f}" for k, v in fit["heldout_auc"].items()))
    _log(f"profile {out} rewritten with the new monitor")
    return refreshed


def _calibrated_scales(agg: dict[str, torch.Tensor], plan: Plan, arch) -> dict[str, torch.Tensor]:
    """Static ranges from the aggregated statistics: the absmax INT8 heads use, the INT8 scales those give
    (``clip * absmax / 127``, per layer clip) and per-channel INT4 scales / zero points of the observed range."""
    key_clip = torch.tensor([lp.key_clip for lp in plan.layers]).view(-1, 1, 1)
    value_clip = torch.tensor([lp.value_clip for lp in plan.layers]).view(-1, 1, 1)
    # Copies: safetensors refuses two names for one storage (these alias the saved aggregates).
    out = {"calibrated.key.absmax": agg["key.absmax"].clone(), "calibrated.value.absmax": agg["value.absmax"].clone(),
           "scales.int8.key": (key_clip * agg["key.absmax"] / 127).to(torch.float16),
           "scales.int8.value": (value_clip * agg["value.absmax"] / 127).to(torch.float16)}
    for kind in ("key", "value"):
        lo, hi = agg[f"{kind}.min"], agg[f"{kind}.max"]
        out[f"scales.int4.{kind}"] = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
        out[f"zero_points.int4.{kind}"] = lo.to(torch.float16)
    return out
