"""The monitor's building blocks without a model: thresholds, the sequence reference, windows, alarms, ROC
AUC and the risk classifier; and its attention hook on a tiny random model, fused read against today's."""

import math

import pytest
import torch

from kvguard import attention, fused_attention
from kvguard.cache import KVGuardCache
from kvguard.calibration.monitor_fit import replay_alarms
from kvguard.calibration.signals import window_means
from kvguard.config import CacheConfig
from kvguard.config import MonitorConfig
from kvguard.control.monitor import TokenMonitor, _LiveHook, live_attention
from kvguard.control.recompute import ceil_fraction
from kvguard.entropy import EntropyBaseline, SequenceReference, baseline_ratio
from kvguard.metrics import roc_auc
from kvguard.risk import RiskClassifier


def test_config_defaults_are_specs_numbers_and_validate():
    cfg = MonitorConfig()
    assert MonitorConfig.from_dict({}) == cfg
    assert (cfg.window_tokens, cfg.refresh_tokens, cfg.warn_drop, cfg.trigger_drop, cfg.trigger_consecutive) == (32, 8, 0.20, 0.25, 3)
    assert (cfg.heavy_drop, cfg.heavy_layers, cfg.recompute_fraction, cfg.max_trigger_rate) == (0.35, 4, (0.02, 0.05), 0.05)
    assert MonitorConfig.from_dict(cfg.to_dict()) == cfg
    assert MonitorConfig.from_dict(cfg.to_dict(), warn_drop=0.3).warn_drop == 0.3
    # Keys this kvguard does not know are ignored: a newer kvguard's, and an older one's dead light_drop.
    assert MonitorConfig.from_dict({**cfg.to_dict(), "from_a_newer_kvguard": 1, "light_drop": 0.2}) == cfg
    with pytest.raises(ValueError, match="unknown monitor settings"):
        MonitorConfig.from_dict(cfg.to_dict(), warn=0.3)
    with pytest.raises(ValueError, match="recompute_fraction"):
        MonitorConfig(recompute_fraction=(0.05, 0.02))
    with pytest.raises(ValueError, match="warn_drop"):
        MonitorConfig(warn_drop=0.0)
    with pytest.raises(ValueError, match="hysteresis"):
        MonitorConfig(promote_risk=0.3, demote_risk=0.6)
    with pytest.raises(ValueError, match="demotion must be one of"):
        MonitorConfig(demotion="never")
    risk = MonitorConfig(demotion="risk")
    assert risk.to_dict()["demotion"] == "risk" and MonitorConfig.from_dict(risk.to_dict()) == risk


def test_sequence_reference_tracks_the_texts_level_and_flags_sudden_drops():
    ref = SequenceReference(2, tokens=16)
    # A text that runs 30 % below the calibrated baseline in layer 0: its first token looks like a drop...
    drops = [ref.drop(torch.tensor([0.7, 1.0])) for _ in range(40)]
    assert drops[0][0] == pytest.approx(0.3)
    # ...then the level follows the text, and steady tokens show no drop.
    assert drops[-1].abs().max() < 1e-6
    # A sudden halving stands out against the level.
    assert ref.drop(torch.tensor([0.35, 1.0]))[0] == pytest.approx(0.5, abs=1e-5)
    # Non-finite ratios are reported, not folded into the level.
    level = ref.level.clone()
    assert torch.isnan(ref.drop(torch.tensor([float("nan"), 1.0]))[0])
    assert torch.equal(ref.level[0], level[0])
    seq = torch.tensor([[0.7, 1.0]] * 5)
    whole = SequenceReference.drops(seq, 16)  # the same, over a whole sequence at once
    assert whole[0, 0] == pytest.approx(0.3) and whole[1:].abs().max() < 1e-6
    assert torch.equal(baseline_ratio(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0])), torch.tensor([1.0, 0.5]))


def test_window_means_end_at_every_refresh_point():
    x = torch.arange(20, dtype=torch.float32)
    w = window_means(x, window=4, stride=8)
    assert w.tolist() == [pytest.approx((4 + 5 + 6 + 7) / 4), pytest.approx((12 + 13 + 14 + 15) / 4)]
    early = window_means(x, window=32, stride=8)  # fewer tokens than the window: the mean so far
    assert early[0] == pytest.approx(3.5)


def test_alarms_follow_the_thresholds():
    cfg = MonitorConfig()
    drop = torch.zeros(64, 2)
    drop[40:48, 0] = 0.5  # layer 0: a sharp drop for 8 tokens; layer 1 quiet
    drop[45:48, 1] = 0.3  # layer 1: three tokens 30 % down at the end of step 6
    a = replay_alarms(drop, cfg, start=16)
    assert a["ends"].tolist() == [16, 24, 32, 40, 48, 56, 64]
    step = a["ends"].tolist().index(48)
    # Window mean over 32 tokens: 8 * 0.5 / 32 = 0.125 in layer 0 -> no warning, but the consecutive rule fires.
    assert not a["warning"][step].any()
    assert a["trigger"][step].tolist() == [True, True]
    assert not a["trigger"][step + 1].any()
    drop[16:48, 0] = 0.4
    a = replay_alarms(drop, cfg, start=16)
    assert a["severe"][step, 0] and a["warning"][step, 0] and not a["severe"][step, 1]


def test_roc_auc():
    assert roc_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), torch.tensor([0, 1, 0, 1])) == 0.5
    assert math.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


def test_risk_classifier_learns_and_round_trips():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 4, generator=g)
    y = (x[:, 2] + 0.3 * torch.randn(2000, generator=g)) > 1.5  # risk lives in feature 2, rare positives
    clf = RiskClassifier.fit(x, y, ("drop", "abs_drop", "werr_k", "werr_v"), 0.01)
    assert roc_auc(clf.predict(x), y) > 0.95
    assert abs(clf.weight[2]) > 5 * max(abs(clf.weight[0]), abs(clf.weight[1]), abs(clf.weight[3]))
    again = RiskClassifier.from_dict(clf.to_dict())
    assert torch.allclose(again.predict(x), clf.predict(x))
    const = RiskClassifier.fit(x, torch.zeros(2000, dtype=torch.bool), clf.features, 0.01)
    assert float(const.predict(x).max()) < 0.01
    with pytest.raises(ValueError, match="invalid risk classifier"):
        RiskClassifier.from_dict({"features": ["a"]})
    with pytest.raises(ValueError, match="finite"):
        RiskClassifier(("a",), (0.0,), (1.0,), (float("nan"),), 0.0, 0.01)


def _baseline(layers=2, heads=2):
    mean = torch.full((layers, heads, 17), float("nan"))
    mean[:, :, 3] = 2.0  # 8-15 keys
    return EntropyBaseline(mean, torch.zeros_like(mean), torch.ones_like(mean), torch.full((layers, heads), 0.9))


def test_token_monitor_records_drop_error_and_mass():
    cfg = MonitorConfig(window_tokens=4)
    mon = TokenMonitor(_baseline(), cfg, 2, sliding_window=None)
    probs = torch.full((1, 1, 2, 10), 0.1)  # uniform over 10 keys: entropy log 10 ~ 2.303 vs baseline 2.0
    error = torch.zeros(1, 10, 2)
    error[0, 3] = torch.tensor([0.5, 0.25])
    for layer in (0, 1):
        mon.observe(layer, probs, first=0, error=error)
    mon.end_token()
    drop, werr, entropy = mon.window()
    assert entropy[0] == pytest.approx(math.log(10), abs=1e-5)
    assert drop[0] == pytest.approx(1 - math.log(10) / 2.0, abs=1e-5)  # the first token is measured against the calibrated baseline
    assert werr[0].tolist() == [pytest.approx(0.05), pytest.approx(0.025)]
    assert mon.attention_mass(0, 10)[3] == pytest.approx(0.2)  # 2 query heads x 0.1
    # A collapsed attention row later drops sharply against the sequence's level, and runs count up.
    sharp = torch.zeros(1, 1, 2, 10)
    sharp[..., 0] = 1.0
    for _ in range(3):
        for layer in (0, 1):
            mon.observe(layer, sharp, first=0, error=error)
        mon.end_token()
    assert mon.consecutive.tolist() == [3, 3]
    nan = torch.full((1, 1, 2, 10), float("nan"))
    mon.observe(0, nan, 0, error)
    mon.observe(1, probs, 0, error)
    mon.end_token()
    assert bool(mon.nonfinite)
    assert mon.features().shape == (2, 4)
    assert ceil_fraction(0.02, 100) == 2 and ceil_fraction(0.02, 10) == 1 and ceil_fraction(0.02, 0) == 0


@pytest.mark.skipif(not fused_attention.available(), reason="fused kernels not built: make install")
def test_live_attention_reads_fused_and_records_the_same_evidence(monkeypatch):
    from tests.helpers import tiny_llama

    calls = []
    real = fused_attention.attend_with_probs
    monkeypatch.setattr(fused_attention, "attend_with_probs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_llama()
    config = CacheConfig(residual=4, sinks=2, group_size=4)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    results = []
    for fused in (False, True):
        cache = KVGuardCache(model.config, [("int4", "int2"), ("int3", "fp16")], config)
        for layer in cache.layers:
            layer.track_error = True
        mon = TokenMonitor(_baseline(), MonitorConfig(window_tokens=4), 2, sliding_window=None)
        hook = _LiveHook(mon, cache)
        model(input_ids=ids, cache=cache, use_cache=True)
        logits = []
        for token in (5, 9, 11, 3, 7, 2):
            reads = live_attention(model, mon, cache) if fused else attention.hooked(model, hook)
            with torch.no_grad(), reads:
                logits.append(model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits)
            mon.end_token()
        assert len(calls) == (12 if fused else 0)  # 6 steps x 2 layers
        results.append((torch.cat(logits), mon.entropies.clone(), mon.werrs.clone(), mon.attention_mass(1, 36)))
    for slow, fast in zip(*results):
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
