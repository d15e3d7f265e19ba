"""The feedback loop on the real SmolLM2 and real text: what the monitor sees, recomputation, fault injection."""

import pytest
import torch

from kvguard import data, signals
from kvguard.config import CacheConfig
from kvguard.live import LiveSession
from kvguard.models import Architecture
from kvguard.monitor import MonitorConfig
from kvguard.plan import Plan
from kvguard.statistics import collect

pytestmark = pytest.mark.slow

SMALL = CacheConfig(residual=32, sinks=4, group_size=32)


@pytest.fixture(scope="module")
def baseline(smollm2):
    """An FP16 entropy baseline from two calibration-split batches (the real calibration uses thousands)."""
    model, tok = smollm2
    ids = data.token_stream("prose", "calib", tok, 1024)
    return collect(model, [ids.view(2, 512)], progress=False)[1]


def _greedy(session: LiveSession, logits: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens through the session; returns the last logits."""
    for _ in range(n):
        logits = session.step(int(logits.argmax()))
    return logits


def test_the_monitor_sees_what_the_simulation_computes(smollm2, baseline):
    """Entropy and weighted quantization error recorded while decoding equal the exact simulation's."""
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    plan = Plan.uniform(arch, "int4", SMALL)
    ids = data.token_stream("prose", "eval", tok, 161)
    quiet = MonitorConfig(window_tokens=160, refresh_tokens=10_000)  # records everything, never acts
    session = LiveSession(model, plan, baseline, config=quiet)
    for token in ids[:-1].tolist():
        session.step(token)
    sim = signals.record(model, ids, plan)
    assert sim.entropy.shape == (160, arch.num_layers)
    # Equal up to float rounding (streaming and the parallel pass accumulate differently across 30 layers).
    for live, simulated in ((session.monitor.entropies, sim.entropy), (session.monitor.werrs[..., 0], sim.werr_k),
                            (session.monitor.werrs[..., 1], sim.werr_v)):
        diff = (live - simulated).abs()
        assert float(diff.max()) < 1e-2 and float(diff.mean()) < 1e-3
    assert float(sim.werr_k[-1].mean()) > 0.01  # late queries do read quantized keys
    assert float(sim.werr_k[:60].abs().max()) == 0.0  # nothing quantized yet in the first 68 tokens
    assert session.counters.steps == 0 and not session.events
    assert sim.kl.shape == (160,) and float(sim.kl[100:].mean()) > 0


@pytest.mark.parametrize("fp_dtype,tolerance", [("model", 1e-3), ("float16", 2e-2)])
def test_recomputing_an_fp16_cache_reproduces_it(smollm2, baseline, fp_dtype, tolerance):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    plan = Plan.uniform(arch, "fp16", CacheConfig(residual=32, sinks=4, group_size=32, fp_dtype=fp_dtype))
    session = LiveSession(model, plan, baseline, config=MonitorConfig(refresh_tokens=10_000))
    session.prefill(data.token_stream("code", "eval", tok, 150))
    before = [layer.materialize(torch.float32) for layer in session.cache.layers]
    positions = torch.tensor([0, 5, 17, 40, 77, 100, 149])  # sinks, stored runs, window
    assert session.recompute(list(range(arch.num_layers)), positions) == arch.num_layers * positions.numel()
    for layer, (k0, v0) in zip(session.cache.layers, before):
        k1, v1 = layer.materialize(torch.float32)
        assert (k1 - k0).abs().max() <= tolerance and (v1 - v0).abs().max() <= tolerance
    assert session.cache.layers[3].overlay_positions().tolist() == [5, 17, 40, 77]  # stored runs go to the overlay


def _corrupt_keys(cache, factor: float) -> int:
    """Scale every quantized key run by ``factor`` (what a bad scale write would do); returns the runs hit."""
    hit = 0
    for layer in cache.layers:
        for run in layer._runs:
            for part in run.parts:
                if part.layout.key_spec is not None:
                    part.keys.scale.mul_(factor)
                    if part.keys.zero_point is not None:
                        part.keys.zero_point.mul_(factor)
                    hit += 1
    return hit


def test_fault_injection_alarms_escalates_and_rolls_back_to_fp16(smollm2, baseline, tmp_path):
    model, tok = smollm2
    arch = Architecture.from_config(model.config)
    events = tmp_path / "events.jsonl"
    session = LiveSession(model, Plan.uniform(arch, "int4", SMALL), baseline, sequence_id="fault",
                          events_path=events)
    logits = _greedy(session, session.prefill(data.token_stream("prose", "eval", tok, 200)), 24)
    before = len(session.events)
    assert session.level < 3
    corrupted_at = session.length
    assert _corrupt_keys(session.cache, 20.0) > 0
    _greedy(session, logits, 72)
    after = session.events[before:]
    alarms = [e for e in after if e["alarm"] in ("warning", "trigger", "severe")]
    assert alarms and alarms[0]["token"] - corrupted_at < 16
    ladder = [e["action"] for e in after if e["action"].startswith("rollback")]
    assert ladder[:3] == ["rollback_int8_double_recompute", "rollback_widen_recompute_all_layers", "rollback_full_precision"]
    levels = [e["level"] for e in after if e["action"].startswith("rollback")]
    assert levels[:3] == [1, 2, 3]
    lines = events.read_text().splitlines()
    assert len(lines) == len(session.events)
    import json

    logged = [json.loads(line) for line in lines]
    assert {"time", "sequence", "token", "layers", "entropy", "baseline", "drop", "risk", "action", "level",
            "positions", "ms"} <= set(logged[-1]) and logged[-1]["sequence"] == "fault"
    # After the full rollback the cache is FP16: greedy tokens match an FP16 cache fed the same tokens.
    rolled = next(e["token"] for e in after if e["action"] == "rollback_full_precision")
    assert session.rolled_back_at == rolled + 1
    assert all(p == "fp16" for layer in session.summary()["precisions"] for p in layer)
    prefix = torch.tensor(session.ids[:rolled + 2])
    generated = session.ids[rolled + 2:]
    assert len(generated) >= 16
    ref_cache = Plan.uniform(arch, "fp16").make_cache(model.config)
    with torch.no_grad():
        ref_logits = model(input_ids=prefix.view(1, -1), cache=ref_cache, use_cache=True).logits[0, -1]
        ref = []
        for _ in range(len(generated)):
            token = int(ref_logits.argmax())
            ref.append(token)
            ref_logits = model(input_ids=torch.tensor([[token]]), cache=ref_cache, use_cache=True).logits[0, -1]
    assert generated == ref[:len(generated)]
    assert session.recompute_fraction() > 0.5


def test_recomputation_respects_what_sliding_layers_still_hold(gemma3):
    """Gemma 3: positions whose sliding-window context is still stored reproduce an FP16 cache; older ones
    are refused (their recomputed K/V would be wrong above the first sliding layer)."""
    model, tok = gemma3
    from kvguard.entropy import EntropyBaseline

    arch = Architecture.from_config(model.config)
    nan = torch.full((arch.num_layers, arch.num_query_heads, 17), float("nan"))
    baseline = EntropyBaseline(nan, nan, nan, torch.ones(arch.num_layers, arch.num_query_heads))
    plan = Plan.uniform(arch, "fp16", CacheConfig(residual=32, sinks=4, group_size=32, fp_dtype="model"))
    session = LiveSession(model, plan, baseline, config=MonitorConfig(refresh_tokens=10_000))
    session.prefill(data.token_stream("code", "eval", tok, 700))
    first = session.first_recomputable()
    assert first == session.cache.layers[0].offset + arch.sliding_window - 1 and 0 < first < 700
    before = [layer.materialize(torch.float32) for layer in session.cache.layers]
    session.recompute(list(range(arch.num_layers)), torch.tensor([first, first + 5, 699]))
    for layer, (k0, v0) in zip(session.cache.layers, before):
        k1, v1 = layer.materialize(torch.float32)
        assert (k1 - k0).abs().max() <= 1e-3 and (v1 - v0).abs().max() <= 1e-3
    with pytest.raises(ValueError, match="sliding-window"):
        session.recompute([5], torch.tensor([first - 1]))
