"""One-byte scales and zero points, and the per-group range search."""

import pytest
import torch

from kvguard import scale_codes
from kvguard.config import CacheConfig
from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantSpec, quantize


def _groups(seed: int, n: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ranges of every kind: centred, offset far from zero, narrow, wide, constant."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-3, 3, generator=gen)
    width = torch.rand(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 2, generator=gen)
    width[:10] = 0.0
    return centre - width / 2, centre + width / 2


@pytest.mark.parametrize("levels", [4, 8])
def test_the_grid_covers_every_group_and_is_read_back_as_encoded(levels):
    lo, hi = _groups(1)
    s_codes, z_codes = scale_codes.encode(lo, hi, levels)
    assert s_codes.dtype == torch.uint8 and z_codes.dtype == torch.int8
    scale = scale_codes.decode_scale(s_codes).to(torch.float32)
    zero = scale_codes.decode_zero(z_codes, scale).to(torch.float32)
    top = zero + (levels - 1) * scale
    # Never cut: the grid starts at or below the minimum (up to the zero point's float16 rounding) and reaches
    # the maximum.
    slack = 1e-3 * scale + 2e-3 * lo.abs()
    assert bool((zero <= lo + slack).all()) and bool((top >= hi - slack).all())
    # And not much wider than the group needs where the group sits within 8 steps of zero: one step of the
    # scale table (2 ** (1 / 8)) and the zero point's 1/16 of a level.
    near = lo.abs() < 7 * (hi - lo) / (levels - 1)
    need = (hi - lo)[near] / (levels - 1)
    assert bool((scale[near] <= torch.clamp(need * 2 ** 0.125 * (levels - 1) / (levels - 1.0625), min=6.2e-5) * 1.001).all())


def test_a_range_beyond_one_byte_scales_is_refused():
    with pytest.raises(ValueError, match="one-byte scale"):
        scale_codes.encode(torch.tensor([-1e6]), torch.tensor([1e6]), 4)


@pytest.mark.parametrize("precision", ["int3", "int2"])
@pytest.mark.parametrize("axis, group", [(Axis.CHANNEL, 16), (Axis.TOKEN, 32)])
def test_one_byte_scales_store_half_the_scale_bytes_and_read_back_within_a_step(precision, axis, group):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3)) * 4 + 1
    wide = quantize(x, QuantSpec(precision, axis, group))
    narrow = quantize(x, QuantSpec(precision, axis, group, scale_bits=8))
    assert narrow.scale.dtype == torch.uint8 and narrow.zero_point.dtype == torch.int8
    assert wide.nbytes - narrow.nbytes == (wide.scale.numel() * 2)
    scale = narrow.scales().to(torch.float32).unsqueeze(-2 if axis is Axis.CHANNEL else -1)
    grouped = (x - narrow.dequantize()).reshape(*narrow.scale.shape[:-1], -1, narrow.scale.shape[-1]) \
        if axis is Axis.CHANNEL else (x - narrow.dequantize()).reshape(*narrow.scale.shape, group)
    assert bool((grouped.abs() <= scale / 2 + 1e-4).all())
    # The codes, cut and concatenated, stay in one byte.
    assert quantize(x[..., :32, :], narrow.spec).cat([narrow.keep_front(32)]).scale.dtype == torch.uint8


@pytest.mark.parametrize("precision, scale_bits", [("int4", 16), ("int3", 16), ("int3", 8), ("int2", 8)])
@pytest.mark.parametrize("axis", [Axis.CHANNEL, Axis.TOKEN])
def test_the_range_search_never_reads_a_group_back_worse_than_its_full_range(precision, scale_bits, axis):
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(4))
    x[..., 5, 7] = 9.0  # an outlier the full range would stretch its groups for
    spec = QuantSpec(precision, axis, 32, scale_bits=scale_bits)
    full = quantize(x, spec)
    searched = quantize(x, QuantSpec(precision, axis, 32, scale_bits=scale_bits, range_search=True))
    assert searched.nbytes == full.nbytes and searched.scale.dtype == full.scale.dtype

    def group_error(q):
        err = (q.dequantize() - x).square()
        return err.reshape(1, 2, 2, 32, 64).sum(-2) if axis is Axis.CHANNEL else err.reshape(1, 2, 64, 2, 32).sum(-1)

    assert bool((group_error(searched) <= group_error(full) * (1 + 1e-6) + 1e-9).all())
    assert float(group_error(searched).sum()) < 0.95 * float(group_error(full).sum())


def _searched_one_at_a_time(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, ...]:
    """The range search's grids as a loop over the shrinkings computes them: each candidate's error in turn, a
    later one kept only where it is strictly smaller (the widest wins a tie)."""
    from kvguard import quantizer as qz

    grouped = qz._group(x.to(torch.float32), spec)
    lo, hi = grouped.amin(dim=qz._group_dim(spec)), grouped.amax(dim=qz._group_dim(spec))
    best = None
    for i in range(qz.RANGE_CANDIDATES):
        grid = qz._grid(*qz._shrink(lo, hi, 1 - i * 0.28 / spec.levels), spec)
        u = (grouped - qz._expand(grid[3], spec)) / qz._expand(grid[2], spec)
        err = (u.round().clamp(0, spec.levels - 1) - u).square().sum(dim=qz._group_dim(spec)) * grid[2].square()
        keep = torch.ones_like(err, dtype=torch.bool) if best is None else err < best[4]
        best = [torch.where(keep, new, old) for new, old in zip((*grid, err), best or (*grid, err))]
    return tuple(best[:2])


@pytest.mark.parametrize("precision, scale_bits", [("int3", 16), ("int3", 8), ("int2", 16), ("int2", 8)])
@pytest.mark.parametrize("axis", [Axis.CHANNEL, Axis.TOKEN])
@pytest.mark.parametrize("per_batch", [8, 3, 1])  # candidates measured at once (a long prefill takes fewer)
def test_the_range_search_stores_each_groups_least_error_grid(precision, scale_bits, axis, per_batch, monkeypatch):
    from kvguard import quantizer

    monkeypatch.setattr(quantizer, "SEARCH_BATCH_VALUES", per_batch * 2 * 3 * 64 * 64)  # x's values, below
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 64, 64, generator=gen) * torch.rand(64, generator=gen) * 4
    x[..., 3, 9] = 12.0  # an outlier, so that shrinking pays for some groups
    spec = QuantSpec(precision, axis, 32, scale_bits=scale_bits, range_search=True)
    q = quantize(x, spec)
    scale, zero = _searched_one_at_a_time(x, spec)
    assert torch.equal(q.scale, scale) and torch.equal(q.zero_point, zero)
    widths = {q.scales().flatten()[i].item() for i in range(q.scale.numel())}
    assert len(widths) > 3  # groups really chose different grids


def test_specs_refuse_what_their_format_cannot_store():
    with pytest.raises(ValueError, match="int3 and int2 only"):
        QuantSpec("int4", Axis.TOKEN, scale_bits=8)
    with pytest.raises(ValueError, match="scale_bits must be 16 or 8"):
        QuantSpec("int2", Axis.TOKEN, scale_bits=4)
    with pytest.raises(ValueError, match="asymmetric tiers"):
        QuantSpec("int8", Axis.TOKEN, range_search=True)
    with pytest.raises(ValueError, match="scale_bits must be 16"):
        CacheConfig(scale_bits=12)


def test_a_layout_gives_one_byte_scales_to_int3_and_int2_only():
    cfg = CacheConfig(scale_bits=8, range_search=True, value_group_size=64)
    assert cfg.quant_spec(Precision.INT2, Axis.TOKEN, 1.0) == QuantSpec("int2", Axis.TOKEN, 64, 1.0, False, 8, True)
    assert cfg.quant_spec(Precision.INT3, Axis.CHANNEL, 0.9) == QuantSpec("int3", Axis.CHANNEL, 32, 0.9, False, 8, True)
    assert cfg.quant_spec(Precision.INT4, Axis.CHANNEL, 1.0) == QuantSpec("int4", Axis.CHANNEL, 32, 1.0, False, 16, False)
    assert cfg.quant_spec(Precision.INT8, Axis.CHANNEL, 1.0, static=True) == QuantSpec("int8", Axis.CHANNEL, 32, 1.0, True)
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert "scale_bits" not in CacheConfig().to_dict() and "range_search" not in CacheConfig().to_dict()


def test_a_layout_searches_ranges_only_for_int2_and_one_byte_int3():
    wide = CacheConfig(range_search=True)  # float16 scales everywhere
    assert wide.quant_spec(Precision.INT2, Axis.CHANNEL, 1.0).range_search
    assert not wide.quant_spec(Precision.INT3, Axis.CHANNEL, 1.0).range_search
    assert not wide.quant_spec(Precision.INT4, Axis.TOKEN, 1.0).range_search
    assert not CacheConfig(scale_bits=8).quant_spec(Precision.INT2, Axis.TOKEN, 1.0).range_search
