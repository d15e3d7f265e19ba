import pytest
import torch

from kvguard.architecture import Architecture
from kvguard.evaluation import methods
from kvguard.plan import StaticScales
from kvguard.precision import Precision

TINY = Architecture("llama", num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=32,
                    layer_types=("sliding_attention", "full_attention"), sliding_window=48)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "int2", "kivi-4", "kivi-2", "int4+rot+v1"])
def test_static_bytes_equal_the_bytes_after_decoding_token_by_token(name):
    plan = methods.get(name).plan(TINY)
    cache = plan.make_cache(TINY)
    gen = torch.Generator().manual_seed(0)
    for _ in range(203):
        for layer in range(TINY.num_layers):
            k, v = torch.randn(1, 2, 1, 32, generator=gen), torch.randn(1, 2, 1, 32, generator=gen)
            cache.update(k, v, layer)
    assert plan.kv_bytes(TINY, 203) == methods.kv_bytes(cache)


def test_registry_names_and_layouts():
    assert set(methods.METHODS) >= {"fp16", "int8", "int4", "kivi-4", "kivi-2", "hf-quanto-4", "hf-quanto-2", "hf-hqq-4"}
    kivi = methods.get("kivi-4").plan(TINY)
    assert (kivi.cache.residual, kivi.cache.sinks, kivi.cache.group_size) == (128, 0, 32)
    assert not methods.get("hf-quanto-4").simulatable and methods.get("int4").simulatable


def test_value_modifiers_store_the_values_below_their_keys():
    sided = methods.get("int4+v2").plan(TINY)
    assert all(lp.value_precision == (Precision.INT2,) * 2 and lp.precision == (Precision.INT4,) * 2
               for lp in sided.layers)
    assert methods.get("int4+v2+v0").plan(TINY) == methods.get("int4").plan(TINY)
    assert methods.get("int8+v1").plan(TINY) == methods.get("int8").plan(TINY)  # INT8 keys keep INT8 values
    stored, _ = sided.kv_bytes(TINY, 203)
    assert stored < methods.get("int4").plan(TINY).kv_bytes(TINY, 203)[0]
    with pytest.raises(ValueError, match="unknown modifier 'v3'"):
        methods.get("int4+v3")


def test_window_modifiers_need_calibrated_scales_for_8_bits():
    with pytest.raises(ValueError, match=r"\+w8 stores the window under calibrated INT8 scales"):
        methods.get("int3+w8")
    assert methods.get("int3+w16").plan(TINY) == methods.get("int3").plan(TINY)  # 16 bits is the default
    scales = StaticScales(torch.ones(2, 2, 32), torch.ones(2, 2, 32))
    base = methods.Method("int3-calibrated", "INT3 with scales", lambda arch: methods.get("int3").plan(arch), scales=scales)
    eight = base.plan(TINY).with_window_bits(8)
    cache = eight.make_cache(TINY, scales)
    for layer in range(TINY.num_layers):
        cache.update(torch.randn(1, 2, 100, 32), torch.randn(1, 2, 100, 32), layer)
    # Sized from shapes alone, the 8-bit window's plan stores what its cache does, and less than 16 bits.
    assert eight.kv_bytes(TINY, 100) == methods.kv_bytes(cache)
    assert eight.kv_bytes(TINY, 100)[0] < base.plan(TINY).kv_bytes(TINY, 100)[0]


def test_key_rope_modifiers_store_keys_before_rope_at_the_same_bytes():
    pre = methods.get("int3+rot+prerope").plan(TINY)
    assert pre.cache.prerope_keys and pre.layers == methods.get("int3+rot").plan(TINY).layers
    assert methods.get("int3+prerope+postrope").plan(TINY) == methods.get("int3").plan(TINY)
    # where keys are turned changes no byte (sized without the model's RoPE, which an Architecture lacks)
    assert pre.kv_bytes(TINY, 203) == methods.get("int3+rot").plan(TINY).kv_bytes(TINY, 203)
    with pytest.raises(ValueError, match="prerope_keys and score_correction"):
        methods.get("int2+sb+prerope").plan(TINY)
