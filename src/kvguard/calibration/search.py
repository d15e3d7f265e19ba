"""Hierarchical search for a mixed-precision plan.

Level 1 picks the global format (INT8 / INT4 / INT3 / INT2, and the cache layout); level 2 allocates a tier to
every layer and KV head from the measured sensitivity, with each layer's keys / values Hadamard-rotated where
the sensitivity measured that rotation helps, at memory targets from the budget down to about half of the
all-INT4 bytes (the low-bit frontier ``kvguard@<bytes>`` picks from); level 3 tunes the clipping ratio of the
most sensitive quantized layers. Every candidate is *measured* on held-out calibration text and scored by

    Score = alpha * Memory + beta * Latency + gamma * PerplexityPenalty

with Memory the KV bytes over an FP16 cache at the reference context, Latency the decode-time ratio from a
cost model calibrated by measurement, and PerplexityPenalty the perplexity increase in percent on held-out
calibration text *as the measured next-token KL predicts it*: ``100 * (exp(KL) - 1)``, the expected increase
of perplexity under the FP16 model's own predictions. On a ~1,500-token slice the directly measured
increase is dominated by which tokens happen to be there (uniform INT4 on SmolLM2 measures anywhere from
-0.4 % to +0.7 % depending on the text), while the KL ranks plans by how much they actually distort the
output distribution; the measured increase (worst domain) still enforces ``max_ppl_increase``.
Constraints (``max_ppl_increase``, ``memory_budget``)
come first: the chosen plan is the lowest-scoring candidate that meets them.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from kvguard import score_bias
from kvguard.architecture import Architecture
from kvguard.calibration.distributed import Executor, LocalExecutor
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.latency import TIERS, LatencyModel
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.config import CacheConfig, Objective
from kvguard.plan import LayerPlan, Plan, StaticScales
from kvguard.precision import Precision
from kvguard.profile import Candidate

# Cache layouts level 1 tries: the default (FP window 64, groups of 32), a shorter FP window, larger groups
# (half the scale / zero-point bytes), and the low-bit layouts.
LAYOUTS = {"window-64": CacheConfig(), "window-32": CacheConfig(residual=32), "group-64": CacheConfig(group_size=64),
           "window-32 group-64 w8 s8": CacheConfig(residual=32, group_size=64, window_bits=8, scale_bits=8,
                                                   range_search=True),
           "window-16 value-group-64 w8 s8": CacheConfig(residual=16, value_group_size=64, window_bits=8, scale_bits=8,
                                                         range_search=True)}
DEFAULT_LAYOUT = "window-64"
# Below 3 bits the FP window and the scales are a third of the bytes, so the low-bit frontier lives in a layout
# that shrinks one of them, and which one pays more depends on the model. Groups of 64 halve the scale bytes; a
# 16-token window with groups of 32 halves the window instead (tokens wait in it R + G/2 = 32 on average, not
# 64), which is the larger share where sliding layers keep few tokens (Gemma 3: 512). Values take groups of 64
# channels in both: they are quantized per token, so a wider value group thins the scales without keeping a token
# longer at full precision (on Gemma 3's calibration text, values rotated, all-INT3: 5 % fewer bytes for at most
# 4 % more KL; 128 channels cost 11-12 % more KL for another 3 %). The search uses the one that stores all-INT3 in
# fewer bytes at the calibration context (:func:`low_bit_layout`), the first on a tie, among those whose groups
# divide the head dimension. Both keep the window in 8 bits, as the INT8 tier stores (``w8``: calibrated scales, no
# per-token bytes): on Gemma 3's calibration text at all-INT3 that stores 6.5 % fewer bytes for 4 % (prose) / 12 %
# (code) more KL; level 2 also allocates its targets with a 16-bit window (:meth:`Searcher.low_bit_layouts`;
# benchmarks/DECISIONS.md, "Can the FP window be stored in 8 bits?"). Both also store the INT3 / INT2 groups' scales and zero points in
# one byte each and search those groups' ranges (``s8``: ``CacheConfig.scale_bits`` / ``range_search``). On
# SmolLM2's calibration prose, all heads rotated (``benchmarks/scale_bytes.py``, in the history), all-INT2 went from 0.197 of
# FP16's bytes at KL 0.060 to 0.174 at 0.047, all-INT3 from 0.258 at 0.00675 to 0.235 at 0.00666; the search's
# floors fell from 0.191 to 0.168 (Gemma 3) and 0.168 to 0.153 (SmolLM2) of FP16's bytes.
LOW_BIT_LAYOUTS = ("window-32 group-64 w8 s8", "window-16 value-group-64 w8 s8")
CLIP_GRID = (0.95, 0.9)
# Low-bit memory targets as fractions of the default layout's all-INT4 bytes (B4), and the ones also searched
# without rotation and without INT3 (the ablation at a fixed budget, kept in the search log).
LOW_BIT_TARGETS = (0.85, 0.75, 0.68, 0.60, 0.52, 0.45)
ABLATION_TARGETS = (0.75, 0.60)
# The quick search's low-bit targets (``Search.QUICK``, ``kvguard run``): one near INT4's bytes, step 3's plan's, and
# the floor, in the model's low-bit layout only.
QUICK_TARGETS = (0.85, 0.60)
# From this fraction of B4 up, level 2 also allocates in the low-bit layout with float16 scales and [min, max]
# ranges (:meth:`Searcher.low_bit_layouts`). There the plans are mostly INT4 and INT3, and the one byte a scale
# saves is a small share of the bytes. On SmolLM2's held-out text the one-byte (``s8``) plans measured KL 0.00732
# at 0.68 x B4 and 0.00413 at 0.75, the previous profile's float16-scale ones 0.00538 and 0.00384; below 0.68 the
# one-byte ones won on both models (0.60 x B4: 0.00936 against 0.01008, Gemma 3 0.00807 against 0.01047). With
# both in the search, SmolLM2's float16-scale plans won 0.68 / 0.75 / 0.85 x B4 (0.00538 / 0.00406 / 0.00136 against
# 0.00732 / 0.00413 / 0.00152), and on the eval split its 0.75 x B4 plan went from +1.32 / +2.73 / +0.45 % (prose /
# code / dialog) to +0.68 / +0.24 / +0.93 % (benchmarks/DECISIONS.md, "Above 0.68 x B4, float16 scales as well?").
WIDE_SCALES_FROM = 0.68
# From this fraction of B4 up, level 2 also scores each low-bit plan with the softmax-bias correction (``+sb``,
# :meth:`Searcher.corrected`). Below it the plans are mostly INT2 in groups with searched ranges, where the
# correction's model of the keys' noise (uniform rounding within the group's step) does not hold, and in both models'
# search logs it raised the held-out KL at every such target, in both one-byte layouts (SmolLM2 0.52 / 0.45 x B4 and
# the floor: 0.01669 -> 0.01854, 0.04322 -> 0.05607, 0.05456 -> 0.07749; Gemma 3: 0.01508 -> 0.01778, 0.02989 ->
# 0.03318, 0.04073 -> 0.04737), while at 0.60 x B4 it won on Gemma 3 (0.00838 -> 0.00807). Skipping those twins
# saves five scoring passes per model.
CORRECTED_FROM = 0.60
INT3, INT2 = TIERS.index(Precision.INT3), TIERS.index(Precision.INT2)


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates no other candidate beats on both memory and (expected, KL-predicted) perplexity increase,
    ordered by memory."""
    front = []
    for c in sorted(candidates, key=lambda c: (c.memory, c.quality.kl)):
        if not front or c.quality.kl < front[-1].quality.kl:
            front.append(c)
    return front


def low_bit_layout(model_config, context: int) -> str:
    """The name of the :data:`LOW_BIT_LAYOUTS` entry that stores an all-INT3 cache of ``context`` tokens in the
    fewest bytes (shapes only: no model run)."""
    arch = Architecture.from_config(model_config)

    def int3_bytes(name: str) -> int:
        return Plan.uniform(arch, Precision.INT3, LAYOUTS[name]).kv_bytes(model_config, context)[0]

    fitting = [name for name in LOW_BIT_LAYOUTS if arch.head_dim % LAYOUTS[name].value_group == 0]
    return min(fitting, key=int3_bytes) if fitting else DEFAULT_LAYOUT


def int4_bytes(candidates: list[Candidate]) -> float:
    """B4: level 1's all-INT4 plan in the default layout, its bytes over FP16's (the unit of the low-bit targets)."""
    return next(c.memory for c in candidates if c.name == f"L1 all-int4 {DEFAULT_LAYOUT}")


def best(candidates: list[Candidate]) -> Candidate:
    """The lowest score among feasible candidates; with none feasible, the lowest score among those that keep
    the perplexity limit, else overall (the caller reports that the constraints were not met). Plans with keys
    stored before RoPE are left out where any other is there: the chosen plan is what decoding runs by default
    and what the engine exports describe, and the GPU kernel and the engines read post-RoPE codes only (those
    plans stay on the frontier, for ``kvguard@<bytes>``; the CPU kernels read them)."""
    post_rope = [c for c in candidates if not c.plan.cache.prerope_keys] or candidates
    feasible = [c for c in post_rope if c.feasible]
    pool = feasible or post_rope
    return min(pool, key=lambda c: (c.score, c.quality.kl, c.memory, c.name))


class Searcher:
    """Scores plans on held-out text and keeps the log of every candidate."""

    def __init__(self, model, heldout: HeldOut, objective: Objective, latency: LatencyModel, *,
                 scales: StaticScales | None = None, context: int = 2048, progress: bool = True,
                 executor: Executor | None = None, quick: bool = False) -> None:
        self.model, self.heldout, self.objective, self.latency = model, heldout, objective, latency
        self.quick = quick  # the quick low-bit search (:class:`~kvguard.calibration.settings.Search`)
        self.executor = executor or LocalExecutor(model)  # where the held-out scores run
        self.scales = scales  # calibrated INT8 ranges: INT8 heads are scored as they will run
        self.arch = heldout.arch
        self.context = context
        self.progress = progress
        self.log: list[Candidate] = []
        self._bytes_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer_bytes(self, cache_config: CacheConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bytes [layers, tiers], fp16 reference bytes [layers])`` of uniform caches at the reference context."""
        cache_config = replace(cache_config, prerope_keys=False)  # the same bytes, however keys are turned
        key = tuple(sorted(cache_config.to_dict().items()))
        if key not in self._bytes_cache:
            table = torch.zeros(self.arch.num_layers, len(TIERS), dtype=torch.float64)
            ref = torch.zeros(self.arch.num_layers, dtype=torch.float64)
            zeros = torch.zeros(1, self.arch.num_kv_heads, self.context, self.arch.head_dim)
            for j, tier in enumerate(TIERS):
                plan = Plan.uniform(self.arch, tier, cache_config)
                cache = plan.make_cache(self.model.config, plan.sizing_scales(self.arch, None))
                for i, layer in enumerate(cache.layers):
                    cache.update(zeros, zeros, i)
                    table[i, j] = layer.nbytes()
                    ref[i] = layer.fp16_nbytes()
            self._bytes_cache[key] = (table, ref)
        return self._bytes_cache[key]

    def evaluate(self, name: str, level: int, plan: Plan) -> Candidate:
        return self.evaluate_all([(name, level, plan)])[0]

    def evaluate_all(self, todo: list[tuple[str, int, Plan]], desc: str | None = None) -> list[Candidate]:
        """Score ``(name, level, plan)`` candidates (together, on the executor), log them in order and return them."""
        qualities = self.executor.score(self.heldout, [plan for _, _, plan in todo], self.scales)
        out = []
        for (name, level, plan), quality in tqdm(zip(todo, qualities), total=len(todo), desc=desc, unit="plan",
                                                  disable=not self.progress or desc is None):
            stored, fp16 = plan.kv_bytes(self.model.config, self.context)
            memory = stored / fp16
            _, ref = self.layer_bytes(plan.cache)
            latency = self.latency.plan_latency(plan, (ref / ref.sum()).float())
            ppl = quality.worst_ppl_increase_pct
            out.append(Candidate(name, level, plan, memory, latency, quality,
                                 self.objective.score(memory, latency, quality.kl), self.objective.feasible(memory, ppl)))
        self.log += out
        return out

    # ------------------------------------------------------------------ level 1
    def level1(self, low_bit: bool = False) -> list[Candidate]:
        """Global precision x cache layout: INT8 and INT4 in every layout but the low-bit ones; all-INT2 in the
        default layout as the floor of the frontier; with ``low_bit``, INT8 and INT4 in the model's low-bit
        layout too, and all-INT3 and all-INT2 rotated in the default and the low-bit layouts (their KL ratio
        prices INT3 in level 2)."""
        low = self.low_bit_layout if low_bit else None
        todo = [(f"L1 all-{tier.value} {lname}", 1, Plan.uniform(self.arch, tier, layout))
                for lname, layout in LAYOUTS.items() for tier in (Precision.INT8, Precision.INT4)
                if lname not in LOW_BIT_LAYOUTS or lname == low]
        todo.append((f"L1 all-int2 {DEFAULT_LAYOUT}", 1, Plan.uniform(self.arch, Precision.INT2, LAYOUTS[DEFAULT_LAYOUT])))
        if low_bit and self.rotatable:
            todo += [(f"L1 all-{tier.value}+rot {lname}", 1, Plan.uniform(self.arch, tier, LAYOUTS[lname]).with_rotation(True, True))
                     for lname in self.frontier_layouts for tier in (Precision.INT3, Precision.INT2)]
        return self.evaluate_all(todo, "search level 1")

    @functools.cached_property
    def low_bit_layout(self) -> str:
        """This model's low-bit layout at the calibration context (:func:`low_bit_layout`; worked out once: it
        builds a cache per candidate layout)."""
        return low_bit_layout(self.model.config, self.context)

    @property
    def frontier_layouts(self) -> tuple[str, ...]:
        """The layouts the low-bit frontier is searched in: the default and the low-bit one, once each (they are
        the same where no low-bit layout fits the head)."""
        return tuple(dict.fromkeys((DEFAULT_LAYOUT, self.low_bit_layout)))

    @property
    def rotatable(self) -> bool:
        return self.arch.head_dim & (self.arch.head_dim - 1) == 0  # the transform needs a power-of-2 head_dim

    # ------------------------------------------------------------------ level 2
    def unit_costs(self, sens: Sensitivity, int8_kl: float, int3_ratio: float | None = None,
                   rotated: bool = False) -> torch.Tensor:
        """Predicted KL ``[layers, KV heads, tiers]`` of storing one head at each tier (others FP16): FP16 0,
        INT8 an even share of the measured all-INT8 KL, INT4 a share of the measured all-INT4 KL (half by the
        KL the layer's FP16 buys back, half by its INT2 *alone* KL, which is far less noisy), INT2 the measured
        *alone* KL (``rotated``: with the layer's chosen rotation, for plans that apply it), INT3 that times
        ``int3_ratio`` (all-INT3 over all-INT2 KL, both rotated, measured in level 1; without it INT3 costs as
        much as INT2 and is never chosen); split over heads by the measured head shares."""
        n_layers, n_heads = self.arch.num_layers, self.arch.num_kv_heads
        w = sens.head_weights()  # [L, H]
        costs = torch.zeros(n_layers, n_heads, len(TIERS), dtype=torch.float64)
        costs[..., 1] = max(int8_kl, 0.0) / (n_layers * n_heads)
        alone = sens.alone_kl.clamp_min(0).double()
        gain = sens.gain_kl.clamp_min(0).double()
        share = 0.5 * alone / alone.sum().clamp_min(1e-12) + 0.5 * gain / gain.sum().clamp_min(1e-12)
        costs[..., 2] = max(sens.base_kl, 0.0) * share[:, None] * w
        # A plan that does not rotate must not be priced by the rotated KL: that sent SmolLM2's layer 0 to INT2.
        costs[..., INT2] = (sens.aggressive_kl() if rotated else alone)[:, None] * w
        costs[..., INT3] = costs[..., INT2] * (1.0 if int3_ratio is None else min(max(int3_ratio, 0.0), 1.0))
        return costs.cummax(dim=-1).values  # a lower tier never predicts less error than a higher one

    def allocate(self, costs: torch.Tensor, layout: CacheConfig, memory: float,
                 rotation: tuple[list[bool], list[bool]] | None = None) -> Plan:
        """The plan with the least predicted KL whose predicted memory is at most ``memory`` (Lagrangian
        relaxation: each head takes the tier minimising ``cost + lambda * bytes``; ``lambda`` by bisection).
        ``rotation``: per layer, whether its keys / values are rotated (where a head is below INT8)."""
        table, ref = self.layer_bytes(layout)
        per_head = (table / self.arch.num_kv_heads)[:, None, :].expand_as(costs)  # [L, H, tiers]
        budget = memory * float(ref.sum())

        def assign(lam: float) -> torch.Tensor:
            return (costs + lam * per_head).argmin(-1)

        def used(choice: torch.Tensor) -> float:
            return float(per_head.gather(-1, choice[..., None]).sum())

        lo, hi = 0.0, 1.0
        while used(assign(hi)) > budget and hi < 1e12:
            hi *= 10
        for _ in range(60):
            mid = (lo + hi) / 2
            if used(assign(mid)) > budget:
                lo = mid
            else:
                hi = mid
        keys, values = rotation or ([False] * self.arch.num_layers,) * 2
        layers = []
        for i, row in enumerate(assign(hi)):
            tiers = tuple(TIERS[int(c)] for c in row)
            low = any(t.bits < 8 for t in tiers)
            layers.append(LayerPlan(tiers, key_rotation=keys[i] and low, value_rotation=values[i] and low))
        return Plan(tuple(layers), layout)

    def level2(self, sens: Sensitivity, layout: CacheConfig, int8_kl: float, targets: list[float], *,
               int3_ratio: float | None = None, rotate: bool = False, label: str = "",
               name: str | None = None) -> list[Candidate]:
        """Plans allocated at each memory target in ``layout`` (``name``: how the log calls it, by default its
        :data:`LAYOUTS` key); ``int3_ratio`` lets INT3 in (see :meth:`unit_costs`), ``rotate`` applies the
        sensitivity's per-layer rotation choice."""
        costs = self.unit_costs(sens, int8_kl, int3_ratio, rotated=rotate)
        rotation = sens.rotation() if rotate else None
        if name is None:
            name = next((n for n, c in LAYOUTS.items() if c == layout), "custom")
        todo, seen = [], set()
        for target in targets:
            plan = self.allocate(costs, layout, target, rotation)
            key = str(plan.to_dict())
            if key not in seen:
                seen.add(key)
                todo.append((f"L2 mixed {name}{label}, predicted memory <= {target:.3f}", 2, plan))
        return self.evaluate_all(todo, "search level 2")

    def level2_low_bit(self, sens: Sensitivity, int8_kl: float, level1: list[Candidate]) -> list[Candidate]:
        """The low-bit frontier: tiers down to INT2, with INT3 and rotation, at :data:`LOW_BIT_TARGETS` of the
        default layout's all-INT4 bytes and at each layout's all-INT2 floor, in the layouts of
        :meth:`low_bit_layouts`, each plan from :data:`CORRECTED_FROM` x B4 up also with the softmax-bias correction
        (:meth:`corrected`), the frontier of those with their keys stored before RoPE (:meth:`prerope`), and the same
        plans without rotation and without INT3 at :data:`ABLATION_TARGETS`. The quick search (``quick``): the
        model's low-bit layout alone, at :data:`QUICK_TARGETS` and its floor, with the softmax-bias twins."""
        by_name = {c.name: c for c in level1}
        b4 = int4_bytes(level1)
        rot3, rot2 = (by_name.get(f"L1 all-{t}+rot {DEFAULT_LAYOUT}") for t in ("int3", "int2"))
        ratio = rot3.quality.kl / rot2.quality.kl if rot3 and rot2 and rot2.quality.kl > 0 else None
        rotate = self.rotatable
        out, to_correct, low = [], [], self.low_bit_layout
        layouts = self.low_bit_layouts()[:1] if self.quick else self.low_bit_layouts()
        targets = QUICK_TARGETS if self.quick else LOW_BIT_TARGETS
        for lname, layout, upper_only in layouts:
            if upper_only:
                fractions = [f for f in targets if f >= WIDE_SCALES_FROM]
                floor = None
            else:
                table, ref = self.layer_bytes(layout)
                floor = float(table[:, INT2].sum() / ref.sum())
                fractions = [f for f in targets if f * b4 > floor + 0.001]
            # Allocated in two calls, the targets the correction is also scored at first, in the same order as one.
            upper = [round(f * b4, 4) for f in fractions if f >= CORRECTED_FROM]
            # The floor is a target too: all-INT2 with each layer's chosen rotation. Level 1's all-INT2 rotates every
            # layer, which on Gemma 3's held-out text cost 4.6x the KL (0.2496 against 0.0544).
            lower = [round(f * b4, 4) for f in fractions if f < CORRECTED_FROM]
            lower += [] if floor is None else [round(floor, 4)]
            kwargs = dict(int3_ratio=ratio, rotate=rotate, label=" low-bit", name=lname)
            plans = self.level2(sens, layout, int8_kl, upper, **kwargs) if upper else []
            out += plans + (self.level2(sens, layout, int8_kl, lower, **kwargs) if lower else [])
            to_correct += plans
        out += self.corrected(to_correct)
        if self.quick:
            return out
        out += self.prerope(pareto_front(out))
        ablation = [round(f * b4, 4) for f in ABLATION_TARGETS]
        if rotate:
            out += self.level2(sens, LAYOUTS[low], int8_kl, ablation, int3_ratio=ratio, label=" low-bit, no rotation")
        out += self.level2(sens, LAYOUTS[low], int8_kl, ablation, rotate=rotate, label=" low-bit, no int3")
        return out

    def low_bit_layouts(self) -> list[tuple[str, CacheConfig, bool]]:
        """The layouts the low-bit targets are allocated in: the model's low-bit layout, the same with its window
        in 16 bits (named without ``w8``: "window-16 value-group-64 s8"), and that with float16 scales and
        ``[min, max]`` ranges (named without ``s8`` either), for the targets from :data:`WIDE_SCALES_FROM` x B4
        up only (the third item: ``True``); the default layout where no low-bit layout fits the head.

        The 8-bit window adds a nearly fixed error (on Gemma 3's held-out text all-INT8 in the low-bit layout
        scored KL 0.00213, in the default layout 0.00006), which the bytes it frees outweigh only where the plan's
        own error is larger; one-byte scales likewise. Allocating each target in each format lets the frontier keep
        whichever measures lower at the same bytes. (Re-scoring the 8-bit plans with a 16-bit window instead gave
        the wide window only at a plan's bytes plus the window's, and lost at 0.85 x B4: Gemma 3 0.00175 ->
        0.00202, SmolLM2 0.00137 -> 0.00222.) The default layout (a 64-token window) is not among them: in four
        calibrations of both models its plans measured 2-5x the held-out KL of the low-bit layouts' at every
        target."""
        low = self.low_bit_layout
        base = LAYOUTS[low]
        out = [(low, base, False)]
        if base.window_bits == 8:
            out.append((low.replace(" w8", ""), replace(base, window_bits=16), False))
        if base.scale_bits == 8:
            out.append((low.replace(" w8", "").replace(" s8", ""),
                        replace(base, window_bits=16, scale_bits=16, range_search=False), True))
        return out

    def corrected(self, candidates: list[Candidate]) -> list[Candidate]:
        """The same plans with the softmax-bias correction of their quantized keys' scores
        (:mod:`kvguard.score_bias`), named ``<name> +sb``: it stores nothing, so each one costs its plan's bytes,
        and the held-out KL decides where it helps (measured by hand on the frontier plans of SmolLM2 and Gemma 3
        it lowered the evaluation split's KL by 18-44 %, but it is an approximation: whether it helps a plan is
        a measurement, not an assumption)."""
        todo = [(f"{c.name} +sb", c.level, c.plan.with_score_correction()) for c in candidates
                if not c.plan.cache.score_correction
                and score_bias.corrects(p for lp in c.plan.layers for p in lp.precision)]
        return self.evaluate_all(todo, "search level 2, corrected") if todo else []

    def prerope(self, candidates: list[Candidate]) -> list[Candidate]:
        """The same plans with their keys below INT8 stored before RoPE (``CacheConfig.prerope_keys``), named
        ``<name> +pre`` (``+sb`` plans without the correction, which models post-RoPE keys): the same bytes, and the
        held-out KL decides. Only the plans on the frontier so far: on calibration text it lowered the KL of
        Gemma 3's frontier plans and of SmolLM2's with float16 scales, and raised it for SmolLM2's one-byte-scale,
        8-bit-window plans (``benchmarks/prerope_keys.py``, in the history: commit 9242d86), so it is a measurement per plan; twins of the whole
        level would cost as many scoring passes again."""
        todo, seen = [], set()
        for c in candidates:
            if c.plan.cache.prerope_keys or not any(p.bits < 8 for lp in c.plan.layers for p in lp.precision):
                continue
            plan = c.plan.with_score_correction(False).with_prerope_keys()
            key = str(plan.to_dict())
            if key not in seen:
                seen.add(key)
                todo.append((f"{c.name.removesuffix(' +sb')} +pre", c.level, plan))
        return self.evaluate_all(todo, "search level 2, keys before RoPE") if todo else []

    # ------------------------------------------------------------------ level 3
    def level3(self, start: Candidate, sens: Sensitivity, layers: int = 2) -> list[Candidate]:
        """Greedy key-clipping search on the ``layers`` most sensitive quantized layers of ``start``."""
        quantized = [i for i in sens.layer_ranking() if any(p.is_quantized for p in start.plan.layers[i].precision)]
        current, out = start, []
        for i in quantized[:layers]:
            # The clips of one layer are scored together: keeping one of them changes only layer i's key clip,
            # which the next one sets anyway, so every clip's plan is the same as if they ran one by one.
            lp = current.plan.layers[i]
            todo = [(f"L3 layer {i} key clip {clip}", 3, current.plan.replace_layer(i, replace(lp, key_clip=clip)))
                    for clip in CLIP_GRID]
            for cand in self.evaluate_all(todo, f"search level 3, layer {i}"):
                out.append(cand)
                if cand.quality.kl < current.quality.kl:
                    current = cand
        return out


def level2_targets(int4: Candidate, objective: Objective, int8_memory: float) -> list[float]:
    """Memory targets for level 2 in one layout: the budget, the layout's all-INT4 memory and a step below."""
    top = objective.memory_budget if objective.memory_budget is not None else int8_memory
    base = min(int4.memory, top)
    targets = {round(top, 4), round(base, 4), round(base - 0.02, 4)}
    if top > base + 0.03:
        targets.add(round((top + base) / 2, 4))
    return sorted((t for t in targets if 0.05 < t <= top + 1e-9), reverse=True)
