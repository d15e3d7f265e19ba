"""KVGuardCache on the real embedded models and real text."""

import pytest
import torch
from transformers import DynamicCache

from kvguard import data
from kvguard.cache import KVGuardCache
from kvguard.config import CacheConfig
from kvguard.scoring import score_stream

pytestmark = pytest.mark.slow


def _prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    return data.token_stream("prose", "eval", tokenizer, n_tokens).unsqueeze(0)


def _greedy(model, input_ids, cache, new_tokens, **kwargs):
    return model.generate(
        input_ids=input_ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=cache, **kwargs
    )


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_all_fp16_greedy_equals_dynamic_cache(model_name, request):
    model, tok = request.getfixturevalue(model_name)
    # 540 prompt tokens + 24 new ones: past Gemma 3's 512-token sliding window, in prefill and in decoding.
    ids = _prompt(tok, 540)
    expected = _greedy(model, ids, DynamicCache(config=model.config), 24)
    cache = KVGuardCache(model.config, "fp16")
    got = _greedy(model, ids, cache, 24)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == 540 + 23


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_batch_with_left_padding(model_name, request):
    model, tok = request.getfixturevalue(model_name)
    tok.padding_side = "left"
    texts = [d.text for d in data.documents("prose", "eval", limit=2, max_chars=400)]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any(), "the test needs one padded row"
    expected = model.generate(**batch, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=model.config))
    got = model.generate(**batch, max_new_tokens=12, do_sample=False, past_key_values=KVGuardCache(model.config, "fp16"))
    assert torch.equal(got, expected)
    # Rows are quantized independently: an unpadded row decodes as it would alone.
    full_row = int(batch.attention_mask.sum(1).argmax())
    cfg = CacheConfig(residual=16, group_size=16)
    batched = model.generate(**batch, max_new_tokens=12, do_sample=False, past_key_values=KVGuardCache(model.config, "int4", cfg))
    single = _greedy(model, batch.input_ids[full_row:full_row + 1], KVGuardCache(model.config, "int4", cfg), 12)
    assert torch.equal(batched[full_row], single[0])


def _teacher_forced_logits(model, ids: torch.Tensor, cache, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then feed the rest one token at a time; logits predicting tokens prefill+1.."""
    with torch.no_grad():
        model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
        out = []
        for t in range(prefill, ids.shape[1] - 1):
            step = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            out.append(step.logits[:, -1])
    return torch.stack(out, dim=1)


def test_int8_top1_agreement_with_fp16_over_256_teacher_forced_tokens(smollm2):
    model, tok = smollm2
    ids = _prompt(tok, 256 + 257)
    # The reference in one pass: an all-FP16 cache decodes as the model's own cache does (above).
    with torch.no_grad():
        ref = model(input_ids=ids[:, :-1]).logits[:, 256:]
    got = _teacher_forced_logits(model, ids, KVGuardCache(model.config, "int8"), 256)
    assert ref.shape[1] == 256
    agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.99


def test_int4_stores_at_most_35_percent_at_2048_tokens_and_keeps_quality(smollm2):
    model, tok = smollm2
    # 2,049 tokens: the last one is only a target, so 2,048 go through the cache.
    ids = data.token_stream("long", "eval", tok, 2049).unsqueeze(0)
    fp = KVGuardCache(model.config, "fp16")
    q4 = KVGuardCache(model.config, "int4")
    nll_fp = score_stream(model, ids, fp, chunk=256).nll
    nll_q4 = score_stream(model, ids, q4, chunk=256).nll
    assert q4.get_seq_length() == 2048
    assert fp.bytes_ratio() == 1.0
    assert q4.bytes_ratio() <= 0.35
    # Chunks after the first attend to INT4 history: perplexity stays within 10 % of FP16.
    assert torch.exp(torch.tensor(nll_q4 - nll_fp)).item() < 1.10


def test_gemma3_int4_decodes_past_the_sliding_window(gemma3):
    model, tok = gemma3
    ids = _prompt(tok, 500)
    cache = KVGuardCache(model.config, "int4")
    out = _greedy(model, ids, cache, 40)
    assert out.shape[1] == 540
    sliding = [l for l in cache.layers if l.is_sliding]
    assert len(sliding) == 15 and all(l.offset > 0 for l in sliding)
    # At 540 tokens the FP window (64-95 tokens), the sinks and the group-aligned sliding edge are a large
    # share of what is stored; INT4 codes alone would be ~0.31.
    assert cache.bytes_ratio() < 0.50
    text = tok.decode(out[0, 500:], skip_special_tokens=True)
    assert len(text.split()) >= 10  # real words, not a collapsed stream


def test_unsupported_layer_type_and_wrong_plan_length(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="30 layers"):
        KVGuardCache(model.config, ["int4"] * 29)
    with pytest.raises(ValueError, match="3 KV heads"):
        KVGuardCache(model.config, [["int4", "int8"]] * 30)
