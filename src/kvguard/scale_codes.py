"""One-byte scales and zero points for the low-bit tiers (``QuantSpec.scale_bits == 8``).

Below 4 bits a group's float16 scale and zero point are a large share of its bytes: INT2 keys in groups of 32
tokens store 2 bits of code and 1 bit of scale and zero point per value. Here each takes one byte:

- the scale is a code ``c`` in ``[0, 239]`` meaning ``2 ** (c / 8 - 14)`` (rounded to float16): eight steps per
  octave from float16's smallest normal number to below its largest. A group's scale is rounded **up** to the
  next step, so the range it covers is never cut;
- the zero point is a signed byte ``z`` meaning ``z / 16`` of the group's own step: ``zero = z * scale / 16``.
  It is rounded **down** (the grid starts at or below the group's minimum), and the step is widened by 1/16 of
  a level beforehand so the top of the grid still reaches the group's maximum. Where ``|min|`` is more than 8
  steps (a group far from zero and narrow, e.g. an unrotated key channel at INT4), the step is widened until
  it fits: that is why only INT3 and INT2 use this format (measured on SmolLM2's calibration keys, unrotated
  INT4: 1.9x the squared error of float16 scales; rotated INT2: 1.16x).

Decoding is a table lookup and one multiply, and quantization uses exactly the decoded numbers, so a stored
group reads back as it was quantized.
"""

from __future__ import annotations

import torch

STEPS_PER_OCTAVE = 8
ZERO_FRACTION = 16  # the zero point's resolution: 1/16 of the group's step
_CODES = 240  # 2 ** (239 / 8 - 14) = 60096 is the last step below float16's largest number (65504)
_TABLE = (2.0 ** (torch.arange(_CODES, dtype=torch.float64) / STEPS_PER_OCTAVE - 14)).to(torch.float16)
_TABLE32 = _TABLE.to(torch.float32)
# Every byte's value, for readers that index with any code (the fused decode kernels): NaN past the last code.
BYTE_TABLE = torch.cat([_TABLE, torch.full((256 - _CODES,), float("nan"), dtype=torch.float16)])
_ZERO_MIN, _ZERO_MAX = -128, 127


def decode_scale(codes: torch.Tensor) -> torch.Tensor:
    """float16 scales of the ``uint8`` ``codes`` (same shape)."""
    return _TABLE.to(codes.device)[codes.long()]


def decode_zero(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float16 zero points of the ``int8`` ``codes`` under their groups' float16 ``scale``."""
    return (codes.to(torch.float32) * scale.to(torch.float32) / ZERO_FRACTION).to(torch.float16)


def encode(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale codes uint8, zero codes int8)`` of groups spanning ``[lo, hi]`` (float32, same shape) on a grid of
    ``levels`` levels that covers the whole span (see the module docstring)."""
    step = (hi - lo) / (levels - 1 - 1 / ZERO_FRACTION)
    # The zero code must fit a signed byte: |lo| <= 128 / 16 steps (below zero) or 127 / 16 (above).
    step = torch.maximum(step, torch.maximum(-lo / (-_ZERO_MIN / ZERO_FRACTION), lo / (_ZERO_MAX / ZERO_FRACTION)))
    table = _TABLE32.to(lo.device)
    if bool((step > table[-1]).any()):
        raise ValueError(f"a group's range exceeds what a one-byte scale holds ({float(table[-1])} per level); "
                         "the input values are too large")
    scale_codes = torch.searchsorted(table, step.contiguous())  # the first step at or above the need
    scale = table[scale_codes]
    zero_codes = torch.floor(lo * ZERO_FRACTION / scale).clamp(_ZERO_MIN, _ZERO_MAX)
    return scale_codes.to(torch.uint8), zero_codes.to(torch.int8)

