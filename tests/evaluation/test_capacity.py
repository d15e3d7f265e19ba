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


def _probe_row(per_sequence: bool = False):
    # Batch 2, model 1,000 MiB; per sequence the cache holds 10 MiB + 1 MiB per 256 tokens, and a chunk's transient
    # is 4 MiB + 2 MiB per 256 tokens of context: per forward (the served path), or per sequence (the peers' batch).
    points = []
    for t in (256, 512, 768, 1024):
        kv, act = 10 + t / 256, 4 + 2 * t / 256
        transient = 2 * act if per_sequence else act
        points.append([t, kv * MIB, 2 * kv * MIB, (1000 + 2 * kv + transient) * MIB])
    return {"method": "int4", "batch": 2, "model_rss": 1000 * MIB, "load_peak": 1100 * MIB, "points": points,
            "act_per_sequence": per_sequence}


def test_footprint_from_a_probe_recovers_the_lines():
    fp = Footprint.from_probe(_probe_row())
    assert math.isclose(fp.kv.intercept, 10 * MIB) and math.isclose(fp.kv.slope, MIB / 256)
    assert math.isclose(fp.act.intercept, 4 * MIB) and math.isclose(fp.act.slope, 2 * MIB / 256)
    # At 4,096 tokens one sequence adds 10 + 16 = 26 MiB; the forward's transient is 4 + 32 = 36 MiB, once.
    assert math.isclose(fp.per_sequence(4096), 26 * MIB)
    assert math.isclose(fp.peak(8, 4096), (1000 + 8 * 26 + 36) * MIB)
    assert fp.peak(1, 256) == 1100 * MIB  # the load's peak is higher than one short sequence's
    peers = Footprint.from_probe(_probe_row(per_sequence=True))
    assert peers.act_per_sequence and math.isclose(peers.per_sequence(4096), 62 * MIB)
    assert math.isclose(peers.peak(8, 4096), (1000 + 8 * 62) * MIB)


def test_max_batch_is_the_largest_that_fits():
    fp = Footprint("x", model_rss=1000 * MIB, load_peak=1000 * MIB, kv=Linear(0, MIB / 256), act=Linear(16 * MIB, 0))
    # 16 MiB per sequence at 4,096 tokens and 16 MiB once: (4,096 - 1,000 - 16) / 16 = 192.5 -> 192.
    assert fp.max_batch(4 * 1024 * MIB, 4096) == 192
    assert fp.peak(192, 4096) <= 4 * 1024 * MIB < fp.peak(193, 4096)
    assert fp.max_batch(900 * MIB, 4096) == 0  # the model alone does not fit
    heavy = Footprint("y", model_rss=1000 * MIB, load_peak=5000 * MIB, kv=Linear(0, MIB), act=Linear(0, 0))
    assert heavy.max_batch(4 * 1024 * MIB, 16) == 0  # loading already peaks above the budget


def test_rows_and_table():
    fp = Footprint.from_probe(_probe_row())
    row = capacity.capacity_row(fp, 4 * 1024 * MIB, (1024, 4096), 8, 4096)
    assert row["max_batch"] == {"1024": (4096 - 1000 - 12) // 14, "4096": (4096 - 1000 - 36) // 26}
    assert math.isclose(row["predicted_peak_mb"], 1000 + 8 * 26 + 36)
    row.update(kv_bytes_ratio=0.33, measured_peak_mb=1300.0, peak_rss_ratio=0.9,
               largest_check={"batch": 117, "predicted_mb": 4078.0, "measured_mb": 3900.0, "budget_mb": 4096.0,
                              "within_budget": True, "error_pct": -4.4})
    table = capacity.markdown_table([row, {"method": "hf-quanto-4", "error": "no quanto"}], 4.0)
    assert "max batch @ 4096 (4 GiB)" in table and "peak 8 x 4096 predicted MiB" in table
    assert "| int4 | 1000 | 26.0 | 36.0 | 220 | 117 | 1244 | 1300 | 0.90 | 0.330 |" in table
    assert "| int4 | 117 | 4078 | 3900 | 0.956 | yes |" in table


def test_a_probe_counts_the_weights_in_the_model_not_in_the_first_chunk(smollm2):
    """The weights are resident before the first chunk: the model's RSS over a bare process holds at least their
    bytes, and the first chunk's peak over model and cache is not that large again (a fresh process, real model)."""
    row = capacity.probe_subprocess("smollm2-135m", "fp16", 1, 2 * capacity.CHUNK, capacity.CHUNK, None, "cpu")
    assert "error" not in row, row
    weights = smollm2[0].num_parameters() * 4  # float32
    assert row["model_rss"] - row["base_rss"] >= 0.95 * weights
    (_, _, kv, first_peak), _ = row["points"]
    assert first_peak - row["model_rss"] - kv < 0.5 * weights
