"""The calibration profile: everything the run-time half needs, tied to one exact model.

A profile is a directory:

- ``profile.json`` — :class:`ProfileMeta`: schema version, model name and fingerprint, kvguard and library
  versions, the data manifest, the chosen plan (tiers and clip ratios), the run-time monitor thresholds and risk
  classifier, the objective, the search log and its Pareto frontier, and records of the calibration run
  (latency model, sensitivity ranking, monitor calibration, timings);
- ``tensors.safetensors`` — calibrated scales and zero points, per-batch K/V statistics and their
  aggregates, the attention-entropy baseline and the sensitivity measurements.

Calibration writes it (:mod:`kvguard.calibration.pipeline`); everything else only loads it. It is written
atomically (:mod:`kvguard.atomic`) and never pickled. Loading checks the schema version, a SHA-256 of the
tensor file and one of ``profile.json`` itself (its ``manifest_sha256``: an edited model name, fingerprint or
plan is refused), every block of ``profile.json`` (an invalid one is a :class:`ProfileError` naming the field),
each block against the model architecture the profile records (plan layers and heads, monitored layers, the
risk classifier, the shapes of the tensors run time reads), and — given a model — its fingerprint. Every
command and the server load profiles through :meth:`Profile.load`, so a bad profile is refused the same way
everywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from kvguard import atomic
from kvguard.config import MonitorConfig, Objective
from kvguard.entropy import EntropyBaseline
from kvguard.plan import Plan, StaticScales
from kvguard.risk import RiskClassifier

SCHEMA_VERSION = 1
KIND = "kvguard-profile"
JSON_NAME = "profile.json"
TENSORS_NAME = "tensors.safetensors"


# The tensors run time reads: the calibrated INT8 / FP8 ranges and the attention-entropy baseline.
REQUIRED_TENSORS = ("calibrated.key.absmax", "calibrated.value.absmax", "entropy.mean", "entropy.std", "entropy.count",
                    "entropy.normalized")


class ProfileError(ValueError):
    """A profile that cannot be used: missing, corrupted, from a newer kvguard, or for another model."""


@dataclass(frozen=True)
class ModelInfo:
    """The model a profile belongs to."""

    name: str
    fingerprint: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        return cls(str(d["name"]), str(d["fingerprint"]), str(d["model_type"]), int(d["num_layers"]),
                   int(d["num_kv_heads"]), int(d["head_dim"]), tuple(d["layer_types"]))


@dataclass(frozen=True)
class PlanScore:
    """Quality of one plan on the held-out calibration streams.

    Attributes:
        kl: token-weighted mean next-token ``KL(fp16 || plan)`` over all streams.
        ppl_increase_pct: per domain, perplexity increase over the FP16 cache in percent.
        top1_agree: token-weighted arg-max agreement with the FP16 cache.
        kl_p99: the 99th percentile of the per-token KL over all streams (the tail a mean hides); ``None`` in
            profiles calibrated before it was recorded.
    """

    kl: float
    ppl_increase_pct: dict[str, float]
    top1_agree: float
    kl_p99: float | None = None

    @property
    def worst_ppl_increase_pct(self) -> float:
        """The largest increase over the domains: a plan has to hold in every scenario it was calibrated for."""
        return max(self.ppl_increase_pct.values())

    def to_dict(self) -> dict:
        out = {"kl": self.kl, "ppl_increase_pct": dict(self.ppl_increase_pct), "top1_agree": self.top1_agree}
        return out if self.kl_p99 is None else {**out, "kl_p99": self.kl_p99}

    @classmethod
    def from_dict(cls, d: dict) -> "PlanScore":
        p99 = d.get("kl_p99")
        return cls(float(d["kl"]), {k: float(v) for k, v in d["ppl_increase_pct"].items()}, float(d["top1_agree"]),
                   None if p99 is None else float(p99))


@dataclass(frozen=True)
class Candidate:
    """One plan the search evaluated, as the profile's search log records it."""

    name: str
    level: int
    plan: Plan
    memory: float
    latency: float
    quality: PlanScore
    score: float
    feasible: bool

    @property
    def ppl_increase_pct(self) -> float:
        return self.quality.worst_ppl_increase_pct

    def to_dict(self) -> dict:
        from kvguard.config import penalty

        return {"name": self.name, "level": self.level, "memory": self.memory, "latency": self.latency,
                "quality": self.quality.to_dict(), "ppl_increase_pct": self.ppl_increase_pct,
                "ppl_penalty_pct": penalty(self.quality.kl), "score": self.score,
                "feasible": self.feasible, "precision_counts": self.plan.precision_counts(), "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(str(d["name"]), int(d["level"]), Plan.from_dict(d["plan"]), float(d["memory"]), float(d["latency"]),
                   PlanScore.from_dict(d["quality"]), float(d["score"]), bool(d["feasible"]))


# How much lower (in ln KL) a ranked candidate's ranking KL has to be than the held-out pick's to replace it: twice the
# standard error of the ranking's ln KL ratio between close candidates from one stream per domain, measured on twelve
# further 2,048-token streams of SmolLM2's calibration text (benchmarks/ranking_noise.py, in the history: commit e534271; a median spread of 0.157
# within a domain, / sqrt(3) domains). A smaller margin is within what another stream of the same text would reverse.
RANKING_MARGIN = 0.18


@dataclass(frozen=True)
class RankedBudget:
    """Candidates calibration scored again on longer calibration text (``kvguard.calibration.ranking``) at one
    budget: its closest ones, and every one at or below it with a lower held-out KL.

    Attributes:
        share: the budget as a share of B4 (the default layout's all-INT4 bytes).
        memory: the budget, KV bytes over FP16's (``share * B4``).
        kl: candidate name -> mean next-token KL on the ranking streams, in held-out order.
    """

    share: float
    memory: float
    kl: dict[str, float]

    def choose(self, held_out_pick: str, names: Iterable[str]) -> str:
        """Among ``names`` (ranked here), the lowest ranking KL (the held-out order breaks a tie) where it is lower
        than ``held_out_pick``'s by more than :data:`RANKING_MARGIN`; else ``held_out_pick``."""
        best = min(names, key=self.kl.__getitem__)
        return best if self.kl[best] < self.kl[held_out_pick] * math.exp(-RANKING_MARGIN) else held_out_pick

    @property
    def pick(self) -> str:
        """What the ranking runs at this budget: :meth:`choose` over the held-out pick (the first)."""
        return self.choose(next(iter(self.kl)), self.kl)

    def to_dict(self) -> dict:
        return {"share": self.share, "memory": self.memory, "kl": dict(self.kl), "pick": self.pick}

    @classmethod
    def from_dict(cls, d: dict) -> "RankedBudget":
        return cls(float(d["share"]), float(d["memory"]), {str(k): float(v) for k, v in d["kl"].items()})


@dataclass(frozen=True)
class DomainData:
    """What one calibration domain contributed."""

    samples: int
    tokens: int
    documents: int
    heldout_documents: int
    heldout_tokens: int
    ranking_documents: int = 0  # the ranking stream's, past the samples' documents (0: none; older profiles)
    ranking_tokens: int = 0


@dataclass(frozen=True)
class DataManifest:
    """The calibration data: always the ``calib`` split, never evaluation text."""

    domains: dict[str, DomainData]
    samples: int
    tokens: int
    max_tokens: int
    split: str = "calib"

    def to_dict(self) -> dict:
        return {"domains": {k: asdict(v) for k, v in self.domains.items()}, "split": self.split,
                "samples": self.samples, "tokens": self.tokens, "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "DataManifest":
        domains = {str(k): DomainData(**{f.name: int(v[f.name]) for f in fields(DomainData) if f.name in v or
                                         f.default is MISSING}) for k, v in d["domains"].items()}
        return cls(domains, int(d["samples"]), int(d["tokens"]), int(d.get("max_tokens", 512)), str(d.get("split", "calib")))


@dataclass(frozen=True)
class Settings:
    """The calibration settings that are not the data or the objective."""

    seed: int
    batch_size: int
    heldout_tokens: int
    context: int
    head_layers: int
    latency_context: int
    ranking_tokens: int = 0  # re-ranking text, all domains (0: off; profiles before it)

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        return cls(**{f.name: int(d[f.name]) for f in fields(cls) if f.name in d or f.default is MISSING})


@dataclass(frozen=True)
class ProfileMeta:
    """``profile.json``, typed. The ``record`` blocks are calibration's own records (its latency model, the
    sensitivity summary, the monitor calibration, timings), kept as written for the report and for resuming."""

    model: ModelInfo
    plan: Plan
    monitor: MonitorConfig
    risk_classifier: RiskClassifier | None
    objective: Objective
    settings: Settings
    data: DataManifest
    chosen: Candidate
    constraints_met: bool
    search_log: tuple[Candidate, ...]
    pareto_front: tuple[str, ...]
    kvguard_version: str
    libraries: dict[str, str] = field(default_factory=dict)
    record: dict[str, dict] = field(default_factory=dict)

    RECORDS = ("latency_model", "sensitivity", "monitor_calibration", "ranking", "run")

    def frontier(self) -> list[Candidate]:
        """The Pareto-frontier candidates of the search log, by memory."""
        names = set(self.pareto_front)
        return sorted((c for c in self.search_log if c.name in names), key=lambda c: c.memory)

    def ranked(self) -> list[RankedBudget]:
        """The budgets whose closest candidates were scored again on the ranking streams (none before that stage)."""
        return [RankedBudget.from_dict(b) for b in self.record.get("ranking", {}).get("budgets", [])]

    def frontier_pick(self, memory: float, tail: bool = False) -> Candidate | None:
        """The plan ``kvguard@<memory>`` runs: the frontier candidate with the lowest held-out KL at or below
        ``memory``; where that one was ranked, the one with the lowest ranking KL among those ranked with it that
        fit, where that is lower by more than :data:`RANKING_MARGIN` (the longer text's word over the held-out
        slice's); ``None`` where nothing fits. ``tail`` (``kvguard@<memory>/p99``): the candidate of the whole
        search log with the lowest held-out p99 per-token KL at or below ``memory`` instead (the frontier is the
        mean's; the ranking streams score means only)."""
        if tail:
            return self._tail_pick(memory)
        points = [c for c in self.frontier() if c.memory <= memory]
        if not points:
            return None
        point = min(points, key=lambda c: c.quality.kl)
        log = {c.name: c for c in self.search_log}
        for budget in self.ranked():
            if point.name in budget.kl:
                fits = [name for name in budget.kl if log[name].memory <= memory]
                return log[budget.choose(point.name, fits)]
        return point

    def _tail_pick(self, memory: float) -> Candidate | None:
        if any(c.quality.kl_p99 is None for c in self.search_log):
            raise ValueError("this profile records no tail KL for its candidates (calibrated before kvguard "
                             "recorded p99 KL): run kvguard calibrate again to rank by the tail")
        points = [c for c in self.search_log if c.memory <= memory]
        return min(points, key=lambda c: (c.quality.kl_p99, c.quality.kl), default=None)

    def plan_summary(self) -> str:
        return self.plan.summary()

    def to_json(self) -> dict:
        out = {"kind": KIND, "kvguard_version": self.kvguard_version, "libraries": dict(self.libraries),
               "model": dict(asdict(self.model), layer_types=list(self.model.layer_types)),
               "data": self.data.to_dict(), "settings": asdict(self.settings), "objective": self.objective.to_dict(),
               "plan": self.plan.to_dict(), "plan_summary": self.plan_summary(), "chosen": self.chosen.to_dict(),
               "constraints_met": self.constraints_met, "monitor": self.monitor.to_dict(),
               "risk_classifier": None if self.risk_classifier is None else self.risk_classifier.to_dict(),
               "pareto_front": list(self.pareto_front), "search_log": [c.to_dict() for c in self.search_log]}
        out.update({k: self.record[k] for k in self.RECORDS if k in self.record})
        return out

    @classmethod
    def from_json(cls, d: dict) -> "ProfileMeta":
        """Every block parsed and validated; :class:`ProfileError` names the first bad one."""
        def block(name: str, parse):
            if name not in d:
                raise ProfileError(f"{JSON_NAME} lacks the {name!r} block")
            try:
                return parse(d[name])
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise ProfileError(f"{JSON_NAME}: invalid {name!r} block: {err}") from None

        risk = d.get("risk_classifier")
        meta = cls(
            model=block("model", ModelInfo.from_dict), plan=block("plan", Plan.from_dict),
            monitor=block("monitor", MonitorConfig.from_dict),
            risk_classifier=None if risk is None else block("risk_classifier", RiskClassifier.from_dict),
            objective=block("objective", Objective.from_dict), settings=block("settings", Settings.from_dict),
            data=block("data", DataManifest.from_dict), chosen=block("chosen", Candidate.from_dict),
            constraints_met=bool(d.get("constraints_met", True)),
            search_log=block("search_log", lambda v: tuple(Candidate.from_dict(c) for c in v)),
            pareto_front=block("pareto_front", lambda v: tuple(str(n) for n in v)),
            kvguard_version=str(d.get("kvguard_version", "unknown")), libraries=dict(d.get("libraries") or {}),
            record={k: d[k] for k in cls.RECORDS if isinstance(d.get(k), dict)})
        names = {c.name for c in meta.search_log}
        ranked = block("ranking", lambda _: [set(b.kl) for b in meta.ranked()]) if "ranking" in d else []
        if any(group - names for group in ranked):  # kvguard@<bytes> runs one of them
            raise ProfileError(f"{JSON_NAME}: the 'ranking' block names candidates the search log lacks: "
                               f"{sorted(set().union(*ranked) - names)}")
        return meta


@dataclass
class Profile:
    """A loaded (or freshly calibrated) profile: ``meta`` is ``profile.json``, ``tensors`` the tensor file."""

    meta: ProfileMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None
    tensors_sha256: str | None = None  # of the tensor file, once written or read

    @property
    def model_name(self) -> str:
        return self.meta.model.name

    @property
    def fingerprint(self) -> str:
        return self.meta.model.fingerprint

    @property
    def plan(self) -> Plan:
        return self.meta.plan

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ProfileError(f"profile {self.path or ''}: {TENSORS_NAME} lacks the tensor {name!r}") from None

    def static_scales(self) -> StaticScales:
        """The calibrated INT8 ranges the plan's INT8 heads use."""
        return StaticScales(self._tensor("calibrated.key.absmax"), self._tensor("calibrated.value.absmax"))

    def entropy_baseline(self) -> EntropyBaseline:
        return EntropyBaseline(*(self._tensor(f"entropy.{k}") for k in ("mean", "std", "count", "normalized")))

    def check_model(self, model) -> None:
        """Raise :class:`ProfileError` unless ``model`` is the model this profile was calibrated on."""
        from kvguard.models import fingerprint

        actual = fingerprint(model)
        if actual != self.fingerprint:
            raise ProfileError(
                f"profile {self.path or ''} was calibrated for model {self.model_name!r} (fingerprint "
                f"{self.fingerprint[:19]}...), but the loaded model has fingerprint {actual[:19]}...; "
                f"calibrate this model with `kvguard calibrate`")

    # ------------------------------------------------------------------ files
    def save(self, directory: str | os.PathLike) -> Path:
        """Write the profile to ``directory`` atomically (replacing an existing profile there)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        if directory.exists() and not (directory / JSON_NAME).is_file() and any(directory.iterdir()):
            raise ProfileError(f"{directory} exists and is not a kvguard profile; refusing to overwrite it")
        with atomic.directory(directory) as tmp:
            tensor_file = tmp / TENSORS_NAME
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(tensor_file))
            digest = _sha256(tensor_file)
            payload = dict(self.meta.to_json(), schema_version=SCHEMA_VERSION, tensors_sha256=digest)
            payload["manifest_sha256"] = manifest_sha256(payload)
            (tmp / JSON_NAME).write_text(json.dumps(payload, indent=2) + "\n")
        self.path, self.tensors_sha256 = directory, digest
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, model=None) -> "Profile":
        """Read a profile; given ``model``, also check that it is the calibrated model."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        if not directory.exists():
            atomic.recover(directory)  # a writer killed between the two renames of a replacement
        json_path, tensor_path = directory / JSON_NAME, directory / TENSORS_NAME
        if not json_path.is_file():
            raise ProfileError(f"{directory} is not a kvguard profile (no {JSON_NAME}); create one with `kvguard calibrate`")
        try:
            raw = json.loads(json_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ProfileError(f"{json_path} is corrupted: {err}") from None
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        if not isinstance(version, int):
            raise ProfileError(f"{json_path} has no schema_version; not a kvguard profile")
        if version > SCHEMA_VERSION:
            raise ProfileError(f"{directory} has profile schema {version}, newer than this kvguard reads "
                               f"({SCHEMA_VERSION}); upgrade kvguard")
        # Profiles from before the manifest hash have none; they load, checked block by block as the rest.
        if "manifest_sha256" in raw and raw["manifest_sha256"] != manifest_sha256(raw):
            raise ProfileError(f"{json_path} was edited or corrupted (its SHA-256 does not match its "
                               f"manifest_sha256); recalibrate, or restore the profile as written")
        if not tensor_path.is_file():
            raise ProfileError(f"{directory} is missing {TENSORS_NAME}")
        if _sha256(tensor_path) != raw.get("tensors_sha256"):
            raise ProfileError(f"{tensor_path} is corrupted (its SHA-256 does not match profile.json)")
        try:
            tensors = load_file(str(tensor_path))
        except (SafetensorError, OSError) as err:
            raise ProfileError(f"{tensor_path} cannot be read: {err}") from None
        try:
            meta = ProfileMeta.from_json(raw)
            check_architecture(meta, tensors)
        except ProfileError as err:
            raise ProfileError(f"{directory}: {err}") from None
        profile = cls(meta, tensors, directory, raw["tensors_sha256"])
        if model is not None:
            profile.check_model(model)
        return profile


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_sha256(payload: dict) -> str:
    """SHA-256 of ``profile.json``'s content without its own ``manifest_sha256`` (canonical JSON: sorted keys)."""
    body = {k: v for k, v in payload.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_architecture(meta: ProfileMeta, tensors: dict[str, torch.Tensor]) -> None:
    """Every block against the architecture the profile records; :class:`ProfileError` names the first field
    that does not fit."""
    from kvguard.risk import NUM_FEATURES

    m = meta.model
    layers, heads = m.num_layers, m.num_kv_heads
    if layers < 1 or heads < 1 or m.head_dim < 1 or len(m.layer_types) != layers:
        raise ProfileError(f"{JSON_NAME}: invalid 'model' block: {layers} layers, {heads} KV heads, head_dim "
                           f"{m.head_dim}, {len(m.layer_types)} layer types")
    for name, plan in (("plan", meta.plan), ("chosen.plan", meta.chosen.plan)):
        if len(plan.layers) != layers:
            raise ProfileError(f"{JSON_NAME}: {name!r} has {len(plan.layers)} layers but model {m.name!r} has {layers}")
        for i, lp in enumerate(plan.layers):
            if len(lp.precision) != heads:
                raise ProfileError(f"{JSON_NAME}: {name!r} layer {i} has {len(lp.precision)} KV heads but model "
                                   f"{m.name!r} has {heads}")
    bad = [i for i in meta.monitor.layers or () if not 0 <= i < layers]
    if bad or len(set(meta.monitor.layers or ())) != len(meta.monitor.layers or ()):
        raise ProfileError(f"{JSON_NAME}: 'monitor' block: monitored layers {list(meta.monitor.layers)} must be "
                           f"distinct and in [0, {layers - 1}]")
    risk = meta.risk_classifier
    if risk is not None and len(risk.features) != NUM_FEATURES:
        raise ProfileError(f"{JSON_NAME}: 'risk_classifier' block has {len(risk.features)} features; the monitor "
                           f"gives {NUM_FEATURES}")
    _check_tensors(tensors, layers, heads, m.head_dim)


def _check_tensors(tensors: dict[str, torch.Tensor], layers: int, heads: int, head_dim: int) -> None:
    for name in REQUIRED_TENSORS:
        if name not in tensors:
            raise ProfileError(f"{TENSORS_NAME} lacks the tensor {name!r}")
    for name in ("calibrated.key.absmax", "calibrated.value.absmax"):
        t = tensors[name]
        if tuple(t.shape) != (layers, heads, head_dim) or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ProfileError(f"{TENSORS_NAME}: {name!r} must be finite, >= 0 and of shape [{layers}, {heads}, "
                               f"{head_dim}], got shape {list(t.shape)}")
    for name in REQUIRED_TENSORS[2:]:
        if tensors[name].dim() < 2 or tensors[name].shape[0] != layers:
            raise ProfileError(f"{TENSORS_NAME}: {name!r} must have one row per layer ({layers}), got shape "
                               f"{list(tensors[name].shape)}")
