"""The Hadamard rotation: orthonormal, undone exactly in what the cache returns, and what it buys."""

import pytest
import torch

from kvguard import rotation
from kvguard.cache_layer import KVGuardLayer
from kvguard.config import CacheConfig
from kvguard.plan import LayerPlan, Plan
from kvguard.quantizer import Axis, QuantSpec, quantize


def _hadamard_entry(i: int, j: int) -> int:
    """Sylvester's definition, independent of the recursive construction: (-1)^popcount(i & j)."""
    return -1 if bin(i & j).count("1") % 2 else 1


@pytest.mark.parametrize("d", [16, 64, 256])
def test_rotation_is_a_signed_normalized_hadamard(d):
    r = rotation.matrix(d, 3, layer=5)
    assert r.shape == (3, d, d) and r.dtype == torch.float32
    eye = torch.eye(d).expand(3, d, d)
    assert torch.allclose(r @ r.transpose(-1, -2), eye, atol=1e-5)
    h = torch.tensor([[_hadamard_entry(i, j) for j in range(d)] for i in range(d)], dtype=torch.float32)
    signs = (r * d ** 0.5 / h).round()  # row c of head h is scaled by that head's sign c
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs, signs[:, :, :1].expand_as(signs))
    # Heads get different signs; the same (layer) gives the same matrix in every process.
    assert not torch.equal(signs[0], signs[1])
    assert torch.equal(r, rotation.matrix(d, 3, layer=5))
    assert not torch.equal(r, rotation.matrix(d, 3, layer=6))
    # The butterfly transform the cache uses is that matrix.
    x = torch.randn(2, 3, 5, d, generator=torch.Generator().manual_seed(d))
    s = rotation.signs(d, 3, layer=5)
    assert torch.allclose(rotation.rotate(x, s), x @ r, atol=1e-5)
    assert torch.allclose(rotation.unrotate(x, s), x @ r.transpose(-1, -2), atol=1e-5)


def test_rotation_is_the_same_bit_for_bit_whatever_the_batch_shape():
    # The cache rotates a group of heads and tokens at a time, the simulation one head and all tokens: both
    # must produce the same numbers, or a quantization bin flips between them.
    x = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(4))
    s = rotation.signs(64, 3, layer=2)
    whole = rotation.rotate(x, s)
    for h in range(3):
        assert torch.equal(rotation.rotate(x[:, h:h + 1, 8:24], s[h:h + 1]), whole[:, h:h + 1, 8:24])
    assert torch.equal(rotation.unrotate(whole[:1, 1:], s[1:]), rotation.unrotate(whole, s)[:1, 1:])


def test_non_power_of_two_head_dim_is_refused():
    with pytest.raises(ValueError, match="power-of-two head_dim, got 96"):
        rotation.signs(96, 1, layer=0)


def test_rotate_then_unrotate_is_identity_up_to_float_rounding():
    x = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(0)) * 5
    s = rotation.signs(64, 3, layer=0)
    assert torch.allclose(rotation.unrotate(rotation.rotate(x, s), s), x, atol=1e-5)


def _stream(layer: KVGuardLayer, k: torch.Tensor, v: torch.Tensor):
    for t in range(k.shape[2]):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return layer.materialize(torch.float32)


@pytest.mark.parametrize("precision", ["int4", "int3", "int2"])
def test_cache_stores_rotated_codes_and_reads_them_back_rotated_back(precision):
    cfg = CacheConfig(residual=8, sinks=2, group_size=16, fp_dtype="float32")
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 58, 32, generator=gen) for _ in range(2))
    layer = KVGuardLayer(precision, cfg, layer_idx=3)
    layer.set_rotation(True, True)
    keys, values = _stream(layer, k, v)
    r = rotation.signs(32, 2, layer=3)
    q = slice(2, 50)  # 3 groups of 16 left the window
    k_ref = rotation.unrotate(quantize(rotation.rotate(k[:, :, q], r), QuantSpec(precision, Axis.CHANNEL, 16)).dequantize(), r)
    v_ref = rotation.unrotate(quantize(rotation.rotate(v[:, :, q], r), QuantSpec(precision, Axis.TOKEN, 16)).dequantize(), r)
    assert torch.equal(keys[:, :, q], k_ref) and torch.equal(values[:, :, q], v_ref)
    # Sinks and the window stay exact.
    assert torch.equal(keys[:, :, :2], k[:, :, :2]) and torch.equal(keys[:, :, 50:], k[:, :, 50:])


def test_fp16_and_int8_heads_ignore_rotation():
    cfg = CacheConfig(residual=8, sinks=2, group_size=16, fp_dtype="float32")
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 2, 58, 32, generator=gen) for _ in range(2))
    for precision in ("fp16", "int8"):
        plain, rotated = KVGuardLayer(precision, cfg), KVGuardLayer(precision, cfg)
        rotated.set_rotation(True, True)
        assert all(torch.equal(a, b) for a, b in zip(_stream(plain, k, v), _stream(rotated, k, v)))


def test_rotation_flattens_an_outlier_channel_for_per_token_groups():
    # Values are grouped per token across channels; one outlier channel sets every group's range. The
    # rotation spreads it over all channels, so the per-token INT4 error drops.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 256, 64, generator=gen)
    x[..., 7] *= 30
    r = rotation.signs(64, 1, layer=0)
    spec = QuantSpec("int4", Axis.TOKEN, 64)
    plain = (quantize(x, spec).dequantize() - x).norm()
    rotated = (rotation.unrotate(quantize(rotation.rotate(x, r), spec).dequantize(), r) - x).norm()
    assert rotated < 0.5 * plain


def test_plan_round_trips_rotation_and_writes_it_only_when_set():
    plan = Plan((LayerPlan(("int4",), key_rotation=True), LayerPlan(("int2",))))
    data = plan.to_dict()
    assert data["layers"][0]["key_rotation"] is True and "value_rotation" not in data["layers"][0]
    assert "key_rotation" not in data["layers"][1]
    assert Plan.from_dict(data) == plan
    assert plan.with_rotation(False, True).layers[1].value_rotation
    assert "0:int4rk" in plan.summary()
