"""The engine skip-list chooser: candidates within the budget, scored on held-out text, the choice.

The numbers of the chooser itself run on a tiny random Llama with hand-made sensitivities; the real-model test
chooses on a small real SmolLM2 profile and its held-out calibration text.
"""

import math

import pytest
import torch

from kvguard.calibration.engine_skip import choose, choose_for_profile
from kvguard.calibration.heldout import HeldOut
from kvguard.calibration.sensitivity import Sensitivity
from kvguard.export.skip_list import EngineDtype
from kvguard.precision import Precision
from tests.helpers import tiny_llama


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
