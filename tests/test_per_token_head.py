"""vLLM's per-token-head INT8 / INT4 KV formats against a slow reference of vLLM's kernels, written as loops over
single float32 values (one operation at a time, as the Triton kernels do them)."""

import math
import struct

import pytest
import torch

from kvguard.architecture import Architecture
from kvguard.per_token_head import TokenHeadCache, TokenHeadCodes, TokenHeadFormat, quantize, rht, rht_signs


def f32(x: float) -> float:
    """Round a Python float (double) to float32, as every float32 kernel operation does."""
    return struct.unpack("f", struct.pack("f", x))[0]


def bits(x: float) -> int:
    return struct.unpack("i", struct.pack("f", x))[0]


def from_bits(b: int) -> float:
    return struct.unpack("f", struct.pack("i", b))[0]


def round_half_away(v: float) -> float:
    """``tl.where(v >= 0, v + 0.5, v - 0.5)`` then truncation toward zero, in float32."""
    return float(math.trunc(f32(v + 0.5) if v >= 0 else f32(v - 0.5)))


def ref_int8(vec: list[float]) -> tuple[list[int], float]:
    scale = max(f32(max(abs(x) for x in vec) / 127.0), f32(1e-6))
    inv = f32(1.0 / scale)
    codes = []
    for x in vec:
        q = f32(x * inv)
        q = f32(q + 0.5) if q >= 0 else f32(q - 0.5)
        codes.append(math.trunc(min(max(q, -128.0), 127.0)))
    return codes, scale


def ref_hadamard_matrix(n: int) -> list[list[int]]:
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-x for x in row] for row in h]
    return h


def ref_rht(vec: list[float]) -> list[float]:
    """``H_b (s * x)`` per block of b = the largest power of two dividing the length (Sylvester's H)."""
    d = len(vec)
    b = d & -d
    signs = rht_signs(b).tolist()
    h = ref_hadamard_matrix(b)
    out = []
    for start in range(0, d, b):
        block = [vec[start + j] * signs[j] for j in range(b)]
        out += [math.fsum(h[i][j] * block[j] for j in range(b)) for i in range(b)]
    return out


def ref_rht_f32(vec: list[float]) -> list[float]:
    """The same rotation as vLLM computes it on CPU: sign flips, then the in-place butterfly with every sum and
    difference rounded to float32."""
    d = len(vec)
    b = d & -d
    signs = rht_signs(b).tolist()
    x = [f32(v * signs[j % b]) for j, v in enumerate(vec)]
    for start in range(0, d, b):
        h = 1
        while h < b:
            for g in range(start, start + b, 2 * h):
                for j in range(g, g + h):
                    x[j], x[j + h] = f32(x[j] + x[j + h]), f32(x[j] - x[j + h])
            h *= 2
    return x


def ref_int4(vec: list[float]) -> tuple[list[int], int, float]:
    r = ref_rht_f32(vec)
    lo, hi = min(r), max(r)
    scale = max(f32(f32(hi - lo) / 15.0), f32(1e-6))
    zp = min(max(round_half_away(f32(-lo / scale)), 0.0), 15.0)
    inv = f32(1.0 / scale)
    codes = [int(min(max(round_half_away(f32(f32(x * inv) + zp)), 0.0), 15.0)) for x in r]
    packed = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]
    stored = from_bits((bits(scale) & ~0xF) | int(zp))
    return packed, int(zp), stored


def _vectors(d: int, n: int = 40) -> torch.Tensor:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=gen) * torch.logspace(-3, 2, n).view(-1, 1)
    x[0] = 0.0  # a zero vector: the 1e-6 floor
    x[1] = 0.37  # a constant vector
    x[2, 0] = 1e4  # one outlier channel
    x[3] = torch.arange(d) - d / 2 + 0.5  # values on exact halves after scaling
    return x


@pytest.mark.parametrize("d", [64, 96, 256])
def test_int8_matches_the_slow_reference_exactly(d):
    x = _vectors(d)
    got = quantize(x, "int8_per_token_head")
    assert got.qdata.dtype == torch.int8 and got.scale.shape == (x.shape[0], 1)
    for i, vec in enumerate(x.tolist()):
        codes, scale = ref_int8(vec)
        assert got.qdata[i].tolist() == codes and got.scale[i, 0].item() == scale
    deq = got.dequantize()
    assert torch.equal(deq, got.qdata.float() * got.scale)


@pytest.mark.parametrize("d", [64, 96, 256])
def test_int4_matches_the_slow_reference_exactly(d):
    x = _vectors(d)
    got = quantize(x, TokenHeadFormat.INT4)
    assert got.qdata.dtype == torch.uint8 and got.qdata.shape == (x.shape[0], d // 2)
    for i, vec in enumerate(x.tolist()):
        packed, zp, stored = ref_int4(vec)
        assert got.qdata[i].tolist() == packed, i
        assert bits(got.scale[i, 0].item()) == bits(stored) and bits(stored) & 0xF == zp


def test_rotation_is_vllms_and_inverts_up_to_b():
    signs = rht_signs(64)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, rht_signs(64))
    x = torch.randn(3, 96, dtype=torch.float64)
    for i in range(3):
        torch.testing.assert_close(rht(x)[i], torch.tensor(ref_rht(x[i].tolist()), dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(rht(rht(x), inverse=True), 32 * x, atol=1e-12, rtol=0)  # 96 = 3 blocks of 32


def test_dequantize_follows_the_engines_read_path():
    """INT4 reads ``(q - zp) * scale_read`` with the zero point's bits cleared from the scale, then de-rotates."""
    x = _vectors(64)
    codes = quantize(x, "int4_per_token_head")
    for i, vec in enumerate(x.tolist()):
        packed, zp, stored = ref_int4(vec)
        q = [c for p in packed for c in (p & 0xF, p >> 4)]
        scale_read = from_bits(bits(stored) & ~0xF)
        r = torch.tensor([(c - zp) * scale_read for c in q], dtype=torch.float64)
        expected = rht(r, inverse=True) / 64
        # float32 (kvguard) against float64 (here): equal to float32 rounding of the row's magnitude
        atol = 1e-6 * (1 + float(expected.abs().max()))
        torch.testing.assert_close(codes.dequantize(torch.float64)[i], expected, atol=atol, rtol=1e-6)
    # The error is that of 16 levels over the rotated range: small next to the vector's own size.
    y = torch.randn(200, 64)
    err = (quantize(y, "int4_per_token_head").dequantize() - y).norm() / y.norm()
    assert 0.02 < err < 0.15
    err8 = (quantize(y, "int8_per_token_head").dequantize() - y).norm() / y.norm()
    assert err8 < 0.01
    with pytest.raises(ValueError, match=r"has to be one of \[int8_per_token_head, int4_per_token_head\]"):
        quantize(y, "int2_per_token_head")


TINY = Architecture("llama", num_layers=3, num_query_heads=4, num_kv_heads=2, head_dim=32,
                    layer_types=("sliding_attention", "full_attention", "full_attention"), sliding_window=8)


@pytest.mark.parametrize("fmt", list(TokenHeadFormat))
def test_cache_quantizes_each_token_once_and_counts_its_bytes(fmt):
    cache = TokenHeadCache(TINY, fmt, skip_layers=(2,))
    gen = torch.Generator().manual_seed(1)
    seen = []
    for step in range(12):
        n = 3 if step == 0 else 1
        k, v = torch.randn(1, 2, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen)
        seen.append(k)
        for layer in range(3):
            keys, values = cache.update(k, v, layer)
            if layer == 1:  # full attention: every past token decodes as it was first quantized
                expected = quantize(torch.cat(seen, dim=-2), fmt).dequantize()
                assert torch.equal(keys, expected)
            if layer == 2:
                assert torch.equal(keys[..., -n:, :], k.half().float())
    tokens = 14
    sliding = 7  # window - 1
    vector = fmt.bytes_per_vector(32)
    expected = 2 * 2 * vector * (sliding + tokens) + 2 * 2 * 32 * 2 * tokens  # K+V, 2 heads; skipped layer fp16
    assert cache.nbytes() == expected
    assert cache.fp16_nbytes() == 2 * 2 * 2 * 32 * (sliding + 2 * tokens)
    assert cache.layers[0].key_scales.shape == (1, 2, sliding, 1)
    with pytest.raises(ValueError, match="outside the model's 3 layers"):
        TokenHeadCache(TINY, fmt, skip_layers=(3,))


@pytest.mark.slow
def test_vllm_methods_score_real_text_between_fp16_and_uncalibrated_int4(smollm2):
    from kvguard import data
    from kvguard.evaluation import harness, methods

    model, tok = smollm2
    ids = data.token_stream("prose", "eval", tok, 384)
    names = ["vllm-int8_per_token_head", "vllm-int4_per_token_head"]
    rows = {r.method: r for r in harness.evaluate_stream(model, ids, "prose", names, progress=False)}
    int8, int4 = rows[names[0]], rows[names[1]]
    assert int8.error is None and int8.mode == "simulated"  # one pass: each token is quantized once, alone
    assert 0 < int8.kl < 0.005 and int8.top1_agree > 0.97
    assert int8.kl < int4.kl < 0.5
    # 64 codes + 4 scale bytes per vector, against 128 bytes in FP16 (SmolLM2: head_dim 64).
    assert int8.kv_bytes_ratio == pytest.approx(68 / 128) and int4.kv_bytes_ratio == pytest.approx(36 / 128)
    assert methods.get(names[1]).make_cache(model).format is TokenHeadFormat.INT4
