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


def test_llamacpp_rows_follow_their_reference_and_carry_its_ratio(monkeypatch):
    import json
    import subprocess

    tok_s = {"fp16": 10.0, "int4": 8.0, "llamacpp-f16": 40.0, "llamacpp-q4_0": 30.0}
    asked = []

    def fake_run(cmd, **kwargs):
        name = cmd[cmd.index("--method") + 1]
        asked.append((name, cmd[cmd.index("--device") + 1]))
        row = {"method": name, "context": 64, "new_tokens": 4, "tok_s": tok_s[name], "peak_rss_mb": 100.0,
               "kv_bytes": 1, "kv_bytes_ratio": 1.0}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")

    monkeypatch.setattr(speed.subprocess, "run", fake_run)
    rows = speed.run("smollm2-135m", ["llamacpp-q4_0", "int4"], [64], 4, progress=False, device="auto")
    assert asked == [("fp16", "cpu"), ("int4", "cpu"), ("llamacpp-f16", "cpu"), ("llamacpp-q4_0", "cpu")]
    by_name = {r["method"]: r for r in rows}
    assert by_name["llamacpp-q4_0"]["tok_s_vs_reference"] == 0.75 and by_name["llamacpp-q4_0"]["tok_s_ratio"] == 3.0
    assert "tok_s_vs_reference" not in by_name["int4"]
    assert "llamacpp-q4_0 / llamacpp-f16 decode speed at 64 tokens: 0.75" in speed.markdown_table(rows)


@pytest.mark.slow
def test_llamacpp_decode_is_timed_on_the_gguf():
    pytest.importorskip("llama_cpp")
    row = speed.measure("smollm2-135m", "llamacpp-q4_0", 64, 4)
    assert row["method"] == "llamacpp-q4_0" and row["tok_s"] > 0
    assert row["kv_bytes_ratio"] == 18 / 32 / 2  # GGML's q4_0 blocks over kvguard's FP16 count
