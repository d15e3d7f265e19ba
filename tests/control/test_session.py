"""The feedback loop on the real SmolLM2 and real text: what the monitor sees, recomputation, fault injection."""

import json
import threading

import pytest
import torch

from kvguard import data
from kvguard.architecture import Architecture
from kvguard.calibration import signals
from kvguard.calibration.kv_statistics import collect
from kvguard.config import CacheConfig, MonitorConfig
from kvguard.control.decoding import FinishReason
from kvguard.control.events import Event, StepRecord
from kvguard.control.policy import Action, Alarm
from kvguard.control.recompute import first_recomputable, recompute
from kvguard.control.session import LiveSession
from kvguard.plan import Plan
from kvguard.profile import Profile

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


def _recompute(session: LiveSession, layers, positions: torch.Tensor) -> int:
    """Recompute ``positions`` of ``layers`` in the session's cache from its tokens."""
    return recompute(session.model, session.cache, session.ids, layers, positions, session.arch.sliding_window)


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
    # Equal up to float rounding (streaming and the parallel pass accumulate differently across 30 layers). A
    # rounding can flip an INT4 bin, which moves one step's value by ~1e-2 (0.0148 measured on an AVX-512 CPU):
    # the mean is what shows a real disagreement.
    for live, simulated in ((session.monitor.entropies, sim.entropy), (session.monitor.werrs[..., 0], sim.werr_k),
                            (session.monitor.werrs[..., 1], sim.werr_v)):
        diff = (live - simulated).abs()
        assert float(diff.max()) < 3e-2 and float(diff.mean()) < 1e-3
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
    assert _recompute(session, list(range(arch.num_layers)), positions) == arch.num_layers * positions.numel()
    for layer, (k0, v0) in zip(session.cache.layers, before):
        k1, v1 = layer.materialize(torch.float32)
        assert (k1 - k0).abs().max() <= tolerance and (v1 - v0).abs().max() <= tolerance
    assert session.cache.layers[3].overlay_positions().tolist() == [5, 17, 40, 77]  # stored runs go to the overlay


def _corrupt_keys(cache, factor: float) -> int:
    """Scale every quantized key run by ``factor`` (what a bad scale write would do); returns the runs hit."""
    hit = 0
    for layer in cache.layers:
        for run in layer.store.runs:
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
    seen, steps = [], []
    session = LiveSession(model, Plan.uniform(arch, "int4", SMALL), baseline, sequence_id="fault",
                          events_path=events, on_event=seen.append, on_step=steps.append)
    logits = _greedy(session, session.prefill(data.token_stream("prose", "eval", tok, 200)), 24)
    before = len(session.events)
    assert session.level < 3
    corrupted_at = session.length
    assert _corrupt_keys(session.cache, 20.0) > 0
    _greedy(session, logits, 72)
    after = session.events[before:]
    assert all(isinstance(e, Event) for e in session.events)
    alarms = [e for e in after if e.alarm in (Alarm.WARNING, Alarm.TRIGGER, Alarm.SEVERE)]
    assert alarms and alarms[0].token - corrupted_at < 16
    rollbacks = (Action.ROLLBACK_INT8, Action.ROLLBACK_WIDEN, Action.ROLLBACK_FULL)
    ladder = [e.action for e in after if e.action in rollbacks]
    assert ladder[:3] == [Action.ROLLBACK_INT8, Action.ROLLBACK_WIDEN, Action.ROLLBACK_FULL]
    levels = [e.level for e in after if e.action in rollbacks]
    assert levels[:3] == [1, 2, 3]
    assert session.counters.full_rollbacks >= 1 and session.counters.max_level == 3
    lines = events.read_text().splitlines()
    assert len(lines) == len(session.events)
    logged = [json.loads(line) for line in lines]
    assert logged == [e.to_json() for e in session.events]  # the file holds every event, as to_json writes it
    assert seen == session.events  # on_event got every Event, in order
    assert all(isinstance(s, StepRecord) for s in steps) and len(steps) == session.counters.steps
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert sum(s.recomputed for s in steps) == session.counters.recomputed_positions > 0
    assert {"time", "sequence", "token", "layers", "entropy", "baseline", "drop", "risk", "action", "level",
            "positions", "ms"} <= set(logged[-1]) and logged[-1]["sequence"] == "fault"
    full = next(line for line in logged[before:] if line["action"] == "rollback_full_precision")
    assert full["alarm"] in ("severe", "nonfinite") and full["level"] == 3 and full["previous_level"] == 2
    # After the full rollback the cache is FP16: greedy tokens match an FP16 cache fed the same tokens.
    rolled = next(e.token for e in after if e.action is Action.ROLLBACK_FULL)
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
    first = first_recomputable(session.cache)
    assert first == session.cache.layers[0].offset + arch.sliding_window - 1 and 0 < first < 700
    before = [layer.materialize(torch.float32) for layer in session.cache.layers]
    _recompute(session, list(range(arch.num_layers)), torch.tensor([first, first + 5, 699]))
    for layer, (k0, v0) in zip(session.cache.layers, before):
        k1, v1 = layer.materialize(torch.float32)
        assert (k1 - k0).abs().max() <= 1e-3 and (v1 - v0).abs().max() <= 1e-3
    with pytest.raises(ValueError, match="sliding-window"):
        _recompute(session, [5], torch.tensor([first - 1]))


def test_two_sessions_on_two_threads_decode_exactly_as_they_do_alone(smollm2, small_profile_dir):
    """Two LiveSessions decoding different prompts at the same time through one model (each thread's attention
    hook is its own) produce exactly the tokens, and take exactly the actions, that each produces alone."""
    model, tok = smollm2
    profile = Profile.load(small_profile_dir, model)
    prompts = [data.token_stream("prose", "eval", tok, 120), data.token_stream("code", "eval", tok, 120)]
    assert not torch.equal(prompts[0], prompts[1])
    n = 32

    def trace(session: LiveSession) -> list:
        return [(e.token, e.alarm, e.action, e.level, e.layers, e.positions) for e in session.events]

    alone = []
    for prompt in prompts:
        session = LiveSession.from_profile(model, profile)
        out = session.generate(prompt, n)  # greedy
        assert out.finish_reason is FinishReason.LENGTH and len(out.tokens) == n
        assert session.length == len(prompt) + n - 1  # the last token is not fed back
        assert session.counters.steps > 0  # the monitor ran monitoring steps while decoding
        alone.append((out.tokens, trace(session), session.ids))
    assert alone[0][0] != alone[1][0]

    sessions = [LiveSession.from_profile(model, profile, sequence_id=str(i)) for i in range(2)]
    barrier = threading.Barrier(2, timeout=300)  # lock step: both threads are decoding the same token index at once
    results: dict[int, object] = {}

    def in_step(token: int) -> bool:
        barrier.wait()
        return False

    def run(i: int) -> None:
        try:
            results[i] = sessions[i].generate(prompts[i], n, on_token=in_step)
        except BaseException as err:  # reported by the main thread
            barrier.abort()
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads)
    for i, session in enumerate(sessions):
        out = results[i]
        assert not isinstance(out, BaseException), out
        tokens, events, ids = alone[i]
        assert out.tokens == tokens
        assert trace(session) == events and session.ids == ids


def test_a_session_that_ends_frees_its_cache_without_a_collection(smollm2, small_profile_dir):
    """A server's sessions decode in packed forwards under the loop, and their caches must go when the session
    does, not at the next full collection (minutes apart in a server): no reference cycle holds them."""
    import gc
    import weakref

    from kvguard import attention, packed

    model, tok = smollm2
    profile = Profile.load(small_profile_dir, model)
    prompt = data.token_stream("prose", "eval", tok, 100)
    gc.collect()
    gc.disable()
    try:
        sessions = [LiveSession.from_profile(model, profile, sequence_id=str(i)) for i in range(2)]
        attention.install(model)  # as the server does, once
        logits = packed.forward(model, [s.piece(prompt[:-1]) for s in sessions])
        for s in sessions:
            s.fed_prompt(prompt[:-1])
        tokens = [int(prompt[-1])] * 2
        for step in range(12):  # the prompt check, then monitoring steps
            logits = packed.forward(model, [s.piece(torch.tensor([t])) for s, t in zip(sessions, tokens)])
            for s, t in zip(sessions, tokens):
                s.fed_token(t, prompt=step == 0)
            tokens = [int(row.argmax()) for row in logits]
        assert all(s.counters.steps > 0 for s in sessions)  # the loop watched them
        refs = [weakref.ref(s.cache) for s in sessions]
        del sessions, s  # the loops' variable holds the last one
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
