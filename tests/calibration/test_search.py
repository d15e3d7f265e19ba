"""The search's pieces: objective, Pareto frontier, choice, and the tier allocation."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvguard.config import CacheConfig, Objective, penalty
from kvguard.architecture import Architecture
from kvguard.plan import LayerPlan, Plan
from kvguard.precision import Precision
from kvguard.profile import Candidate, PlanScore
from kvguard.calibration.latency import TIERS, LatencyModel
from kvguard.calibration.search import INT2, INT3, Searcher, best, pareto_front
from kvguard.calibration.sensitivity import Sensitivity


def _cand(name, memory, ppl, kl=0.001, feasible=True, score=None):
    arch = Architecture("llama", 2, 1, 1, 4, ("full_attention",) * 2, None)
    q = PlanScore(kl, {"prose": ppl}, 0.99)
    return Candidate(name, 1, Plan.uniform(arch, "int4"), memory, 1.0, q, memory if score is None else score, feasible)


def test_objective_scores_and_constraints():
    obj = Objective(alpha=1.0, beta=0.5, gamma=2.0, max_ppl_increase=1.0, memory_budget=0.4)
    # penalty(KL) = 100 * (e^KL - 1) percent
    assert math.isclose(penalty(0.01), 100 * math.expm1(0.01))
    assert math.isclose(obj.score(0.3, 1.2, 0.01), 0.3 + 0.6 + 2.0 * 100 * math.expm1(0.01))
    assert obj.feasible(0.4, 1.0) and not obj.feasible(0.41, 0.1) and not obj.feasible(0.3, 1.5)
    assert Objective(memory_budget=None, max_ppl_increase=None).feasible(9.0, 50.0)
    with pytest.raises(ValueError, match="gamma"):
        Objective(gamma=-1)
    with pytest.raises(ValueError, match="memory_budget"):
        Objective(memory_budget=0)


def test_pareto_front_and_choice():
    # The frontier is on memory vs the KL-predicted increase (the measured increase is too noisy to rank by).
    cands = [_cand("a", 0.3, 0.0, kl=0.02), _cand("b", 0.35, 0.0, kl=0.005), _cand("c", 0.36, 0.0, kl=0.007),
             _cand("d", 0.5, 0.0, kl=0.0), _cand("e", 0.2, 0.0, kl=0.05)]
    assert [c.name for c in pareto_front(cands)] == ["e", "a", "b", "d"]
    infeasible = [_cand("x", 0.1, 9.0, feasible=False, score=0.0), _cand("y", 0.5, 0.1, score=2.0)]
    assert best(infeasible).name == "y"
    # Ties on score go to the lower KL.
    assert best([_cand("p", 0.3, 0.0, kl=0.002), _cand("q", 0.3, 0.0, kl=0.001)]).name == "q"
    # A plan with keys before RoPE is not chosen while any other is there (the fused decode kernels cannot read it),
    # though it stays on the frontier.
    turned = _cand("t", 0.3, 0.0, kl=0.0005)
    turned = replace(turned, plan=turned.plan.with_prerope_keys())
    assert best([turned, _cand("u", 0.3, 0.0, kl=0.002)]).name == "u" and best([turned]).name == "t"
    assert [c.name for c in pareto_front([turned, _cand("u", 0.3, 0.0, kl=0.002)])] == ["t"]


def test_latency_model_weights_layers():
    arch = Architecture("llama", 2, 2, 2, 4, ("full_attention",) * 2, None)
    plan = Plan.uniform(arch, "int4").replace_layer(0, Plan.uniform(arch, "fp16").layers[0])
    lat = LatencyModel({"fp16": 1.0, "int8": 1.1, "int4": 1.2, "int2": 1.3}, 1024)
    assert math.isclose(lat.plan_latency(plan, torch.tensor([0.25, 0.75])), 0.25 + 0.75 * 1.2)
    assert LatencyModel.from_dict(lat.to_dict()) == lat


@pytest.mark.slow
def test_allocation_puts_bytes_where_the_error_is(smollm2):
    model, _ = smollm2
    arch = Architecture.from_config(model.config)
    searcher = Searcher(model, SimpleNamespace(arch=arch), Objective(), LatencyModel({}, 0), context=512, progress=False)
    n = arch.num_layers
    alone = torch.full((n,), 0.001)
    alone[7] = 0.5  # one layer far more sensitive than the rest
    sens = Sensitivity(Precision.INT4, Precision.INT2, 0.003, alone, torch.zeros(n), alone / 10,
                       torch.full((n, arch.num_kv_heads), float("nan")))
    costs = searcher.unit_costs(sens, int8_kl=0.00005)
    layout = CacheConfig()
    table, ref = searcher.layer_bytes(layout)
    predicted = []
    names = [t.value for t in TIERS]
    lo, hi = float(table[:, INT2].sum() / ref.sum()), float(table[:, 0].sum() / ref.sum())  # all-INT2, all-FP16
    for target in (lo + 0.1 * (hi - lo), lo + 0.3 * (hi - lo), lo + 0.6 * (hi - lo)):
        plan = searcher.allocate(costs, layout, target)
        memory = sum(float(table[i, names.index(lp.precision[0].value)])
                     for i, lp in enumerate(plan.layers)) / float(ref.sum())
        assert memory <= target + 1e-9
        # The sensitive layer is never the one sent to INT2, and gets the best tier any layer gets.
        assert plan.layers[7].precision[0] is not Precision.INT2
        order = names[::-1]
        assert all(order.index(plan.layers[7].precision[0].value) >= order.index(p.value)
                   for lp in plan.layers for p in lp.precision)
        predicted.append(sum(float(costs[i, h, names.index(p.value)])
                             for i, lp in enumerate(plan.layers) for h, p in enumerate(lp.precision)))
    assert predicted[0] >= predicted[1] >= predicted[2]


def _sens(arch, alone, rotated=None):
    n = arch.num_layers
    return Sensitivity(Precision.INT4, Precision.INT2, 0.003, alone, torch.zeros(n), alone / 10,
                       torch.full((n, arch.num_kv_heads), float("nan")), rotated)


def test_rotation_is_chosen_per_layer_and_side_where_it_measured_better():
    arch = Architecture("llama", 3, 2, 2, 64, ("full_attention",) * 3, None)
    alone = torch.tensor([0.10, 0.10, 0.10])
    # Layer 0: rotating either side helps; layer 1: only the keys; layer 2: neither.
    sens = _sens(arch, alone, torch.tensor([[0.06, 0.08], [0.07, 0.12], [0.11, 0.10]]))
    assert sens.rotation() == ([True, True, False], [True, False, False])
    # The gains add: 0.10 - 0.04 - 0.02 for layer 0; a side that hurts adds nothing.
    assert torch.allclose(sens.aggressive_kl(), torch.tensor([0.04, 0.07, 0.10], dtype=torch.float64))
    # Gains larger than the KL itself stop at a tenth of the best single measurement.
    big = _sens(arch, alone, torch.tensor([[0.01, 0.01], [0.1, 0.1], [0.1, 0.1]]))
    assert float(big.aggressive_kl()[0]) == pytest.approx(0.001)
    plain = _sens(arch, alone)
    assert plain.rotation() == ([False] * 3, [False] * 3) and torch.equal(plain.aggressive_kl(), alone.double())
    restored = Sensitivity.from_parts(sens.to_dict(), sens.tensors())
    assert torch.equal(restored.rotated_kl, sens.rotated_kl) and Sensitivity.from_parts(plain.to_dict(), plain.tensors()).rotated_kl is None


@pytest.mark.slow
def test_low_bit_allocation_uses_int3_and_rotates_only_low_bit_layers(smollm2):
    model, _ = smollm2
    arch = Architecture.from_config(model.config)
    searcher = Searcher(model, SimpleNamespace(arch=arch), Objective(), LatencyModel({}, 0), context=512, progress=False)
    n = arch.num_layers
    alone = torch.linspace(0.001, 0.2, n)
    rotated = torch.stack([alone * 0.5, alone * 1.5], 1)  # keys gain, values lose, everywhere
    sens = _sens(arch, alone, rotated)
    layout = CacheConfig(residual=32, group_size=64)
    table, ref = searcher.layer_bytes(layout)
    int2, int4 = (float(table[:, j].sum() / ref.sum()) for j in (INT2, TIERS.index(Precision.INT4)))
    target = (int2 + int4) / 2
    with_int3 = searcher.allocate(searcher.unit_costs(sens, 1e-5, int3_ratio=0.2, rotated=True), layout, target,
                                  sens.rotation())
    without = searcher.allocate(searcher.unit_costs(sens, 1e-5, rotated=True), layout, target, sens.rotation())
    counts = with_int3.precision_counts()
    assert counts.get("int3", 0) > 0 and "int3" not in without.precision_counts()
    for lp in with_int3.layers:
        low = any(p.bits < 8 for p in lp.precision)
        assert lp.key_rotation == low and not lp.value_rotation
    # The INT3 plan predicts less error at the same budget (what lets it onto the frontier).
    costs = searcher.unit_costs(sens, 1e-5, int3_ratio=0.2, rotated=True)
    # INT2 is priced by the rotated KL only for plans that rotate; a plain plan pays the plain KL.
    plain = searcher.unit_costs(sens, 1e-5, int3_ratio=0.2)
    assert bool((costs[..., INT2] < plain[..., INT2]).all())

    def predicted(plan):
        return sum(float(costs[i, h, TIERS.index(p)]) for i, lp in enumerate(plan.layers) for h, p in enumerate(lp.precision))

    assert predicted(with_int3) < predicted(without)


def test_level3_clips_keys_and_keeps_the_rest_of_the_layer():
    """Level 3 changes only the key clip: the layer's rotation and values below its keys stay as they were (it
    used to rebuild the layer from its tiers and clips, dropping both)."""
    from tests.helpers import tiny_llama

    model = tiny_llama()
    arch = Architecture.from_config(model.config)

    class Scores:  # every clipped plan scores lower than the start, so level 3 keeps each one
        def score(self, heldout, plans, scales=None):
            return [PlanScore(0.001 * (1 - p.layers[0].key_clip), {"prose": 0.1}, 0.99) for p in plans]

    latency = LatencyModel({t.value: 1.0 for t in TIERS}, 64)
    searcher = Searcher(model, SimpleNamespace(arch=arch), Objective(), latency, context=64, progress=False,
                        executor=Scores())
    layer = LayerPlan((Precision.INT4,) * arch.num_kv_heads, key_rotation=True, value_rotation=True,
                      value_drop=(1,) * arch.num_kv_heads)
    start = _cand("start", 0.3, 0.1, kl=0.01)
    start = Candidate("start", 2, Plan((layer,) * arch.num_layers), 0.3, 1.0, start.quality, 0.3, True)
    sens = SimpleNamespace(layer_ranking=lambda: list(range(arch.num_layers)))
    out = searcher.level3(start, sens, layers=1)
    assert [c.plan.layers[0].key_clip for c in out] == [0.95, 0.9]
    for cand in out:
        assert cand.plan.layers[0] == replace(layer, key_clip=cand.plan.layers[0].key_clip)
        assert cand.plan.layers[1] == layer


def test_the_quick_search_allocates_the_low_bit_frontier_in_one_layout_at_fewer_targets():
    """``Search.QUICK`` (``kvguard run``): the model's low-bit layout only, at QUICK_TARGETS and the floor, with the
    ``+sb`` twins; no 16-bit-window or float16-scale formats, no keys-before-RoPE twins, no ablation plans."""
    from kvguard.calibration.search import QUICK_TARGETS
    from tests.helpers import tiny_llama

    model = tiny_llama(hidden_size=256)  # 4 heads of 64 channels: the low-bit layouts fit
    arch = Architecture.from_config(model.config)

    class Scores:  # KL falls with the bytes a plan stores, so every allocated plan is a distinct frontier point
        def score(self, heldout, plans, scales=None):
            return [PlanScore(0.001 / (1 + sum(p.bits for lp in plan.layers for p in lp.precision)), {"prose": 0.1},
                              0.99) for plan in plans]

    level1 = [_cand("L1 all-int4 window-64", 0.344, 0.1), _cand("L1 all-int3+rot window-64", 0.285, 0.5, kl=0.004),
              _cand("L1 all-int2+rot window-64", 0.225, 2.0, kl=0.03)]
    sens = _sens(arch, torch.linspace(0.001, 0.02, arch.num_layers), torch.full((arch.num_layers, 2), 0.0005))
    latency = LatencyModel({t.value: 1.0 for t in TIERS}, 64)

    def search(quick):
        searcher = Searcher(model, SimpleNamespace(arch=arch), Objective(), latency, context=256, progress=False,
                            executor=Scores(), quick=quick)
        return searcher, [c.name for c in searcher.level2_low_bit(sens, 1e-5, level1)]

    searcher, quick = search(True)
    _, full = search(False)
    low = searcher.low_bit_layout
    assert quick and len(quick) < len(full) / 2
    assert all(f"L2 mixed {low} low-bit" in name for name in quick)  # one layout, the 8-bit-window one
    assert not any(name.endswith(" +pre") or "no rotation" in name or "no int3" in name for name in quick)
    assert any(name.endswith(" +sb") for name in quick)
    targets = {name.split("<= ")[1].split(" ")[0] for name in quick}
    assert len(targets) <= len(QUICK_TARGETS) + 1  # and the floor
    assert any(name.endswith(" +pre") for name in full) and any("no int3" in name for name in full)


def test_the_search_setting_is_checked_and_keyed_only_when_quick(tmp_path):
    from kvguard.calibration.settings import Search
    from tests.helpers import small_config

    with pytest.raises(ValueError, match=r"search has to be one of \['full', 'quick'\] but got 'fast'"):
        small_config(tmp_path, search="fast")
    assert small_config(tmp_path, low_bit=True).search is Search.FULL
    # A full search keeps the digest it had before the setting existed; a quick one is another profile.
    full = small_config(tmp_path, low_bit=True)
    assert full.key() == small_config(tmp_path, low_bit=True, search="full").key()
    assert small_config(tmp_path, low_bit=True, search="quick").key() != full.key()
    assert small_config(tmp_path, search="quick").key() == small_config(tmp_path).key()  # no low-bit search to trim
