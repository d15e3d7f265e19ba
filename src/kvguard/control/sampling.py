"""Choosing the next token: greedy, or nucleus sampling with a temperature and an optional seed."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

SEED_RANGE = (-(2 ** 63), 2 ** 64)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Sampler:
    """How the next token is drawn from the logits.

    Attributes:
        temperature: 0 is greedy (arg-max); otherwise softmax(logits / temperature).
        top_p: nucleus sampling keeps the most likely tokens up to this probability mass (1: all).
        seed: makes sampling reproducible; ``None`` draws a fresh seed per generation.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def start(self) -> Callable[[torch.Tensor], int]:
        """A draw function for one generation (its own random stream).

        The draw runs where the logits are (a GPU's: no copy of the vocabulary to the host); the one value that
        crosses is the token id, which the caller needs on the host anyway (stop checks, streaming). The random
        stream is seeded per device, so a seed reproduces a generation on the same kind of device."""
        if self.greedy:
            return lambda logits: int(logits.argmax())
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        generators: dict[torch.device, torch.Generator] = {}

        def draw(logits: torch.Tensor) -> int:
            if logits.device not in generators:
                generators[logits.device] = torch.Generator(device=logits.device).manual_seed(seed)
            return self._draw(logits, generators[logits.device])

        return draw

    def _draw(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))


GREEDY = Sampler()
