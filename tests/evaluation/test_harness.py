"""`kvguard eval` end to end on the real SmolLM2 (short streams) and the harness's contracts."""

import json

import pytest

from kvguard import cli
from kvguard.evaluation import harness, methods
from tests.helpers import eval_row

FIELDS = {"method", "corpus", "mode", "kv_bytes", "kv_bytes_ratio", "ppl", "ppl_delta_pct", "kl", "kl_p99", "kl_p999",
          "kl_max", "top1_agree", "tok_s", "trigger_rate", "recompute_fraction", "ram_bytes_ratio", "disk_bytes_ratio",
          "error"}


def test_unknown_method_lists_valid_ones(capsys):
    assert cli.main(["eval", "--methods", "fp16,int5"]) == 2
    assert "kivi-4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="calibration profile"):
        methods.get("kvguard")
    assert cli.main(["eval", "--methods", "kvguard"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_markdown_table_marks_unsupported_rows():
    rows = [eval_row("fp16", "prose", "simulated", 10, 1.0, 5.0, 0.0, 0.0, 1.0, 100.0),
            harness.Row("hf-quanto-4", "prose", "streamed", error="refuses sliding layers")]
    table = harness.markdown_table(rows).splitlines()
    assert table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert "unsupported [1]" in table[3] and table[-1] == "[1] refuses sliding layers"


def test_windows_combine_by_mean_nll():
    import math

    w1 = [eval_row("fp16", "prose", "simulated", 10, 1.0, 10.0, 0.0, 0.0, 1.0, 100.0),
          eval_row("int4", "prose", "simulated", 4, 0.4, 11.0, 10.0, 0.02, 0.9, 80.0),
          harness.Row("hf-quanto-4", "prose", "streamed", error="refused")]
    w2 = [eval_row("fp16", "prose", "simulated", 10, 1.0, 40.0, 0.0, 0.0, 1.0, 120.0),
          eval_row("int4", "prose", "simulated", 4, 0.4, 40.0, 0.0, 0.04, 0.8, 100.0),
          harness.Row("hf-quanto-4", "prose", "streamed", error="refused")]
    fp16, int4, peer = harness.combine_windows([w1, w2])
    assert math.isclose(fp16.ppl, 20.0) and math.isclose(int4.ppl, math.sqrt(11.0 * 40.0))
    assert math.isclose(int4.ppl_delta_pct, 100 * (math.sqrt(440.0) / 20.0 - 1))
    assert math.isclose(int4.kl, 0.03) and math.isclose(int4.top1_agree, 0.85) and peer.error == "refused"
    with pytest.raises(ValueError, match="same methods"):
        harness.combine_windows([w1, w2[::-1]])


def test_windows_combine_the_kl_tail_over_every_token_and_the_json_leaves_the_tokens_out():
    import torch

    def window(values):
        row = eval_row("int4", "prose", "simulated", 4, 0.4, 11.0, 0.0, sum(values) / len(values), 0.9, 80.0)
        harness._set_tail(row, torch.tensor(values))
        return [eval_row("fp16", "prose", "simulated", 10, 1.0, 10.0, 0.0, 0.0, 1.0, 100.0), row]

    _, int4 = harness.combine_windows([window([0.1, 0.2]), window([0.9, 0.3])])
    # Sorted 0.1 0.2 0.3 0.9: p99 at rank 0.99 * 3 = 2.97, 0.3 + 0.97 * 0.6; p99.9 at 2.997; max 0.9.
    assert int4.kl_p99 == pytest.approx(0.3 + 0.97 * 0.6) and int4.kl_p999 == pytest.approx(0.3 + 0.997 * 0.6)
    assert int4.kl_max == pytest.approx(0.9) and int4.kl == pytest.approx(0.375)
    results = harness.rows_payload("m", 2, 1, [int4])["results"]
    assert set(results[0]) == FIELDS and results[0]["kl_max"] == pytest.approx(0.9)
    json.dumps(results)  # plain numbers only
    table = harness.markdown_table([int4]).splitlines()
    assert "| kl | kl_p99 | kl_p999 | kl_max |" in table[0] and "| 0.37500 | 0.8820 | 0.8982 | 0.9000 |" in table[2]


@pytest.mark.slow
def test_eval_json_contract_and_fp16_reference(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = cli.main(["eval", "--model", "smollm2-135m", "--methods", "fp16,int4,kivi-2,hf-quanto-4",
                     "--corpus", "prose,code", "--tokens", "192", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| prose | int4 | simulated |" in table and "| code | hf-quanto-4 | streamed |" in table
    payload = json.loads(out.read_text())
    assert payload["model"] == "smollm2-135m" and payload["tokens"] == 192 and payload["chunk"] == 1
    rows = payload["results"]
    assert {(r["method"], r["corpus"]) for r in rows} == {
        (m, c) for m in ("fp16", "int4", "kivi-2", "hf-quanto-4") for c in ("prose", "code")}
    for r in rows:
        assert set(r) == FIELDS and r["error"] is None
        assert r["ppl"] > 1 and r["kl"] >= 0 and 0 <= r["top1_agree"] <= 1 and r["tok_s"] > 0
        assert r["kl_max"] >= r["kl_p999"] >= r["kl_p99"] >= 0 and r["kl_max"] >= r["kl"]
        assert r["trigger_rate"] is None and r["recompute_fraction"] is None
        if r["method"] == "fp16":
            assert r["ppl_delta_pct"] == 0.0 and r["top1_agree"] == 1.0 and r["kl"] == 0.0 and r["kl_max"] == 0.0
            assert r["kv_bytes_ratio"] == 1.0
        else:
            assert r["kv_bytes_ratio"] < 1.0
    kivi2 = next(r for r in rows if r["method"] == "kivi-2" and r["corpus"] == "prose")
    assert kivi2["kl"] > 0 and kivi2["ppl_delta_pct"] != 0.0


@pytest.mark.slow
def test_eval_streams_when_chunked_and_reads_text_files(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("Quantized caches trade memory for error. " * 60)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--methods", "fp16,int8", "--text-file", str(text), "--tokens", "128",
                     "--chunk", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["streamed", "streamed"] and rows[0]["corpus"] == "notes.txt"
    assert rows[1]["top1_agree"] >= 0.9
