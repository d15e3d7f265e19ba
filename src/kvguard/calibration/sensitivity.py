"""Per-layer and per-KV-head sensitivity of a model to KV-cache quantization.

Two measurements per layer, on held-out calibration text (:class:`~kvguard.calibration.heldout.HeldOut`):

- **alone**: only that layer quantized (at the aggressive tier, INT2 by default), every other layer FP16;
- **fp gain**: every layer at the base tier (INT4) except that one, kept FP16 — how much KL the layer's
  full precision buys back.

Then, for the layers that the *alone* measurement ranks most sensitive, the same per KV head. Rankings put
the most sensitive component first; calibration assigns the tiers from them (high -> FP16/INT8, low -> INT2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvguard.calibration.distributed import Executor, LocalExecutor
from kvguard.calibration.heldout import HeldOut
from kvguard.profile import PlanScore
from kvguard.plan import LayerPlan, Plan
from kvguard.precision import Precision


@dataclass(frozen=True)
class Sensitivity:
    """Measured sensitivity (KL in nats per token, perplexity increase in percent, worst domain).

    Attributes:
        base, aggressive: the tiers measured against (e.g. ``int4`` / ``int2``).
        base_kl: KL of every layer at ``base``.
        alone_kl, alone_ppl: ``[layers]``, only that layer at ``aggressive``.
        gain_kl: ``[layers]``, ``base_kl`` minus the KL with that layer FP16 and the rest at ``base``.
        head_alone_kl: ``[layers, KV heads]``, only that head at ``aggressive``; NaN where not measured.
    """

    base: Precision
    aggressive: Precision
    base_kl: float
    alone_kl: torch.Tensor
    alone_ppl: torch.Tensor
    gain_kl: torch.Tensor
    head_alone_kl: torch.Tensor

    def layer_ranking(self) -> list[int]:
        """Layers, most sensitive first (by the *alone* KL)."""
        return sorted(range(self.alone_kl.numel()), key=lambda i: -float(self.alone_kl[i]))

    def head_weights(self) -> torch.Tensor:
        """``[layers, KV heads]``: each head's share of its layer's sensitivity (measured shares where the
        heads were measured, an even split elsewhere)."""
        h = self.head_alone_kl.clone()
        even = torch.full_like(h, 1.0 / h.shape[1])
        measured = ~torch.isnan(h).any(1)
        share = h.clamp_min(0) / h.clamp_min(0).sum(1, keepdim=True).clamp_min(1e-12)
        return torch.where(measured[:, None], share, even)

    def tensors(self, prefix: str = "sensitivity.") -> dict[str, torch.Tensor]:
        return {f"{prefix}{k}": getattr(self, k).contiguous().float() for k in ("alone_kl", "alone_ppl", "gain_kl", "head_alone_kl")}

    def to_dict(self) -> dict:
        return {"base": self.base.value, "aggressive": self.aggressive.value, "base_kl": self.base_kl,
                "layer_ranking": self.layer_ranking()}

    @classmethod
    def from_parts(cls, meta: dict, tensors: dict[str, torch.Tensor], prefix: str = "sensitivity.") -> "Sensitivity":
        return cls(Precision.parse(meta["base"]), Precision.parse(meta["aggressive"]), float(meta["base_kl"]),
                   *(tensors[f"{prefix}{k}"] for k in ("alone_kl", "alone_ppl", "gain_kl", "head_alone_kl")))


def _with_layer(plan: Plan, index: int, precision: tuple[Precision, ...]) -> Plan:
    lp = plan.layers[index]
    return plan.replace_layer(index, LayerPlan(precision, lp.key_clip, lp.value_clip))


def measure(heldout: HeldOut, cache_config, *, base: Precision | str = Precision.INT4,
            aggressive: Precision | str = Precision.INT2, head_layers: int = 4, progress: bool = True,
            executor: Executor | None = None) -> Sensitivity:
    """Run the sensitivity analysis; ``head_layers``: how many of the most sensitive layers also get a
    per-head measurement (only for models with more than one KV head). The trials of each round (all
    layers; then the heads of the layers that round ranked first) run on ``executor`` (default: this
    process, one after another)."""
    base, aggressive = Precision.parse(base), Precision.parse(aggressive)
    executor = executor or LocalExecutor(heldout.model)
    arch = heldout.arch
    n_layers, n_heads = arch.num_layers, arch.num_kv_heads
    fp16 = Plan.uniform(arch, Precision.FP16, cache_config)
    based = Plan.uniform(arch, base, cache_config)
    head_layers = head_layers if n_heads > 1 else 0
    total = 1 + 2 * n_layers + head_layers * n_heads
    bar = tqdm(total=total, desc="sensitivity", unit="plan", disable=not progress)

    def scores(plans: list[Plan]) -> list[PlanScore]:
        out = []
        for s in executor.score(heldout, plans):
            out.append(s)
            bar.update(1)
        return out

    # Round 1: the base plan, then per layer "alone at aggressive" and "FP16 in the base plan".
    layer_plans = [based]
    for i in range(n_layers):
        layer_plans += [_with_layer(fp16, i, (aggressive,) * n_heads), _with_layer(based, i, (Precision.FP16,) * n_heads)]
    first = scores(layer_plans)
    base_kl = first[0].kl
    alone_kl, alone_ppl, gain_kl = (torch.zeros(n_layers) for _ in range(3))
    for i in range(n_layers):
        alone, gain = first[1 + 2 * i], first[2 + 2 * i]
        alone_kl[i], alone_ppl[i] = alone.kl, alone.worst_ppl_increase_pct
        gain_kl[i] = base_kl - gain.kl
    # Round 2: each head of the most sensitive layers alone at aggressive.
    head_alone = torch.full((n_layers, n_heads), float("nan"))
    trials = [(i, h) for i in sorted(range(n_layers), key=lambda j: -float(alone_kl[j]))[:head_layers] for h in range(n_heads)]
    plans = [_with_layer(fp16, i, tuple(aggressive if k == h else Precision.FP16 for k in range(n_heads))) for i, h in trials]
    for (i, h), s in zip(trials, scores(plans)):
        head_alone[i, h] = s.kl
    bar.close()
    return Sensitivity(base, aggressive, base_kl, alone_kl, alone_ppl, gain_kl, head_alone)


def ranking_table(sens: Sensitivity, layer_types: tuple[str, ...], limit: int | None = None) -> str:
    """The ranking as a markdown table (what ``kvguard calibrate`` prints)."""
    lines = [f"| rank | layer | type | KL, {sens.aggressive.value} alone | ppl +%, {sens.aggressive.value} alone | "
             f"KL bought back by FP16 in all-{sens.base.value} | per-head KL ({sens.aggressive.value} alone) |",
             "|---|---|---|---|---|---|---|"]
    for rank, i in enumerate(sens.layer_ranking()[:limit], 1):
        heads = sens.head_alone_kl[i]
        per_head = "-" if bool(torch.isnan(heads).any()) else " / ".join(f"{float(x):.4f}" for x in heads)
        lines.append(f"| {rank} | {i} | {layer_types[i]} | {float(sens.alone_kl[i]):.5f} | "
                     f"{float(sens.alone_ppl[i]):+.2f} | {float(sens.gain_kl[i]):+.5f} | {per_head} |")
    return "\n".join(lines)
