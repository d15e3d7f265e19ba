"""Held-out scoring skips the positions no quantized key can reach, and the layers a trial shares with a recorded
pass, and gets the same numbers."""

import math

import pytest
import torch

from kvguard import data
from kvguard.architecture import Architecture
from kvguard.calibration import prefix
from kvguard.calibration.heldout import HeldOut
from kvguard.config import CacheConfig
from kvguard.plan import LayerPlan, Plan
from kvguard.precision import Precision
from kvguard.scoring import score_simulated

pytestmark = pytest.mark.slow


def test_skipping_the_exact_prefix_changes_nothing(smollm2):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    ids = data.token_stream("code", "calib", tok, 300)
    heldout = HeldOut(model, {"code": ids})
    ref = torch.log_softmax(score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True).logits, -1)
    fp_nll = heldout.reference_nll["code"]
    for plan in (Plan.uniform(arch, "int2"), Plan.uniform(arch, "int4", CacheConfig(residual=32, group_size=16))):
        full = score_simulated(model, ids, plan, reference=ref)
        fast = heldout.score(plan)
        assert math.isclose(fast.kl, full.kl, rel_tol=1e-4)
        assert math.isclose(fast.top1_agree, full.top1_agree, rel_tol=1e-6)
        assert math.isclose(fast.ppl_increase_pct["code"], 100 * (math.exp(full.nll - fp_nll) - 1), abs_tol=1e-4)
        # The tail over every prediction, the skipped ones (KL 0) included, as the full pass measures it.
        assert math.isclose(fast.kl_p99, full.kl_p99, rel_tol=1e-3) and fast.kl_p99 > fast.kl
    assert heldout.score(Plan.uniform(arch, "fp16")).kl == 0.0


def _attention_calls(model) -> tuple[list[int], list]:
    """Per decoder layer, how often its attention ran (a layer that hands on a recorded input never calls it)."""
    calls = [0] * len(prefix.decoder_layers(model))

    def counter(i):
        def count(module, args):
            calls[i] += 1
        return count

    handles = [layer.self_attn.register_forward_pre_hook(counter(i)) for i, layer in enumerate(prefix.decoder_layers(model))]
    return calls, handles


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3_6_layers"])
def test_a_trial_resumed_from_a_recorded_pass_scores_bit_for_bit_what_a_full_pass_scores(request, fixture):
    model, tok = request.getfixturevalue(fixture)
    arch = Architecture.from_config(model.config)
    streams = {d: data.token_stream(d, "calib", tok, 300) for d in ("prose", "code")}
    heldout = HeldOut(model, streams)
    fp16, int4 = Plan.uniform(arch, "fp16"), Plan.uniform(arch, "int4")
    k = arch.num_layers // 2
    int2 = LayerPlan((Precision.INT2,) * arch.num_kv_heads, key_rotation=True)
    trials = [(fp16.replace_layer(k, int2), k), (int4.replace_layer(k, LayerPlan((Precision.FP16,) * arch.num_kv_heads)), k),
              (int4, arch.num_layers - 1)]  # the anchor itself still runs its last layer
    for anchor in (fp16, int4):  # records the pass under each anchor
        heldout.score(anchor, anchors=(fp16, int4))
    for plan, starts_at in trials:
        full = heldout.score(plan)
        calls, handles = _attention_calls(model)
        try:
            fast = heldout.score(plan, anchors=(fp16, int4))
        finally:
            for h in handles:
                h.remove()
        assert (fast.kl, fast.top1_agree, fast.ppl_increase_pct) == (full.kl, full.top1_agree, full.ppl_increase_pct)
        assert calls == [0] * starts_at + [len(streams)] * (arch.num_layers - starts_at)
    assert set(heldout._recorded) == {fp16, int4}  # one recorded pass per anchor, reused


def test_layers_are_shared_only_while_plan_layout_and_static_scales_allow():
    arch = Architecture("llama", num_layers=4, num_query_heads=2, num_kv_heads=2, head_dim=8,
                        layer_types=("full_attention",) * 4, sliding_window=None)
    fp16 = Plan.uniform(arch, "fp16")
    int8 = LayerPlan((Precision.INT8, Precision.FP16))
    assert prefix.shared_layers(fp16, fp16, None) == 4
    assert prefix.shared_layers(fp16.replace_layer(2, int8), fp16, None) == 2
    assert prefix.shared_layers(Plan.uniform(arch, "fp16", CacheConfig(residual=32)), fp16, None) == 0
    with_int8 = Plan.uniform(arch, "fp16").replace_layer(1, int8)
    assert prefix.shared_layers(with_int8.replace_layer(3, int8), with_int8, None) == 3
    assert prefix.shared_layers(with_int8.replace_layer(3, int8), with_int8, scales=object()) == 1  # static INT8 differs
