"""The fused decode attention against the slow reference: today's read (materialize, then plain attention)."""

import copy
import dataclasses

import pytest
import torch

from kvguard import attention, fused_attention, score_bias
from kvguard.cache import KVGuardCache
from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer
from kvguard.config import CacheConfig
from kvguard.control.decoding import CacheDecoder, generate
from kvguard.rope import Rope
from kvguard.stored_read import StoredRead, StoredSegment

pytestmark = pytest.mark.skipif(not fused_attention.available(), reason="fused kernels not built: make install")

B, H_KV, REP, D = 2, 3, 2, 16
CONFIG = CacheConfig(residual=6, sinks=2, group_size=8, fp_dtype="float16")


def _fill(layer: KVGuardLayer, tokens: int, gen: torch.Generator, chunk: int = 7) -> None:
    """Feed ``tokens`` random tokens through today's read (no fused context is active here)."""
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        k = torch.randn(B, H_KV, n, D, generator=gen) * 2 + torch.linspace(-1, 1, D)  # per-channel offsets
        layer.update(k, torch.randn(B, H_KV, n, D, generator=gen))
        done += n


def _reference(layer: KVGuardLayer, q, k, v, mask, scaling):
    """Attention over ``materialize()`` + the new tokens, by the textbook formula."""
    past_k, past_v = layer.materialize(torch.float32)
    keys, values = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
    keys, values = attention.expand_kv(keys, REP), attention.expand_kv(values, REP)
    scores = q @ keys.transpose(-1, -2) * scaling  # [B, H_q, T_q, N]
    if mask is None:  # causal among the new tokens
        tq, n = q.shape[-2], keys.shape[-2]
        mask = torch.ones(tq, n, dtype=torch.bool).tril(n - tq)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ values


def _check(layer: KVGuardLayer, gen: torch.Generator, tq: int = 1, mask=None):
    q = torch.randn(B, H_KV * REP, tq, D, generator=gen)
    k, v = torch.randn(B, H_KV, tq, D, generator=gen), torch.randn(B, H_KV, tq, D, generator=gen)
    expected = _reference(layer, q, k, v, mask, D ** -0.5)
    read = layer.stored_read()
    got = fused_attention.attend(q, read, k, v, mask, scaling=D ** -0.5)
    assert read.length == layer.stored_tokens
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2", "fp16", ("int4", "fp16", "int2"),
                                       ("int8", "int3", "int8")])
@pytest.mark.parametrize("rotate", [False, True])
def test_matches_reference_per_precision(precision, rotate):
    gen = torch.Generator().manual_seed(1)
    layer = KVGuardLayer(precision, CONFIG)
    layer.set_rotation(rotate, rotate)
    _fill(layer, 61, gen)
    assert layer.stored_tokens == 61 and layer.store.runs
    _check(layer, gen)


@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("dim,group,rep,tq", [(12, 6, 3, 3), (24, 8, 3, 3), (40, 8, 1, 1)])
def test_kernel_paths_for_every_shape(precision, dim, group, rep, tq):
    """The vector paths (eight channels at a time, four query rows per block) and the scalar ones (a head_dim
    that is not a multiple of eight, groups of six channels, row blocks with a remainder) agree with the
    reference."""
    if precision == "int3" and dim % 8:
        pytest.skip("int3 packs eight codes per word: head_dim must be a multiple of 8")
    gen = torch.Generator().manual_seed(dim + rep)
    layer = KVGuardLayer(precision, CacheConfig(residual=4, sinks=1, group_size=group, fp_dtype="float16"))
    layer.update(torch.randn(B, H_KV, 300, dim, generator=gen) * 2 + 1, torch.randn(B, H_KV, 300, dim, generator=gen))
    q = torch.randn(B, H_KV * rep, tq, dim, generator=gen)
    k, v = torch.randn(B, H_KV, tq, dim, generator=gen), torch.randn(B, H_KV, tq, dim, generator=gen)
    past_k, past_v = layer.materialize(torch.float32)
    keys = attention.expand_kv(torch.cat([past_k, k], dim=-2), rep)
    values = attention.expand_kv(torch.cat([past_v, v], dim=-2), rep)
    n = keys.shape[-2]
    scores = (q @ keys.transpose(-1, -2) * dim ** -0.5).masked_fill(~torch.ones(tq, n, dtype=torch.bool).tril(n - tq),
                                                                    float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ values
    got = fused_attention.attend(q, layer.stored_read(), k, v, None, scaling=dim ** -0.5)
    assert sum(r.length for r in layer.store.runs) >= 256  # more than one token block of the kernels
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_static_int8_scales_and_clips():
    gen = torch.Generator().manual_seed(2)
    layer = KVGuardLayer("int8", CONFIG)
    layer.set_static_scales(torch.rand(H_KV, D, generator=gen) * 3 + 1, torch.rand(H_KV, D, generator=gen) * 3 + 1)
    _fill(layer, 40, gen)
    layer.set_precision(("int4", "int8", "int2"))
    layer.set_clip(0.9, 0.8)
    _fill(layer, 33, gen)
    assert len(layer.store.runs) == 2
    _check(layer, gen)


def test_an_8_bit_window_is_read_decoded():
    gen = torch.Generator().manual_seed(5)
    layer = KVGuardLayer(("int3", "int8", "fp16"), CacheConfig(residual=6, sinks=2, group_size=8, window_bits=8))
    layer.set_static_scales(torch.rand(H_KV, D, generator=gen) * 3 + 3, torch.rand(H_KV, D, generator=gen) * 3 + 3)
    layer.set_rotation(True, True)
    _fill(layer, 45, gen)
    assert layer.store.win_k.dtype == torch.int8 and layer.store.win_k.shape[-2] > 0
    _check(layer, gen)


def test_one_byte_scales_and_searched_ranges_are_read_decoded():
    gen = torch.Generator().manual_seed(6)
    cfg = CacheConfig(residual=6, sinks=2, group_size=8, scale_bits=8, range_search=True)
    layer, wide = KVGuardLayer(("int3", "int2", "int4"), cfg), KVGuardLayer(("int3", "int2", "int4"), CONFIG)
    for each in (layer, wide):
        each.set_rotation(True, False)
    _fill(layer, 45, gen)
    _fill(wide, 45, torch.Generator().manual_seed(6))
    dtypes = {part.keys.scale.dtype for run in layer.store.runs for part in run.parts}
    assert dtypes == {torch.uint8, torch.float16}  # one byte for INT3 / INT2, float16 for INT4
    # INT3 / INT2 scales and zero points take 2 of the 4 bytes per group: keys every 8 tokens per channel,
    # values every 8 channels per token, over the 2 x 2 quantized heads' 32 history tokens.
    assert layer.history_tokens() == 32
    groups = B * 2 * (32 // 8 * D + 32 * D // 8)
    assert wide.history_nbytes() - layer.history_nbytes() == 2 * groups
    _check(layer, gen)
    _check(layer, gen, tq=3)



def test_one_byte_scales_are_decoded_in_the_kernel_exactly_as_in_torch():
    """The kernels read one-byte scale and zero codes themselves; the scores and sums equal those of the same
    codes with the scales decoded beforehand (``QuantizedTensor.scales()`` / ``zeros()``), bit for bit."""
    gen = torch.Generator().manual_seed(8)
    cfg = CacheConfig(residual=4, sinks=1, group_size=8, scale_bits=8, range_search=True)
    layer = KVGuardLayer(("int3", "int2", "int3"), cfg)
    layer.update(torch.randn(B, H_KV, 300, D, generator=gen) * 3 + 1, torch.randn(B, H_KV, 300, D, generator=gen))
    ops, part = fused_attention.kernels(), layer.store.runs[0].parts[0]  # the two INT3 heads
    h = part.keys.shape[1]
    q = torch.randn(B, h, REP, D, generator=gen)
    for x, axis in ((part.keys, (8, 1)), (part.values, (1, 8))):
        assert x.scale.dtype == torch.uint8
        codes = x.qdata
        decoded = (codes, x.scales(), x.zeros(), torch.empty(0, dtype=torch.float16), x.spec.precision.bits, *axis)
        coded = fused_attention._codes(x, B, h)
        assert coded[1].dtype == torch.uint8 and coded[2].dtype == torch.int8
        if x is part.keys:
            got, want = (torch.zeros(B, h, REP, x.shape[-2]) for _ in range(2))
            ops.key_scores(got, 0, torch.empty(0, dtype=torch.long), q, *coded, True, *NO_TURN)
            ops.key_scores(want, 0, torch.empty(0, dtype=torch.long), q, *decoded, True, *NO_TURN)
        else:
            p = torch.softmax(torch.randn(B, h, REP, x.shape[-2], generator=gen), -1)
            got = ops.value_accumulate(p, 0, torch.empty(0, dtype=torch.long), *coded, D)
            want = ops.value_accumulate(p, 0, torch.empty(0, dtype=torch.long), *decoded, D)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("scale_bits", [16, 8])
def test_the_kernel_applies_the_softmax_bias_correction(scale_bits):
    """With ``score_correction`` the kernel adds :func:`kvguard.score_bias.correction` to every quantized key's
    score (in the keys' rotated basis), and nothing to full-precision keys or to INT8 ones."""
    gen = torch.Generator().manual_seed(9)
    cfg = CacheConfig(residual=6, sinks=2, group_size=8, fp_dtype="float16", score_correction=True,
                      scale_bits=scale_bits)
    layer = KVGuardLayer(("int3", "fp16", "int2"), cfg)
    layer.set_rotation(True, False)
    _fill(layer, 40, gen)
    layer.set_precision(("int8", "int4", "fp16"))
    _fill(layer, 30, gen)
    q = torch.randn(B, H_KV * REP, 1, D, generator=gen)
    k, v = torch.randn(B, H_KV, 1, D, generator=gen), torch.randn(B, H_KV, 1, D, generator=gen)
    scaling = D ** -0.5
    past_k, past_v = layer.materialize(torch.float32)
    keys = torch.cat([past_k, k], dim=-2)
    qs = (q * scaling).reshape(B, H_KV, REP, D)  # rows: the query heads of each KV head
    scores = qs @ keys.transpose(-1, -2)  # [B, H_kv, REP, N]
    column, corrected = layer.store.sinks_k.shape[-2], 0
    for run in layer.store.runs:
        for part in run.parts:
            if part.layout.key_spec is not None and score_bias.applies(part.layout.key_spec):
                rows = qs.index_select(1, part.index)
                rows = rows @ part.rotation_matrix if part.layout.key_rotated else rows
                bias = score_bias.correction(rows, part.keys)  # [B, h, REP, run.length]
                scores[:, part.index, :, column:column + run.length] += bias
                corrected += 1
        column += run.length
    assert corrected == 3  # INT3 and INT2 in the first run, INT4 in the second; not INT8 or FP16
    values = torch.cat([past_v, v], dim=-2)
    expected = (torch.softmax(scores, -1) @ values).reshape(B, H_KV * REP, 1, D)
    got = fused_attention.attend(q, layer.stored_read(), k, v, None, scaling=scaling)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    uncorrected = dataclasses.replace(layer.stored_read(), score_correction=False)
    assert not torch.allclose(fused_attention.attend(q, uncorrected, k, v, None, scaling=scaling), got, atol=1e-4)


def test_several_runs_overlay_and_query_tokens():
    gen = torch.Generator().manual_seed(3)
    layer = KVGuardLayer("int4", CONFIG)
    layer.set_rotation(True, False)
    _fill(layer, 30, gen)
    layer.set_precision(("int2", "fp16", "int3"))
    _fill(layer, 40, gen)
    positions = torch.tensor([3, 11, 40, 41])  # quantized positions of both runs
    assert bool(torch.isin(positions, layer.quantized_positions()).all())
    layer.write_fp(positions, torch.randn(B, H_KV, 4, D, generator=gen), torch.randn(B, H_KV, 4, D, generator=gen))
    assert layer.stored_read().overlay_columns.tolist() == positions.tolist()
    _check(layer, gen)
    _check(layer, gen, tq=3)  # causal among the new tokens, no mask given
    n = layer.stored_tokens + 3
    mask = torch.ones(B, 1, 3, n, dtype=torch.bool).tril(n - 3)
    mask[0, :, :, :5] = False  # left padding of the first sequence
    _check(layer, gen, tq=3, mask=mask)
    _check(layer, gen, tq=3, mask=torch.where(mask, 0.0, torch.finfo(torch.float32).min))  # additive form


def test_sliding_layer_after_dropping_groups():
    gen = torch.Generator().manual_seed(4)
    layer = KVGuardSlidingLayer("int4", CONFIG, sliding_window=30)
    _fill(layer, 90, gen)
    assert layer.offset > 0 and layer.store.runs
    n = layer.stored_tokens + 1
    visible = torch.arange(layer.offset, layer.offset + n) > layer.length - 30  # what the window still sees
    _check(layer, gen, mask=visible.view(1, 1, 1, n).expand(B, 1, 1, n))


PREROPE = Rope((10000.0,), D)
NO_TURN = (torch.empty(0),) * 3  # signs, cos, sin: keys stored after RoPE


@pytest.mark.parametrize("precision", ["int4", "int3", "int2", ("int4", "fp16", "int2"), ("int8", "int3", "int8")])
@pytest.mark.parametrize("rotate", [False, True])
def test_keys_stored_before_rope_are_turned_in_the_kernel(precision, rotate):
    """Keys stored before RoPE (rotated or not, some heads at INT8 / FP16, which store them after it) are rotated
    back and turned by their positions as the kernel reads them: the same attention as the materializing read."""
    gen = torch.Generator().manual_seed(6)
    layer = KVGuardLayer(precision, dataclasses.replace(CONFIG, prerope_keys=True), rope=PREROPE)
    layer.set_rotation(rotate, rotate)
    _fill(layer, 61, gen)
    assert layer.holds_prerope_keys()
    read = layer.stored_read()
    turned = [seg for seg in read.segments if seg.key_turn is not None]
    assert turned
    assert all((seg.key_signs is not None) == rotate for seg in turned)
    _check(layer, gen)
    _check(layer, gen, tq=3)


@pytest.mark.parametrize("dim", [12, 24, 40, 64])
def test_keys_before_rope_on_the_vector_and_scalar_paths(dim):
    """Head dims whose halves are not a multiple of eight (the scalar tail of the turn) and a rotated power of two
    (the butterflies in registers, then across them) agree with the reference."""
    gen = torch.Generator().manual_seed(dim)
    layer = KVGuardLayer("int4", CacheConfig(residual=4, sinks=1, group_size=4, fp_dtype="float16", prerope_keys=True),
                         rope=Rope((10000.0,), dim))
    rotate = dim & (dim - 1) == 0
    layer.set_rotation(rotate, False)
    layer.update(torch.randn(B, H_KV, 300, dim, generator=gen) * 2 + 1, torch.randn(B, H_KV, 300, dim, generator=gen))
    q = torch.randn(B, H_KV * REP, 1, dim, generator=gen)
    k, v = torch.randn(B, H_KV, 1, dim, generator=gen), torch.randn(B, H_KV, 1, dim, generator=gen)
    read = layer.stored_read()
    assert read.segments[1].key_turn is not None and (read.segments[1].key_signs is not None) == rotate
    got = fused_attention.attend(q, read, k, v, None, scaling=dim ** -0.5)
    torch.testing.assert_close(got, _reference(layer, q, k, v, None, dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_keys_before_rope_in_plain_tensors_are_refused():
    """Only codes are turned in the kernel: a full-precision segment that says its keys are before RoPE would be
    read unturned, so it is refused."""
    keys = torch.randn(B, H_KV, 5, D)
    cos, sin = PREROPE.tables(0, 0, 5)
    read = StoredRead((StoredSegment(0, 5, None, keys, keys, key_turn=(cos, sin)),), 5, *keys.shape[:2], keys.shape[-1])
    q, k = torch.randn(B, H_KV * REP, 1, D), torch.randn(B, H_KV, 1, D)
    with pytest.raises(ValueError, match="as codes"):
        fused_attention.attend(q, read, k, k, None, scaling=0.25)


def test_keys_before_rope_several_runs_and_a_sliding_layer_turn_by_absolute_positions():
    """Each run is turned from its own first position; a sliding layer that dropped groups (and its sinks' offset)
    still turns what it keeps by the positions those tokens had."""
    gen = torch.Generator().manual_seed(7)
    config = dataclasses.replace(CONFIG, prerope_keys=True)
    layer = KVGuardLayer("int4", config, rope=PREROPE)
    layer.set_rotation(True, False)
    _fill(layer, 30, gen)
    layer.set_precision(("int2", "fp16", "int3"))
    _fill(layer, 40, gen)
    assert len(layer.store.runs) == 2
    _check(layer, gen)
    sliding = KVGuardSlidingLayer("int3", config, sliding_window=30, rope=PREROPE)
    _fill(sliding, 90, gen)
    assert sliding.offset > 0 and sliding.store.runs
    n = sliding.stored_tokens + 1
    visible = torch.arange(sliding.offset, sliding.offset + n) > sliding.length - 30
    _check(sliding, gen, mask=visible.view(1, 1, 1, n).expand(B, 1, 1, n))


def test_result_does_not_depend_on_thread_count():
    gen = torch.Generator().manual_seed(5)
    layer = KVGuardLayer("int4", CONFIG)
    _fill(layer, 700, gen, chunk=100)  # several token blocks of the kernels
    threads = torch.get_num_threads()
    q, k, v = torch.randn(B, H_KV * REP, 1, D), torch.randn(B, H_KV, 1, D), torch.randn(B, H_KV, 1, D)
    outs = []
    for n in (1, max(threads, 2)):
        torch.set_num_threads(n)
        outs.append(fused_attention.attend(q, layer.stored_read(), k, v, None, scaling=0.25))
    torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("dim", [16, 12])  # the vector path, and the scalar one (a dim not a multiple of 8)
def test_many_sequences_in_one_pass(dim):
    """A server's batch reads every sequence in one call, whatever its cache stores (FP16, codes of every width,
    mixed heads, rotated sides, a float32 window): each result equals the sequence read alone (bit for bit: one
    task per head, whatever else is in the call, whatever the thread count) and the reference."""
    gen = torch.Generator().manual_seed(6)
    f32 = dataclasses.replace(CONFIG, fp_dtype="float32")
    cases = [("fp16", CONFIG, 3), ("fp16", CONFIG, 70), ("fp16", f32, 41), ("int4", CONFIG, 70), ("int2", CONFIG, 33),
             (("int4", "fp16", "int2"), CONFIG, 50), ("int8", f32, 45)]
    if dim % 8 == 0:
        cases += [("int3", CONFIG, 70)]
    cases += [(("int4", "fp16", "int2"), CONFIG, 2300), ("fp16", CONFIG, 1100)]  # several column splits
    layers = []
    for i, (precision, cfg, tokens) in enumerate(cases):
        layer = KVGuardLayer(precision, cfg if dim % 8 == 0 else dataclasses.replace(cfg, group_size=6))
        if dim == 16:  # rotations are Hadamard transforms: a power of two
            layer.set_rotation(i % 2 == 1, i % 3 == 1)
        _fill_dim(layer, tokens, gen, dim)
        quantized = layer.quantized_positions()
        if (i % 2 == 0 or tokens > 1024) and quantized.numel():  # restored positions: the overlay wins
            at = quantized[torch.tensor([0, quantized.numel() // 2, quantized.numel() - 1])]
            layer.write_fp(at, torch.randn(B, H_KV, 3, dim, generator=gen), torch.randn(B, H_KV, 3, dim, generator=gen))
        layers.append(layer)
    steps = [(torch.randn(B, H_KV * REP, 1, dim, generator=gen), layer.stored_read(),
              torch.randn(B, H_KV, 1, dim, generator=gen), torch.randn(B, H_KV, 1, dim, generator=gen))
             for layer in layers]
    assert all(fused_attention.direct(read, q, k) for q, read, k, _ in steps)
    assert sum(read.overlay_columns is not None for _, read, _, _ in steps) >= 2
    if dim == 16:
        assert any(seg.key_signs is not None for _, read, _, _ in steps for seg in read.segments)
        assert any(seg.value_signs is not None for _, read, _, _ in steps for seg in read.segments)
    threads = torch.get_num_threads()
    together = []
    for n in (1, max(threads, 2)):
        torch.set_num_threads(n)
        together.append(fused_attention.attend_steps(steps, scaling=dim ** -0.5,
                                                     probabilities=[i % 2 == 0 for i in range(len(steps))]))
    torch.set_num_threads(threads)
    for i, ((q, read, k, v), layer, (one, _), (many, probs)) in enumerate(zip(steps, layers, *together)):
        torch.testing.assert_close(one, many, rtol=0, atol=0)
        alone = fused_attention.attend(q, read, k, v, None, scaling=dim ** -0.5)
        torch.testing.assert_close(many, alone, rtol=0, atol=0)
        torch.testing.assert_close(many, _reference(layer, q, k, v, None, dim ** -0.5), rtol=1e-5, atol=1e-5)
        assert (probs is None) == (i % 2 == 1)
        if probs is not None:  # what the monitor reads: the softmax over the stored columns and the new token
            past_k, _ = layer.materialize(torch.float32)
            keys = torch.cat([past_k, k], dim=-2)  # [B, H_kv, N, D]
            expected = torch.softmax(q.view(B, H_KV, REP, dim) @ keys.transpose(-1, -2) * dim ** -0.5, dim=-1)
            torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)


def _fill_dim(layer: KVGuardLayer, tokens: int, gen: torch.Generator, dim: int) -> None:
    k = torch.randn(B, H_KV, tokens, dim, generator=gen) * 2 + torch.linspace(-1, 1, dim)  # per-channel offsets
    layer.update(k, torch.randn(B, H_KV, tokens, dim, generator=gen))


def _decode_logits(model, cache, fused: bool, steps: int, gen):
    decoder = CacheDecoder(model, cache, fused=fused)
    logits = [decoder.prefill(torch.randint(0, 128, (40,), generator=gen))]
    for _ in range(steps):
        logits.append(decoder.step(int(logits[-1].argmax())))
    return torch.stack(logits)


def test_tiny_model_decodes_the_same_with_the_fused_read(monkeypatch):
    from tests.helpers import tiny_llama

    calls = []
    real = fused_attention.attend
    monkeypatch.setattr(fused_attention, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_llama()
    config = CacheConfig(residual=4, sinks=2, group_size=4)
    precision = [("int4", "int2"), ("fp16", "int3")]
    fused_cache, slow_cache = KVGuardCache(model.config, precision, config), KVGuardCache(model.config, precision, config)
    fused = _decode_logits(model, fused_cache, True, 12, torch.Generator().manual_seed(0))
    assert len(calls) == 24  # 12 steps x 2 layers
    slow = _decode_logits(model, slow_cache, False, 12, torch.Generator().manual_seed(0))
    assert len(calls) == 24
    torch.testing.assert_close(fused, slow, rtol=1e-4, atol=1e-4)


def test_padded_batch_through_the_model():
    from tests.helpers import tiny_llama

    model = tiny_llama()
    attention.install(model)
    config = CacheConfig(residual=4, sinks=2, group_size=4)
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    outs = []
    for fused in (False, True):
        cache = KVGuardCache(model.config, "int4", config)
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        step_ids, step_mask = ids[:, -2:], torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
        with attention.fused_reads(model) if fused else torch.no_grad():
            out = model(input_ids=step_ids, attention_mask=step_mask, cache=cache, use_cache=True).logits
        assert bool(cache.layers[0].store.runs)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_unconsumed_read_is_refused():
    layer = KVGuardLayer("int4", CONFIG)
    _fill(layer, 20, torch.Generator().manual_seed(6))
    try:
        attention.defer_read(torch.zeros(1), layer.stored_read())
        with pytest.raises(RuntimeError, match="no attention call took it"):
            attention.defer_read(torch.zeros(1), layer.stored_read())
    finally:
        attention._PENDING.set(None)


def test_reads_the_kernels_cannot_take_go_tile_by_tile(monkeypatch):
    """The kernels are C++ CPU code: where they cannot read (a cache on a GPU, no build), a deferred read goes
    through the tiles of the chunked read instead, with the same attention."""
    assert fused_attention.available(torch.device("cpu"))
    assert not fused_attention.available(torch.device("cuda"))
    gen = torch.Generator().manual_seed(7)
    layer = KVGuardLayer(("int4", "fp16", "int2"), CONFIG)
    layer.set_rotation(True, True)
    _fill(layer, 61, gen)
    monkeypatch.setattr(fused_attention, "available", lambda device=None: False)
    _check(layer, gen)
    _check(layer, gen, tq=3)


@pytest.mark.slow
def test_smollm2_greedy_tokens_unchanged(smollm2):
    model, tok = smollm2
    text = "The printing press spread across Europe within decades, and with it cheap books, pamphlets and news. "
    ids = tok(text * 3 + "In the next century", return_tensors="pt").input_ids[0]
    config = CacheConfig(residual=8, sinks=4, group_size=16)  # most of the prompt is stored as codes
    caches = [KVGuardCache(model.config, "int4", config) for _ in range(2)]
    tokens = [generate(CacheDecoder(model, cache, fused=fused), ids, 24).tokens
              for cache, fused in zip(caches, (False, True))]
    assert caches[1].layers[0].stored_tokens > 64 and sum(r.length for r in caches[1].layers[0].store.runs) >= 48
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24


@pytest.mark.parametrize("rotate", [False, True])
def test_smollm2_greedy_tokens_unchanged_with_keys_before_rope(smollm2, rotate):
    """The real model's RoPE: keys stored before it (INT3, rotated or not) generate the same greedy tokens through
    the kernels, which turn them, as through the materializing read."""
    from kvguard.rope import Rope

    model, tok = smollm2
    text = "The printing press spread across Europe within decades, and with it cheap books, pamphlets and news. "
    ids = tok(text * 3 + "In the next century", return_tensors="pt").input_ids[0]
    config = CacheConfig(residual=8, sinks=4, group_size=16, prerope_keys=True)
    caches = [KVGuardCache(model.config, "int3", config, rope=Rope.from_config(model.config)) for _ in range(2)]
    for cache in caches:
        for layer in cache.layers:
            layer.set_rotation(rotate, rotate)
    tokens = [generate(CacheDecoder(model, cache, fused=fused), ids, 24).tokens
              for cache, fused in zip(caches, (False, True))]
    assert caches[1].layers[0].holds_prerope_keys() and caches[1].layers[0].stored_read().segments[1].key_turn
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24


@pytest.mark.parametrize("rep", [3, 5])  # a block of three rows; a block of four and one of one
@pytest.mark.parametrize("precision", ["int4", "int3", "int2", "int8", ("int4", "fp16", "int2")])
def test_folded_reads_match_the_reference(precision, rep):
    """Keys grouped over tokens and values grouped over sixteen channels or more take the folded reads (the scale
    folded into the query, the zero point into a bias; INT4's nibbles unpacked in even / odd order): the one-pass
    read still equals the materialized reference, for every width and for row counts that are not a multiple of
    four, and a sequence reads the same alone as in a batch."""
    gen = torch.Generator().manual_seed(11)
    dim, cfg = 64, dataclasses.replace(CONFIG, group_size=32, residual=8)
    layers = []
    for tokens in (40, 1500):
        layer = KVGuardLayer(precision, cfg)
        _fill_dim(layer, tokens, gen, dim)
        layers.append(layer)
    steps = [(torch.randn(B, H_KV * rep, 1, dim, generator=gen), layer.stored_read(),
              torch.randn(B, H_KV, 1, dim, generator=gen), torch.randn(B, H_KV, 1, dim, generator=gen))
             for layer in layers]
    assert all(fused_attention.direct(read, q, k) for q, read, k, _ in steps)
    batch = fused_attention.attend_steps(steps, scaling=dim ** -0.5)
    for (q, read, k, v), layer, (many, _) in zip(steps, layers, batch):
        alone = fused_attention.attend(q, read, k, v, None, scaling=dim ** -0.5)
        torch.testing.assert_close(many, alone, rtol=0, atol=0)
        past_k, past_v = layer.materialize(torch.float32)
        keys = attention.expand_kv(torch.cat([past_k, k], dim=-2), rep)
        values = attention.expand_kv(torch.cat([past_v, v], dim=-2), rep)
        expected = torch.softmax(q @ keys.transpose(-1, -2) * dim ** -0.5, dim=-1) @ values
        torch.testing.assert_close(many, expected, rtol=1e-5, atol=1e-5)
