"""The corpora registry: one reader per name, the names the split hash uses, arguments checked once."""

from __future__ import annotations

import pytest

from kvguard import data as D
from kvguard.data import CORPORA, Split, corpora


def test_the_registry_reads_every_corpus_the_splits_name():
    assert tuple(corpora.REGISTRY) == CORPORA
    assert all(c.name == name and c.source for name, c in corpora.REGISTRY.items())


def test_documents_come_from_the_registered_reader(fake_corpus):
    fake_corpus("prose", ["one", "two", "three"], ["four"])
    assert [(d.doc_id, d.text) for d in D.documents("prose", "calib", limit=2)] == [("c0", "one"), ("c1", "two")]
    assert [d.text for d in D.iter_documents("prose", Split.EVAL)] == ["four"]


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
