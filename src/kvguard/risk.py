"""The risk classifier behind dynamic precision: logistic regression on the monitor's evidence.

Inputs are one layer's window means of :data:`kvguard.calibration.signals.FEATURES` (entropy drop, its size, and the
attention-weighted key / value quantization error); the output is the probability that the window's
next-token ``KL(fp16 || quantized)`` exceeds ``kl_threshold`` (0.01 nats by default: about a 1 % local
perplexity cost). It is trained during calibration on held-out calibration text under several plans, and
stored in the profile as plain numbers (``profile.json``), never pickled.

It is core, not a stage's: the profile stores it, calibration fits it and the run-time session applies it, and
the core imports no stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The monitor's window means per layer (control/monitor.py, ``features()``): drop, |drop|, K error, V error.
NUM_FEATURES = 4


@dataclass(frozen=True)
class RiskClassifier:
    """``p = sigmoid(bias + sum_i weight_i * (x_i - mean_i) / std_i)``."""

    features: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    weight: tuple[float, ...]
    bias: float
    kl_threshold: float

    def __post_init__(self) -> None:
        n = len(self.features)
        if not (len(self.mean) == len(self.std) == len(self.weight) == n) or n == 0:
            raise ValueError("risk classifier: features, mean, std and weight need one entry per feature")
        values = (*self.mean, *self.std, *self.weight, self.bias, self.kl_threshold)
        if not all(math.isfinite(v) for v in values) or any(s <= 0 for s in self.std):
            raise ValueError("risk classifier: coefficients must be finite and std positive")

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., features]`` -> ``[...]`` log-odds."""
        mean, std, w = (torch.tensor(v, dtype=torch.float32) for v in (self.mean, self.std, self.weight))
        return ((x.float() - mean) / std) @ w + self.bias

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Risk in [0, 1] for ``x`` ``[..., features]``."""
        return torch.sigmoid(self.logit(x))

    @classmethod
    def fit(cls, x: torch.Tensor, labels: torch.Tensor, features: tuple[str, ...], kl_threshold: float, *,
            l2: float = 1e-3, steps: int = 200) -> "RiskClassifier":
        """Fit on ``x`` ``[N, features]`` and binary ``labels`` ``[N]`` (L2-regularised, class-balanced)."""
        x, y = x.double().reshape(-1, len(features)), labels.double().reshape(-1)
        if x.shape[0] != y.shape[0] or x.shape[0] < 2:
            raise ValueError(f"need matching features and labels (>= 2 rows), got {tuple(x.shape)}, {tuple(y.shape)}")
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
        z = (x - mean) / std
        pos = float(y.sum())
        if pos == 0 or pos == y.numel():
            # One class only: a constant classifier at the observed rate (no evidence to weigh).
            rate = min(max(pos / y.numel(), 1e-3), 1 - 1e-3)
            return cls(tuple(features), tuple(mean.tolist()), tuple(std.tolist()), (0.0,) * len(features),
                       math.log(rate / (1 - rate)), kl_threshold)
        # Balanced weights so rare positives count as much as the many negatives.
        sample_w = torch.where(y > 0, 0.5 / pos, 0.5 / (y.numel() - pos))
        w = torch.zeros(len(features), dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, reduction="none") * sample_w).sum()
            loss = loss + l2 * (w ** 2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return cls(tuple(features), tuple(mean.tolist()), tuple(std.tolist()), tuple(w.detach().tolist()),
                   float(b.detach()), kl_threshold)

    def to_dict(self) -> dict:
        return {"features": list(self.features), "mean": list(self.mean), "std": list(self.std),
                "weight": list(self.weight), "bias": self.bias, "kl_threshold": self.kl_threshold}

    @classmethod
    def from_dict(cls, data: dict) -> "RiskClassifier":
        try:
            return cls(tuple(data["features"]), tuple(map(float, data["mean"])), tuple(map(float, data["std"])),
                       tuple(map(float, data["weight"])), float(data["bias"]), float(data["kl_threshold"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"invalid risk classifier: {err}") from None
