"""Bit-packing of low-precision codes into bytes.

Codes are unsigned integers in ``[0, 2**bits)`` packed along the **last** axis, little-endian: code ``i`` of a
packed word occupies bits ``[i * bits, (i + 1) * bits)`` of it, and the word's bytes are stored low byte first.

- ``bits = 2``: four codes per byte; ``bits = 4``: two codes per byte (the even element is the low nibble).
- ``bits = 3``: eight codes share a 24-bit word stored as three bytes, so ``D`` codes take ``3 * D / 8`` bytes
  (no padding bits: 3 bits per code exactly).
- ``bits = 8`` is stored as is.
"""

from __future__ import annotations

import math

import torch

PACKABLE_BITS = (2, 3, 4, 8)


def _word(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest whole-byte word holding codes of ``bits`` bits."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits has to be one of {list(PACKABLE_BITS)} but got {bits}")
    width = math.lcm(bits, 8)
    return width // bits, width // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (``uint8``, values ``< 2**bits``) along the last axis: ``[..., D] -> [..., D * bits / 8]``."""
    per_word, word_bytes = _word(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes
    d = codes.shape[-1]
    if d % per_word:
        raise ValueError(f"last axis ({d}) must be a multiple of {per_word} to pack {bits}-bit codes")
    grouped = codes.reshape(*codes.shape[:-1], d // per_word, per_word).to(torch.int32)  # [..., D/n, n]
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int32) * bits
    # The codes occupy disjoint bits, so a sum is an OR; a 3-bit word is 24 bits, within int32.
    word = (grouped << shifts).sum(dim=-1)  # [..., D/n]
    if word_bytes == 1:
        return word.to(torch.uint8)
    byte_shifts = torch.arange(word_bytes, device=codes.device, dtype=torch.int32) * 8
    split = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., D/n, bytes]
    return split.reshape(*codes.shape[:-1], d // per_word * word_bytes).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits / 8] -> [..., D]`` ``uint8`` codes."""
    per_word, word_bytes = _word(bits)
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    if word_bytes == 1:
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.uint8) * bits
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    n = packed.shape[-1]
    if n % word_bytes:
        raise ValueError(f"last axis ({n}) must be a multiple of {word_bytes} bytes to unpack {bits}-bit codes")
    words = packed.reshape(*packed.shape[:-1], n // word_bytes, word_bytes).to(torch.int32)  # [..., W, bytes]
    byte_shifts = torch.arange(word_bytes, device=packed.device, dtype=torch.int32) * 8
    word = (words << byte_shifts).sum(dim=-1, keepdim=True)  # [..., W, 1]
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
    codes = ((word >> shifts) & mask).to(torch.uint8)  # [..., W, n]
    return codes.reshape(*packed.shape[:-1], n // word_bytes * per_word)
