"""The softmax-bias correction: the formula on hand-made numbers, and the cache's decode reads against the
simulation on real text."""

import math
import warnings

import pytest
import torch

from kvguard import data, fused_attention, score_bias
from kvguard.architecture import Architecture
from kvguard.config import CacheConfig
from kvguard.control.decoding import CacheDecoder
from kvguard.evaluation import methods
from kvguard.plan import LayerPlan, Plan
from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantSpec, quantize
from kvguard.scoring import score_logits
from kvguard.simulate import simulate_logits
from tests.helpers import tiny_llama


@pytest.mark.parametrize("axis", [Axis.CHANNEL, Axis.TOKEN])
def test_the_correction_is_minus_half_the_score_noise_variance_of_each_key(axis):
    gen = torch.Generator().manual_seed(0)
    keys = quantize(torch.randn(1, 2, 12, 8, generator=gen), QuantSpec("int2", axis, 4))
    q = torch.randn(1, 2, 3, 8, generator=gen)
    got = score_bias.correction(q, keys)
    assert got.shape == (1, 2, 3, 12)
    scale = keys.scale.float()
    for h in range(2):
        for r in range(3):
            for j in range(12):
                # The step of key j's channel d: its group's scale (per channel for keys, per token for values).
                step = scale[0, h, j // 4] if axis is Axis.CHANNEL else scale[0, h, j].repeat_interleave(4)
                want = -0.5 * float((q[0, h, r].square() * step.square() / 12).sum())
                assert math.isclose(float(got[0, h, r, j]), want, rel_tol=1e-5, abs_tol=1e-7)
    assert bool((got < 0).all())  # every quantized key loses some of the weight its noise adds


def test_only_keys_below_int8_with_dynamic_scales_are_corrected():
    assert score_bias.applies(QuantSpec("int2", Axis.CHANNEL)) and score_bias.applies(QuantSpec("int4", Axis.CHANNEL))
    assert not score_bias.applies(QuantSpec("int8", Axis.CHANNEL))
    assert not score_bias.applies(QuantSpec("int8", Axis.CHANNEL, static=True))


def test_the_setting_round_trips_and_leaves_profiles_without_it_unchanged():
    assert "score_correction" not in CacheConfig().to_dict()
    on = CacheConfig(score_correction=True)
    assert CacheConfig.from_dict(on.to_dict()) == on
    assert CacheConfig.from_dict(CacheConfig().to_dict()) == CacheConfig()


def test_the_method_modifiers_turn_it_on_and_off_for_static_plans_only():
    arch = Architecture.from_config(tiny_llama().config)
    on, off = methods.get("int2+sb").plan(arch), methods.get("int2+sb+nosb").plan(arch)
    assert on.cache.score_correction and not off.cache.score_correction
    assert off == methods.get("int2").plan(arch) and on.layers == off.layers
    with pytest.raises(ValueError, match="unknown modifier"):
        methods.get("int2+bias")
    with pytest.raises(ValueError, match="static kvguard plan"):
        methods.get("hf-quanto-2+sb")


@pytest.mark.slow
@pytest.mark.skipif(not fused_attention.available(), reason="fused kernels not built: make install")
def test_decoding_through_the_cache_applies_the_correction_the_simulation_measures(smollm2):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    # Every tier in one plan (INT2 and INT3 heads, rotated keys on odd layers): one decode covers them all.
    cycle = ["int2", "int3", "int4", "int8", "fp16"]
    layers = tuple(LayerPlan(tuple(cycle[(i + h) % 5] for h in range(arch.num_kv_heads)), key_rotation=i % 2 == 1)
                   for i in range(arch.num_layers))
    plain = Plan(layers, CacheConfig(residual=16, sinks=4, group_size=16))
    corrected = plain.with_score_correction()
    ids = data.token_stream("prose", "eval", tok, 200)

    def decoded(plan, n=ids.numel()):
        decoder = CacheDecoder(model, plan.make_cache(model.config))
        return torch.stack([decoder.prefill(ids[:1])] + [decoder.step(int(t)) for t in ids[1:n - 1]])

    streamed = decoded(corrected)
    simulated = simulate_logits(model, ids[:-1], corrected)
    # As for the uncorrected simulation: not bit-exact (attention arithmetic differs by ~1e-6), within 0.2 %.
    a, b = score_logits(ids, [streamed]), score_logits(ids, [simulated])
    assert abs(math.exp(a.nll - b.nll) - 1) < 2e-3
    assert (streamed.argmax(-1) == simulated.argmax(-1)).float().mean() > 0.98
    # And it does something: the corrected read is not the plain one, in the cache and in the simulation (the
    # plain decode's first 64 tokens show it: they already read quantized groups).
    assert not torch.allclose(streamed[:64], decoded(plain, 65), atol=1e-3)
    assert not torch.allclose(simulated, simulate_logits(model, ids[:-1], plain), atol=1e-3)


def test_a_read_that_dequantizes_says_the_correction_is_not_applied():
    from kvguard.cache_layer import KVGuardLayer

    def chunks(config):
        layer = KVGuardLayer(Precision.INT2, config, 0)
        torch.manual_seed(0)
        for n in (64, 16):  # the second chunk reads a stored past of INT2 groups the dequantizing way
            layer.update(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16))

    with pytest.warns(RuntimeWarning, match="score_correction is on"):
        chunks(CacheConfig(residual=8, group_size=8, sinks=0, score_correction=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunks(CacheConfig(residual=8, group_size=8, sinks=0))
