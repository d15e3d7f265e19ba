"""Qwen2.5-Coder-0.5B, the embedded model with key outliers (a large k_proj bias), on real text: few and short
tests, its whole workflow is measured in benchmarks/."""

import pytest

from kvguard import data
from kvguard.calibration import outliers
from kvguard.calibration.kv_statistics import collect_batch
from kvguard.evaluation import harness


@pytest.mark.slow
def test_calibration_statistics_find_the_key_outliers(qwen25):
    model, tok = qwen25
    ids = data.token_stream("code", "calib", tok, 256).view(1, -1)
    stats = collect_batch(model, ids).statistics.tensors()
    keys, values = outliers.find(stats, "key"), outliers.find(stats, "value")
    hit = [r for r in keys if r.channels]
    assert hit and max(r.ratio for r in hit) > 20  # huge next to their head's other channels
    assert sum(r.offsets for r in hit) > 0  # some are the bias: a constant offset, not spikes
    assert sum(len(r.channels) for r in keys) > 4 * sum(len(r.channels) for r in values)  # a key problem


@pytest.mark.slow
def test_per_channel_int4_survives_the_outliers_that_break_transformers_quantized_cache(qwen25):
    pytest.importorskip("optimum.quanto")
    model, tok = qwen25
    # quanto keeps the last 128 tokens unquantized: 384 tokens leave most of the history quantized. Chunks of 32
    # (prefill-like passes) instead of 384 decode steps: the same caches, a tenth of quanto's time.
    ids = data.token_stream("code", "eval", tok, 384)
    rows = {r.method: r for r in harness.evaluate_stream(model, ids, "code", ["int4", "hf-quanto-4"], chunk=32,
                                                         progress=False)}
    int4, quanto = rows["int4"], rows["hf-quanto-4"]
    assert int4.error is None and quanto.error is None
    assert int4.kl < 0.01 and int4.top1_agree > 0.95
    assert quanto.kl > 10 * int4.kl and quanto.ppl_delta_pct > 5 * max(int4.ppl_delta_pct, 0.5)
