"""The calibration profile: everything the run-time half needs, tied to one exact model.

A profile is a directory:

- ``profile.json`` — schema version, model name and fingerprint, kvguard and library versions, the data
  manifest, the chosen plan (tiers and clip ratios), the run-time monitor thresholds, the objective, the
  latency model, the sensitivity ranking, the Pareto frontier and the search log;
- ``tensors.safetensors`` — calibrated scales and zero points, per-batch K/V statistics and their
  aggregates, the attention-entropy baseline and the sensitivity measurements.

It is written atomically (a temporary directory renamed into place) and never pickled. Loading checks the
schema version, a SHA-256 of the tensor file, and — given a model — its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvguard.entropy import EntropyBaseline
from kvguard.plan import Plan, StaticScales
from kvguard.statistics import KVStatistics

SCHEMA_VERSION = 1
JSON_NAME = "profile.json"
TENSORS_NAME = "tensors.safetensors"

# The run-time monitor's defaults (SPEC, part 2); calibration writes them into every profile.
MONITOR_DEFAULTS = {
    "window_tokens": 32,          # sliding mean over the last 32 tokens
    "refresh_tokens": 8,          # refreshed every 8 tokens
    "baseline_tokens": 64,        # drops are measured against the sequence's own level (time constant)
    "warn_drop": 0.20,            # warn when the window mean falls 20 % below baseline
    "trigger_drop": 0.25,         # recompute after 3 consecutive tokens 25 % below baseline
    "trigger_consecutive": 3,
    "light_drop": 0.20,           # > 20 %: light compensation, recompute the current layer's KV
    "heavy_drop": 0.35,           # > 35 %: heavy compensation, recompute the most recent 4 layers
    "heavy_layers": 4,
    "recompute_fraction": [0.02, 0.05],  # the 2-5 % most sensitive positions
    "max_trigger_rate": 0.05,     # normally < 5 %; a sharp rise means recalibrate
}


class ProfileError(ValueError):
    """A profile that cannot be used: missing, corrupted, from a newer kvguard, or for another model."""


@dataclass
class Profile:
    """A loaded (or freshly calibrated) profile: ``meta`` is ``profile.json``, ``tensors`` the tensor file."""

    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None

    @property
    def model_name(self) -> str:
        return self.meta["model"]["name"]

    @property
    def fingerprint(self) -> str:
        return self.meta["model"]["fingerprint"]

    @property
    def plan(self) -> Plan:
        return Plan.from_dict(self.meta["plan"])

    @property
    def monitor(self) -> dict:
        return dict(self.meta["monitor"])

    def static_scales(self) -> StaticScales:
        """The calibrated INT8 ranges the plan's INT8 heads use."""
        return StaticScales(self.tensors["calibrated.key.absmax"], self.tensors["calibrated.value.absmax"])

    def statistics(self) -> KVStatistics:
        """The per-batch history (float16)."""
        return KVStatistics.from_tensors(self.tensors)

    def aggregate_statistics(self) -> dict[str, torch.Tensor]:
        """K/V statistics over all calibration batches, ``"key.mean"`` ... -> ``[layers, KV heads, D]``."""
        return KVStatistics.aggregate_from(self.tensors)

    def entropy_baseline(self) -> EntropyBaseline:
        return EntropyBaseline.from_tensors(self.tensors)

    def risk_classifier(self):
        """The run-time risk classifier trained during calibration (``None`` in profiles without one)."""
        from kvguard.risk import RiskClassifier

        data = self.meta.get("risk_classifier")
        if data is None:
            return None
        try:
            return RiskClassifier.from_dict(data)
        except ValueError as err:
            raise ProfileError(f"profile {self.path or ''}: {err}") from None

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
        directory.parent.mkdir(parents=True, exist_ok=True)
        if directory.exists() and not (directory / JSON_NAME).is_file() and any(directory.iterdir()):
            raise ProfileError(f"{directory} exists and is not a kvguard profile; refusing to overwrite it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            tensor_file = tmp / TENSORS_NAME
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(tensor_file))
            meta = dict(self.meta, schema_version=SCHEMA_VERSION, tensors_sha256=_sha256(tensor_file))
            with open(tmp / JSON_NAME, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=False)
                f.write("\n")
            old = None
            if directory.exists():
                old = directory.parent / f".{directory.name}.old-{os.getpid()}"
                os.replace(directory, old)
            os.replace(tmp, directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.meta, self.path = meta, directory
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, model=None) -> "Profile":
        """Read a profile; given ``model``, also check that it is the calibrated model."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        json_path, tensor_path = directory / JSON_NAME, directory / TENSORS_NAME
        if not json_path.is_file():
            raise ProfileError(f"{directory} is not a kvguard profile (no {JSON_NAME}); create one with `kvguard calibrate`")
        try:
            meta = json.loads(json_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ProfileError(f"{json_path} is corrupted: {err}") from None
        version = meta.get("schema_version") if isinstance(meta, dict) else None
        if not isinstance(version, int):
            raise ProfileError(f"{json_path} has no schema_version; not a kvguard profile")
        if version > SCHEMA_VERSION:
            raise ProfileError(f"{directory} has profile schema {version}, newer than this kvguard reads "
                               f"({SCHEMA_VERSION}); upgrade kvguard")
        if not tensor_path.is_file():
            raise ProfileError(f"{directory} is missing {TENSORS_NAME}")
        if _sha256(tensor_path) != meta.get("tensors_sha256"):
            raise ProfileError(f"{tensor_path} is corrupted (its SHA-256 does not match profile.json)")
        try:
            tensors = load_file(str(tensor_path))
        except (SafetensorError, OSError) as err:
            raise ProfileError(f"{tensor_path} cannot be read: {err}") from None
        missing = [k for k in ("model", "plan", "monitor") if k not in meta]
        if missing:
            raise ProfileError(f"{json_path} lacks {missing}")
        profile = cls(meta, tensors, directory)
        try:
            profile.plan
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(f"{json_path} has an invalid plan: {err}") from None
        if model is not None:
            profile.check_model(model)
        return profile


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
