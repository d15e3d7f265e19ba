"""Text as token ids: one stream of a split, per-document samples, or a user's text file.

:func:`token_stream` joins documents (:func:`kvguard.data.corpora.iter_documents` order, each tokenized
separately without special tokens) with the tokens of :data:`DOC_SEPARATOR` into exactly ``n_tokens`` ids;
:func:`samples` keeps one truncated document per sample, skipping those under :data:`MIN_SAMPLE_TOKENS`;
:func:`load_text_file` reads a UTF-8 file checked by :func:`read_text_file` before any model is loaded. All three
put BOS first the way the tokenizer itself would (:func:`wants_bos`), unless told otherwise (``add_bos``). A long
document is never tokenized whole: a generous character prefix is tokenized first (:func:`_encode_prefix`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from kvguard.data.corpora import iter_documents
from kvguard.data.splits import Split, check_corpus, parse_split

MIN_SAMPLE_TOKENS: int = 16
"""Documents shorter than this (in tokens) are skipped by :func:`samples`."""

DOC_SEPARATOR: str = "\n\n"
"""Text placed between consecutive documents in :func:`token_stream`."""


def _check_positive(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_PREFIX_CHARS_PER_TOKEN = 16
_PREFIX_MARGIN_TOKENS = 16


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_prefix(tokenizer: Any, text: str, n: int) -> list[int]:
    """The first ``n`` tokens of ``text``, without tokenizing all of a very long text.

    A generous character prefix is tokenized first; its tokens are used only if it yields
    comfortably more than ``n`` tokens (so the cut cannot affect the first ``n``).
    """
    cut = (n + _PREFIX_MARGIN_TOKENS) * _PREFIX_CHARS_PER_TOKEN + 1024
    if len(text) > cut:
        ids = _encode(tokenizer, text[:cut])
        if len(ids) >= n + _PREFIX_MARGIN_TOKENS:
            return ids[:n]
    return _encode(tokenizer, text)[:n]


def wants_bos(tokenizer: Any) -> bool:
    """Whether texts for this tokenizer's model start with BOS (the tokenizer adds it itself)."""
    return _resolve_bos(tokenizer, None) is not None


def _resolve_bos(tokenizer: Any, add_bos: bool | None) -> int | None:
    """The BOS id to prepend, or None.

    ``add_bos=None`` follows the tokenizer: BOS is added when ``tokenizer.add_bos_token``
    is True or when ``tokenizer(text)`` itself starts with ``bos_token_id``.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos is None:
        if bos is None:
            return None
        if getattr(tokenizer, "add_bos_token", None) is True:
            return bos
        probe = list(tokenizer("a")["input_ids"])
        return bos if probe and probe[0] == bos else None
    if add_bos:
        if bos is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
        return bos
    return None


def samples(
    corpus: str,
    split: Split | str,
    tokenizer: Any,
    *,
    n_samples: int,
    max_tokens: int,
    add_bos: bool | None = None,
) -> list[torch.Tensor]:
    """Tokenize up to ``n_samples`` documents, one 1-D LongTensor per document.

    Each sample is one document (in :func:`documents` order) truncated to ``max_tokens``
    tokens, BOS included when added (see :func:`token_stream` for ``add_bos``); documents
    with fewer than 16 tokens are skipped. When the split has fewer usable documents,
    fewer samples are returned (the caller decides whether to warn).
    """
    corpus = check_corpus(corpus)
    split = parse_split(split)
    _check_positive("n_samples", n_samples)
    _check_positive("max_tokens", max_tokens)
    bos = _resolve_bos(tokenizer, add_bos)
    out: list[torch.Tensor] = []
    for doc in iter_documents(corpus, split, tokenizer):
        ids = _encode_prefix(tokenizer, doc.text, max_tokens)
        if len(ids) < MIN_SAMPLE_TOKENS:
            continue
        if bos is not None and ids[0] != bos:
            ids = [bos] + ids[: max_tokens - 1]
        out.append(torch.tensor(ids, dtype=torch.long))
        if len(out) == n_samples:
            break
    return out


def token_stream(
    corpus: str,
    split: Split | str,
    tokenizer: Any,
    n_tokens: int,
    *,
    add_bos: bool | None = None,
) -> torch.Tensor:
    """Concatenate documents into one 1-D LongTensor of exactly ``n_tokens`` tokens.

    Documents (in :func:`documents` order) are tokenized separately without special
    tokens and joined with the tokens of ``"\\n\\n"``. ``add_bos``: True prepends
    ``tokenizer.bos_token_id`` once at the start of the stream, False never does, None
    does so when the tokenizer adds BOS by itself (``add_bos_token`` or ``tokenizer(text)``
    starting with BOS). Raises ``ValueError`` naming the corpus and the number of tokens
    available when the split is too small.
    """
    corpus = check_corpus(corpus)
    split = parse_split(split)
    _check_positive("n_tokens", n_tokens)
    bos = _resolve_bos(tokenizer, add_bos)
    sep = _encode(tokenizer, DOC_SEPARATOR)
    ids: list[int] = []
    for doc in iter_documents(corpus, split, tokenizer):
        if ids:
            ids.extend(sep)
        remaining = n_tokens - len(ids)
        if remaining <= 0:
            break
        doc_ids = _encode_prefix(tokenizer, doc.text, remaining)
        if not ids and bos is not None and (not doc_ids or doc_ids[0] != bos):
            ids.append(bos)
            doc_ids = doc_ids[: n_tokens - 1]
        ids.extend(doc_ids)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise ValueError(
            f"corpus {corpus!r} split {split.value!r} has only {len(ids)} tokens available "
            f"with this tokenizer, but {n_tokens} were requested"
        )
    return torch.tensor(ids[:n_tokens], dtype=torch.long)


def read_text_file(path: str | os.PathLike[str]) -> str:
    """The text of a UTF-8 file, checked before any model is loaded.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a directory, a file that is not
    UTF-8, one with NUL bytes (binary data, or UTF-16), or one with no text.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"text file not found: {p}")
    if not p.is_file():
        raise ValueError(f"not a regular file: {p}")
    data = p.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{p} contains NUL bytes (offset {data.index(bytes(1))}): binary data or UTF-16, not UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{p} is not UTF-8 text (invalid byte at offset {exc.start}); re-encode it as UTF-8"
        ) from None
    if not text.strip():
        raise ValueError(f"text file is empty: {p}")
    return text


def load_text_file(
    path: str | os.PathLike[str],
    tokenizer: Any,
    n_tokens: int,
    *,
    add_bos: bool | None = None,
) -> torch.Tensor:
    """Tokenize a UTF-8 text file into a 1-D LongTensor of at most ``n_tokens`` tokens.

    BOS handling as in :func:`token_stream`. A shorter file gives a shorter tensor. The file is checked by
    :func:`read_text_file`.
    """
    _check_positive("n_tokens", n_tokens)
    text = read_text_file(path)
    bos = _resolve_bos(tokenizer, add_bos)
    ids = _encode_prefix(tokenizer, text, n_tokens)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids[: n_tokens - 1]
    return torch.tensor(ids, dtype=torch.long)
