"""The engine skip-list chooser: memory as the engine allocates it, candidates within the budget, the choice.

The numbers of the chooser itself run on a tiny random Llama with hand-made sensitivities; the real-model test
chooses on a small real SmolLM2 profile and its held-out calibration text.
"""

import math

import pytest
import torch

from kvguard.architecture import Architecture
from kvguard.calibration.engine_skip import EngineDtype, choose, choose_for_profile, engine_cache, memory_ratio
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.fp8 import FP8Cache, FP8Scales
from kvguard.per_token_head import TokenHeadCache
from kvguard.precision import Precision
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


def _sensitivity(alone: list[float]) -> Sensitivity:
    n = len(alone)
    return Sensitivity(Precision.INT4, Precision.INT2, 0.1, torch.tensor(alone), torch.zeros(n), torch.zeros(n),
                       torch.full((n, 2), float("nan")))


@pytest.fixture(scope="module")
def tiny_heldout():
    model = tiny_llama(num_hidden_layers=3)
    gen = torch.Generator().manual_seed(0)
    return HeldOut(model, {"a": torch.randint(0, 128, (96,), generator=gen), "b": torch.randint(0, 128, (96,), generator=gen)})


def test_choose_scores_the_rankings_prefixes_within_the_budget(tiny_heldout):
    sens = _sensitivity([0.01, 0.5, 0.2])  # layer 1 most sensitive, then 2, then 0
    dtype = EngineDtype.INT4_PER_TOKEN_HEAD  # head_dim 16: 8 + 4 bytes vs 32
    one, two = (2 * 12 + 32) / 96, (12 + 64) / 96
    choice = choose(tiny_heldout, sens, dtype, budget=two + 1e-9, context=96)
    assert [c.skip for c in choice.candidates] == [(), (1,), (1, 2)]
    assert [c.memory for c in choice.candidates] == pytest.approx([12 / 32, one, two])
    assert choice.chosen is min(choice.candidates, key=lambda c: c.kl) and choice.chosen.kl > 0
    assert all(math.isfinite(c.ppl_increase_pct) and 0 < c.top1_agree <= 1 for c in choice.candidates)
    args = choice.engine_args()
    assert args[:2] == ["--kv-cache-dtype", "int4_per_token_head"]
    assert args[2:] == ([] if not choice.chosen.skip else ["--kv-cache-dtype-skip-layers", *map(str, choice.chosen.skip)])
    assert "| 1,2 | " in choice.table() and choice.to_dict()["chosen"] == list(choice.chosen.skip)
    # Nothing fits: no choice, and asking for its arguments says why.
    tight = choose(tiny_heldout, sens, dtype, budget=0.1, context=96)
    assert tight.chosen is None and tight.candidates == ()
    with pytest.raises(ValueError, match="fits the memory budget 0.1"):
        tight.engine_args()
    with pytest.raises(ValueError, match=r"fraction of FP16 in \(0, 1\]"):
        choose(tiny_heldout, sens, dtype, budget=1.5, context=96)


def test_engine_caches_are_the_engines_formats(tiny_heldout):
    config = tiny_heldout.model.config
    scales = FP8Scales(torch.full((3,), 0.02), torch.full((3,), 0.03), "tensor")
    cache = engine_cache(config, EngineDtype.FP8, (2,), scales)
    assert isinstance(cache, FP8Cache) and cache.scales.skip_layers == (2,)
    cache = engine_cache(config, EngineDtype.INT8_PER_TOKEN_HEAD, (0,))
    assert isinstance(cache, TokenHeadCache) and cache.skip_layers == (0,)
    with pytest.raises(ValueError, match="needs the exported FP8 scales"):
        engine_cache(config, EngineDtype.FP8, ())


@pytest.mark.slow
def test_choice_on_a_real_profile_and_its_heldout_text(small_profile_dir, smollm2):
    from kvguard.profile import Profile

    model, tok = smollm2
    profile = Profile.load(small_profile_dir)
    choice = choose_for_profile(profile, model, tok, "int4_per_token_head", 0.40, max_skip=2)
    ranking = Sensitivity.from_parts(profile.meta.record["sensitivity"], profile.tensors).layer_ranking()
    assert [c.skip for c in choice.candidates] == [(), tuple(sorted(ranking[:1])), tuple(sorted(ranking[:2]))]
    assert choice.chosen is not None and choice.chosen.memory <= 0.40
    assert all(0 < c.kl < 1 for c in choice.candidates)
    # Keeping the most sensitive layer in 16 bits buys back held-out KL on real text.
    assert choice.candidates[1].kl < choice.candidates[0].kl
