"""The backing tier: exact restores, the byte cap and its eviction order, the layer lifecycle, and the loop
restoring instead of recomputing."""

import pytest
import torch

from kvguard.architecture import Architecture
from kvguard.backing import BackingConfig, BackingStore
from kvguard.cache import KVGuardCache
from kvguard.store import Store
from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer
from kvguard.config import CacheConfig, MonitorConfig
from kvguard.control.events import describe
from kvguard.control.recompute import restore_then_recompute
from kvguard.control.session import LiveSession
from kvguard.entropy import EntropyBaseline
from kvguard.plan import Plan
from tests.helpers import tiny_llama

SMALL = CacheConfig(residual=4, sinks=1, group_size=4)
ON = BackingConfig(enabled=True)


def _stream(layer, keys: torch.Tensor, values: torch.Tensor, chunks=(3, 5, 1, 7)) -> None:
    """Feed ``[B, H, T, D]`` K/V to ``layer`` in uneven chunks (cycling ``chunks``)."""
    t, i = 0, 0
    while t < keys.shape[-2]:
        n = chunks[i % len(chunks)]
        layer.update(keys[..., t:t + n, :], values[..., t:t + n, :])
        t, i = t + n, i + 1


def _kv(batch=1, heads=2, tokens=40, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tokens, dim, generator=g) * 3,
            torch.randn(batch, heads, tokens, dim, generator=g))


def _read(layer, positions: torch.Tensor):
    k, v = layer.materialize(layer.fp_dtype)
    idx = positions - layer.offset
    return k[..., idx, :], v[..., idx, :]


@pytest.mark.parametrize("precision", ["int8", "int4", "int2", ("int2", "fp16")])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("fp_dtype", ["float16", "model"])
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_restore_gives_back_the_originals_bit_for_bit(precision, rotate, fp_dtype, tier):
    config = CacheConfig(residual=4, sinks=1, group_size=4, fp_dtype=fp_dtype)
    store = BackingStore(BackingConfig(enabled=True, tier=tier))
    layer = KVGuardLayer(precision, config, 0, store)
    layer.set_rotation(rotate, rotate)
    keys, values = _kv(dim=16)
    _stream(layer, keys[..., :20, :], values[..., :20, :])
    layer.set_precision("int4" if precision != "int4" else "int2")  # a second run, another layout
    _stream(layer, keys[..., 20:, :], values[..., 20:, :])
    assert len(layer.store.runs) == 2
    pos = layer.quantized_positions()
    assert pos.numel() == 32 and layer.backed_positions().tolist() == pos.tolist()
    dtype = layer.fp_dtype
    want_k, want_v = keys[..., pos, :].to(dtype), values[..., pos, :].to(dtype)
    before_k, _ = _read(layer, pos)
    assert not torch.equal(before_k, want_k)  # the codes are not the originals
    assert layer.restore(pos).tolist() == pos.tolist()
    got_k, got_v = _read(layer, pos)
    assert got_k.dtype == dtype and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert layer.overlay_positions().tolist() == pos.tolist()


def test_a_sliding_layer_drops_the_originals_of_the_tokens_it_drops():
    layer = KVGuardSlidingLayer("int2", SMALL, 0, sliding_window=12, backing=BackingStore(ON))
    keys, values = _kv(tokens=60)
    _stream(layer, keys, values)
    assert layer.offset > 20  # it did drop old tokens
    held = layer.backed_positions()
    assert held.tolist() == layer.quantized_positions().tolist() and int(held.min()) >= layer.offset
    assert layer.restore(torch.arange(0, layer.offset)).numel() == 0  # dropped: missing, nothing written
    assert layer.restore(held).tolist() == held.tolist()
    got_k, got_v = _read(layer, held)
    assert torch.equal(got_k, keys[..., held, :].half()) and torch.equal(got_v, values[..., held, :].half())


def test_the_cap_holds_and_the_oldest_groups_go_first_whatever_their_layer():
    one = torch.ones(1, 1, 2, 1, dtype=torch.float16)  # a group of 2 tokens: 2 x 2 x 2 bytes (K and V)
    store = BackingStore(BackingConfig(enabled=True, max_bytes=20))  # room for 2 groups
    store.put(0, 0, one, one, group_size=2)
    store.put(1, 0, one, one, group_size=2)
    assert store.nbytes() == 16
    store.put(0, 2, one, one, group_size=2)  # over the cap: layer 0's [0, 2) was stored first
    assert store.positions(0).tolist() == [2, 3] and store.positions(1).tolist() == [0, 1]
    store.put(1, 2, 2 * one, 2 * one, group_size=2)
    assert store.positions(0).tolist() == [2, 3] and store.positions(1).tolist() == [2, 3]
    assert store.nbytes() == 16 <= 20 and store.evicted_tokens == 4
    found = store.restore(1, [1, 2, 3])
    assert found.positions.tolist() == [2, 3] and found.missing.tolist() == [1]
    assert torch.equal(found.keys, 2 * one)
    store.put(0, 4, torch.ones(1, 1, 6, 1, dtype=torch.float16), one.new_ones(1, 1, 6, 1), group_size=6)
    assert store.positions(0).tolist() == [2, 3]  # a 24-byte group is larger than the whole cap: not kept
    with pytest.raises(ValueError, match="ascending"):
        store.put(0, 0, one, one, group_size=2)
    with pytest.raises(ValueError, match="max_bytes"):
        BackingConfig(enabled=True, max_bytes=-1)


def test_backing_bytes_are_reported_apart_from_nbytes():
    model = tiny_llama()
    arch = Architecture.from_config(model.config)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = [KVGuardCache(model.config, "int2", SMALL, backing=b) for b in (None, BackingConfig(), ON)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, cache=cache, use_cache=True)
    off, disabled, on = caches
    quantized = on.layers[0].quantized_positions().numel()
    assert quantized == 24
    assert on.nbytes() == off.nbytes() == disabled.nbytes()  # the hot cache is unchanged
    assert off.backing_bytes() == disabled.backing_bytes() == 0 and disabled.backing is None
    assert off.restore(0, [5, 9]).numel() == 0  # nothing kept: everything is missing
    per_layer = quantized * arch.num_kv_heads * arch.head_dim * 2 * 2  # K and V, float16
    assert on.backing_bytes(0) == per_layer and on.backing_bytes() == arch.num_layers * per_layer
    on.reset()
    assert on.backing_bytes() == 0 and on.layers[0].backed_positions().numel() == 0


def test_batch_reorder_and_selection_keep_the_backing_aligned():
    layer = KVGuardLayer("int2", SMALL, 0, BackingStore(ON))
    keys, values = _kv(batch=3, tokens=24)
    _stream(layer, keys, values)
    pos = layer.quantized_positions()
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    found = layer.backing.restore(0, pos)
    assert torch.equal(found.keys, keys[[2, 0, 1]][..., pos, :].half())
    layer.batch_select_indices(torch.tensor([1]))  # now the original batch row 0
    layer.restore(pos)
    got_k, got_v = _read(layer, pos)
    assert got_k.shape[0] == 1 and torch.equal(got_k, keys[[0]][..., pos, :].half())
    assert torch.equal(got_v, values[[0]][..., pos, :].half())


def _record_stores(monkeypatch) -> dict:
    """Record what every layer's store quantizes: ``{layer: {position: (k [B, H, D], v)}}``."""
    seen: dict = {}
    encode = Store.encode

    def recording(self, run, keys, values, first, observe=None):
        for i in range(keys.shape[-2]):
            seen.setdefault(self.layer_idx, {})[first + i] = (keys[..., i, :].clone(), values[..., i, :].clone())
        encode(self, run, keys, values, first, observe)

    monkeypatch.setattr(Store, "encode", recording)
    return seen


def test_positions_missing_from_the_backing_are_recomputed(monkeypatch):
    seen = _record_stores(monkeypatch)
    model = tiny_llama()
    arch = Architecture.from_config(model.config)
    group = 4 * arch.num_kv_heads * arch.head_dim * 2 * 2  # bytes of one group of one layer
    cache = KVGuardCache(model.config, "int2", SMALL, backing=BackingConfig(enabled=True, max_bytes=4 * group))
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert cache.backing_bytes() == 4 * group  # 2 newest groups of each layer: positions 17..24
    assert cache.layers[0].backed_positions().tolist() == list(range(17, 25))
    positions = torch.tensor([2, 9, 18, 23])
    restored, recomputed = restore_then_recompute(model, cache, ids[0].tolist(), [0, 1], positions, None)
    assert (restored, recomputed) == (2 * 2, 2 * 2)
    for l, layer in enumerate(cache.layers):
        assert layer.overlay_positions().tolist() == positions.tolist()
        got_k, got_v = _read(layer, positions)
        for i, p in enumerate(positions.tolist()):
            k0, v0 = seen[l][p]
            exact = torch.equal(got_k[..., i, :], k0) and torch.equal(got_v[..., i, :], v0)
            if p >= 17:
                assert exact  # restored bit for bit
            elif l > 0:
                assert not exact  # recomputed against the quantized past (layer 0's K/V see no past)


def test_an_alarm_restores_the_original_kv(monkeypatch):
    """On a tiny random Llama (its attention swings enough to alarm within 20 tokens), the loop's first
    compensation puts the originals into the overlay and recomputes nothing."""
    seen = _record_stores(monkeypatch)
    model = tiny_llama(initializer_range=0.5)
    arch = Architecture.from_config(model.config)
    nan = torch.full((arch.num_layers, arch.num_query_heads, 17), float("nan"))
    baseline = EntropyBaseline(nan, nan, nan, torch.ones(arch.num_layers, arch.num_query_heads))
    plan = Plan.uniform(arch, "int2", CacheConfig(residual=8, sinks=2, group_size=8))
    events = []
    session = LiveSession(model, plan, baseline, backing=ON, on_event=events.append,
                          config=MonitorConfig(window_tokens=8, refresh_tokens=4, baseline_tokens=16))
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    for token in ids.tolist():
        session.step(token)
        if any(e.action.recomputes and e.positions for e in events):
            break
    acted = next(e for e in events if e.action.recomputes and e.positions)
    assert acted.restored == acted.positions * len(acted.layers) > 0
    summary = session.summary()
    assert summary["restored_positions"] == acted.restored and summary["recomputed_positions"] == 0
    assert summary["backing_bytes"] == session.cache.backing_bytes() > 0
    assert acted.to_json()["restored"] == acted.restored
    assert f"{acted.restored} (layer, position) pairs restored exactly" in describe(acted.to_json())
    for l in acted.layers:
        layer = session.cache.layers[l]
        pos = layer.overlay_positions()
        assert pos.numel() == acted.positions
        got_k, got_v = _read(layer, pos)
        for i, p in enumerate(pos.tolist()):
            assert torch.equal(got_k[..., i, :], seen[l][p][0]) and torch.equal(got_v[..., i, :], seen[l][p][1])


class _UniformMass:
    """A monitor stand-in: every position received the same attention mass."""

    def attention_mass(self, layer: int, end: int) -> torch.Tensor:
        return torch.ones(end)


def test_positions_whose_sliding_context_is_gone_are_restored_not_refused(monkeypatch):
    """A tiny random Gemma 3 (one sliding, one full layer): positions before ``first_recomputable`` cannot be
    recomputed, but the backing still holds them, so they are selected and restored exactly."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvguard.control.recompute import first_recomputable, select_positions

    seen = _record_stores(monkeypatch)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 128, (1, 44), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, backing in (("off", None), ("on", ON)):
        caches[name] = cache = KVGuardCache(model.config, "int2", SMALL, backing=backing)
        for layer in cache.layers:
            layer.track_error = True
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
    cache = caches["on"]
    first = first_recomputable(cache)
    sliding, full = cache.layers
    assert sliding.is_sliding and 0 < sliding.offset < first
    assert int(full.quantized_positions().max()) < first  # nothing quantized here can be recomputed
    assert select_positions(caches["off"], _UniformMass(), [1], 44, 1.0, 1.0).numel() == 0
    selected = select_positions(cache, _UniformMass(), [1], 44, 1.0, 1.0)
    assert selected.tolist() == full.quantized_positions().tolist() and int(selected.min()) < first
    assert restore_then_recompute(model, cache, ids[0].tolist(), [0, 1], selected, 12) == (
        selected.numel() + int((selected >= sliding.offset).sum()), 0)
    for l, layer in enumerate(cache.layers):
        pos = layer.overlay_positions()
        got_k, got_v = _read(layer, pos)
        for i, p in enumerate(pos.tolist()):
            assert torch.equal(got_k[..., i, :], seen[l][p][0]) and torch.equal(got_v[..., i, :], seen[l][p][1])


# ---------------------------------------------------------------- re-encoding history at a promoted tier
class _Risky:
    """A risk classifier stand-in: every layer at risk."""

    def predict(self, features):
        return torch.ones(features.shape[0])

@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("heads", [("int4", "int4"), ("int4", "fp16")])
def test_reencoded_history_equals_a_layer_that_stored_the_promoted_tiers_from_the_start(rotate, heads):
    """INT2 history re-encoded at the promoted tiers reads back bit for bit as if it had been stored so; the
    window, the sinks and the tokens stored afterwards are untouched, and the error evidence follows."""
    keys, values = _kv(dim=16, tokens=44)
    promoted = KVGuardLayer(("int2", "int2"), SMALL, 0, BackingStore(ON))
    direct = KVGuardLayer(heads, SMALL, 0)
    for layer in (promoted, direct):
        layer.set_rotation(rotate, rotate)
        layer.track_error = True
        _stream(layer, keys[..., :30, :], values[..., :30, :])
    before, counted = promoted.nbytes(), list(promoted.quantized_values)
    promoted.set_precision(heads)
    assert promoted.reencodable() == (1, 25)  # sinks 1, window 5 of 30 tokens
    assert promoted.reencode() == 24
    assert promoted.nbytes() == direct.nbytes() > before
    assert promoted.quantized_values == counted  # counted once, when first quantized
    for layer in (promoted, direct):
        _stream(layer, keys[..., 30:, :], values[..., 30:, :])
    got, want = promoted.materialize(torch.float32), direct.materialize(torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(promoted.error_evidence(), direct.error_evidence())


def test_reencoding_at_the_same_tiers_changes_nothing_and_the_overlay_still_wins():
    keys, values = _kv(dim=16, tokens=40)
    layer = KVGuardLayer("int2", SMALL, 0, BackingStore(ON))
    layer.track_error = True
    _stream(layer, keys, values)
    layer.restore(torch.tensor([9, 13]))
    k0, v0 = layer.materialize(torch.float32)
    err0 = layer.error_evidence().clone()
    bytes0 = layer.nbytes()
    assert layer.reencode() == 32
    k1, v1 = layer.materialize(torch.float32)
    assert torch.equal(k0, k1) and torch.equal(v0, v1) and layer.nbytes() == bytes0
    assert torch.equal(layer.error_evidence(), err0)  # overlay positions still read at full precision: 0
    assert float(err0[:, 9].abs().sum()) == 0.0 and float(err0[:, 10].abs().sum()) > 0


def test_reencoding_covers_what_the_backing_holds_and_respects_a_byte_limit():
    keys, values = _kv(dim=16, tokens=40)
    group = 4 * 2 * 16 * 2 * 2  # one group of 4 tokens, 2 heads, K and V, float16
    layer = KVGuardLayer("int2", SMALL, 0, BackingStore(BackingConfig(enabled=True, max_bytes=3 * group)))
    _stream(layer, keys, values)
    assert layer.reencodable() == (21, 33)  # the 3 newest groups; 1..20 were evicted
    layer.set_precision("int8")
    k_old, _ = layer.materialize(torch.float32)
    assert layer.reencode(max_extra_bytes=0) == 0  # INT8 costs more: refused, nothing changed
    assert torch.equal(layer.materialize(torch.float32)[0], k_old)
    assert layer.reencode() == 12
    k_new, _ = layer.materialize(torch.float32)
    idx = torch.arange(21, 33) - layer.offset
    assert torch.equal(k_new[..., :20, :], k_old[..., :20, :])  # evicted history keeps its INT2 codes
    err = lambda k: float((k[..., idx, :] - keys[..., 21:33, :]).abs().max())
    assert err(k_new) < err(k_old) / 10
    assert [run.length for run in layer.store.runs] == [20, 12]


def test_a_promotion_reencodes_the_history_within_the_saving_kept(monkeypatch):
    """The loop promotes a layer on risk; with a backing tier its history is stored again at the new tier, and
    the hot cache keeps ``min_saving_kept`` of the plan's saving: room for one layer here, not two."""
    from kvguard.control import session as session_mod
    from kvguard.control.policy import Action

    model = tiny_llama()
    arch = Architecture.from_config(model.config)
    nan = torch.full((arch.num_layers, arch.num_query_heads, 17), float("nan"))
    baseline = EntropyBaseline(nan, nan, nan, torch.ones(arch.num_layers, arch.num_query_heads))
    plan = Plan.uniform(arch, "int2", CacheConfig(residual=8, sinks=2, group_size=8))

    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for kept in (0.0, 0.9):
        events = []
        config = MonitorConfig(window_tokens=8, refresh_tokens=8, baseline_tokens=16, promote_steps=1,
                               warn_drop=1.0, trigger_drop=1.0, heavy_drop=1.0, min_saving_kept=kept)
        session = LiveSession(model, plan, baseline, backing=ON, classifier=_Risky(), config=config,
                              on_event=events.append)
        for token in ids:
            session.step(token)
        runs[kept] = session, events
    free, tight = runs[0.0][0], runs[0.9][0]
    up = [e for e in runs[0.0][1] if e.action is Action.PRECISION_UP]
    assert up and all(e.reencoded and e.reencoded > 0 for e in up)
    assert free.summary()["reencoded_positions"] == sum(e.reencoded for e in up)
    assert "positions of history re-encoded" in describe(up[0].to_json())
    for layer in free.cache.layers:  # every layer's whole history is INT4 now
        assert {p.layout.precision.value for run in layer.store.runs for p in run.parts} == {"int4"}
    plan_bytes, fp16 = plan.kv_bytes(model.config, len(ids))
    budget = fp16 - 0.9 * (fp16 - plan_bytes)
    # The budget is kept at monitoring steps by promotions and demotions; the restored positions' overlay (capped
    # apart, at 5 % of the positions) comes on top.
    overlay = sum(layer.overlay_nbytes() for layer in tight.cache.layers)
    assert tight.cache.nbytes() - overlay <= budget < free.cache.nbytes()
    assert 0 < tight.summary()["reencoded_positions"] < free.summary()["reencoded_positions"]
    down = [e for e in runs[0.9][1] if e.action is Action.PRECISION_DOWN]
    assert down and all(e.alarm.value == "memory_budget" for e in down)


def test_the_prompt_check_promotes_and_reencodes_a_prefilled_prompt_before_the_first_token():
    from kvguard.control.policy import Action

    model = tiny_llama()
    arch = Architecture.from_config(model.config)
    nan = torch.full((arch.num_layers, arch.num_query_heads, 65), float("nan"))
    baseline = EntropyBaseline(nan, nan, nan, torch.ones(arch.num_layers, arch.num_query_heads))
    plan = Plan.uniform(arch, "int2", CacheConfig(residual=8, sinks=2, group_size=8))
    events = []
    session = LiveSession(model, plan, baseline, backing=ON, classifier=_Risky(), on_event=events.append,
                          config=MonitorConfig(window_tokens=8, refresh_tokens=8, baseline_tokens=16, promote_steps=2,
                                                min_saving_kept=0.0))
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(2))
    logits = session.prefill(ids)
    assert logits.shape == (128,) and session.length == 50 and session.counters.steps == 1
    up = [e for e in events if e.action is Action.PRECISION_UP]
    assert [e.token for e in up] == [49, 49] and all(e.reencoded == 40 for e in up)  # positions 2..41
    assert all(p == ("int4",) * arch.num_kv_heads for p in session.state.tiers)
    # Without the loop the same prompt is one pass and no step.
    quiet = LiveSession(model, plan, baseline, backing=ON, classifier=_Risky(), monitor=False)
    torch.testing.assert_close(quiet.prefill(ids), logits, atol=1e-4, rtol=0)  # the check acts after the logits
    assert quiet.counters.steps == 0
    # The ablation: without the check the prompt's last token is an ordinary token, and no step is due yet.
    off = LiveSession(model, plan, baseline, backing=ON, classifier=_Risky(),
                      config=MonitorConfig(window_tokens=8, refresh_tokens=8, baseline_tokens=16, promote_steps=2,
                                           min_saving_kept=0.0, prompt_check=False))
    torch.testing.assert_close(off.prefill(ids), logits, atol=1e-4, rtol=0)
    assert off.counters.steps == 0 and off.state.tiers == off.state.floor


# ------------------------------------------------------------------------------------------------ the disk tier
def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_cpu_cache_keeps_its_originals_on_disk_not_in_its_resident_memory(tmp_path):
    """The default tier of a CPU cache is a file under the directory asked for: 64 MiB of originals written there
    leave the process's resident set where it was, its bytes count as disk, not RAM, and they read back exactly."""
    store = BackingStore(BackingConfig(enabled=True, max_bytes=2**30, directory=str(tmp_path)))
    g = torch.Generator().manual_seed(0)
    block = (torch.randn(4, 8, 1024, 64, generator=g).half(), torch.randn(4, 8, 1024, 64, generator=g).half())  # 8 MiB
    before = _rss()
    for i in range(8):
        store.put(0, 1024 * i, *block, group_size=32)
    grew = _rss() - before
    assert store.nbytes() == store.disk_nbytes() == 64 * 2**20 and store.ram_nbytes() == 0
    assert grew < 8 * 2**20, f"the disk tier grew the resident set by {grew / 2**20:.1f} MiB"
    found = store.restore(0, torch.arange(1024 * 5, 1024 * 5 + 40))
    assert torch.equal(found.keys, block[0][..., :40, :]) and torch.equal(found.values, block[1][..., :40, :])
    assert not list(tmp_path.iterdir())  # the file was unlinked when created: nothing is left behind


def test_a_host_tier_counts_as_ram(tmp_path):
    store = BackingStore(BackingConfig(enabled=True, tier="host"))
    keys, values = _kv(tokens=8)
    store.put(0, 0, keys.half(), values.half(), 4)
    assert store.ram_nbytes() == store.nbytes() == 2 * keys.numel() * 2 and store.disk_nbytes() == 0


def test_a_missing_or_read_only_directory_is_a_clear_error_when_the_cache_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KVGuardCache(tiny_llama().config, "int4", SMALL,
                     backing=BackingConfig(enabled=True, directory=str(tmp_path / "missing")))
    with pytest.raises(PermissionError, match="cannot write in '/sys'"):  # read-only even for root
        BackingStore(BackingConfig(enabled=True, tier="disk", directory="/sys"))
    with pytest.raises(ValueError, match="tier has to be one of"):
        BackingConfig(enabled=True, tier="tape")


def test_a_full_disk_stops_keeping_originals_and_the_loop_recomputes_instead(tmp_path, monkeypatch):
    """ENOSPC (injected: no test can fill a real disk here) warns once, keeps what was written, drops what
    comes after, and the loop's compensation recomputes the positions the tier does not hold."""
    import errno
    import os as os_module

    from kvguard import backing

    model = tiny_llama()
    cache = KVGuardCache(model.config, "int2", SMALL, backing=BackingConfig(enabled=True, directory=str(tmp_path)))
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :13], cache=cache, use_cache=True)
    held = cache.layers[0].backed_positions().tolist()
    assert held == list(range(1, 9))

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os_module.strerror(errno.ENOSPC))

    monkeypatch.setattr(backing.os, "pwritev", full)
    with pytest.warns(RuntimeWarning, match="disk is full"), torch.no_grad():
        model(input_ids=ids[:, 13:], cache=cache, use_cache=True)
    assert cache.backing.failure is not None and cache.backing.dropped_tokens > 0
    assert cache.layers[0].backed_positions().tolist() == held  # nothing lost, nothing new
    positions = torch.tensor([2, 18])
    restored, recomputed = restore_then_recompute(model, cache, ids[0].tolist(), [0, 1], positions, None)
    assert (restored, recomputed) == (2, 2)  # position 2 from disk in both layers, 18 recomputed

