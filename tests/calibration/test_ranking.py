"""The ranking streams (calibration documents past every sample and held-out one) and the re-ranking of the closest
candidates at the mid budgets (the budgets' groups, and the plan ``kvguard@<bytes>`` runs); the full calibration's ranking is
in test_low_bit."""

import itertools
import math
from dataclasses import replace

import pytest

from kvguard import data, models
from kvguard.architecture import Architecture
from kvguard.calibration.ranking import RANKED_CANDIDATES, closest
from kvguard.calibration.samples import calibration_text
from kvguard.plan import Plan
from kvguard.profile import RANKING_MARGIN, DataManifest, RankedBudget, Settings
from tests.helpers import candidate, profile_meta, tiny_llama


def _candidates(points):
    plan = Plan.uniform(Architecture.from_config(tiny_llama().config), "int4")
    return [candidate(name, plan, memory=memory, kl=kl) for name, memory, kl in points]


def test_each_budget_takes_its_closest_and_any_lower_held_out_kl_below_them():
    # B4 0.40: 0.75 -> 0.30, band down to 0.292; 0.60 -> 0.24, band down to 0.232.
    log = _candidates([("a", 0.300, 0.010), ("b", 0.295, 0.012), ("c", 0.294, 0.011), ("d", 0.293, 0.020),
                       ("e", 0.310, 0.001), ("f", 0.270, 0.0115), ("g", 0.270, 0.013),
                       ("h", 0.240, 0.015), ("i", 0.235, 0.030), ("j", 0.200, 0.050)])
    groups = {share: [c.name for c in group] for share, group in closest(log, 0.40)}
    # "e" stores more than 0.30; "d" is fourth in the band; "f" is below the band but beats "b", the band's third.
    assert groups[0.75] == ["a", "c", "f", "b"] and len(set(groups[0.75]) - {"f"}) == RANKED_CANDIDATES
    assert groups[0.60] == ["h", "i"]  # only two in the band, nothing below beats them


def test_a_budget_with_one_candidate_is_not_ranked():
    assert closest(_candidates([("a", 0.30, 0.01), ("b", 0.20, 0.02)]), 0.40) == []
    # One in the band, but a cheaper plan with a lower held-out KL: two to rank.
    groups = closest(_candidates([("a", 0.30, 0.01), ("b", 0.20, 0.005)]), 0.40)
    assert [(share, [c.name for c in group]) for share, group in groups] == [(0.75, ["b", "a"])]


def test_kvguard_at_bytes_takes_the_ranking_s_word_where_its_held_out_pick_was_ranked():
    log = _candidates([("a", 0.300, 0.010), ("b", 0.290, 0.008), ("c", 0.280, 0.009), ("d", 0.200, 0.030),
                       ("e", 0.400, 0.001)])
    budget = RankedBudget(0.75, 0.30, {"b": 0.030, "c": 0.020, "a": 0.015})  # each beats "b" by more than the margin
    assert budget.pick == "a" and RankedBudget.from_dict(budget.to_dict()) == budget
    meta = profile_meta(log[0].plan, search_log=tuple(log), pareto_front=("d", "b", "a", "e"),
                        record={"ranking": {"tokens_per_domain": 512, "budgets": [budget.to_dict()]}})
    pick = lambda memory: meta.frontier_pick(memory).name  # noqa: E731
    assert pick(0.30) == "a"  # the held-out pick "b" was ranked: the best ranked with it
    assert pick(0.295) == "c"  # "a" does not fit; "c" is off the held-out frontier but ranked below "b"
    assert pick(0.25) == "d" and pick(0.5) == "e"  # unranked held-out picks stand
    assert meta.frontier_pick(0.1) is None
    unranked = replace(meta, record={})
    assert unranked.frontier_pick(0.30).name == "b"


@pytest.mark.parametrize("factor, replaced", [(1.001, False), (0.999, True)])
def test_the_ranking_replaces_the_held_out_pick_only_by_more_than_its_margin(factor, replaced):
    log = _candidates([("a", 0.300, 0.010), ("b", 0.290, 0.008)])
    # "b" is the held-out pick; "a" has the lower ranking KL, by just under / just over the margin.
    budget = RankedBudget(0.75, 0.30, {"b": 0.0100, "a": 0.0100 * math.exp(-RANKING_MARGIN) * factor})
    want = "a" if replaced else "b"
    assert budget.pick == want and budget.to_dict()["pick"] == want
    meta = profile_meta(log[0].plan, search_log=tuple(log), pareto_front=("b", "a"),
                        record={"ranking": {"tokens_per_domain": 512, "budgets": [budget.to_dict()]}})
    assert meta.frontier_pick(0.30).name == want
    assert meta.frontier_pick(0.295).name == "b"  # "a" does not fit


@pytest.mark.slow
def test_ranking_streams_come_after_every_sample_and_held_out_document():
    _, tok = models.load("smollm2-135m")
    text = calibration_text(tok, ("prose", "code"), 8, 64, 512, ranking_tokens=1024)
    for domain, d in text.manifest.domains.items():
        assert text.ranking[domain].numel() == 512 == d.ranking_tokens and d.ranking_documents >= 1
        skip = d.heldout_documents + d.documents
        first = next(itertools.islice(data.iter_documents(domain, "calib", tok), skip, None))  # nothing else read it
        ids = tok(first.text[:64], add_special_tokens=False)["input_ids"][:8]
        start = 1 if data.wants_bos(tok) else 0
        assert text.ranking[domain][start:start + len(ids)].tolist() == ids
        # No token run of a sample or the held-out slice is the ranking stream's start.
        assert all(s[start:start + 8].tolist() != ids for s in text.samples + [text.streams[domain]])


def test_too_little_text_turns_the_ranking_off_for_every_domain(capsys):
    _, tok = models.load("smollm2-135m")
    text = calibration_text(tok, ("prose", "code"), 8, 64, 512, ranking_tokens=2 * 10**8)
    assert text.ranking == {} and all(d.ranking_tokens == 0 for d in text.manifest.domains.values())
    assert "ranking stream" in capsys.readouterr().err


def test_profiles_written_before_the_ranking_still_load():
    old = {"domains": {"prose": {"samples": 4, "tokens": 256, "documents": 2, "heldout_documents": 1,
                                 "heldout_tokens": 256}}, "samples": 4, "tokens": 256, "max_tokens": 64}
    assert DataManifest.from_dict(old).domains["prose"].ranking_tokens == 0
    settings = {"seed": 0, "batch_size": 4, "heldout_tokens": 512, "context": 512, "head_layers": 1,
                "latency_context": 128}
    assert Settings.from_dict(settings).ranking_tokens == 0
    with pytest.raises(KeyError):
        Settings.from_dict({k: v for k, v in settings.items() if k != "seed"})


def test_the_ranking_setting_is_checked_and_keyed_only_where_it_acts(tmp_path):
    from tests.helpers import small_config

    with pytest.raises(ValueError, match="ranking_tokens"):
        small_config(tmp_path, ranking_tokens=-1)
    # Without the low-bit search nothing is ranked: the digest (and --resume, cached profiles) ignores it.
    assert small_config(tmp_path, ranking_tokens=0).key() == small_config(tmp_path, ranking_tokens=3072).key()
    low = [small_config(tmp_path, low_bit=True, ranking_tokens=n) for n in (0, 1024, 3072)]
    assert len({c.key() for c in low}) == 3
    assert [c.settings().ranking_tokens for c in low] == [0, 1024, 3072]
    assert small_config(tmp_path, ranking_tokens=3072).settings().ranking_tokens == 0


def test_a_ranking_block_naming_unknown_candidates_is_refused():
    from kvguard.profile import ProfileError, ProfileMeta

    log = _candidates([("a", 0.30, 0.01), ("b", 0.29, 0.02)])
    good = profile_meta(log[0].plan, search_log=tuple(log),
                        record={"ranking": {"tokens_per_domain": 512, "budgets": [
                            RankedBudget(0.75, 0.30, {"a": 0.02, "b": 0.01}).to_dict()]}}).to_json()
    assert ProfileMeta.from_json(good).ranked()[0].pick == "b"
    bad = dict(good, ranking={"budgets": [RankedBudget(0.75, 0.30, {"a": 0.02, "zz": 0.01}).to_dict()]})
    with pytest.raises(ProfileError, match="zz"):
        ProfileMeta.from_json(bad)
    with pytest.raises(ProfileError, match="'ranking'"):
        ProfileMeta.from_json(dict(good, ranking={"budgets": [{"share": 0.75}]}))


def test_kvguard_at_bytes_p99_takes_the_lowest_tail_of_the_whole_log():
    from kvguard.profile import PlanScore

    log = _candidates([("a", 0.300, 0.010), ("b", 0.290, 0.008), ("c", 0.280, 0.009), ("d", 0.200, 0.030)])
    tails = {"a": 0.05, "b": 0.09, "c": 0.04, "d": 0.50}  # "c" is off the mean's frontier but has the lowest tail
    log = [replace(c, quality=replace(c.quality, kl_p99=tails[c.name])) for c in log]
    meta = profile_meta(log[0].plan, search_log=tuple(log), pareto_front=("d", "b"))
    assert meta.frontier_pick(0.30).name == "b" and meta.frontier_pick(0.30, tail=True).name == "c"
    assert meta.frontier_pick(0.285, tail=True).name == "c" and meta.frontier_pick(0.25, tail=True).name == "d"
    assert meta.frontier_pick(0.1, tail=True) is None
    assert PlanScore.from_dict(log[2].quality.to_dict()) == log[2].quality  # the tail is saved with the score
    old = replace(meta, search_log=tuple(replace(c, quality=replace(c.quality, kl_p99=None)) for c in log))
    assert "kl_p99" not in old.search_log[0].quality.to_dict()
    with pytest.raises(ValueError, match="records no tail KL .* run kvguard calibrate again"):
        old.frontier_pick(0.3, tail=True)
