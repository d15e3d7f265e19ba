"""Keys stored before RoPE: the model's own RoPE rebuilt, and a cache layer that stores keys turned back."""

import inspect
from dataclasses import replace

import pytest
import torch

from kvguard import rotation
from kvguard.store import Format, Store
from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer
from kvguard.config import CacheConfig
from kvguard.precision import Precision
from kvguard.rope import Rope, rerope, unrope

D = 64
ROPE = Rope((10000.0, 1e6), D)


def _turned_keys(h: int, t: int, layer: int = 0, seed: int = 0) -> torch.Tensor:
    """Random keys ``[1, h, t, D]`` after RoPE (at positions ``0..t-1``)."""
    torch.manual_seed(seed)
    return rerope(torch.randn(1, h, t, D), *ROPE.tables(layer, 0, t))


def _stream(layer: KVGuardLayer, keys: torch.Tensor) -> torch.Tensor:
    """Feed ``keys`` (and keys as values) one token at a time; the materialized keys."""
    for t in range(keys.shape[2]):
        layer.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1])
    return layer.materialize(torch.float32)[0]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_tables_are_the_models_own_rotary_embedding(name, request):
    model, _ = request.getfixturevalue(name)
    rope = Rope.from_config(model.config)
    emb = model.model.rotary_emb
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    per_type = "layer_type" in inspect.signature(emb.forward).parameters  # Gemma 3: a base per layer type
    x, positions = torch.zeros(1, 3000, rope.head_dim), torch.arange(3000)[None]
    for i, kind in enumerate(types):
        cos, sin = emb(x, positions, kind) if per_type else emb(x, positions)
        mine = rope.tables(i, 0, 3000)
        assert torch.equal(cos[0], mine[0]) and torch.equal(sin[0], mine[1])
    assert len(set(rope.bases)) == (2 if per_type else 1)
    # a later stretch of positions is the same rows of the table
    assert torch.equal(rope.tables(0, 1000, 24)[0], rope.tables(0, 0, 1024)[0][1000:])


def test_unrope_undoes_rerope_and_keeps_every_pairs_length():
    x = torch.randn(2, 3, 50, D)
    cos, sin = ROPE.tables(1, 7, 50)
    turned = rerope(x, cos, sin)
    assert torch.allclose(unrope(turned, cos, sin), x, atol=1e-5)
    pairs = lambda y: y[..., :D // 2] ** 2 + y[..., D // 2:] ** 2  # noqa: E731 - channel i and i + D/2 turn together
    assert torch.allclose(pairs(turned), pairs(x), atol=1e-4)
    assert not torch.allclose(turned, x, atol=1e-2)


def test_other_rope_kinds_and_missing_parameters_are_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2)
    assert Rope.from_config(config).bases == (config.rope_parameters["rope_theta"],) * 2
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        Rope.from_config(config)
    with pytest.raises(ValueError, match="needs the model's RoPE"):
        KVGuardLayer("int4", CacheConfig(prerope_keys=True))
    with pytest.raises(ValueError, match="score_correction"):
        CacheConfig(prerope_keys=True, score_correction=True)


@pytest.mark.parametrize("rotate", [False, True])
def test_the_layer_stores_what_the_simulation_stores_exactly(rotate):
    """Streamed token by token, the keys a pre-RoPE layer reads back are, bit for bit, those of a store that takes
    the whole stream in one append, as the simulation does (heads below INT8 turned back, rotated or not; INT8 and
    FP16 heads as post-RoPE), and differ from the post-RoPE store."""
    tiers = (Precision.INT3, Precision.INT2, Precision.INT8, Precision.FP16)
    cfg = CacheConfig(residual=16, sinks=4, group_size=16, prerope_keys=True, fp_dtype="float32")
    keys = _turned_keys(len(tiers), 200, layer=1)
    layer = KVGuardLayer(tiers, cfg, 1, rope=ROPE)
    layer.set_rotation(rotate, False)
    read = _stream(layer, keys)
    whole = Store(cfg, 1, ROPE, Format(tiers, key_rotation=rotate))
    whole.initialize(keys)
    whole.append(keys, keys)
    assert whole.runs and whole.holds_prerope_keys()
    assert torch.equal(read, whole.read().materialize(torch.float32)[0])
    post = KVGuardLayer(tiers, replace(cfg, prerope_keys=False), 1)
    post.set_rotation(rotate, False)
    before = _stream(post, keys)
    low = slice(0, 2)  # the INT3 / INT2 heads are stored differently, the others the same
    assert not torch.allclose(read[:, low], before[:, low], atol=1e-3)
    assert torch.equal(read[:, 2:], before[:, 2:])


def test_int8_and_fp16_heads_are_the_same_with_the_flag():
    cfg = CacheConfig(residual=16, sinks=4, group_size=16)
    keys = _turned_keys(2, 120)
    layers = [KVGuardLayer(("int8", "fp16"), replace(cfg, prerope_keys=on), 0, rope=ROPE) for on in (False, True)]
    assert torch.equal(_stream(layers[0], keys), _stream(layers[1], keys))
    assert not layers[1].holds_prerope_keys()
    low = KVGuardLayer("int4", replace(cfg, prerope_keys=True), 0, rope=ROPE)
    _stream(low, keys)
    assert low.holds_prerope_keys()


def test_a_sliding_layer_turns_what_it_keeps_by_its_absolute_positions():
    """A sliding layer drops its oldest groups; what it keeps is turned back by the positions the tokens had."""
    cfg = CacheConfig(residual=16, sinks=4, group_size=16, prerope_keys=True, fp_dtype="float32")
    keys = _turned_keys(1, 300)
    layer = KVGuardSlidingLayer("int4", cfg, 0, sliding_window=64, rope=ROPE)
    read = _stream(layer, keys)
    full = _stream(KVGuardLayer("int4", cfg, 0, rope=ROPE), keys)
    assert layer.offset > 0 and read.shape[2] == 300 - layer.offset
    assert torch.equal(read, full[:, :, layer.offset:])
    # and read as stored: close to the keys, not to keys turned by other positions
    err = (read - keys[:, :, layer.offset:]).norm() / keys[:, :, layer.offset:].norm()
    assert err < 0.15


def test_the_simulation_stores_keys_before_rope_only_when_the_plan_says_so():
    """A tiny Llama: the flag moves the simulated logits of a plan below INT8 and leaves an INT8 / FP16 plan's bit
    for bit (those heads keep the post-RoPE store); a cache built from the plan turns keys by the model's RoPE."""
    from kvguard.architecture import Architecture
    from kvguard.plan import LayerPlan, Plan
    from kvguard.simulate import simulate_logits
    from tests.helpers import tiny_llama

    model = tiny_llama()
    arch = Architecture.from_config(model.config)
    cfg = CacheConfig(residual=8, sinks=2, group_size=16)
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1))

    def logits(tiers, on):
        plan = Plan(tuple(LayerPlan(tiers) for _ in range(arch.num_layers)), replace(cfg, prerope_keys=on))
        return simulate_logits(model, ids, plan)

    assert not torch.allclose(logits(("int2", "int3"), True), logits(("int2", "int3"), False), atol=1e-4)
    assert torch.equal(logits(("int8", "fp16"), True), logits(("int8", "fp16"), False))
    plan = Plan.uniform(arch, "int3", replace(cfg, prerope_keys=True))
    cache = plan.make_cache(model.config)
    assert all(layer.rope == Rope.from_config(model.config) for layer in cache.layers)
    assert plan.kv_bytes(model.config, 200) == Plan.uniform(arch, "int3", cfg).kv_bytes(model.config, 200)
    with pytest.raises(ValueError, match="rope_parameters"):
        plan.make_cache(arch)  # an Architecture alone does not say how the model turns its keys


def test_decoding_keys_before_rope_through_the_fused_kernels_equals_the_materializing_read(monkeypatch):
    """Through the decoder the runtime uses, a plan with keys before RoPE decodes the same with the fused reads on
    (every step through the kernels, which turn the keys as they read them) as with them off (up to summation
    order)."""
    from kvguard import fused_attention
    from kvguard.architecture import Architecture
    from kvguard.control.decoding import CacheDecoder
    from kvguard.plan import Plan
    from tests.helpers import tiny_llama

    model = tiny_llama()
    plan = Plan.uniform(Architecture.from_config(model.config), "int3",
                        CacheConfig(residual=8, sinks=2, group_size=16, prerope_keys=True))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2))

    if not fused_attention.available():
        pytest.skip("fused kernels not built: make install")
    calls = []
    # A read of keys stored before RoPE goes segment by segment through the kernels, any other in one pass.
    for name in ("attend_with_probs", "_attend_direct"):
        real = getattr(fused_attention, name)
        monkeypatch.setattr(fused_attention, name, lambda *a, real=real, **kw: calls.append(
            any(s.key_turn is not None for s in a[1].segments)) or real(*a, **kw))

    def decode(fused: bool) -> torch.Tensor:
        decoder = CacheDecoder(model, plan.make_cache(model.config), fused=fused)
        out = [decoder.prefill(ids[:8])] + [decoder.step(int(t)) for t in ids[8:]]
        assert all(layer.holds_prerope_keys() for layer in decoder.cache.layers)
        return torch.stack(out)

    fused = decode(True)
    steps = (ids.numel() - 8) * model.config.num_hidden_layers
    # every step fused; turned keys from the step a group leaves the window (token 26 of 40) on
    assert len(calls) == steps and calls[-1] and sum(calls) >= 10 * model.config.num_hidden_layers
    materialized = decode(False)
    assert len(calls) == steps
    assert torch.allclose(fused, materialized, atol=1e-4)
