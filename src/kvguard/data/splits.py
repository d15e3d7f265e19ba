"""Which side of the calibration / evaluation divide a document is on, decided by a hash of its id.

Every document of every corpus belongs to exactly one :class:`Split`: ``sha256(f"{corpus}:{doc_id}")`` mapped
to ``u`` in [0, 1), :attr:`Split.EVAL` when ``u < eval_fraction`` (:func:`split_of`). So calibration and
evaluation data never overlap, and the assignment does not depend on how many documents were read or in which
order. The corpus names are part of the hash, which is why they are written down here (:data:`CORPORA`):
renaming a corpus would reshuffle its splits.

Documents are served in a second hash order (:func:`order_key`), independent of the split hash, so that a
prefix of a split is a random sample and a smaller ``limit`` gives a prefix of a larger one.
"""

from __future__ import annotations

import hashlib
import re
from enum import Enum

CORPORA: tuple[str, ...] = ("prose", "dialog", "code", "long")
EVAL_FRACTION: float = 0.2
"""Fraction of each corpus's documents assigned to :attr:`Split.EVAL`."""

# (doc_id, text) pairs of one split, in hash order.
Entries = tuple[tuple[str, str], ...]


class Split(str, Enum):
    """Which side of the calibration / evaluation divide a document is on."""

    CALIB = "calib"
    EVAL = "eval"


def check_corpus(corpus: str) -> str:
    """``corpus`` if it names a corpus; ``ValueError`` listing the valid names otherwise."""
    if not isinstance(corpus, str) or corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; valid corpora: {', '.join(CORPORA)}")
    return corpus


def parse_split(split: Split | str) -> Split:
    """``split`` as a :class:`Split` (any case); ``ValueError`` listing the valid splits otherwise."""
    if isinstance(split, Split):
        return split
    if isinstance(split, str):
        for s in Split:
            if split.lower() == s.value:
                return s
    valid = ", ".join(s.value for s in Split)
    raise ValueError(f"unknown split {split!r}; valid splits: {valid}")


_PART_SUFFIX = re.compile(r"_\d+$")


def _split_key(corpus: str, doc_id: str) -> str:
    # ShareGPT splits long conversations into parts "<id>_0", "<id>_1", ...: all parts of
    # one conversation must land in the same split, so the part suffix is not hashed.
    if corpus == "dialog":
        return _PART_SUFFIX.sub("", doc_id)
    return doc_id


def _unit_hash(text: str) -> float:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(corpus: str, doc_id: str, eval_fraction: float = EVAL_FRACTION) -> Split:
    """Return the split of a document, deterministically from its corpus and id.

    ``sha256(f"{corpus}:{doc_id}")`` is mapped to a uniform number ``u`` in [0, 1); the
    document is in :attr:`Split.EVAL` when ``u < eval_fraction``. For ``dialog`` the
    ShareGPT part suffix (``"_3"`` in ``"abc_3"``) is dropped first, so all parts of one
    conversation share a split.
    """
    check_corpus(corpus)
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction!r}")
    u = _unit_hash(f"{corpus}:{_split_key(corpus, doc_id)}")
    return Split.EVAL if u < eval_fraction else Split.CALIB


def order_key(corpus: str, doc_id: str) -> tuple[bytes, str]:
    """The serving order of a document: independent of the split hash, so a prefix of the sorted list is a
    random sample."""
    return hashlib.sha256(f"order:{corpus}:{doc_id}".encode("utf-8")).digest(), doc_id


def assign(corpus: str, pairs: list[tuple[str, str]]) -> dict[Split, Entries]:
    """Deduplicate ``(doc_id, text)`` pairs (by id, then exact text), assign splits, sort by :func:`order_key`."""
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    kept: list[tuple[str, str]] = []
    for doc_id, text in sorted(pairs):
        if doc_id in seen_ids or text in seen_texts:
            continue
        seen_ids.add(doc_id)
        seen_texts.add(text)
        kept.append((doc_id, text))
    kept.sort(key=lambda p: order_key(corpus, p[0]))
    out: dict[Split, list[tuple[str, str]]] = {s: [] for s in Split}
    for doc_id, text in kept:
        out[split_of(corpus, doc_id)].append((doc_id, text))
    return {s: tuple(v) for s, v in out.items()}
