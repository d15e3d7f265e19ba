"""Held-out scoring skips the positions no quantized key can reach, and gets the same numbers."""

import math

import pytest
import torch

from kvguard import data
from kvguard.config import CacheConfig
from kvguard.calibration.heldout import HeldOut
from kvguard.architecture import Architecture
from kvguard.plan import Plan
from kvguard.evaluation.scoring import score_simulated

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
    assert heldout.score(Plan.uniform(arch, "fp16")).kl == 0.0
