"""One logits buffer for the output head across the many scoring passes of a calibration.

Every candidate pass ends in the output head: ``[positions, vocab]`` float32 logits, 535 MB for 510 positions
of Gemma 3's 262k-token vocabulary. An allocation that large is a fresh ``mmap`` each time (glibc maps anything
above 32 MB), so every pass also pays the kernel for faulting in and zeroing those pages: about a fifth of a
Gemma 3 sensitivity trial on 2 cores. Within :meth:`LogitBuffer.installed`, the head writes into one buffer
that outlives the passes instead. The numbers are the model's own, bit for bit (the same product into other
memory).

The logits of a pass alias the buffer: they are valid until the next pass, so a caller consumes them first
(:meth:`kvguard.calibration.heldout.HeldOut.score` turns them into metrics at once).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


class LogitBuffer:
    """Memory the output head writes its logits into, kept across passes (it grows to the largest pass)."""

    def __init__(self) -> None:
        self._memory: torch.Tensor | None = None

    def _view(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        memory = self._memory
        if memory is None or memory.numel() < size or memory.dtype != like.dtype or memory.device != like.device:
            memory = self._memory = torch.empty(size, dtype=like.dtype, device=like.device)
        return memory[:size].view(shape)

    @contextlib.contextmanager
    def installed(self, model) -> Iterator[None]:
        """Within this block, ``model``'s output head (a bias-free ``nn.Linear``, as in Llama- and Gemma-style
        models; anything else runs unchanged) writes its logits into this buffer. No autograd: the block is
        for scoring only."""
        head = model.get_output_embeddings()
        if type(head) is not torch.nn.Linear or head.bias is not None:
            yield
            return

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            out = self._view((*hidden.shape[:-1], head.out_features), head.weight)  # [..., vocab]
            return torch.matmul(hidden, head.weight.T, out=out)

        head.forward = forward  # an instance attribute shadows the class's forward (as kvguard.calibration.prefix)
        try:
            with torch.no_grad():
                yield
        finally:
            del head.forward
