"""Bit-packing of low-precision codes into bytes.

Codes are unsigned integers in ``[0, 2**bits)`` packed along the **last** axis. For ``bits = 4`` two codes
share a byte, for ``bits = 2`` four do. Nibble order is little-endian: code ``i`` of a byte occupies bits
``[i * bits, (i + 1) * bits)``, so for INT4 the even element is the low nibble and the odd element the high
nibble. ``bits = 8`` is stored as is.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits has to be one of {list(PACKABLE_BITS)} but got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (``uint8``, values ``< 2**bits``) along the last axis: ``[..., D] -> [..., D * bits / 8]``."""
    per_byte = _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"last axis ({d}) must be a multiple of {per_byte} to pack {bits}-bit codes")
    grouped = codes.reshape(*codes.shape[:-1], d // per_byte, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    # The codes occupy disjoint bits, so a sum is an OR.
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits / 8] -> [..., D]`` ``uint8`` codes."""
    per_byte = _check_bits(bits)
    if bits == 8:
        return packed
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
