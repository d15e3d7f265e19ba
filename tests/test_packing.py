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


@pytest.mark.parametrize("bits", [2, 4])
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
    with pytest.raises(ValueError, match=r"one of \[2, 4, 8\]"):
        packing.pack(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        packing.pack(torch.zeros(4, dtype=torch.int32), 4)
