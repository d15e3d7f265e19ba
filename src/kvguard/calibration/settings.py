"""What ``kvguard calibrate`` is asked for: :class:`CalibrationConfig` (the command line's defaults are its own)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path

from kvguard import data
from kvguard.config import Objective
from kvguard.profile import Settings

RECOMMENDED_SAMPLES = 5000


class Search(str, Enum):
    """How much of the low-bit search level 2 runs (:meth:`kvguard.calibration.search.Searcher.level2_low_bit`).

    - ``full``: every low-bit target in every low-bit format, the softmax-bias and keys-before-RoPE twins, and the
      ablation plans; what ``kvguard calibrate`` runs.
    - ``quick``: no rotation trials in the sensitivity stage (half its trials; the low-bit plans are not rotated), and
      the low-bit frontier in the model's low-bit layout only, at :data:`~kvguard.calibration.search.QUICK_TARGETS`
      and its floor, with the softmax-bias twins: about a tenth of the full level 2's plans. ``kvguard run``'s quick
      profile: a look at the frontier in minutes, not a profile to serve.
    """

    FULL = "full"
    QUICK = "quick"


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``kvguard calibrate`` was asked for (the command line's defaults are these).

    Attributes:
        model: embedded model name or local model folder.
        out: the profile directory to write.
        samples: calibration samples, mixed evenly over ``domains``.
        domains: calibration corpora (``prose``, ``dialog``, ``code``, ``long``).
        max_tokens: tokens per sample.
        batch_size: samples per statistics batch.
        heldout_tokens: held-out calibration tokens (split over the domains) that score every candidate.
        context: the context length memory is measured at.
        head_layers: the most sensitive layers also measured per KV head.
        latency_context: the context of the latency measurement.
        seed: random seed.
        low_bit: also search below INT4: INT3, per-layer key / value rotation, the low-bit layout, and plans
            down to about half of the all-INT4 bytes (about twice the sensitivity stage's trials).
        ranking_tokens: calibration tokens (split over the domains, from documents no sample or held-out slice
            read) that re-score the closest low-bit candidates at the frontier's mid budgets
            (:mod:`kvguard.calibration.ranking`); 0: off. Used with ``low_bit`` only.
        objective: the score's weights and the constraints.
        device: where the model runs (``cpu``, ``cuda``, ``auto``; :mod:`kvguard.device`).
        search: how much of the low-bit search runs (:class:`Search`).
    """

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
    low_bit: bool = True
    ranking_tokens: int = 3072
    objective: Objective = field(default_factory=Objective)
    device: str = "cpu"
    search: Search = Search.FULL

    def __post_init__(self) -> None:
        from kvguard.device import Device

        Device(self.device)  # a ValueError listing the valid names
        try:
            object.__setattr__(self, "search", Search(self.search))
        except ValueError:
            raise ValueError(f"search has to be one of {[s.value for s in Search]} but got {self.search!r}") from None
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
        if self.ranking_tokens < 0:
            raise ValueError(f"ranking_tokens must be 0 (off) or positive, got {self.ranking_tokens}")
        if self.heldout_tokens // len(self.domains) < 256:
            raise ValueError(f"heldout_tokens gives each domain {self.heldout_tokens // len(self.domains)} tokens; "
                             f"at least 256 per domain are needed to see quantized keys")

    def key(self) -> str:
        """A digest of everything that decides the result (``--resume`` refuses a different one)."""
        from kvguard.device import name

        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("out", "device")}
        d["objective"] = self.objective.to_dict()
        if not (self.low_bit and self.ranking_tokens):
            del d["ranking_tokens"]  # no effect: a run without the ranking keeps the digest it had before it existed
        if self.search is Search.FULL or not self.low_bit:
            del d["search"]  # likewise: a full search keeps the digest it had before there was a quick one
        else:
            d["search"] = self.search.value
        # A GPU's float kernels round differently, so a CUDA run is a different result; a CPU one keeps the digest
        # it had before there was a device setting (cached `kvguard run` profiles stay valid).
        if name(self.device) != "cpu":
            d["device"] = name(self.device)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]

    def settings(self) -> Settings:
        return Settings(self.seed, self.batch_size, self.heldout_tokens, self.context, self.head_layers,
                        self.latency_context, self.ranking_tokens if self.low_bit else 0)
