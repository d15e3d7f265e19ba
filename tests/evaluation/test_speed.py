import pytest
import torch

from kvguard.evaluation import speed


class _Counting:
    """A decoder that prefers token 1 and counts its steps; every third step 'compensates' for 0.5 s."""

    def __init__(self) -> None:
        self.steps, self.compensation = 0, 0.0

    def prefill(self, ids):
        return torch.tensor([0.0, 1.0])

    def step(self, token):
        self.steps += 1
        self.compensation += 0.5 if self.steps % 3 == 0 else 0.0
        return torch.tensor([0.0, 1.0])


def test_blocks_are_consecutive_runs_of_new_tokens_steps_with_their_compensation():
    decoder = _Counting()
    blocks = speed.time_decode(decoder, torch.tensor([5, 6]), 4, rounds=3, compensation_s=lambda: decoder.compensation)
    # 3 blocks of 4 steps: 12 steps fed back, the 13th token only drawn.
    assert decoder.steps == 12 and len(blocks) == 3
    # Steps 3, 6, 9, 12 compensate: block 1 holds step 3, block 2 step 6 (steps 5-8), block 3 steps 9 and 12.
    assert [c for _, c in blocks] == [0.5, 0.5, 1.0]
    row = speed._row("kvguard-live", 2, 4, [(2.0, 0.5), (1.0, 0.0), (4.0, 3.5)], 10, 40, acted_steps=3)
    assert row["tok_s"] == 4.0 and row["all_blocks_tok_s"] == 12 / 7 and row["kv_bytes_ratio"] == 0.25
    assert row["tok_s_watching"] == 8.0 and row["compensation_s"] == 4.0
    assert "tok_s_watching" not in speed._row("int4", 2, 4, [(1.0, 0.0)], 10, 40)


def test_a_chunked_prefill_feeds_every_token_once_in_chunks():
    fed = []

    class Recording:
        def prefill(self, ids):
            fed.append(ids.tolist())

    assert speed.time_prefill(Recording(), torch.arange(600), chunk=256) > 0
    assert [len(c) for c in fed] == [256, 256, 88] and sum(fed, []) == list(range(600))


@pytest.mark.slow
def test_speed_rows_side_by_side():
    rows = speed.run("smollm2-135m", ["int4"], [128], new_tokens=4, progress=False, rounds=2)
    assert [r["method"] for r in rows] == ["fp16", "int4"]
    fp16, int4 = rows
    assert fp16["tok_s_ratio"] == 1.0 and fp16["peak_rss_ratio"] == 1.0
    assert len(int4["block_tok_s"]) == 2 and int4["tok_s"] == max(int4["block_tok_s"])
    assert int4["tok_s"] > 0 and int4["peak_rss_mb"] > 100 and int4["kv_bytes_ratio"] < fp16["kv_bytes_ratio"]
    assert int4["prefill_tok_s"] > 0 and int4["prefill_ratio"] == int4["prefill_tok_s"] / fp16["prefill_tok_s"]
    assert "| 128 | int4 |" in speed.markdown_table(rows) and "chunked prefill" in speed.markdown_table(rows)


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


def test_passes_run_the_whole_list_in_turn_and_keep_the_fastest_block(monkeypatch):
    import json
    import subprocess

    blocks = {"fp16": [[10.0, 12.0], [8.0, 9.0]], "kvguard-live": [[6.0, 11.0], [12.0, 4.0]]}  # tok/s per pass
    asked = []

    def fake_run(cmd, **kwargs):
        name = cmd[cmd.index("--method") + 1]
        turn = sum(1 for n in asked if n == name)
        asked.append(name)
        row = {"method": name, "context": 64, "new_tokens": 4, "tok_s": max(blocks[name][turn]),
               "block_tok_s": blocks[name][turn], "peak_rss_mb": 100.0 + turn, "kv_bytes": 1, "kv_bytes_ratio": 1.0}
        if name == "kvguard-live":
            row.update(tok_s_watching=[11.5, 13.0][turn], compensation_s=0.5, monitoring_steps=1, acted_steps=turn)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")

    monkeypatch.setattr(speed.subprocess, "run", fake_run)
    fp16, live = speed.run("smollm2-135m", ["kvguard-live"], [64], 4, progress=False, passes=2)
    assert asked == ["fp16", "kvguard-live", "fp16", "kvguard-live"]  # the list in turn, not one method twice
    assert fp16["block_tok_s"] == [10.0, 12.0, 8.0, 9.0] and fp16["tok_s"] == 12.0 and fp16["passes"] == 2
    assert fp16["all_blocks_tok_s"] == pytest.approx(4 * 4 / sum(4 / b for b in [10.0, 12.0, 8.0, 9.0]))
    assert live["tok_s"] == 12.0 and live["tok_s_ratio"] == 1.0 and live["peak_rss_mb"] == 101.0
    assert live["tok_s_watching"] == 13.0 and live["tok_s_watching_ratio"] == pytest.approx(13.0 / 12.0)
    assert live["compensation_s"] == 1.0 and live["acted_steps"] == 1 and live["monitoring_steps"] == 2


@pytest.mark.slow
def test_llamacpp_decode_is_timed_on_the_gguf():
    pytest.importorskip("llama_cpp")
    row = speed.measure("smollm2-135m", "llamacpp-q4_0", 64, 4)
    assert row["method"] == "llamacpp-q4_0" and row["tok_s"] > 0
    assert row["kv_bytes_ratio"] == 18 / 32 / 2  # GGML's q4_0 blocks over kvguard's FP16 count
