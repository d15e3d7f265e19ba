"""The engine's side of a skip list: its dtypes, the memory a skip list costs, caches in the engine's formats."""

import pytest
import torch

from kvguard.architecture import Architecture
from kvguard.export.skip_list import EngineDtype, SkipCandidate, SkipChoice, engine_cache, memory_ratio
from kvguard.fp8 import FP8Cache, FP8Scales
from kvguard.per_token_head import TokenHeadCache
from tests.helpers import tiny_llama

ARCH = Architecture("gemma3_text", num_layers=4, num_query_heads=4, num_kv_heads=2, head_dim=64,
                    layer_types=("sliding_attention",) * 3 + ("full_attention",), sliding_window=512)


def test_memory_counts_codes_scales_and_windows_as_the_engine_allocates():
    # int4_per_token_head: 32 code bytes + 4 scale bytes per 64 elements (128 bytes in FP16).
    assert memory_ratio(ARCH, EngineDtype.INT4_PER_TOKEN_HEAD, (), 2048) == pytest.approx(36 / 128)
    assert memory_ratio(ARCH, EngineDtype.INT8_PER_TOKEN_HEAD, (), 2048) == pytest.approx(68 / 128)
    assert memory_ratio(ARCH, EngineDtype.FP8, (), 2048) == pytest.approx(0.5)
    # Skipping the global layer (2,048 tokens) costs four times what a sliding one (511) does.
    tokens = [511, 511, 511, 2048]
    for skip in ((3,), (0,)):
        stored = sum(t * (128 if i in skip else 36) for i, t in enumerate(tokens))
        assert memory_ratio(ARCH, EngineDtype.INT4_PER_TOKEN_HEAD, skip, 2048) == pytest.approx(stored / (128 * sum(tokens)))
    with pytest.raises(ValueError, match=r"has to be one of \[fp8, int8_per_token_head, int4_per_token_head\]"):
        EngineDtype.parse("int2")


def test_engine_caches_are_the_engines_formats():
    config = tiny_llama(num_hidden_layers=3).config
    scales = FP8Scales(torch.full((3,), 0.02), torch.full((3,), 0.03), "tensor")
    cache = engine_cache(config, EngineDtype.FP8, (2,), scales)
    assert isinstance(cache, FP8Cache) and cache.scales.skip_layers == (2,)
    cache = engine_cache(config, EngineDtype.INT8_PER_TOKEN_HEAD, (0,))
    assert isinstance(cache, TokenHeadCache) and cache.skip_layers == (0,)
    with pytest.raises(ValueError, match="needs the exported FP8 scales"):
        engine_cache(config, EngineDtype.FP8, ())


def test_a_choice_gives_the_engine_arguments_of_its_chosen_skip_list():
    none, one = SkipCandidate((), 0.375, 0.02, 3.0, 0.9), SkipCandidate((1,), 0.5, 0.01, 1.5, 0.95)
    choice = SkipChoice(EngineDtype.INT4_PER_TOKEN_HEAD, 0.5, (none, one), one)
    assert choice.engine_args() == ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-dtype-skip-layers", "1"]
    assert choice.to_dict()["chosen"] == [1] and choice.to_dict()["engine_args"] == choice.engine_args()
    assert "| 1 | 0.500 | 0.01000 | +1.50 | 0.950 | yes |" in choice.table()
    nothing = SkipChoice(EngineDtype.FP8, 0.3, (), None)
    assert nothing.to_dict()["engine_args"] is None
    with pytest.raises(ValueError, match="no skip list of fp8 fits the memory budget 0.3"):
        nothing.engine_args()
