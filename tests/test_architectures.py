"""kvguard on every common decoder family, each a small random model built offline from its config.

Llama and Gemma 3 (tested on real weights elsewhere) are here for reference; Qwen2 has biased Q/K/V projections
and sliding layers above its first, Qwen3 normalises Q and K before RoPE, Mistral and Phi-3 (fused qkv
projection) slide every layer without naming layer types, Gemma 2 alternates sliding and global layers and
soft-caps both its attention logits and its final logits. Each model gets a 16-token sliding window and
sequences of up to 64 tokens, a cache window, sinks and group small enough that most reads are quantized, and
weights 5x transformers' default scale (``initializer_range`` 0.1), so that attention scores are a few units
as in trained models, not ~0.1: large enough for quantization error and soft-capping to show.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvguard.architecture import Architecture
from kvguard.cache import KVGuardCache
from kvguard.calibration import signals
from kvguard.calibration.kv_statistics import collect, entropy_rows
from kvguard.config import CacheConfig, MonitorConfig
from kvguard.control.recompute import first_recomputable, recompute
from kvguard.control.session import LiveSession
from kvguard.plan import LayerPlan, Plan
from kvguard.simulate import simulate_logit_slices, simulate_logits

WINDOW = 16
SMALL = CacheConfig(residual=8, sinks=2, group_size=8)
EXACT = CacheConfig(residual=8, sinks=2, group_size=8, fp_dtype="model")  # bit-exact FP storage
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1)
# model_type -> what its config needs for a 16-wide head and a sliding window the sequences run past.
FAMILIES = {
    "llama": dict(head_dim=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full
    "qwen3": dict(head_dim=16),
    "mistral": dict(head_dim=16, sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),  # head_dim = hidden / heads = 16
    # Caps below Gemma 2's real 50 / 30, so that this model's scores reach the tanh's bend (see the test below).
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
# Layer types each family must come out with, so a config change that silently drops the window shows.
LAYER_TYPES = {
    "llama": ("full_attention",) * 3,
    "qwen2": ("full_attention", "sliding_attention", "sliding_attention"),
    "qwen3": ("full_attention",) * 3,
    "mistral": ("sliding_attention",) * 3,
    "phi3": ("sliding_attention",) * 3,
    "gemma2": ("sliding_attention", "full_attention", "sliding_attention"),
    "gemma3_text": ("sliding_attention", "sliding_attention", "full_attention"),
}


def build(model_type: str, **overrides):
    """The family's small random causal LM (seed 0), in its default attention implementation."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model's matmuls are too small to split: on 2 cores shared with other work, two torch threads run
    these tests ~20x slower than one, with the same results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return build(request.param)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, cache, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``prompt`` ``[T]``, then decode greedily one token at a time: the tokens and the logits
    ``[new_tokens, vocab]`` each was chosen from."""
    logits = model(input_ids=prompt.view(1, -1), cache=cache, use_cache=True).logits[0, -1]
    tokens, seen = [], []
    for _ in range(new_tokens):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return tokens, torch.stack(seen)


@torch.no_grad()
def _teacher_forced(model, ids: torch.Tensor, cache, prefill: int) -> torch.Tensor:
    """Logits ``[T - prefill + 1, vocab]`` of positions ``prefill - 1 .. T - 1``: ``prefill`` tokens in one pass,
    then the rest one at a time."""
    out = [model(input_ids=ids[:prefill].view(1, -1), cache=cache, use_cache=True).logits[0, -1]]
    for t in range(prefill, ids.numel()):
        out.append(model(input_ids=ids[t:t + 1].view(1, -1), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


def _mixed_plan(arch: Architecture) -> Plan:
    """A different tier on each (layer, KV head), every tier from INT2 to FP16, clipped keys on layer 0."""
    cycle = ["int2", "int4", "int8", "fp16"]
    return Plan(tuple(LayerPlan(tuple(cycle[(i + h) % 4] for h in range(arch.num_kv_heads)),
                                key_clip=0.95 if i == 0 else 1.0) for i in range(arch.num_layers)), SMALL)


def test_architecture_reads_each_familys_layers(model):
    arch = Architecture.from_config(model.config)
    assert arch.layer_types == LAYER_TYPES[model.config.model_type]
    assert arch.sliding_window == (WINDOW if arch.sliding_layers else None)
    assert (arch.num_layers, arch.num_query_heads, arch.num_kv_heads, arch.head_dim) == (3, 4, 2, 16)
    # The cache's layers slide where transformers' own DynamicCache's do.
    reference = DynamicCache(config=model.config)
    assert KVGuardCache(model.config, "int4").is_sliding == reference.is_sliding == [
        t == "sliding_attention" for t in LAYER_TYPES[model.config.model_type]]


def test_fp16_greedy_decoding_equals_dynamic_cache(model):
    """40 prompt tokens and 24 decoded ones, past the 16-token window in prefill and in decoding."""
    prompt = _ids(40)
    expected, expected_logits = _greedy(model, prompt, DynamicCache(config=model.config), 24)
    cache = KVGuardCache(model.config, "fp16", EXACT)
    got, logits = _greedy(model, prompt, cache, 24)
    assert got == expected
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    # Not vacuous where a random model repeats one token (Gemma's do): every step's logits follow the context.
    assert float((logits[1:] - logits[:-1]).abs().amax(-1).min()) > 1e-3
    for layer in cache.layers:
        if layer.is_sliding:
            # Whole groups leave a sliding layer: it still holds tokens out of the window, which the
            # sliding-window mask built from get_mask_sizes must hide for the tokens above to match.
            assert layer.offset > 0 and layer.stored_tokens > WINDOW - 1
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        assert float(logits.abs().max()) <= softcap


@torch.no_grad()
def test_fp16_chunked_prefill_and_left_padded_batches_equal_dynamic_cache(model):
    """Chunks of 12 queries over a 16-token window (each chunk's first query reaches back past what the sliding
    layers' mask offset starts at), and a batch with one row left-padded by 10 tokens."""
    ids = _ids(64, seed=8).view(1, -1)
    expected, cache = DynamicCache(config=model.config), KVGuardCache(model.config, "fp16", EXACT)
    for i in range(0, 64, 12):
        want = model(input_ids=ids[:, i:i + 12], cache=expected, use_cache=True).logits
        got = model(input_ids=ids[:, i:i + 12], cache=cache, use_cache=True).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    batch = _ids(80, seed=9).view(2, 40)
    mask = torch.ones_like(batch)
    batch[0, :10], mask[0, :10] = COMMON["pad_token_id"], 0
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    want = model.generate(batch, past_key_values=DynamicCache(config=model.config), **settings)
    got = model.generate(batch, past_key_values=KVGuardCache(model.config, "fp16", EXACT), **settings)
    assert torch.equal(got, want) and got.shape == (2, 48)


def test_int8_agrees_with_fp16(model):
    """Teacher-forced over 57 positions, 8-token prefill: most reads see INT8 keys and values. INT8's error is
    ~0.4 % of a group's range; a random model's top-2 logits can lie closer than that, so the floor is 0.9, not
    the 0.99 SmolLM2 reaches on real text (tests/test_cache.py)."""
    ids = _ids(64, seed=2)
    fp = _teacher_forced(model, ids, KVGuardCache(model.config, "fp16", SMALL), 8)
    int8 = KVGuardCache(model.config, "int8", SMALL)
    q = _teacher_forced(model, ids, int8, 8)
    assert all(layer.quantized_positions().numel() > 0 for layer in int8.layers)  # groups were quantized
    assert not torch.equal(q, fp)
    agreement = float((q.argmax(-1) == fp.argmax(-1)).float().mean())
    assert agreement >= 0.9


def test_simulation_equals_streaming_through_the_cache(model):
    arch = Architecture.from_config(model.config)
    plan = _mixed_plan(arch)
    ids = _ids(64, seed=3)
    streamed = _teacher_forced(model, ids, plan.make_cache(model.config), 1)[:-1]  # predicting tokens 1..63
    simulated = simulate_logits(model, ids[:-1], plan)
    assert simulated.shape == streamed.shape == (63, COMMON["vocab_size"])
    # Not bit-exact: the simulation's attention arithmetic differs from the model's by float rounding, which
    # can move a value across a quantization bin (tests/test_simulate.py has the contract on real models).
    assert float((simulated - streamed).abs().max()) < 1e-3
    # The head a slice at a time (kvguard eval's long texts) gives the same logits, final soft-capping included.
    sliced = torch.cat([s.clone() for s in simulate_logit_slices(model, ids[:-1], plan, rows=20)])
    assert float((sliced - simulated).abs().max()) < 1e-5
    fp = simulate_logits(model, ids[:-1], Plan.uniform(arch, "fp16", SMALL))
    assert float((fp - simulated).abs().max()) > 1e-2  # the plan's quantization is visible


@pytest.fixture(scope="module")
def baseline(model):
    """An FP16 attention-entropy baseline from one 2 x 64 batch of the model's statistics."""
    return collect(model, [_ids(128, seed=4).view(2, 64)], progress=False)[1]


def test_live_monitor_sees_what_the_simulation_computes(model, baseline):
    arch = Architecture.from_config(model.config)
    plan = Plan.uniform(arch, "int4", EXACT)  # float16 storage would let rounding flips of ~1e-6 show as ~1e-4
    ids = _ids(49, seed=5)
    quiet = MonitorConfig(window_tokens=48, refresh_tokens=10_000)  # records every token, never acts
    session = LiveSession(model, plan, baseline, config=quiet)
    logits = torch.stack([session.step(token) for token in ids[:-1].tolist()])
    # What the monitored attention computes is the model's own attention through the same cache.
    own = _teacher_forced(model, ids[:-1], plan.make_cache(model.config), 1)
    assert float((logits - own).abs().max()) < 5e-4
    entropies = session.monitor.entropies
    assert entropies.shape == (48, arch.num_layers)
    assert bool(torch.isfinite(entropies).all()) and float(entropies[8:].min()) > 0
    simulated = signals.record(model, ids, plan)
    torch.testing.assert_close(entropies, simulated.entropy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(session.monitor.werrs[..., 0], simulated.werr_k, atol=1e-4, rtol=1e-4)
    assert bool((simulated.werr_k[-1] > 0).all())  # late queries read quantized keys in every layer


def test_recomputation_reproduces_an_fp16_cache(model):
    """K/V recomputed through the recompute hook equal those the model's own attention stored."""
    arch = Architecture.from_config(model.config)
    ids = _ids(48, seed=6)
    cache = Plan.uniform(arch, "fp16", EXACT).make_cache(model.config)
    with torch.no_grad():
        model(input_ids=ids.view(1, -1), cache=cache, use_cache=True)
    first = first_recomputable(cache)
    assert first == (WINDOW - 1 + cache.layers[arch.sliding_layers[0]].offset if arch.sliding_layers else 0)
    positions = torch.tensor([first, (first + 47) // 2, 47])
    before = [layer.materialize(torch.float32) for layer in cache.layers]
    layers = list(range(arch.num_layers))
    assert recompute(model, cache, ids.tolist(), layers, positions, arch.sliding_window) == 3 * arch.num_layers
    for layer, (k0, v0) in zip(cache.layers, before):
        k1, v1 = layer.materialize(torch.float32)
        assert float((k1 - k0).abs().max()) < 1e-4 and float((v1 - v0).abs().max()) < 1e-4


def test_statistics_are_the_models_keys_and_values(model):
    ids = _ids(80, seed=7).view(2, 40)
    stats, entropy = collect(model, [ids], progress=False)
    cache = DynamicCache()  # no config: full layers that keep every token's K/V
    with torch.no_grad():
        model.base_model(input_ids=ids, cache=cache, use_cache=True)
    arch = Architecture.from_config(model.config)
    for layer in range(arch.num_layers):
        k, v = cache.layers[layer].keys, cache.layers[layer].values  # [B, H_kv, T, D], after RoPE
        torch.testing.assert_close(stats.history["key.max"][0, layer], k.amax((0, 2)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.history["value.mean"][0, layer], v.mean((0, 2)), atol=1e-5, rtol=1e-5)
    rows = entropy_rows(40).numel()
    assert entropy.count.sum().item() == 2 * rows * arch.num_layers * arch.num_query_heads
    assert bool(torch.isfinite(entropy.normalized).all())


def test_gemma2_soft_capping_changes_what_every_check_above_compares():
    """Without its attention soft-cap the same Gemma 2 computes visibly different logits, so the exact
    comparisons above (model vs the simulation, monitor, recompute and statistics hooks) would fail in any
    hook that left the cap out."""
    ids = _ids(40).view(1, -1)
    with torch.no_grad():
        capped = build("gemma2")(input_ids=ids).logits
        uncapped = build("gemma2", attn_logit_softcapping=None)(input_ids=ids).logits
    assert float((capped - uncapped).abs().max()) > 1e-2


def test_a_layer_type_no_cache_stores_is_refused_by_model_type():
    """Qwen3-Next's linear-attention layers hold a recurrent state, not keys and values."""
    config = AutoConfig.for_model("qwen3_next", **COMMON, layer_types=["linear_attention", "full_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"qwen3_next: layer 0 has type 'linear_attention'.*supported layer types"):
        KVGuardCache(config, "int4")
