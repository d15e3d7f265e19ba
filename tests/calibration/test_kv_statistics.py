"""K/V statistics: pooled aggregates by hand, and the recorded numbers equal the real model's K/V."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvguard import data
from kvguard.architecture import Architecture
from kvguard.config import CacheConfig
from kvguard.entropy import EntropyAccumulator
from kvguard.plan import LayerPlan, Plan, StaticScales
from kvguard.scoring import score_simulated, score_stream
from kvguard.calibration.kv_statistics import (BatchStatistics, KVStatistics, batches_by_length, collect, collect_batch,
                                              entropy_rows, merge)


def _history(means, stds, maxs):
    h = {}
    for kind in ("key", "value"):
        h[f"{kind}.mean"] = torch.tensor(means).view(-1, 1, 1, 1)
        h[f"{kind}.std"] = torch.tensor(stds).view(-1, 1, 1, 1)
        h[f"{kind}.max"] = torch.tensor(maxs).view(-1, 1, 1, 1)
        h[f"{kind}.min"] = -torch.tensor(maxs).view(-1, 1, 1, 1) * 2
        h[f"{kind}.absmax"] = torch.tensor(maxs).view(-1, 1, 1, 1) * 2
    return h


def test_aggregate_pools_batches_by_token_count():
    # Batch 1: 10 tokens, mean 1, std 0; batch 2: 30 tokens, mean 3, std 1.
    stats = KVStatistics(_history([1.0, 3.0], [0.0, 1.0], [1.0, 5.0]), torch.tensor([10, 30]))
    agg = stats.aggregate()
    # Pooled mean (10 * 1 + 30 * 3) / 40 = 2.5; E[x^2] = (10 * 1 + 30 * (1 + 9)) / 40 = 7.75; var 1.5.
    assert math.isclose(float(agg["key.mean"]), 2.5, rel_tol=1e-6)
    assert math.isclose(float(agg["value.std"]), math.sqrt(1.5), rel_tol=1e-6)
    assert float(agg["key.max"]) == 5.0 and float(agg["key.min"]) == -10.0 and float(agg["key.absmax"]) == 10.0
    again = KVStatistics.from_tensors(stats.tensors())
    assert torch.equal(again.tokens, stats.tokens)


def _batch(value: float, tokens: int, entropy: float) -> BatchStatistics:
    history = {k: v[:1] * value for k, v in _history([1.0], [0.5], [2.0]).items()}
    acc = EntropyAccumulator(1, 1)
    acc.add(0, torch.tensor([[[0.0, entropy]]]), torch.tensor([1, 2]))
    return BatchStatistics(KVStatistics(history, torch.tensor([tokens])), acc)


def test_merge_keeps_batches_in_order_and_adds_entropy_sums():
    stats, baseline = merge([_batch(1.0, 10, 0.5), _batch(3.0, 30, 0.25), _batch(2.0, 20, 1.0)])
    assert stats.tokens.tolist() == [10, 30, 20]
    assert stats.history["key.mean"].view(-1).tolist() == [1.0, 3.0, 2.0]
    assert stats.history["value.max"].view(-1).tolist() == [2.0, 6.0, 4.0]
    # Bin 1 (two keys) got 0.5, 0.25 and 1.0; bin 0 three zeros.
    assert baseline.count[0, 0, :2].tolist() == [3.0, 3.0]
    assert math.isclose(float(baseline.mean[0, 0, 1]), 1.75 / 3, rel_tol=1e-6)
    # Stacking shards of the history is the history of all batches.
    whole = KVStatistics.concat([stats, KVStatistics.concat([_batch(5.0, 5, 0.0).statistics])])
    assert whole.num_batches == 4 and whole.history["key.min"].view(-1).tolist() == [-4.0, -12.0, -8.0, -20.0]
    with pytest.raises(ValueError, match="no calibration batches"):
        merge([])


def test_batches_group_similar_lengths_without_padding():
    samples = [torch.arange(n) for n in (20, 5, 18, 6, 19)]
    batches = batches_by_length(samples, 2)
    assert [tuple(b.shape) for b in batches] == [(2, 19), (2, 6), (1, 5)]
    with pytest.raises(ValueError, match="batch_size"):
        batches_by_length(samples, 0)


@pytest.mark.slow
def test_recorded_statistics_are_the_models_keys_and_values(smollm2):
    model, tok = smollm2
    ids = torch.stack([s[:40] for s in data.samples("code", "calib", tok, n_samples=2, max_tokens=40)])
    stats, entropy = collect(model, [ids], progress=False)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        plain = model.base_model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
    for layer in (0, 17):
        k, v = cache.layers[layer].keys, cache.layers[layer].values  # [B, H_kv, T, D], after RoPE
        assert torch.allclose(stats.history["key.max"][0, layer], k.amax((0, 2)), atol=1e-4)
        assert torch.allclose(stats.history["value.mean"][0, layer], v.mean((0, 2)), atol=1e-5)
        assert torch.allclose(stats.history["key.std"][0, layer], k.std((0, 2), unbiased=False), atol=1e-4)
        assert torch.allclose(stats.history["value.absmax"][0, layer], v.abs().amax((0, 2)), atol=1e-4)
    # Every recorded query row (the first 16, then every 8th) of every layer and head was counted once.
    arch = Architecture.from_config(model.config)
    assert entropy_rows(40).tolist() == list(range(16)) + [16, 24, 32]
    assert entropy.count.sum().item() == 2 * 19 * arch.num_layers * arch.num_query_heads
    assert bool((entropy.normalized > 0).all()) and bool((entropy.normalized <= 1.0001).all())
    # The observing attention computes the same attention as the model's own.
    with torch.no_grad():
        from kvguard import attention
        from kvguard.calibration.kv_statistics import _Recorder, _RecordingHook

        recorder = _Recorder(arch, arch.num_query_heads)
        recorder.start_batch()
        with attention.hooked(model, _RecordingHook(recorder)):
            observed = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        recorder.end_batch(ids.numel())  # raises unless the hook saw every layer
    assert torch.allclose(observed, plain, atol=1e-4)
    assert torch.equal(recorder.statistics().history["key.max"], stats.history["key.max"])
    # A batch run one row per pass has the statistics of the batch in one pass (each row's keys and values
    # do not depend on the other rows).
    one_pass, by_row = collect_batch(model, ids, rows_per_pass=len(ids)), collect_batch(model, ids, rows_per_pass=1)
    for name, history in one_pass.statistics.history.items():
        assert torch.allclose(by_row.statistics.history[name], history, rtol=1e-6, atol=1e-7), name
    assert torch.allclose(by_row.entropy.sum, one_pass.entropy.sum, rtol=1e-6)
    assert torch.equal(by_row.entropy.count, one_pass.entropy.count)
    with pytest.raises(ValueError, match="rows_per_pass"):
        collect_batch(model, ids, rows_per_pass=0)


@pytest.mark.slow
def test_calibrated_int8_scales_simulate_like_the_real_cache(smollm2):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    batch = torch.stack([s[:64] for s in data.samples("prose", "calib", tok, n_samples=4, max_tokens=64) if s.numel() >= 64][:2])
    agg = collect(model, [batch], progress=False)[0].aggregate()
    # Deliberately tight ranges (half the observed absmax) so saturation shows and must match too.
    scales = StaticScales(agg["key.absmax"] * 0.5, agg["value.absmax"] * 0.5)
    plan = Plan(tuple(LayerPlan(("int8", "int4", "int8")) for _ in range(arch.num_layers)),
                CacheConfig(residual=16, sinks=4, group_size=16))
    ids = data.token_stream("prose", "eval", tok, 200)
    streamed = score_stream(model, ids, plan.make_cache(model.config, scales), chunk=1)
    simulated = score_simulated(model, ids, plan, scales=scales)
    dynamic = score_simulated(model, ids, plan)
    assert abs(simulated.perplexity / streamed.perplexity - 1) < 1e-3
    assert not math.isclose(simulated.perplexity, dynamic.perplexity, rel_tol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        plan.make_cache(model.config, StaticScales(agg["key.absmax"][:2], agg["value.absmax"][:2]))
