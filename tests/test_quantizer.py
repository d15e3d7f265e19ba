import pytest
import torch

from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantizedTensor, QuantSpec, quantize

F16_TINY = torch.finfo(torch.float16).tiny


def _f16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(torch.float32)


def reference(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow, element-by-element quantize + dequantize of a [T, D] tensor: (codes, reconstruction)."""
    t, d = x.shape
    g = spec.group_size
    codes = torch.zeros(t, d, dtype=torch.int32)
    out = torch.zeros(t, d)
    if spec.axis is Axis.CHANNEL:
        groups = [[(tt, c) for tt in range(t0, t0 + g)] for t0 in range(0, t, g) for c in range(d)]
    else:
        groups = [[(tt, c) for c in range(c0, c0 + g)] for tt in range(t) for c0 in range(0, d, g)]
    for members in groups:
        vals = torch.stack([x[i, j] for i, j in members]).to(torch.float32)
        if spec.precision is Precision.INT8:
            s = _f16(spec.clip * vals.abs().max() / 127.0).clamp(min=F16_TINY)
            for (i, j), v in zip(members, vals):
                q = torch.clamp(torch.round(v / s), -127, 127)
                codes[i, j], out[i, j] = int(q), q * s
        else:
            lo, hi = vals.min(), vals.max()
            if spec.clip < 1:
                c, h = (hi + lo) / 2, (hi - lo) / 2 * spec.clip
                lo, hi = c - h, c + h
            top = 2**spec.precision.bits - 1
            s = _f16((hi - lo) / top).clamp(min=F16_TINY)
            z = _f16(lo)
            for (i, j), v in zip(members, vals):
                q = torch.clamp(torch.round((v - z) / s), 0, top)
                codes[i, j], out[i, j] = int(q), q * s + z
    return codes, out


SPECS = [
    QuantSpec(p, a, group_size=g, clip=c)
    for p in (Precision.INT8, Precision.INT4, Precision.INT3, Precision.INT2)
    for a in (Axis.CHANNEL, Axis.TOKEN)
    for g, c in ((4, 1.0), (8, 0.9))
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.precision.value}-{s.axis.value}-g{s.group_size}-c{s.clip}")
def test_matches_slow_reference_exactly(spec):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 16, generator=gen) * 3
    x[:, 5] += 20.0  # an outlier channel, as keys have
    codes, expected = reference(x, spec)
    qt = quantize(x, spec)
    assert torch.equal(qt.codes().to(torch.int32), codes)
    torch.testing.assert_close(qt.dequantize(), expected, atol=0, rtol=0)


def test_four_dim_layout_matches_per_head_reference():
    spec = QuantSpec("int4", "channel", group_size=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 8, generator=gen)  # [B, H, T, D]
    qt = quantize(x, spec)
    assert qt.scale.shape == (2, 3, 2, 8)
    for b in range(2):
        for h in range(3):
            _, expected = reference(x[b, h], spec)
            torch.testing.assert_close(qt.dequantize()[b, h], expected, atol=0, rtol=0)


def test_hand_computed_int4_group():
    # min 0, max 15 -> scale 1, zero point 0: codes are the values themselves.
    x = torch.arange(16, dtype=torch.float32).reshape(1, 16)
    qt = quantize(x, QuantSpec("int4", "token", group_size=16))
    assert qt.scale.item() == 1.0 and qt.zero_point.item() == 0.0
    assert qt.codes().tolist() == [list(range(16))]
    assert qt.qdata.shape == (1, 8) and qt.qdata[0, 0].item() == 0x10


def test_hand_computed_int8_static():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    absmax = torch.tensor([2.0, 4.0])  # per channel, from "calibration"
    qt = quantize(x, QuantSpec("int8", "channel", group_size=1, static=True), absmax=absmax)
    # scales 2/127 and 4/127 (as float16): 1.0 -> 63.5 -> 64, -2.0 -> -63.5 -> -64 (half to even),
    # 0.5 -> 31.75 -> 32, 4.0 -> 127; values past the calibrated absmax saturate.
    assert qt.codes().tolist() == [[64, -64], [32, 127]]
    bigger = quantize(torch.tensor([[10.0, 0.0]]), QuantSpec("int8", "channel", 1, static=True), absmax=absmax)
    assert bigger.codes().tolist() == [[127, 0]]


@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("value", [0.0, 3.25, -7.5])
def test_zero_range_groups_are_exact(precision, value):
    x = torch.full((8, 8), value)
    qt = quantize(x, QuantSpec(precision, "channel", group_size=4))
    assert torch.isfinite(qt.scale.float()).all()
    torch.testing.assert_close(qt.dequantize(), x, atol=abs(value) * 1e-3, rtol=0)


def test_non_finite_input_raises():
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, QuantSpec("int4", "token", group_size=4))
    x[1, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, QuantSpec("int8", "token", group_size=4))


def test_partial_groups_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(torch.randn(6, 8), QuantSpec("int4", "channel", group_size=4))
    with pytest.raises(ValueError, match="multiple of 3"):
        quantize(torch.randn(6, 8), QuantSpec("int4", "token", group_size=3))


def test_spec_validation_lists_valid_values():
    with pytest.raises(ValueError, match=r"\[fp16, int8, int4, int3, int2\]"):
        QuantSpec("int5", "token")
    with pytest.raises(ValueError, match="channel"):
        QuantSpec("int4", "rows")
    with pytest.raises(ValueError, match="clip"):
        QuantSpec("int4", "token", clip=1.5)
    with pytest.raises(ValueError, match="int8 only"):
        QuantSpec("int4", "token", static=True)


def test_cat_equals_quantizing_blocks_separately():
    spec = QuantSpec("int2", "channel", group_size=4)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 2, 8, 8, generator=gen), torch.randn(1, 2, 4, 8, generator=gen)
    joined = QuantizedTensor.cat([quantize(a, spec), quantize(b, spec)])
    expected = torch.cat([quantize(a, spec).dequantize(), quantize(b, spec).dequantize()], dim=-2)
    assert joined.shape == (1, 2, 12, 8)
    torch.testing.assert_close(joined.dequantize(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_keep_front_equals_quantizing_the_front_alone(precision, axis):
    spec = QuantSpec(precision, axis, group_size=4)
    x = torch.randn(1, 2, 12, 8, generator=torch.Generator().manual_seed(4))
    kept = quantize(x, spec).keep_front(8)
    assert kept.shape == (1, 2, 8, 8) and kept.nbytes == quantize(x[..., :8, :], spec).nbytes
    torch.testing.assert_close(kept.dequantize(), quantize(x[..., :8, :], spec).dequantize(), atol=0, rtol=0)
    if axis == "channel":
        with pytest.raises(ValueError, match="whole groups"):
            quantize(x, spec).keep_front(6)


@pytest.mark.parametrize(
    "precision, floor_db", [("int8", 35.0), ("int4", 15.0), ("int3", 9.0), ("int2", 4.0)]
)
def test_sqnr_floor_on_gaussian_data(precision, floor_db):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 256, 64, generator=gen)
    y = quantize(x, QuantSpec(precision, "token", group_size=32)).dequantize()
    sqnr = 20 * torch.log10(x.norm() / (x - y).norm())
    assert sqnr > floor_db


@pytest.mark.parametrize("precision, bytes_per_value", [("int8", 1 + 2 / 32), ("int4", 0.5 + 4 / 32), ("int3", 0.375 + 4 / 32), ("int2", 0.25 + 4 / 32)])
def test_nbytes_counts_codes_scales_and_zero_points(precision, bytes_per_value):
    x = torch.randn(1, 2, 64, 64)
    qt = quantize(x, QuantSpec(precision, "channel", group_size=32))
    assert qt.nbytes == int(x.numel() * bytes_per_value)
