"""Quality measured through the cache, the way decoding sees it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache


@dataclass(frozen=True)
class StreamScore:
    """Teacher-forced scores of one token stream.

    Attributes:
        nll: mean next-token negative log-likelihood (nats) over ``tokens - 1`` predictions.
        tokens: length of the stream.
        logits: ``[tokens - 1, vocab]`` float32 next-token logits when kept, else ``None``.
    """

    nll: float
    tokens: int
    logits: torch.Tensor | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.no_grad()
def score_stream(model, input_ids: torch.Tensor, cache: Cache, *, chunk: int = 1, keep_logits: bool = False,
                 progress: bool = False, desc: str = "scoring") -> StreamScore:
    """Feed ``input_ids`` (``[T]`` or ``[1, T]``) through ``model`` in chunks of ``chunk`` tokens, each chunk
    attending to the cached (possibly quantized) past, and score every next-token prediction."""
    ids = input_ids.reshape(1, -1).to(model.device)
    total = ids.shape[1]
    if total < 2:
        raise ValueError(f"need at least 2 tokens to score, got {total}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    nll_sum = torch.zeros((), dtype=torch.float64)
    kept = []
    for start in tqdm(range(0, total - 1, chunk), desc=desc, unit="chunk", disable=not progress, leave=False):
        piece = ids[:, start:min(start + chunk, total - 1)]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits[0].float()
        targets = ids[0, start + 1:start + 1 + piece.shape[1]]
        nll_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").double().cpu()
        if keep_logits:
            kept.append(logits.cpu())
    return StreamScore((nll_sum / (total - 1)).item(), total, torch.cat(kept) if keep_logits else None)
