"""Calibration below INT4: INT3 and per-layer rotation in the search, the low-bit frontier ``kvguard@<bytes>``
picks from, and the ablation kept in the search log (real SmolLM2 layers, real calibration text)."""

from dataclasses import replace

import pytest
import torch

from kvguard import models
from kvguard.architecture import Architecture
from kvguard.calibration.pipeline import calibrate
from kvguard.calibration.ranking import RANKED_TARGETS, closest
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.calibration.search import (CORRECTED_FROM, DEFAULT_LAYOUT, LAYOUTS, LOW_BIT_LAYOUTS, WIDE_SCALES_FROM,
                                       low_bit_layout)
from kvguard.evaluation import methods
from kvguard.plan import Plan
from kvguard.precision import Precision
from tests.helpers import small_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def low_bit(smollm2_4_layers, tmp_path_factory):
    out = tmp_path_factory.mktemp("lowbit") / "profile"
    return calibrate(replace(small_config(out), model=str(smollm2_4_layers), low_bit=True, ranking_tokens=1024),
                     progress=False)


def test_sensitivity_measures_rotation_per_layer_and_side(low_bit):
    rotated = low_bit.tensors["sensitivity.rotated_kl"]
    alone = low_bit.tensors["sensitivity.alone_kl"]
    assert rotated.shape == (alone.numel(), 2) and bool((rotated > 0).all())
    # Measured, not copied: rotating a side changes the layer's KL.
    assert not torch.allclose(rotated[:, 0], alone) and not torch.allclose(rotated[:, 1], alone)


def _config(name_or_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(models.resolve(name_or_path))


def test_low_bit_layout_is_the_one_that_stores_int3_in_fewer_bytes():
    smol, gemma = _config("smollm2-135m"), _config("gemma3-270m")
    # SmolLM2 holds all 2,048 tokens in every layer: halving the scale bytes (groups of 64) saves more than
    # halving the FP window. Gemma 3's sliding layers hold 512 tokens, where the window is the larger share.
    short = "window-16 value-group-64 w8 s8"
    cases = ((smol, "window-32 group-64 w8 s8", short), (gemma, short, "window-32 group-64 w8 s8"))
    for config, chosen, other in cases:
        assert low_bit_layout(config, 2048) == chosen
        arch = Architecture.from_config(config)
        stored = {name: Plan.uniform(arch, "int3", LAYOUTS[name]).kv_bytes(config, 2048)[0] for name in (chosen, other)}
        assert stored[chosen] < stored[other]  # strictly fewer, not a tie broken by order


def test_a_head_the_low_bit_groups_do_not_divide_keeps_the_default_layout():
    from tests.helpers import tiny_llama

    config = tiny_llama(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=96).config
    assert all(96 % LAYOUTS[name].value_group for name in LOW_BIT_LAYOUTS)  # 64 does not divide 96
    assert low_bit_layout(config, 512) == DEFAULT_LAYOUT


def test_search_reaches_below_int4_with_int3_and_rotation(low_bit, smollm2_4_layers):
    log = {c.name: c for c in low_bit.meta.search_log}
    b4 = log["L1 all-int4 window-64"].memory
    layout = low_bit_layout(_config(smollm2_4_layers), 512)  # the fixture's calibration context
    assert {"L1 all-int3+rot window-64", f"L1 all-int2+rot {layout}", f"L1 all-int4 {layout}"} <= set(log)
    low = [c for c in low_bit.meta.search_log if "low-bit" in c.name and "no " not in c.name]
    assert low and min(c.memory for c in low) < 0.8 * b4
    in_layout = [c for c in low if f"L2 mixed {layout} " in c.name]
    assert in_layout and all(replace(c.plan.cache, score_correction=False, window_bits=LAYOUTS[layout].window_bits,
                                     prerope_keys=False) == LAYOUTS[layout] for c in in_layout)
    assert any(Precision.INT3 in lp.precision for c in low for lp in c.plan.layers)
    assert any(lp.key_rotation or lp.value_rotation for c in low for lp in c.plan.layers)
    # Rotation only where a head is below INT8 (the transform applies to those heads only).
    for c in low:
        for lp in c.plan.layers:
            if lp.key_rotation or lp.value_rotation:
                assert any(p.bits < 8 for p in lp.precision)
    # The floor is searched too: all-INT2 with each layer's own rotation choice, in the low-bit layout.
    keys, values = Sensitivity.from_parts(low_bit.meta.record["sensitivity"], low_bit.tensors).rotation()
    floor = [c for c in in_layout if all(lp.uniform is Precision.INT2 for lp in c.plan.layers)]
    assert floor and all([(lp.key_rotation, lp.value_rotation) for lp in c.plan.layers] == list(zip(keys, values))
                         for c in floor)
    # The ablation at a fixed budget: the same targets without rotation and without INT3.
    no_rot = [c for c in log.values() if "no rotation" in c.name]
    no_int3 = [c for c in log.values() if "no int3" in c.name]
    assert no_rot and no_int3
    assert all(not (lp.key_rotation or lp.value_rotation) for c in no_rot for lp in c.plan.layers)
    assert all(Precision.INT3 not in lp.precision for c in no_int3 for lp in c.plan.layers)


def test_frontier_spans_low_bit_plans_and_kvguard_at_bytes_picks_them(low_bit):
    front = low_bit.meta.frontier()
    b4 = next(c.memory for c in low_bit.meta.search_log if c.name == "L1 all-int4 window-64")
    memories = [c.memory for c in front]
    assert memories == sorted(memories) and min(memories) < 0.8 * b4
    kls = [c.quality.kl for c in front]
    assert kls == sorted(kls, reverse=True)  # each step up in bytes buys a lower KL
    # At a frontier point's bytes, the lowest KL is that point (the frontier's KL falls as the bytes grow).
    for point in front[:3]:
        assert methods.get(f"kvguard@{point.memory!r}", low_bit).plan(None) == point.plan
    with pytest.raises(ValueError, match="no plan at or below"):
        methods.get(f"kvguard@{front[0].memory / 2:.4f}", low_bit)


def test_low_bit_plans_are_also_scored_with_the_softmax_bias_correction(low_bit):
    log = {c.name: c for c in low_bit.meta.search_log}
    corrected = [c for c in log.values() if c.name.endswith(" +sb")]
    assert corrected and all(c.plan.cache.score_correction for c in corrected)
    for c in corrected:
        plain = log[c.name.removesuffix(" +sb")]
        assert not plain.plan.cache.score_correction
        assert c.plan.layers == plain.plan.layers and c.memory == plain.memory  # it stores nothing
        assert c.quality.kl != plain.quality.kl  # measured, not copied
    # Only the low-bit frontier is corrected; the ablation rows stay as they were searched.
    assert not any("no " in c.name for c in corrected)
    # And only from CORRECTED_FROM x B4 up: every plan allocated there has its twin, none below (nor the floor).
    b4 = log["L1 all-int4 window-64"].memory
    low = [c for c in log.values() if " low-bit, predicted" in c.name and not c.name.endswith((" +sb", " +pre"))]
    floor = {c.name for c in low if all(lp.uniform is Precision.INT2 for lp in c.plan.layers)}
    upper = {c.name for c in low if float(c.name.split("<= ")[1]) >= CORRECTED_FROM * b4 - 6e-4} - floor  # 3 decimals
    assert upper and len(upper) < len(low)
    assert {c.name.removesuffix(" +sb") for c in corrected} == upper


def test_the_frontier_is_also_scored_with_keys_before_rope(low_bit):
    log = {c.name: c for c in low_bit.meta.search_log}
    twins = [c for c in log.values() if c.name.endswith(" +pre")]
    assert twins and all(c.plan.cache.prerope_keys and not c.plan.cache.score_correction for c in twins)
    for c in twins:
        plain = log[c.name.removesuffix(" +pre")]  # the plan it turns, or that plan's corrected twin
        origin = plain if not plain.plan.cache.prerope_keys else None
        assert origin is not None and c.plan.layers == origin.plan.layers and c.memory == origin.memory
        assert c.quality.kl != origin.quality.kl  # measured, not copied
    # Twins of the low-bit frontier as it stood after level 2 (with the corrected plans), not of every plan.
    low = [c for c in log.values() if " low-bit, predicted" in c.name and not c.name.endswith(" +pre")]
    assert len(twins) < len(low)


def test_low_bit_targets_are_allocated_with_8_and_16_bit_windows(low_bit, smollm2_4_layers):
    log = low_bit.meta.search_log
    layout = low_bit_layout(_config(smollm2_4_layers), 512)
    assert LAYOUTS[layout].window_bits == 8
    wide_name = layout.replace(" w8", "")
    narrow = {c.name.split(", ")[1]: c for c in log if f"L2 mixed {layout} low-bit," in c.name and not c.name.endswith((" +sb", " +pre"))}
    wide = {c.name.split(", ")[1]: c for c in log if f"L2 mixed {wide_name} low-bit," in c.name and not c.name.endswith((" +sb", " +pre"))}
    assert wide and all(c.plan.cache == replace(LAYOUTS[layout], window_bits=16) for c in wide.values())
    assert all(c.plan.cache.window_bits == 8 for c in narrow.values())
    shared = set(narrow) & set(wide)  # the targets above both floors: "predicted memory <= x"
    assert shared
    # Allocated at the same budgets, not re-scored: the 16-bit window's bytes come out of the codes.
    assert all(wide[t].memory <= float(t.split("<= ")[1]) + 0.01 for t in shared)
    assert any(narrow[t].plan.layers != wide[t].plan.layers for t in shared)
    # The 16-bit floor (all-INT2 plus the wide window) lies above the 8-bit one.
    assert min(c.memory for c in wide.values()) > min(c.memory for c in narrow.values())


def test_upper_low_bit_targets_are_also_allocated_with_float16_scales(low_bit, smollm2_4_layers):
    log = low_bit.meta.search_log
    b4 = next(c.memory for c in log if c.name == "L1 all-int4 window-64")
    layout = low_bit_layout(_config(smollm2_4_layers), 512)
    assert LAYOUTS[layout].scale_bits == 8
    wide_name = layout.replace(" w8", "").replace(" s8", "")
    wide = [c for c in log if f"L2 mixed {wide_name} low-bit," in c.name and not c.name.endswith((" +sb", " +pre"))]
    assert wide and all(c.plan.cache == replace(LAYOUTS[layout], window_bits=16, scale_bits=16, range_search=False)
                        for c in wide)
    # Only the targets from WIDE_SCALES_FROM x B4 up, and no floor: below them the one-byte plans won.
    targets = sorted(float(c.name.split("<= ")[1]) for c in wide)
    assert targets[0] >= WIDE_SCALES_FROM * b4 - 6e-4  # names print the target to 3 decimals
    # The default layout is no longer a low-bit allocation (its plans never won a target).
    assert not any(c.name.startswith(f"L2 mixed {DEFAULT_LAYOUT} low-bit") for c in log)


def test_mid_budgets_are_won_on_the_ranking_streams(low_bit):
    meta = low_bit.meta
    log = list(meta.search_log)
    b4 = next(c.memory for c in log if c.name == f"L1 all-int4 {DEFAULT_LAYOUT}")
    budgets = meta.ranked()
    assert [b.share for b in budgets] == list(RANKED_TARGETS) and meta.record["ranking"]["tokens_per_domain"] == 512
    assert all(d.ranking_tokens == 512 and d.ranking_documents >= 1 for d in meta.data.domains.values())
    held = {c.name: c.quality.kl for c in log}
    for b, (share, group) in zip(budgets, closest(log, b4)):
        assert list(b.kl) == [c.name for c in group]  # the closest candidates, in held-out order
        assert all(kl > 0 and kl != held[name] for name, kl in b.kl.items())  # measured on other text
        # kvguard@<budget> runs the ranking's pick, whichever the held-out slice put first.
        picked = methods.frontier_method(f"kvguard@{b.memory}", low_bit).plan(None)
        assert picked == next(c.plan for c in log if c.name == b.pick)
