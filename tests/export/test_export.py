"""``kvguard export`` and the ``fp8`` evaluation methods.

The profile is built from real SmolLM2 K/V statistics (two 128-token windows of calibration prose) with a
hand-set plan that has FP16-tier layers and clip ratios, so every branch of the export is exercised without
running a whole calibration.
"""

import copy
import json
import math

import pytest
import torch
from pydantic import BaseModel
from safetensors import safe_open
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvguard import cli, data
from kvguard.architecture import Architecture
from kvguard.calibration.kv_statistics import collect
from kvguard.calibration.pipeline import _calibrated_scales
from kvguard.evaluation import harness, methods
from kvguard.export.export import ExportError, ExportSpec, export
from kvguard.fp8 import FP8_MAX, FP8Cache, FP8Scales, Granularity, Rounding, dequantize, fp8_scales, quantize
from kvguard.plan import LayerPlan, Plan
from kvguard.profile import Profile
from kvguard.scoring import score_stream
from tests.helpers import profile_meta

FP16_LAYERS = (0, 7, 29)  # layer 7 has one FP16 head among int4 / int8 ones: engines skip whole layers
CLIPPED = 12  # key clip 0.9, value clip 0.8


@pytest.fixture(scope="module")
def profile(tmp_path_factory, smollm2):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    ids = data.token_stream("prose", "calib", tok, 256)
    stats, entropy = collect(model, [ids.view(2, 128)], progress=False)
    layers = [LayerPlan(("int8",) * 3)] * arch.num_layers
    layers[0] = layers[29] = LayerPlan(("fp16",) * 3)
    layers[7] = LayerPlan(("int4", "fp16", "int8"))
    layers[CLIPPED] = LayerPlan(("int8",) * 3, key_clip=0.9, value_clip=0.8)
    plan = Plan(tuple(layers))
    meta = profile_meta(plan, name="smollm2-135m", model_type=arch.model_type, head_dim=arch.head_dim,
                        layer_types=arch.layer_types)
    tensors = {**stats.tensors(), **entropy.tensors(), **_calibrated_scales(stats.aggregate())}
    out = tmp_path_factory.mktemp("fp8") / "profile"
    Profile(meta, tensors).save(out)
    return Profile.load(out)


def _with_absmax(profile, layer, value):
    tensors = dict(profile.tensors)
    tensors["calibrated.key.absmax"] = tensors["calibrated.key.absmax"].clone()
    tensors["calibrated.key.absmax"][layer] = value
    return Profile(profile.meta, tensors, profile.path)


# ---------------------------------------------------------------------- scales
def test_scales_are_clip_times_absmax_over_448(profile):
    absmax_k = profile.tensors["calibrated.key.absmax"].double()  # [layers, H_kv, D]
    absmax_v = profile.tensors["calibrated.value.absmax"].double()
    head = fp8_scales(profile, "head")
    tensor = fp8_scales(profile, "tensor")
    assert head.key.shape == (30, 3) and tensor.key.shape == (30,) and head.key.dtype == torch.float32
    for layer, clip_k, clip_v in ((3, 1.0, 1.0), (CLIPPED, 0.9, 0.8)):
        for h in range(3):
            assert head.key[layer, h].item() == pytest.approx(clip_k * absmax_k[layer, h].max().item() / 448, rel=1e-6)
            assert head.value[layer, h].item() == pytest.approx(clip_v * absmax_v[layer, h].max().item() / 448, rel=1e-6)
        assert tensor.key[layer].item() == pytest.approx(clip_k * absmax_k[layer].max().item() / 448, rel=1e-6)
    # A per-tensor scale is the largest per-head one; SGLang's shared scale the larger of K and V.
    assert torch.equal(tensor.key, head.key.amax(-1)) and torch.equal(tensor.value, head.value.amax(-1))
    shared = fp8_scales(profile, "tensor", shared_kv=True, skip_fp16=False)
    assert torch.equal(shared.key, torch.maximum(tensor.key, tensor.value)) and torch.equal(shared.key, shared.value)
    assert tensor.skip_layers == FP16_LAYERS and shared.skip_layers == ()
    with pytest.raises(ValueError, match="per tensor only"):
        fp8_scales(profile, "head", shared_kv=True)
    with pytest.raises(ValueError, match=r"granularity has to be one of \[tensor, head\]"):
        fp8_scales(profile, "channel")


@pytest.mark.parametrize("absmax, message", [
    (0.0, "refusing FP8 key scale 0.0 at layer 5: it is zero"),
    (448.0, "refusing FP8 key scale 1.0 at layer 5: it is exactly 1.0"),
    (float("nan"), "key_absmax must be a finite"),  # the profile's ranges are checked first
])
def test_scales_that_engines_would_misread_are_refused(profile, tmp_path, absmax, message):
    bad = _with_absmax(profile, 5, absmax)
    for attempt in (lambda: fp8_scales(bad), lambda: export(bad, ExportSpec("vllm"), tmp_path / "out"),
                    lambda: methods.get("fp8", bad)):
        with pytest.raises(ValueError, match=message):
            attempt()
    assert not (tmp_path / "out").exists()


def test_scales_themselves_are_checked():
    ok = torch.tensor([0.5, 0.25])
    for bad, message in ((torch.tensor([0.5, float("inf")]), "at layer 1: it is NaN or Inf"),
                         (torch.tensor([-0.5, 0.25]), "at layer 0: it is zero or negative"),
                         (torch.tensor([0.5, 1.0]), "at layer 1: it is exactly 1.0")):
        with pytest.raises(ValueError, match=message):
            FP8Scales(bad, ok, "tensor")
    with pytest.raises(ValueError, match="KV head 1: it is exactly 1.0"):
        FP8Scales(torch.tensor([[0.5, 1.0]]), torch.tensor([[0.5, 0.5]]), Granularity.HEAD)
    with pytest.raises(ValueError, match="float32 tensor with 2 dimension"):
        FP8Scales(ok, ok, "head")
    with pytest.raises(ValueError, match="outside the model's 2 layers"):
        FP8Scales(ok, ok, "tensor", skip_layers=(2,))


# ---------------------------------------------------------------------- numerics
def _reference_fp8(x: torch.Tensor) -> torch.Tensor:
    """Slow, obviously correct E4M3 rounding: the nearest finite E4M3 value (ties to the even code) after
    clamping to +-448. The value table comes from decoding all 256 bit patterns."""
    codes = torch.arange(256, dtype=torch.uint8)
    table = codes.view(torch.float8_e4m3fn).to(torch.float64)
    finite = torch.isfinite(table)
    table, codes = table[finite], codes[finite].to(torch.int64)
    out = torch.empty_like(x, dtype=torch.float64)
    for i, v in enumerate(x.to(torch.float64).clamp(-FP8_MAX, FP8_MAX).tolist()):
        dist = (table - v).abs()
        best = torch.nonzero(dist == dist.min()).flatten()
        pick = best[codes[best] % 2 == 0][0] if len(best) > 1 else best[0]
        out[i] = table[pick]
    return out


def _reference_fp8_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """Slow rounding toward zero: the finite E4M3 value of largest magnitude not above the value's, same sign."""
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    magnitudes = table[torch.isfinite(table) & (table >= 0)].unique()
    out = torch.empty_like(x, dtype=torch.float64)
    for i, v in enumerate(x.to(torch.float64).clamp(-FP8_MAX, FP8_MAX).tolist()):
        out[i] = math.copysign(float(magnitudes[magnitudes <= abs(v)].max()), v)
    return out


def test_toward_zero_rounding_matches_a_slow_reference_exactly():
    gen = torch.Generator().manual_seed(1)
    scale = torch.tensor(0.0237958, dtype=torch.float32)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    table = table[torch.isfinite(table)].unique()
    x = torch.cat([torch.randn(3000, generator=gen) * 3, table * scale, (table[1:] + table[:-1]) / 2 * scale,
                   torch.tensor([0.0, -0.0, 1e6, -1e6, 1e-9])])
    ours = dequantize(quantize(x.view(1, 1, -1, 1), scale, Rounding.TOWARD_ZERO), scale).flatten().double()
    expected = _reference_fp8_toward_zero(x.float() / scale) * scale.double()
    torch.testing.assert_close(ours, expected.float().double(), atol=0, rtol=0)
    nearest = dequantize(quantize(x.view(1, 1, -1, 1), scale), scale).flatten()
    assert bool((ours.abs() <= nearest.double().abs()).all()) and bool((ours != nearest.double()).any())


def test_quantize_matches_a_slow_reference_exactly():
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor(0.0371, dtype=torch.float32)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    table = table[torch.isfinite(table)].unique()
    midpoints = (table[1:] + table[:-1]) / 2  # ties: exactly between two E4M3 values
    x = torch.cat([torch.randn(2000, generator=gen) * 4, torch.randn(200, generator=gen) * 40,
                   midpoints * scale, torch.tensor([0.0, 16.62, -16.62, 17.0, -1e6, 1e6])])
    ours = dequantize(quantize(x.view(1, 1, -1, 1), scale), scale).flatten().double()
    expected = _reference_fp8(x.float() / scale) * scale.double()
    torch.testing.assert_close(ours, expected.float().double(), atol=0, rtol=0)


TINY = Architecture("llama", num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=32,
                    layer_types=("sliding_attention", "full_attention"), sliding_window=48)


def test_cache_stores_one_byte_per_element_and_follows_the_sliding_window():
    scales = FP8Scales(torch.tensor([0.02, 0.03]), torch.tensor([0.01, 0.04]), "tensor")
    cache = FP8Cache(TINY, scales)
    reference = DynamicSlidingWindowLayer(sliding_window=48)
    gen = torch.Generator().manual_seed(0)
    for step in range(70):
        n = 1 if step else 5
        k, v = torch.randn(1, 2, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen)
        keys, values = cache.update(k, v, 0)
        ref_k, _ = reference.update(k, v)
        assert keys.shape == ref_k.shape and keys.dtype == k.dtype
        torch.testing.assert_close(keys[..., -n:, :], dequantize(quantize(k, scales.key[0]), scales.key[0]), atol=0, rtol=0)
        assert cache.layers[0].get_mask_sizes(1) == reference.get_mask_sizes(1)
        cache.update(k, v, 1)
    tokens_sliding, tokens_full = 47, 74  # window - 1, all
    elements = 2 * 32  # KV heads x head_dim
    assert cache.layers[0].keys.dtype == torch.float8_e4m3fn
    assert cache.nbytes() == 2 * elements * (tokens_sliding + tokens_full) + 2 * 2 * 4  # codes + 4 float32 scales
    assert cache.fp16_nbytes() == 2 * 2 * elements * (tokens_sliding + tokens_full)


def test_skipped_layers_store_float16_and_head_scales_broadcast():
    key = torch.tensor([[0.02, 0.5], [0.03, 0.04]])
    cache = FP8Cache(TINY, FP8Scales(key, key.clone(), "head", skip_layers=(1,)))
    k = torch.randn(1, 2, 6, 32)
    out_k, _ = cache.update(k, k, 0)
    torch.testing.assert_close(out_k[:, 1], dequantize(quantize(k[:, 1], key[0, 1]), key[0, 1]), atol=0, rtol=0)
    out_k, _ = cache.update(k, k, 1)
    assert cache.layers[1].keys.dtype == torch.float16 and torch.equal(out_k, k.half().float())
    with pytest.raises(ValueError, match="the model needs"):
        FP8Cache(TINY, FP8Scales(torch.ones(3) / 3, torch.ones(3) / 3, "tensor"))


# ---------------------------------------------------------------------- files
def test_vllm_export_loads_with_safetensors_and_compressed_tensors(profile, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStrategy

    for granularity, shape, strategy in (("tensor", (), QuantizationStrategy.TENSOR),
                                         ("head", (3,), QuantizationStrategy.ATTN_HEAD)):
        out = tmp_path / granularity
        manifest = export(profile, ExportSpec("vllm", granularity), out)
        scales = fp8_scales(profile, granularity)
        with safe_open(str(out / "kv_cache_scales.safetensors"), framework="pt") as f:
            names = set(f.keys())
            assert names == {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(30) for kv in "kv"}
            for i in range(30):
                for kv, expected in (("k", scales.key[i]), ("v", scales.value[i])):
                    t = f.get_tensor(f"model.layers.{i}.self_attn.{kv}_scale")
                    assert t.dtype == torch.float32 and tuple(t.shape) == shape
                    assert bool(torch.isfinite(t).all()) and bool((t > 0).all()) and not bool((t == 1.0).any())
                    assert torch.equal(t, expected)  # exactly what the fp8 eval method quantizes with
        block = json.loads((out / "quantization_config.json").read_text())["quantization_config"]
        config = QuantizationConfig.model_validate(block)  # compressed-tensors' own parsing
        scheme = config.kv_cache_scheme
        assert isinstance(scheme, QuantizationArgs) and config.quant_method == "compressed-tensors"
        assert (scheme.num_bits, scheme.type, scheme.strategy, scheme.symmetric, scheme.dynamic) == (
            8, "float", strategy.value, True, False)
        assert config.config_groups == {}
        assert manifest["skip_layers"] == list(FP16_LAYERS)
        assert manifest["engine_args"] == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0", "7", "29"]
        assert manifest["model"]["fingerprint"] == profile.fingerprint
        assert profile.tensors_sha256 and manifest["profile"]["tensors_sha256"] == profile.tensors_sha256
        assert json.loads((out / "kvguard_export.json").read_text()) == manifest
        again = export(profile, ExportSpec("vllm", granularity), tmp_path / "again")
        assert again["files"] == manifest["files"]  # byte-for-byte reproducible
        readme = (out / "README.md").read_text()
        assert "vllm serve served-model --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 7 29" in readme
        assert profile.fingerprint in readme


class _SGLangKVCacheQuantSchema(BaseModel):
    """SGLang's ``KVCacheQuantSchema`` / ``QuantParamSchema`` (python/sglang/srt/model_loader/weight_utils.py),
    the fields its ``kv_cache_scales_loader`` parses ``--quantization-param-path`` with."""

    dtype: str
    scaling_factor: dict[int, dict[int, float]]


class _SGLangQuantParamSchema(BaseModel):
    model_type: str | None
    kv_cache: _SGLangKVCacheQuantSchema


def test_sglang_export_has_its_param_schema(profile, tmp_path):
    manifest = export(profile, ExportSpec("sglang"), tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "kv_cache_scales.json").read_text())
    parsed = _SGLangQuantParamSchema.model_validate(raw)
    assert parsed.model_type == "llama" and parsed.kv_cache.dtype == "float8_e4m3fn"
    assert list(parsed.kv_cache.scaling_factor) == [0] and list(parsed.kv_cache.scaling_factor[0]) == list(range(30))
    shared = fp8_scales(profile, shared_kv=True, skip_fp16=False)
    assert [torch.tensor(s, dtype=torch.float32) for s in parsed.kv_cache.scaling_factor[0].values()] == list(shared.key)
    assert manifest["skip_layers"] == [] and manifest["plan_fp16_layers"] == list(FP16_LAYERS)
    assert manifest["eval_method"] == "fp8:sglang"
    assert "are stored in FP8 too" in (tmp_path / "s" / "README.md").read_text()
    with pytest.raises(ExportError, match="vllm only"):
        ExportSpec("sglang", "head")


def test_cli_export_and_its_errors(profile, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["export", "--profile", str(profile.path), "--format", "vllm", "--out", str(out)]) == 0
    assert "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 7 29" in capsys.readouterr().out
    # A previous export is replaced without --force (here by the SGLang one: no vLLM files left over).
    assert cli.main(["export", "--profile", str(profile.path), "--format", "sglang", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "kv_cache_scales.json", "kvguard_export.json"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    capsys.readouterr()
    cases = [
        (["--format", "sglang", "--granularity", "head", "--out", str(tmp_path / "x")], "head is for vllm only"),
        (["--format", "vllm", "--out", str(foreign)], "not empty and holds no kvguard export"),
    ]
    for args, message in cases:
        assert cli.main(["export", "--profile", str(profile.path), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvguard export: error: ") and message in err
    assert cli.main(["export", "--profile", str(tmp_path / "missing"), "--format", "vllm", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard export: error: ") and "is not a kvguard profile" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "--profile", str(profile.path), "--format", "trt", "--out", str(tmp_path / "z")])
    assert exc.value.code == 2 and "invalid choice: 'trt'" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()
    assert cli.main(["export", "--profile", str(profile.path), "--format", "vllm", "--out", str(foreign), "--force"]) == 0
    assert not (foreign / "notes.txt").exists() and (foreign / "kv_cache_scales.safetensors").is_file()


# ---------------------------------------------------------------------- evaluation
@pytest.mark.slow
def test_fp8_methods_run_on_real_text_close_to_fp16(profile, smollm2):
    model, tok = smollm2
    ids = data.token_stream("prose", "eval", tok, 512)
    names = ["fp16", "fp8", "fp8:head", "fp8:sglang"]
    rows = {r.method: r for r in harness.evaluate_stream(model, ids, "prose", names, profile=profile, progress=False)}
    for name in names[1:]:
        row = rows[name]
        assert row.mode == "simulated" and row.error is None
        assert 1e-5 < row.kl < 0.02, (name, row.kl)  # different from FP16, and close to it
        assert row.top1_agree > 0.95 and abs(row.ppl_delta_pct) < 3.0, (name, row)
    # 1 byte per element, 2 in the 3 skipped layers of 30 (scales: 240 bytes or fewer).
    assert rows["fp8"].kv_bytes_ratio == pytest.approx((27 * 0.5 + 3 * 1.0) / 30, abs=1e-3)
    assert rows["fp8:sglang"].kv_bytes_ratio == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="needs a calibration profile"):
        methods.get("fp8")


@pytest.mark.slow
def test_fp8_cache_generates_and_eval_needs_a_profile(profile, smollm2, capsys):
    model, tok = smollm2
    cache = methods.get("fp8", profile).make_cache(model)
    inputs = tok("The Roman Empire", return_tensors="pt")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 6
    assert cache.layers[1].keys.dtype == torch.float8_e4m3fn and cache.layers[0].keys.dtype == torch.float16
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cli.main(["eval", "--methods", "fp16,fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard eval: error: ") and "method 'fp8' needs a calibration profile" in err


@pytest.mark.slow
def test_one_pass_scoring_is_chunk_one_decoding_exactly(profile, smollm2):
    """In float64 the model's own rounding noise cannot flip an FP8 code, so chunk-1 decoding and the
    long-chunk passes eval uses must agree bit for bit (in float32, a few codes sitting on a rounding
    boundary flip either way, which moves single logits but not the statistics)."""
    model = copy.deepcopy(smollm2[0]).double()
    ids = data.token_stream("prose", "eval", smollm2[1], 24)
    method = methods.get("fp8", profile)
    one = score_stream(model, ids, method.make_cache(model), chunk=1, keep_logits=True)
    passes = score_stream(model, ids, method.make_cache(model), chunk=harness.ONE_PASS_CHUNK, keep_logits=True)
    torch.testing.assert_close(one.logits, passes.logits, atol=0, rtol=0)
