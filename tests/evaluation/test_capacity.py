"""The capacity arithmetic on hand-made numbers: the fits, the predicted peak, the largest batch in a budget."""

import math

import pytest

from kvguard.evaluation import capacity
from kvguard.evaluation.capacity import MIB, Footprint, Linear


def test_line_fit_by_hand():
    line = Linear.fit([(0, 1.0), (1, 3.0), (2, 5.0)])
    assert (line.intercept, line.slope) == (1.0, 2.0) and line(10) == 21.0
    # Least squares through (0, 0), (1, 1), (2, 5): slope 5 / 2, intercept 2 - 5 / 2.
    noisy = Linear.fit([(0, 0.0), (1, 1.0), (2, 5.0)])
    assert math.isclose(noisy.slope, 2.5) and math.isclose(noisy.intercept, -0.5)
    assert Linear.fit([(4, 7.0)]) == Linear(7.0, 0.0)
    with pytest.raises(ValueError, match="at least one point"):
        Linear.fit([])


def _probe_row():
    # Batch 2, model 1,000 MiB; per sequence the cache holds 10 MiB + 1 MiB per 256 tokens and the chunk's
    # transient is 4 MiB + 2 MiB per 256 tokens: the per-chunk peak is model + 2 x (kv + act).
    points = []
    for t in (256, 512, 768, 1024):
        kv, act = 10 + t / 256, 4 + 2 * t / 256
        points.append([t, 2 * kv * MIB, (1000 + 2 * (kv + act)) * MIB])
    return {"method": "int4", "batch": 2, "model_rss": 1000 * MIB, "load_peak": 1100 * MIB, "points": points}


def test_footprint_from_a_probe_recovers_the_per_sequence_lines():
    fp = Footprint.from_probe(_probe_row())
    assert math.isclose(fp.kv.intercept, 10 * MIB) and math.isclose(fp.kv.slope, MIB / 256)
    assert math.isclose(fp.act.intercept, 4 * MIB) and math.isclose(fp.act.slope, 2 * MIB / 256)
    # At 4,096 tokens one sequence adds (10 + 16) + (4 + 32) = 62 MiB.
    assert math.isclose(fp.per_sequence(4096), 62 * MIB)
    assert math.isclose(fp.peak(8, 4096), (1000 + 8 * 62) * MIB)
    assert fp.peak(1, 256) == 1100 * MIB  # the load's peak is higher than one short sequence's


def test_max_batch_is_the_largest_that_fits():
    fp = Footprint("x", model_rss=1000 * MIB, load_peak=1000 * MIB, kv=Linear(0, MIB / 256), act=Linear(0, 0))
    # 16 MiB per sequence at 4,096 tokens: (4,096 - 1,000) / 16 = 193.5 -> 193.
    assert fp.max_batch(4 * 1024 * MIB, 4096) == 193
    assert fp.peak(193, 4096) <= 4 * 1024 * MIB < fp.peak(194, 4096)
    assert fp.max_batch(900 * MIB, 4096) == 0  # the model alone does not fit
    heavy = Footprint("y", model_rss=1000 * MIB, load_peak=5000 * MIB, kv=Linear(0, MIB), act=Linear(0, 0))
    assert heavy.max_batch(4 * 1024 * MIB, 16) == 0  # loading already peaks above the budget


def test_rows_and_table():
    fp = Footprint.from_probe(_probe_row())
    row = capacity.capacity_row(fp, 4 * 1024 * MIB, (1024, 4096), 8, 4096)
    assert row["max_batch"] == {"1024": (4096 - 1000) // (14 + 12), "4096": (4096 - 1000) // 62}
    assert math.isclose(row["predicted_peak_mb"], 1000 + 8 * 62)
    row.update(kv_bytes_ratio=0.33, measured_peak_mb=1500.0, peak_rss_ratio=0.9)
    table = capacity.markdown_table([row, {"method": "hf-quanto-4", "error": "no quanto"}], 4.0)
    assert "max batch @ 4096 (4 GiB)" in table and "peak 8 x 4096 predicted MiB" in table
    assert "| int4 | 1000 | 26.0 | 36.0 | 119 | 49 | 1496 | 1500 | 0.90 | 0.330 |" in table
    assert "| hf-quanto-4 | unsupported: no quanto |" in table


def test_a_probe_counts_the_weights_in_the_model_not_in_the_first_chunk(smollm2):
    """The weights are resident before the first chunk: the model's RSS over a bare process holds at least their
    bytes, and the first chunk's peak over model and cache is not that large again (a fresh process, real model)."""
    row = capacity.probe_subprocess("smollm2-135m", "fp16", 1, 2 * capacity.CHUNK, capacity.CHUNK, None, "cpu")
    assert "error" not in row, row
    weights = smollm2[0].num_parameters() * 4  # float32
    assert row["model_rss"] - row["base_rss"] >= 0.95 * weights
    (_, kv, first_peak), _ = row["points"]
    assert first_peak - row["model_rss"] - kv < 0.5 * weights
