"""The overlay: full-precision K/V of chosen quantized positions, which win over their codes when read.

Selective recomputation and exact restores (:mod:`kvguard.control.recompute`) write here, through
:meth:`KVGuardLayer.write_fp <kvguard.cache_layer.KVGuardLayer.write_fp>`: a position held as codes gets its
full-precision K/V in the overlay, and every read of the layer (a :class:`~kvguard.stored_read.StoredRead`)
serves that column from the overlay instead. Its bytes are the layer's (positions included).

Layout: ``positions`` ``[P]`` absolute positions, ascending and unique; ``keys`` / ``values`` ``[B, H_kv, P, D]``
in the layer's ``fp_dtype``.
"""

from __future__ import annotations

from typing import Callable

import torch


class Overlay:
    """Full-precision K/V at some absolute positions of one layer (see the module docstring)."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None  # [P] absolute positions, ascending
        self.keys: torch.Tensor | None = None  # [B, H, P, D]
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys`` / ``values`` ``[B, H, P, D]`` at ``positions`` ``[P]`` (unique), replacing what it held there."""
        if self.positions is not None:
            keep = ~torch.isin(self.positions, positions)
            positions = torch.cat([self.positions[keep], positions])
            keys = torch.cat([self.keys[:, :, keep], keys], dim=2)
            values = torch.cat([self.values[:, :, keep], values], dim=2)
        order = torch.argsort(positions)
        self.positions = positions[order]
        self.keys, self.values = keys[:, :, order], values[:, :, order]

    def drop_before(self, position: int) -> None:
        """Forget positions before ``position`` (a sliding layer dropped them)."""
        if self.positions is None:
            return
        keep = self.positions >= position
        self.positions = self.positions[keep]
        self.keys, self.values = self.keys[:, :, keep], self.values[:, :, keep]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def columns(self, offset: int) -> torch.Tensor | None:
        """The positions as columns of a read (minus the layer's ``offset``); ``None`` when empty."""
        return None if not len(self) else self.positions - offset

    def nbytes(self) -> int:
        """Bytes of the K/V and their positions."""
        return sum(t.numel() * t.element_size() for t in (self.positions, self.keys, self.values) if t is not None)
