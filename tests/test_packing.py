import itertools

import pytest
import torch

from kvguard import packing


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_every_code(bits):
    levels = 2**bits
    per_byte = 8 // bits
    # Every combination of codes that can share one byte, so no bit pattern goes untested.
    combos = torch.tensor(list(itertools.product(range(levels), repeat=per_byte)), dtype=torch.uint8)
    codes = combos.reshape(1, -1) if bits != 8 else torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    packed = packing.pack(codes, bits)
    assert packed.shape[-1] == codes.shape[-1] * bits // 8
    assert torch.equal(packing.unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_random_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 7, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(packing.unpack(packing.pack(codes, bits), bits), codes)


def test_nibble_order_is_low_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert packing.pack(codes, 4).tolist() == [[0x21, 0x03]]
    assert packing.pack(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 2"):
        packing.pack(torch.zeros(3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match=r"one of \[2, 3, 4, 8\]"):
        packing.pack(torch.zeros(4, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="multiple of 8"):
        packing.pack(torch.zeros(12, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        packing.pack(torch.zeros(4, dtype=torch.int32), 4)


def _pack3_reference(codes):
    """Slow, obviously-correct 3-bit packing: a bit string, low bit of code 0 first, cut into bytes."""
    out = []
    for row in codes.tolist():
        bits = [(c >> i) & 1 for c in row for i in range(3)]
        out.append([sum(b << i for i, b in enumerate(bits[k:k + 8])) for k in range(0, len(bits), 8)])
    return torch.tensor(out, dtype=torch.uint8)


def test_pack3_matches_bit_string_reference():
    # Every code at every one of the 8 positions of a word, plus random rows.
    rows = [[c if i == j else 0 for i in range(8)] for j in range(8) for c in range(8)]
    gen = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.tensor(rows, dtype=torch.uint8),
                       torch.randint(0, 8, (64, 8), generator=gen, dtype=torch.uint8)])
    packed = packing.pack(codes, 3)
    assert packed.shape == (codes.shape[0], 3)
    assert torch.equal(packed, _pack3_reference(codes))
    assert torch.equal(packing.unpack(packed, 3), codes)
    wide = torch.randint(0, 8, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(packing.pack(wide, 3), _pack3_reference(wide))
