"""Calibration text: held-out streams that score candidate plans, and the samples statistics run on.

Both come from the ``calib`` split of each domain only (:mod:`kvguard.data`); the evaluation split is never
read. In each domain the first documents form the held-out stream (``heldout_tokens`` in all, an even share per
domain) and the following ones give the samples, at most :data:`WINDOWS_PER_DOCUMENT` windows of
``max_tokens`` tokens from one document (long code files would otherwise dominate). With ``ranking_tokens``, the
documents after the samples' give one longer stream per domain that re-ranks the closest candidates
(:mod:`kvguard.calibration.ranking`): no token of it is a sample or held out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from kvguard import data
from kvguard.profile import DataManifest, DomainData

WINDOWS_PER_DOCUMENT = 8


@dataclass(frozen=True)
class CalibrationText:
    samples: list[torch.Tensor]  # 1-D token samples, BOS first when the model wants one
    streams: dict[str, torch.Tensor]  # domain -> [heldout tokens]
    manifest: DataManifest
    ranking: dict[str, torch.Tensor] = field(default_factory=dict)  # domain -> [ranking tokens]; empty: none


def _heldout_stream(docs, tokenizer, bos: int | None, sep: list[int], tokens: int, domain: str,
                    what: str = "held-out slice") -> tuple[torch.Tensor, int]:
    """``(stream, documents read)``: ``tokens`` tokens of whole documents joined by the corpus separator."""
    stream: list[int] = [] if bos is None else [bos]
    used = 0
    for doc in docs:
        ids = tokenizer(doc.text[: tokens * 16], add_special_tokens=False)["input_ids"]
        stream.extend((sep if used else []) + ids)
        used += 1
        if len(stream) >= tokens:
            break
    if len(stream) < tokens:
        raise ValueError(f"domain {domain!r} has too little calibration text for a {tokens}-token {what}")
    return torch.tensor(stream[:tokens], dtype=torch.long), used


def _samples(docs, tokenizer, bos: int | None, wanted: int, max_tokens: int) -> tuple[list[torch.Tensor], int]:
    """Up to ``wanted`` windows of ``max_tokens`` tokens (BOS included) from the documents that follow."""
    got, used = [], 0
    body = max_tokens - (bos is not None)
    for doc in docs:  # continues after the held-out documents
        ids = tokenizer(doc.text[: body * WINDOWS_PER_DOCUMENT * 8], add_special_tokens=False)["input_ids"]
        used += 1
        for start in range(0, min(len(ids), body * WINDOWS_PER_DOCUMENT), body):
            window = ids[start:start + body]
            if len(window) < data.MIN_SAMPLE_TOKENS:
                break
            got.append(torch.tensor(([] if bos is None else [bos]) + window, dtype=torch.long))
            if len(got) == wanted:
                return got, used
    return got, used


def calibration_text(tokenizer, domains: tuple[str, ...], samples: int, max_tokens: int,
                     heldout_tokens: int, ranking_tokens: int = 0) -> CalibrationText:
    """The held-out streams and ``samples`` samples, mixed evenly over ``domains``; with ``ranking_tokens``, the
    ranking streams after them (none, with a warning, where a domain has too little text left)."""
    bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None
    sep = tokenizer(data.DOC_SEPARATOR, add_special_tokens=False)["input_ids"]
    per_domain = [samples // len(domains) + (i < samples % len(domains)) for i in range(len(domains))]
    heldout_per_domain, ranking_per_domain = heldout_tokens // len(domains), ranking_tokens // len(domains)
    out, streams, ranking, manifest = [], {}, {}, {}
    for domain, wanted in zip(domains, per_domain):
        docs = data.iter_documents(domain, "calib", tokenizer)
        streams[domain], held_docs = _heldout_stream(docs, tokenizer, bos, sep, heldout_per_domain, domain)
        got, used_docs = _samples(docs, tokenizer, bos, wanted, max_tokens)
        if len(got) < wanted:
            print(f"[kvguard calibrate] warning: domain {domain!r} gave only {len(got)} of the {wanted} samples asked",
                  file=sys.stderr, flush=True)
        out += got
        manifest[domain] = DomainData(len(got), sum(s.numel() for s in got), used_docs, held_docs, heldout_per_domain)
        if ranking_per_domain and ranking is not None:
            try:  # the same iterator: the documents after the samples'
                ranking[domain], ranked_docs = _heldout_stream(docs, tokenizer, bos, sep, ranking_per_domain, domain,
                                                               "ranking stream")
            except ValueError as err:
                print(f"[kvguard calibrate] warning: {err}; the closest candidates are not re-ranked",
                      file=sys.stderr, flush=True)
                ranking = None
            else:
                manifest[domain] = replace(manifest[domain], ranking_documents=ranked_docs,
                                           ranking_tokens=ranking_per_domain)
    if ranking is None:  # all domains or none: a KL over some of them would rank by those alone
        manifest = {d: replace(m, ranking_documents=0, ranking_tokens=0) for d, m in manifest.items()}
    return CalibrationText(out, streams, DataManifest(manifest, len(out), sum(s.numel() for s in out), max_tokens),
                           ranking or {})
