"""Unit tests of one cache layer on synthetic K/V (fast, no model)."""

from dataclasses import replace

import pytest
import torch

from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer
from kvguard.config import WINDOW_HEADROOM, CacheConfig
from kvguard.quantizer import Axis, QuantSpec, quantize

B, H, D = 2, 3, 16
CFG = CacheConfig(residual=8, sinks=2, group_size=4, fp_dtype="float32")


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)


def feed(layer: KVGuardLayer, keys: torch.Tensor, values: torch.Tensor, chunk: int) -> None:
    for start in range(0, keys.shape[-2], chunk):
        layer.update(keys[..., start:start + chunk, :], values[..., start:start + chunk, :])


def expected_layout(keys, values, cfg, precision="int4", value_precision=None):
    """Reference: sinks exact, whole groups past the window quantized per block, window exact (values at
    ``value_precision`` when given)."""
    n = keys.shape[-2]
    quantized = (n - cfg.sinks - cfg.residual) // cfg.group_size * cfg.group_size
    start, end = cfg.sinks, cfg.sinks + max(quantized, 0)
    k, v = keys.clone(), values.clone()
    if end > start:
        ks, vs = QuantSpec(precision, Axis.CHANNEL, cfg.group_size), QuantSpec(value_precision or precision, Axis.TOKEN, cfg.value_group)
        for g0 in range(start, end, cfg.group_size):
            sl = slice(g0, g0 + cfg.group_size)
            k[..., sl, :] = quantize(keys[..., sl, :], ks).dequantize()
            v[..., sl, :] = quantize(values[..., sl, :], vs).dequantize()
    return k, v, end


@pytest.mark.parametrize("precision", ["int4", "int3"])
@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_layout_matches_reference_for_any_chunking(chunk, precision):
    keys, values = kv(50, 0)
    layer = KVGuardLayer(precision, CFG)
    feed(layer, keys, values, chunk)
    exp_k, exp_v, q_end = expected_layout(keys, values, CFG, precision)
    got_k, got_v = layer.materialize(torch.float32)
    torch.testing.assert_close(got_k, exp_k, atol=0, rtol=0)
    torch.testing.assert_close(got_v, exp_v, atol=0, rtol=0)
    window = 50 - q_end
    assert CFG.residual <= window < CFG.residual + CFG.group_size
    assert layer.quantized_positions().tolist() == list(range(CFG.sinks, q_end))


def test_values_take_their_own_group_and_only_the_scales_thin():
    """``value_group_size``: values scale per 16 channels while keys keep groups of 4 tokens; the same tokens are
    quantized (the window is the keys'), the values as the reference quantizes them, in fewer scale bytes."""
    keys, values = kv(50, 3)
    wide = CacheConfig(residual=8, sinks=2, group_size=4, value_group_size=16, fp_dtype="float32")
    layer, narrow = KVGuardLayer("int3", wide), KVGuardLayer("int3", CFG)
    feed(layer, keys, values, 3)
    feed(narrow, keys, values, 3)
    exp_k, exp_v, q_end = expected_layout(keys, values, wide, "int3")
    got_k, got_v = layer.materialize(torch.float32)
    torch.testing.assert_close(got_k, exp_k, atol=0, rtol=0)
    torch.testing.assert_close(got_v, exp_v, atol=0, rtol=0)
    assert layer.quantized_positions().tolist() == narrow.quantized_positions().tolist() == list(range(2, q_end))
    # One float16 scale and zero per token instead of four: 2 * 2 * (4 - 1) bytes per head and token fewer.
    assert narrow.nbytes() - layer.nbytes() == B * H * (q_end - 2) * 12
    assert not torch.equal(got_v, narrow.materialize(torch.float32)[1])


def test_values_below_their_keys_tier_are_stored_at_it_and_follow_the_keys():
    """``set_value_drop``: per head, values 1 / 2 / 0 tiers below INT4 keys (INT3 / INT2 / INT4), each head as the
    slow reference stores it, in fewer bytes; raising the keys to INT8 raises the values with them."""
    keys, values = kv(50, 4)
    layer, same = KVGuardLayer("int4", CFG), KVGuardLayer("int4", CFG)
    layer.set_value_drop((1, 2, 0))
    feed(layer, keys, values, 3)
    feed(same, keys, values, 3)
    got_k, got_v = layer.materialize(torch.float32)
    for h, tier in enumerate(("int3", "int2", "int4")):
        exp_k, exp_v, _ = expected_layout(keys[:, h:h + 1], values[:, h:h + 1], CFG, "int4", tier)
        torch.testing.assert_close(got_k[:, h:h + 1], exp_k, atol=0, rtol=0)
        torch.testing.assert_close(got_v[:, h:h + 1], exp_v, atol=0, rtol=0)
    assert layer.nbytes() < same.nbytes()
    promoted = KVGuardLayer("int4", CFG)
    promoted.set_value_drop((1, 2, 0))
    promoted.set_precision("int8")  # INT8 keys keep their values at INT8
    feed(promoted, keys, values, 3)
    _, exp_v, _ = expected_layout(keys, values, CFG, "int8")
    torch.testing.assert_close(promoted.materialize(torch.float32)[1], exp_v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="3 KV heads but 2 value drops"):
        promoted.set_value_drop((1, 1))


def test_the_value_group_round_trips_defaults_to_the_group_and_is_checked():
    assert "value_group_size" not in CFG.to_dict() and CFG.value_group == CFG.group_size
    wide = CacheConfig(group_size=32, value_group_size=64)
    assert wide.value_group == 64 and CacheConfig.from_dict(wide.to_dict()) == wide
    with pytest.raises(ValueError, match="value_group_size must be >= 1"):
        CacheConfig(value_group_size=0)


def test_tokens_are_quantized_once():
    keys, values = kv(40, 1)
    layer = KVGuardLayer("int2", CFG)
    feed(layer, keys[..., :30, :], values[..., :30, :], 1)
    before, _ = layer.materialize(torch.float32)
    frozen = layer.quantized_positions()
    feed(layer, keys[..., 30:, :], values[..., 30:, :], 1)
    after, _ = layer.materialize(torch.float32)
    # Positions already quantized decode to exactly the same values after more tokens arrive.
    torch.testing.assert_close(after[..., frozen, :], before[..., frozen, :], atol=0, rtol=0)


def test_update_returns_new_tokens_unchanged_after_the_stored_past():
    keys, values = kv(30, 2)
    layer = KVGuardLayer("int4", CFG)
    feed(layer, keys[..., :29, :], values[..., :29, :], 29)
    past_k, _ = layer.materialize(torch.float32)
    out_k, out_v = layer.update(keys[..., 29:, :], values[..., 29:, :])
    assert out_k.shape == (B, H, 30, D)
    torch.testing.assert_close(out_k[..., :29, :], past_k, atol=0, rtol=0)
    torch.testing.assert_close(out_k[..., 29:, :], keys[..., 29:, :], atol=0, rtol=0)
    assert layer.get_seq_length() == 30 and layer.get_mask_sizes(1) == (31, 0)


def test_per_head_precision():
    keys, values = kv(40, 3)
    layer = KVGuardLayer(["fp16", "int8", "int2"], CFG)
    feed(layer, keys, values, 40)
    got_k, _ = layer.materialize(torch.float32)
    q = layer.quantized_positions()
    err = [(got_k[:, h, q] - keys[:, h, q]).abs().max().item() for h in range(H)]
    assert err[0] == 0.0  # fp16 tier stored unquantized (fp_dtype float32 here)
    assert 0.0 < err[1] < err[2]


def test_set_precision_applies_to_tokens_stored_afterwards():
    keys, values = kv(60, 4)
    layer = KVGuardLayer("int2", CFG)
    feed(layer, keys[..., :30, :], values[..., :30, :], 1)
    first = layer.quantized_positions()
    layer.set_precision("int8")
    feed(layer, keys[..., 30:, :], values[..., 30:, :], 1)
    got_k, _ = layer.materialize(torch.float32)
    later = layer.quantized_positions()[first.numel():]
    err_first = (got_k[..., first, :] - keys[..., first, :]).abs().mean()
    err_later = (got_k[..., later, :] - keys[..., later, :]).abs().mean()
    assert later.numel() > 0 and err_later < err_first / 10
    assert layer.precision.value == "int8"


def test_write_fp_overlay_wins_over_codes_and_updates_window():
    keys, values = kv(40, 5)
    layer = KVGuardLayer("int2", CFG)
    feed(layer, keys, values, 40)
    quantized = layer.quantized_positions()
    pos = torch.tensor([int(quantized[0]), int(quantized[-1]), 39])  # two quantized, one in the window
    new_k, new_v = torch.full((B, H, 3, D), 7.0), torch.full((B, H, 3, D), -7.0)
    before = layer.nbytes()
    layer.write_fp(pos, new_k, new_v)
    got_k, got_v = layer.materialize(torch.float32)
    assert torch.equal(got_k[..., pos, :], new_k) and torch.equal(got_v[..., pos, :], new_v)
    assert layer.overlay_positions().tolist() == pos[:2].tolist()
    # Overlay bytes: 2 positions x (K + V) x B x H x D float32 values + 2 int64 indices.
    assert layer.nbytes() - before == 2 * 2 * B * H * D * 4 + 2 * 8
    # Rewriting a position replaces it rather than adding a second copy.
    layer.write_fp(pos[:1], new_k[..., :1, :] * 2, new_v[..., :1, :] * 2)
    assert layer.overlay_positions().tolist() == pos[:2].tolist()
    assert torch.equal(layer.materialize(torch.float32)[0][..., pos[0], :], new_k[..., 0, :] * 2)


def test_write_fp_rejects_bad_input():
    keys, values = kv(20, 6)
    layer = KVGuardLayer("int4", CFG)
    feed(layer, keys, values, 20)
    good = torch.zeros(B, H, 1, D)
    with pytest.raises(ValueError, match=r"\[0, 20\)"):
        layer.write_fp([20], good, good)
    with pytest.raises(ValueError, match="shape"):
        layer.write_fp([3], torch.zeros(B, H, 2, D), good)
    with pytest.raises(ValueError, match="unique"):
        layer.write_fp([3, 3], torch.zeros(B, H, 2, D), torch.zeros(B, H, 2, D))
    with pytest.raises(ValueError, match="finite"):
        layer.write_fp([3], torch.full((B, H, 1, D), float("nan")), good)


def test_nbytes_hand_computed():
    cfg = CacheConfig(residual=8, sinks=2, group_size=4, fp_dtype="float16")
    keys, values = kv(42, 7)
    layer = KVGuardLayer("int4", cfg)
    feed(layer, keys, values, 42)
    # 2 sinks + 32 quantized (8 groups) + 8 window tokens.
    fp_tokens, q_tokens = 2 + 8, 32
    fp_bytes = 2 * B * H * fp_tokens * D * 2
    key_q = B * H * q_tokens * D // 2 + 2 * (B * H * (q_tokens // 4) * D * 2)  # codes + scale + zero point
    val_q = B * H * q_tokens * D // 2 + 2 * (B * H * q_tokens * (D // 4) * 2)
    assert layer.nbytes() == fp_bytes + key_q + val_q
    assert layer.fp16_nbytes() == 2 * 2 * B * H * 42 * D


def test_static_int8_scales_are_used_and_shared():
    keys, values = kv(40, 8)
    layer = KVGuardLayer("int8", CFG)
    absmax = keys.abs().amax(dim=(0, 2))  # [H, D], as calibration would record
    layer.set_static_scales(absmax, values.abs().amax(dim=(0, 2)))
    feed(layer, keys, values, 40)
    part = layer.store.runs[0].parts[0]
    assert part.keys.spec.static and part.keys.scale.shape == (1, H, 1, D)
    got_k, _ = layer.materialize(torch.float32)
    q = layer.quantized_positions()
    step = (absmax / 127).max()
    assert (got_k[..., q, :] - keys[..., q, :]).abs().max() <= step
    with pytest.raises(ValueError, match=r"\[H_kv, D\]"):
        layer.set_static_scales(torch.ones(H), None)


def test_an_8_bit_window_stores_int8_codes_under_the_calibrated_scales():
    cfg = CacheConfig(residual=8, sinks=2, group_size=4, window_bits=8)
    keys, values = kv(42, 11)
    k_amax, v_amax = keys.abs().amax(dim=(0, 2)), values.abs().amax(dim=(0, 2))  # [H, D], as calibration records
    layer, fp = KVGuardLayer("int4", cfg), KVGuardLayer("int4", replace(cfg, window_bits=16))
    layer.set_static_scales(k_amax, v_amax)
    fp.set_static_scales(k_amax, v_amax)
    for t in range(42):
        out_k, out_v = layer.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
        fp.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
        # The newest token is read as computed; the window's older tokens within one INT8 step.
        assert torch.equal(out_k[..., -1:, :], keys[..., t:t + 1, :])
    assert layer.store.win_k.dtype == torch.int8 and layer.store.win_k.shape[-2] == fp.store.win_k.shape[-2] > 0
    win_k, win_v = layer.window_tensors(torch.float32)
    start = layer.window_start()
    assert (win_k - keys[..., start:, :]).abs().max() <= (WINDOW_HEADROOM * k_amax / 127).max() / 2 + 3e-3
    assert (win_v - values[..., start:, :]).abs().max() <= (WINDOW_HEADROOM * v_amax / 127).max() / 2 + 3e-3
    # The window costs 1 byte a value (and one float16 scale per KV head and channel) instead of 2.
    window_values = 2 * B * H * layer.store.win_k.shape[-2] * D
    assert fp.nbytes() - layer.nbytes() == window_values - 2 * H * D * 2
    # Tokens left the window from their 8-bit copy: the history differs from the 16-bit window's, by little.
    got, ref = layer.materialize(torch.float32)[0], fp.materialize(torch.float32)[0]
    assert not torch.equal(got, ref) and (got - ref).abs().max() < 0.5 * (keys.abs().max())
    with pytest.raises(ValueError, match="calibrated INT8 scales"):
        KVGuardLayer("int4", cfg).update(keys[..., :1, :], values[..., :1, :])
    with pytest.raises(ValueError, match="window_bits"):
        CacheConfig(window_bits=4)
    # Profiles write it only when set, and read it back.
    assert "window_bits" not in CFG.to_dict() and CacheConfig.from_dict(cfg.to_dict()) == cfg


def test_sliding_layer_keeps_what_the_window_needs_and_reports_mask_sizes():
    window = 12
    layer = KVGuardSlidingLayer("int4", CFG, sliding_window=window)
    keys, values = kv(60, 9)
    for t in range(60):
        expected_len, offset = layer.get_mask_sizes(1)
        out_k, _ = layer.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])
        assert out_k.shape[-2] == expected_len
        assert offset == layer.length - 1 - (expected_len - 1)  # returned tensor ends at the new token
        assert t + 1 - layer.offset >= min(t + 1, window - 1)  # everything the next query can see is kept
    assert layer.stored_tokens < window - 1 + CFG.group_size + CFG.sinks
    assert layer.fp16_nbytes() == 2 * 2 * B * H * D * (window - 1)


def test_batch_reorder_and_select():
    keys, values = kv(30, 10)
    layer = KVGuardLayer("int4", CFG)
    feed(layer, keys, values, 30)
    full_k, _ = layer.materialize(torch.float32)
    layer.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(layer.materialize(torch.float32)[0], full_k.flip(0), atol=0, rtol=0)
    layer.batch_select_indices(torch.tensor([0]))
    torch.testing.assert_close(layer.materialize(torch.float32)[0], full_k[1:], atol=0, rtol=0)
    assert layer.batch_size == 1


def test_precision_errors_name_valid_values():
    with pytest.raises(ValueError, match=r"\[fp16, int8, int4, int3, int2\]"):
        KVGuardLayer("int5", CFG)
    layer = KVGuardLayer(["int4"] * H, CFG)
    feed(layer, *kv(4, 11), 4)
    with pytest.raises(ValueError, match="3 KV heads"):
        layer.set_precision(["int4", "int8"])


def test_sliding_layers_of_any_precision_hold_the_same_tokens():
    # transformers builds one mask for all sliding layers from the first one's get_mask_sizes.
    layers = [KVGuardSlidingLayer(p, CFG, sliding_window=12) for p in ("fp16", "int4", ["int2", "fp16", "int8"])]
    keys, values = kv(60, 12)
    for t in range(60):
        sizes = {layer.get_mask_sizes(1) for layer in layers}
        assert len(sizes) == 1
        for layer in layers:
            layer.update(keys[..., t:t + 1, :], values[..., t:t + 1, :])


def test_groups_are_written_into_preallocated_room_and_earlier_reads_stay():
    layer = KVGuardLayer(("int4", "fp16", "int2"), CFG)
    keys, values = kv(80, 21)
    feed(layer, keys[..., :40, :], values[..., :40, :], chunk=1)
    int4, fp16 = layer.store.runs[0].parts[0], layer.store.runs[0].parts[1]
    read = layer.stored_read()
    before = [(s.keys.dequantize() if hasattr(s.keys, "dequantize") else s.keys).clone() for s in read.segments]
    codes, plain = int4.keys.qdata.data_ptr(), fp16.values.data_ptr()
    feed(layer, keys[..., 40:, :], values[..., 40:, :], chunk=1)
    # The same buffers took the later groups: nothing was concatenated or copied.
    assert int4.keys.qdata.data_ptr() == codes and fp16.values.data_ptr() == plain
    assert int4.room["keys.codes"].shape[-2] >= int4.keys.num_tokens > read.segments[1].length
    for seg, old in zip(read.segments, before):  # what a read held is what it was
        now = seg.keys.dequantize() if hasattr(seg.keys, "dequantize") else seg.keys
        assert torch.equal(now, old)
    # The stored tokens read as one quantization of all of them, as a concatenation would give.
    ref = KVGuardLayer(("int4", "fp16", "int2"), CFG)
    feed(ref, keys, values, chunk=80)
    for got, want in zip(layer.materialize(), ref.materialize()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # A batch reorder gives new tensors: the next group goes into a new buffer, with the reordered rows.
    layer.reorder_cache(torch.tensor([1, 0]))
    layer.update(*kv(4, 22))
    assert int4.keys.qdata.data_ptr() != codes and layer.stored_tokens == 84
    end = ref.window_start()  # tokens stored the same way in both: the later group changed the rest
    assert torch.equal(layer.materialize()[0][0, :, :end], ref.materialize()[0][1, :, :end])


def test_what_is_held_beyond_the_stored_rows_is_bounded():
    """The process holds what the store counts: the window keeps no storage of the rows that left it (a view would
    keep a prefill chunk's worth per layer), and a key scale buffer (a row per group of tokens) has room for about
    as many tokens as its codes, not group_size times more."""
    layer = KVGuardLayer("int4", CFG)
    keys, values = kv(300, 23)
    layer.update(keys[..., :256, :], values[..., :256, :])  # one prefill chunk: most of it leaves the window
    layer.update(keys[..., 256:, :], values[..., 256:, :])
    for side in (layer.store.win_k, layer.store.win_v):
        assert side.untyped_storage().nbytes() == side.numel() * side.element_size() <= CFG.residual * 2 * B * H * D * 4
    part = layer.store.runs[0].parts[0]
    codes_room, scale_room = part.room["keys.codes"].shape[-2], part.room["keys.scale"].shape[-2]
    assert part.keys.scale.shape[-2] == part.keys.num_tokens // CFG.group_size
    assert scale_room * CFG.group_size <= codes_room + CFG.group_size
