"""Attention entropy and its length-binned baseline, against hand-computed values."""

import math

import pytest
import torch

from kvguard.entropy import NUM_BINS, EntropyAccumulator, attention_entropy, length_bin


def test_entropy_of_known_distributions():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    assert torch.allclose(attention_entropy(probs), torch.tensor([math.log(4), 0.0, math.log(2)]))


def test_length_bins_are_powers_of_two():
    assert length_bin(torch.tensor([1, 2, 3, 4, 7, 8, 1000])).tolist() == [0, 1, 1, 2, 2, 3, 9]
    assert int(length_bin(10 ** 9)) == NUM_BINS - 1


def test_accumulator_means_std_and_normalised_entropy():
    acc = EntropyAccumulator(num_layers=1, num_heads=2)
    # Two rows of one batch; queries see 1, 2, 3 keys (bins 0, 1, 1).
    entropy = torch.tensor([[[0.0, 0.5, 1.0], [0.0, 0.2, 0.4]], [[0.0, 0.7, 1.2], [0.0, 0.2, 0.6]]])
    acc.add(0, entropy, torch.tensor([1, 2, 3]))
    base = acc.finish()
    assert base.count[0, 0, :3].tolist() == [2.0, 4.0, 0.0]
    # Head 0, bin 1 holds 0.5, 1.0, 0.7, 1.2: mean 0.85, population std sqrt(0.0725).
    assert math.isclose(float(base.mean[0, 0, 1]), 0.85, rel_tol=1e-6)
    assert math.isclose(float(base.std[0, 0, 1]), math.sqrt(0.0725), rel_tol=1e-5)
    assert torch.isnan(base.mean[0, 0, 2])
    # Normalised: H / log n over n >= 2, head 1: (0.2 + 0.2) / log 2 + (0.4 + 0.6) / log 3, over 4 queries.
    want = ((0.4 / math.log(2)) + (1.0 / math.log(3))) / 4
    assert math.isclose(float(base.normalized[0, 1]), want, rel_tol=1e-6)
    # A length calibration never saw falls back to the normalised entropy times log n.
    assert math.isclose(float(base.expected(0, 100)[1]), want * math.log(100), rel_tol=1e-6)
    assert math.isclose(float(base.expected(0, 3)[0]), 0.85, rel_tol=1e-6)


def test_baseline_round_trips_through_tensors():
    acc = EntropyAccumulator(2, 3)
    acc.add(1, torch.rand(2, 3, 5), torch.arange(1, 6))
    base = acc.finish()
    again = type(base).from_tensors(base.tensors())
    assert torch.equal(again.count, base.count) and torch.equal(again.normalized, base.normalized)


def test_merge_adds_the_sums_of_another_accumulator():
    # Batch 1: one row, queries see 1, 2 keys; batch 2: one row, queries see 1, 2, 3 keys (bins 0, 1, 1).
    first, second = EntropyAccumulator(1, 1), EntropyAccumulator(1, 1)
    first.add(0, torch.tensor([[[0.0, 0.5]]]), torch.tensor([1, 2]))
    second.add(0, torch.tensor([[[0.0, 0.25, 1.0]]]), torch.tensor([1, 2, 3]))
    merged = EntropyAccumulator(1, 1).merge(first).merge(second)
    assert merged.count[0, 0, :3].tolist() == [2.0, 3.0, 0.0]
    assert merged.sum[0, 0, 1].item() == 1.75 and merged.sumsq[0, 0, 1].item() == 0.25 + 0.0625 + 1.0
    # H / log n summed over queries with n >= 2: 0.5 / log 2 + 0.25 / log 2 + 1 / log 3, over 3 queries.
    assert math.isclose(merged.norm_sum[0, 0].item(), 0.75 / math.log(2) + 1 / math.log(3), rel_tol=1e-12)
    assert merged.norm_count[0, 0].item() == 3.0
    base = merged.finish()
    assert math.isclose(float(base.mean[0, 0, 1]), 1.75 / 3, rel_tol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        merged.merge(EntropyAccumulator(2, 1))
