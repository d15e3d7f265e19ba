"""The one decode loop: prefill, then draw a token, hand it out, feed it back, until done.

``kvguard generate``, the server, the speed task and the pass-key task all decode through :func:`generate`,
over anything that can ``prefill(ids) -> logits`` and ``step(token) -> logits``: a
:class:`~kvguard.control.session.LiveSession` (the feedback loop), or a :class:`CacheDecoder` (a bare cache:
a static plan or a peer's).

On a GPU a token costs one device-to-host read, and it is inherent: the drawn token id (``int(...)`` of the
arg-max or the sample, drawn on the device), which the stop checks, ``on_token`` and the next step's input need
on the host. Nothing else on the per-token path copies to the host: the logits stay on the device, and the
feedback loop reads its evidence once per monitoring step (:mod:`kvguard.control.monitor`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import torch

from kvguard import attention
from kvguard.control.sampling import GREEDY, Sampler


class Decoder(Protocol):
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed a prompt ``[T]``; the last position's next-token logits ``[vocab]``."""

    def step(self, token: int) -> torch.Tensor:
        """Feed one token; its next-token logits ``[vocab]``."""


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # end of sequence, or on_token asked to stop (a stop string)
    CANCELLED = "cancelled"  # should_stop said so (a client went away)


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    finish_reason: FinishReason


@torch.no_grad()
def generate(decoder: Decoder, prompt_ids: torch.Tensor, max_new_tokens: int, *, sampler: Sampler = GREEDY,
             eos_token_id: int | None = None, on_token: Callable[[int], bool | None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> Generation:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``.

    ``on_token(token)`` sees every token as it is drawn (the end-of-sequence token included) and returns
    ``True`` to stop after it; ``should_stop()`` is asked before every token. The last token is not fed back
    (nothing would read its logits)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    draw = sampler.start()
    logits = decoder.prefill(prompt_ids)
    tokens: list[int] = []
    while True:
        if should_stop is not None and should_stop():
            return Generation(tokens, FinishReason.CANCELLED)
        token = draw(logits)
        tokens.append(token)
        stop = bool(on_token(token)) if on_token is not None else False
        if stop or (eos_token_id is not None and token == eos_token_id):
            return Generation(tokens, FinishReason.STOP)
        if len(tokens) == max_new_tokens:
            return Generation(tokens, FinishReason.LENGTH)
        logits = decoder.step(token)


class CacheDecoder:
    """Decoding through a bare cache (no feedback loop): a plan's :class:`~kvguard.cache.KVGuardCache`, an FP8
    cache or a peer's.

    With ``fused`` (the default) a KVGuard cache's decode steps read its codes through the fused decode
    attention (:mod:`kvguard.fused_attention`) instead of dequantizing the history at every step; other caches
    are unaffected."""

    def __init__(self, model, cache, *, fused: bool = True) -> None:
        self.model, self.cache, self.fused = model, cache, fused

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        reads = attention.fused_reads(self.model) if self.fused else contextlib.nullcontext()
        with reads:
            # logits_to_keep=1: only the last position's logits are read (a 256-token chunk's would be 50 MB).
            return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(torch.as_tensor(ids).reshape(1, -1).to(self.model.device))

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        return self._forward(torch.tensor([[int(token)]], device=self.model.device))
