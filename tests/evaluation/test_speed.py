import pytest

from kvguard.evaluation import speed


@pytest.mark.slow
def test_speed_rows_side_by_side():
    rows = speed.run("smollm2-135m", ["int4"], [128], new_tokens=4, progress=False)
    assert [r["method"] for r in rows] == ["fp16", "int4"]
    fp16, int4 = rows
    assert fp16["tok_s_ratio"] == 1.0 and fp16["peak_rss_ratio"] == 1.0
    assert int4["tok_s"] > 0 and int4["peak_rss_mb"] > 100 and int4["kv_bytes_ratio"] < fp16["kv_bytes_ratio"]
    assert "| 128 | int4 |" in speed.markdown_table(rows)
