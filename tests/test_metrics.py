import math

import pytest
import torch

from kvguard.metrics import TokenMetrics, alarm_quality, quantile


def test_hand_computed_nll_kl_top1():
    # Reference distribution [.5, .25, .25]; the method predicts [.25, .5, .25].
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]]))
    m = TokenMetrics()
    m.add(logits, torch.tensor([1, 0]), ref)
    assert m.nll == pytest.approx((math.log(2) + math.log(2)) / 2)
    assert m.ppl == pytest.approx(2.0)
    # KL(ref || p) at position 0: .5 log(.5/.25) + .25 log(.25/.5) = .25 log 2; position 1: 0.
    assert m.kl == pytest.approx(0.25 * math.log(2) / 2)
    assert m.top1_agree == 0.5


def test_hand_computed_kl_tail():
    # Reference [.5, .25, .25] at four positions; the method predicts it exactly at two of them, [.25, .5, .25] at one
    # (KL .25 log 2, as above) and [.125, .4375, .4375] at another: .5 log 4 + .5 log(.25 / .4375) = 2 log 2 - .5 log 7.
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25]] * 4, dtype=torch.float64))
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.125, 0.4375, 0.4375]],
                                    dtype=torch.float64))
    m = TokenMetrics()
    m.add(logits[:3], torch.zeros(3, dtype=torch.long), ref[:3])  # two slices: the tail covers both, in order
    m.add(logits[3:], torch.zeros(1, dtype=torch.long), ref[3:])
    a, b = 0.25 * math.log(2), 2 * math.log(2) - 0.5 * math.log(7)
    assert m.token_kl.tolist() == pytest.approx([0.0, a, 0.0, b], abs=1e-6)
    assert m.kl == pytest.approx((a + b) / 4)
    # Sorted 0, 0, a, b: the 0.99 quantile at rank 0.99 * 3 = 2.97, between a and b; 0.999 at 2.997.
    assert m.kl_p99 == pytest.approx(a + 0.97 * (b - a), rel=1e-6)
    assert m.kl_p999 == pytest.approx(a + 0.997 * (b - a), rel=1e-6)
    assert m.kl_max == pytest.approx(b, rel=1e-6)


def test_quantile_interpolates_between_order_statistics():
    values = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    assert quantile(values, 0.0) == 1.0 and quantile(values, 1.0) == 5.0 and quantile(values, 0.5) == 3.0
    assert quantile(values, 0.9) == pytest.approx(4.6)  # rank 3.6: 4 + 0.6 * (5 - 4)
    assert quantile(torch.tensor([7.0]), 0.99) == 7.0
    assert quantile(values, 0.99) == pytest.approx(float(torch.quantile(values.double(), 0.99)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantile(values, 1.5)
    with pytest.raises(ValueError, match="no values"):
        quantile(torch.tensor([]), 0.5)


def test_identical_distributions_score_zero_kl_and_full_agreement():
    logits = torch.randn(7, 11)
    m = TokenMetrics()
    m.add(logits, torch.arange(7), torch.log_softmax(logits, -1))
    assert m.kl == pytest.approx(0.0, abs=1e-6) and m.top1_agree == 1.0


def test_many_rows_match_the_direct_formulas_and_leave_the_inputs_untouched():
    # More rows than one step holds, so the per-step sums and the in-place arithmetic are both exercised.
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(37, 50) * 3, torch.randn(37, 50) * 3
    ref = torch.log_softmax(ref_logits, -1)
    targets = torch.randint(0, 50, (37,))
    logits_before, ref_before = logits.clone(), ref.clone()
    m = TokenMetrics()
    m.add(logits, targets, ref)
    logprobs = torch.log_softmax(logits.double(), -1)
    assert m.nll == pytest.approx(float(-logprobs.gather(-1, targets[:, None]).mean()), rel=1e-6)
    assert m.kl == pytest.approx(float((ref.double().exp() * (ref.double() - logprobs)).sum(-1).mean()), rel=1e-5)
    assert m.top1_agree == float((ref.argmax(-1) == logits.argmax(-1)).double().mean())
    assert torch.equal(logits, logits_before) and torch.equal(ref, ref_before)
    # A kept reference arg-max gives the same sums as computing it per pass, in the same steps.
    kept = TokenMetrics()
    kept.add(logits, targets, ref, ref.argmax(-1))
    assert (kept.nll, kept.kl, kept.top1_agree) == (m.nll, m.kl, m.top1_agree)
    shifted = TokenMetrics()  # the arg-max given is the one compared with (not recomputed)
    shifted.add(logits, targets, ref, (ref.argmax(-1) + 1) % 50)
    assert shifted.top1_agree == float(((ref.argmax(-1) + 1) % 50 == logits.argmax(-1)).double().mean())
    assert shifted.top1_agree != m.top1_agree
    with pytest.raises(ValueError, match="top-1"):
        kept.add(logits, targets, ref, ref.argmax(-1)[:-1])


def test_metrics_without_reference_and_shape_errors():
    m = TokenMetrics()
    m.add(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    assert m.ppl == pytest.approx(8.0) and m.kl is None and m.top1_agree is None
    assert m.token_kl is None and m.kl_p99 is None and m.kl_max is None
    with pytest.raises(ValueError, match="predictions"):
        m.add(torch.zeros(3, 8), torch.zeros(4, dtype=torch.long))


def test_alarm_quality_hand_counted():
    # Windows:      0      1      2     3      4      5
    alarmed = torch.tensor([True, True, False, True, False, False])
    bad = torch.tensor([True, False, True, True, False, False])
    q = alarm_quality(alarmed, bad)
    assert (q.windows, q.alarmed, q.bad, q.hits) == (6, 3, 3, 2)
    assert q.precision == pytest.approx(2 / 3) and q.recall == pytest.approx(2 / 3)
    assert q.alarm_rate == pytest.approx(0.5)


def test_alarm_quality_undefined_ratios_are_none_not_zero():
    never = alarm_quality(torch.zeros(4, dtype=torch.bool), torch.tensor([True, False, False, False]))
    assert never.precision is None and never.recall == 0.0 and never.alarm_rate == 0.0
    clean = alarm_quality(torch.tensor([True, False]), torch.zeros(2, dtype=torch.bool))
    assert clean.recall is None and clean.precision == 0.0 and clean.alarm_rate == 0.5
    empty = alarm_quality(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool))
    assert (empty.precision, empty.recall, empty.alarm_rate) == (None, None, None)
    with pytest.raises(ValueError, match="shape"):
        alarm_quality(torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.bool))
