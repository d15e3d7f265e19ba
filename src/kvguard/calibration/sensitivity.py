"""Per-layer and per-KV-head sensitivity of a model to KV-cache quantization.

Two measurements per layer, on held-out calibration text (:class:`~kvguard.calibration.heldout.HeldOut`):

- **alone**: only that layer quantized (at the aggressive tier, INT2 by default), every other layer FP16;
- **fp gain**: every layer at the base tier (INT4) except that one, kept FP16 — how much KL the layer's
  full precision buys back.

Then, for the layers that the *alone* measurement ranks most sensitive, the same per KV head. Rankings put
the most sensitive component first; calibration assigns the tiers from them (high -> FP16/INT8, low -> INT2).

With ``rotation``, two more per layer: *alone* at the aggressive tier with the keys Hadamard-rotated, and with
the values rotated (:mod:`kvguard.rotation`). A side is rotated in a layer where that lowered the layer's KL:
rotation spreads outlier channels over the whole head, which helps most layers below 4 bits but competes with
the per-channel key grouping that already isolates them.

Every round-1 trial departs from all-FP16 or all-base at one layer, so it starts there, from a pass recorded
once under that plan (:mod:`kvguard.calibration.prefix`): the same numbers, for about two thirds of the work.
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
        rotated_kl: ``[layers, 2]``, only that layer at ``aggressive`` with its keys (column 0) / values
            (column 1) rotated; ``None`` where rotation was not measured.
    """

    base: Precision
    aggressive: Precision
    base_kl: float
    alone_kl: torch.Tensor
    alone_ppl: torch.Tensor
    gain_kl: torch.Tensor
    head_alone_kl: torch.Tensor
    rotated_kl: torch.Tensor | None = None

    def rotation(self) -> tuple[list[bool], list[bool]]:
        """Per layer, whether to rotate its keys / values: where that side's rotation measured a lower KL."""
        if self.rotated_kl is None:
            n = self.alone_kl.numel()
            return [False] * n, [False] * n
        better = self.rotated_kl < self.alone_kl[:, None]  # [layers, 2]
        return better[:, 0].tolist(), better[:, 1].tolist()

    def aggressive_kl(self) -> torch.Tensor:
        """``[layers]``: the KL of a layer alone at ``aggressive`` with the chosen rotation. Each rotated side's
        gain is measured with the other side plain; the two are added (small, independent perturbations of
        the output add their KL to first order), and the estimate is kept at or above the best single
        measurement's tenth so that it never reaches zero."""
        alone = self.alone_kl.clamp_min(0).double()
        if self.rotated_kl is None:
            return alone
        gains = (alone[:, None] - self.rotated_kl.clamp_min(0).double()).clamp_min(0)  # [layers, 2]
        best_single = torch.minimum(alone, self.rotated_kl.clamp_min(0).double().min(1).values)
        return torch.maximum(alone - gains.sum(1), 0.1 * best_single)

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
        names = ("alone_kl", "alone_ppl", "gain_kl", "head_alone_kl") + ("rotated_kl",) * (self.rotated_kl is not None)
        return {f"{prefix}{k}": getattr(self, k).contiguous().float() for k in names}

    def to_dict(self) -> dict:
        return {"base": self.base.value, "aggressive": self.aggressive.value, "base_kl": self.base_kl,
                "layer_ranking": self.layer_ranking()}

    @classmethod
    def from_parts(cls, meta: dict, tensors: dict[str, torch.Tensor], prefix: str = "sensitivity.") -> "Sensitivity":
        return cls(Precision.parse(meta["base"]), Precision.parse(meta["aggressive"]), float(meta["base_kl"]),
                   *(tensors[f"{prefix}{k}"] for k in ("alone_kl", "alone_ppl", "gain_kl", "head_alone_kl")),
                   tensors.get(f"{prefix}rotated_kl"))  # absent in profiles calibrated without rotation


def _with_layer(plan: Plan, index: int, precision: tuple[Precision, ...], keys: bool = False,
                values: bool = False) -> Plan:
    lp = plan.layers[index]
    return plan.replace_layer(index, LayerPlan(precision, lp.key_clip, lp.value_clip, keys, values))


def measure(heldout: HeldOut, cache_config, *, base: Precision | str = Precision.INT4,
            aggressive: Precision | str = Precision.INT2, head_layers: int = 4, rotation: bool = False,
            progress: bool = True, executor: Executor | None = None) -> Sensitivity:
    """Run the sensitivity analysis; ``head_layers``: how many of the most sensitive layers also get a
    per-head measurement (only for models with more than one KV head); ``rotation``: also measure each layer
    alone with its keys / values rotated. The trials of each round (all layers; then the heads of the layers
    that round ranked first) run on ``executor`` (default: this process, one after another)."""
    base, aggressive = Precision.parse(base), Precision.parse(aggressive)
    executor = executor or LocalExecutor(heldout.model)
    arch = heldout.arch
    n_layers, n_heads = arch.num_layers, arch.num_kv_heads
    fp16 = Plan.uniform(arch, Precision.FP16, cache_config)
    based = Plan.uniform(arch, base, cache_config)
    head_layers = head_layers if n_heads > 1 else 0
    rotation = rotation and arch.head_dim & (arch.head_dim - 1) == 0  # the transform needs a power-of-2 head_dim
    total = 1 + (4 if rotation else 2) * n_layers + head_layers * n_heads
    bar = tqdm(total=total, desc="sensitivity", unit="plan", disable=not progress)

    def scores(plans: list[Plan]) -> list[PlanScore]:
        out = []
        for s in executor.score(heldout, plans, anchors=(fp16, based)):  # each trial starts where it departs
            out.append(s)
            bar.update(1)
        return out

    # Round 1: the base plan, then per layer "alone at aggressive" and "FP16 in the base plan" (and alone at
    # aggressive with keys, then values, rotated).
    per_layer = 4 if rotation else 2
    layer_plans = [based]
    for i in range(n_layers):
        alone = (aggressive,) * n_heads
        layer_plans += [_with_layer(fp16, i, alone), _with_layer(based, i, (Precision.FP16,) * n_heads)]
        if rotation:
            layer_plans += [_with_layer(fp16, i, alone, keys=True), _with_layer(fp16, i, alone, values=True)]
    first = scores(layer_plans)
    base_kl = first[0].kl
    alone_kl, alone_ppl, gain_kl = (torch.zeros(n_layers) for _ in range(3))
    rotated_kl = torch.zeros(n_layers, 2) if rotation else None
    for i in range(n_layers):
        alone, gain, *rotated = first[1 + per_layer * i:1 + per_layer * (i + 1)]
        alone_kl[i], alone_ppl[i] = alone.kl, alone.worst_ppl_increase_pct
        gain_kl[i] = base_kl - gain.kl
        if rotation:
            rotated_kl[i] = torch.tensor([r.kl for r in rotated])
    # Round 2: each head of the most sensitive layers alone at aggressive.
    head_alone = torch.full((n_layers, n_heads), float("nan"))
    trials = [(i, h) for i in sorted(range(n_layers), key=lambda j: -float(alone_kl[j]))[:head_layers] for h in range(n_heads)]
    plans = [_with_layer(fp16, i, tuple(aggressive if k == h else Precision.FP16 for k in range(n_heads))) for i, h in trials]
    for (i, h), s in zip(trials, scores(plans)):
        head_alone[i, h] = s.kl
    bar.close()
    return Sensitivity(base, aggressive, base_kl, alone_kl, alone_ppl, gain_kl, head_alone, rotated_kl)


def ranking_table(sens: Sensitivity, layer_types: tuple[str, ...], limit: int | None = None) -> str:
    """The ranking as a markdown table (what ``kvguard calibrate`` prints)."""
    agg = sens.aggressive.value
    rotated = sens.rotated_kl is not None
    lines = [f"| rank | layer | type | KL, {agg} alone | ppl +%, {agg} alone | "
             f"KL bought back by FP16 in all-{sens.base.value} | per-head KL ({agg} alone) |"
             + f" KL, {agg} alone, keys / values rotated |" * rotated,
             "|---|---|---|---|---|---|---|" + "---|" * rotated]
    keys, values = sens.rotation()
    for rank, i in enumerate(sens.layer_ranking()[:limit], 1):
        heads = sens.head_alone_kl[i]
        per_head = "-" if bool(torch.isnan(heads).any()) else " / ".join(f"{float(x):.4f}" for x in heads)
        line = (f"| {rank} | {i} | {layer_types[i]} | {float(sens.alone_kl[i]):.5f} | "
                f"{float(sens.alone_ppl[i]):+.2f} | {float(sens.gain_kl[i]):+.5f} | {per_head} |")
        if rotated:  # a star marks the side the plan rotates
            k, v = (float(x) for x in sens.rotated_kl[i])
            line += f" {k:.5f}{'*' * keys[i]} / {v:.5f}{'*' * values[i]} |"
        lines.append(line)
    return "\n".join(lines)
