import torch

from kvguard.calibration import outliers


def _stats(kind="key"):
    """3 layers x 2 KV heads x 8 channels; layer 1 head 0 channel 5 is an offset (mean ~ absmax) 40x the
    median, layer 2 head 1 channel 2 a spike 12x; layer 0 has none (its largest channel is 3x)."""
    absmax = torch.ones(3, 2, 8)
    absmax[0, 1, 3] = 3.0
    absmax[1, 0, 5] = 40.0
    absmax[2, 1, 2] = 12.0
    mean = torch.zeros(3, 2, 8)
    mean[1, 0, 5] = -39.0  # a negative offset counts by its size
    mean[2, 1, 2] = 1.0
    return {f"stats.{kind}.absmax": absmax, f"stats.{kind}.mean": mean}


def test_find_names_the_outlier_channels_and_offsets():
    rows = outliers.find(_stats())
    assert [r.layer for r in rows] == [0, 1, 2] and all(r.kind == "key" for r in rows)
    assert rows[0].channels == () and rows[0].ratio == 3.0
    assert rows[1].channels == ((0, 5),) and rows[1].offsets == 1 and rows[1].ratio == 40.0 and rows[1].absmax == 40.0
    assert rows[2].channels == ((1, 2),) and rows[2].offsets == 0 and rows[2].ratio == 12.0


def test_summary_says_where_and_how_large():
    line = outliers.summary(outliers.find(_stats("value"), "value"))
    assert line.startswith("2 outlier value channels") and "1 of them offsets" in line
    assert "in 2 of 3 layers [1, 2]" in line and "layer 1, 40x, absmax 40" in line
    quiet = {"stats.key.absmax": torch.ones(2, 1, 4), "stats.key.mean": torch.zeros(2, 1, 4)}
    assert outliers.summary(outliers.find(quiet)).startswith("no key outlier channels")
