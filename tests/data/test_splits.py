"""The calibration / evaluation divide: disjoint, non-empty, deterministic, hashed by document id."""

from __future__ import annotations

import re

import pytest

from kvguard import data as D
from kvguard.data import CORPORA, Document, Split

# dialog is a 17k-record file read lazily: the split tests take a sample of it.
_DIALOG_LIMIT = {Split.CALIB: 400, Split.EVAL: 100}


def _docs(corpus: str, split: Split) -> list[Document]:
    limit = _DIALOG_LIMIT[split] if corpus == "dialog" else None
    return D.documents(corpus, split, limit=limit)


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
