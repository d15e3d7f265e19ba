"""Text as token ids: exact-length streams, BOS as the tokenizer wants it, samples, text files."""

from __future__ import annotations

import pytest
import torch

from kvguard import data as D
from kvguard.data import CORPORA, Split


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


def test_token_stream_too_short_raises(tok, fake_corpus):
    fake_corpus("prose", ["A short calibration text."] * 2, ["Eval text."])
    with pytest.raises(ValueError, match=r"'prose'.*only \d+ tokens available"):
        D.token_stream("prose", "calib", tok, 10_000)
    assert D.token_stream("prose", "calib", tok, 5).shape == (5,)


def test_samples(tok, fake_corpus):
    out = D.samples("long", "eval", tok, n_samples=3, max_tokens=256)
    assert len(out) == 3
    assert all(s.dtype == torch.long and s.ndim == 1 and len(s) == 256 for s in out)
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    fake_corpus("prose", ["Too short.", long_text, "Tiny.", long_text + "!"], ["x"])
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
