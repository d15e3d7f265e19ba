"""The attention harness: installed once, identical without a hook, one hook per thread."""

import threading

import torch
from transformers import DynamicCache

from kvguard import attention
from tests.helpers import tiny_llama


def _logits(model, ids, cache=None):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=cache is not None).logits


def test_installed_model_computes_exactly_what_it_did_and_stays_installed():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    streamed_before = [_logits(model, ids[:, i:i + 8], cache) for cache in [DynamicCache()] for i in range(0, 40, 8)]
    attention.install(model)
    assert model.config._attn_implementation == attention.ATTN_NAME
    assert torch.equal(_logits(model, ids), before)
    streamed = [_logits(model, ids[:, i:i + 8], cache) for cache in [DynamicCache()] for i in range(0, 40, 8)]
    assert all(torch.equal(a, b) for a, b in zip(streamed, streamed_before))
    with attention.hooked(model, lambda *a, **k: _sdpa(*a, **k)):
        pass
    attention.install(model)  # idempotent
    assert model.config._attn_implementation == attention.ATTN_NAME


def test_eager_models_fall_back_to_their_own_eager_attention():
    model = tiny_llama(attn_implementation="eager")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    attention.install(model)
    assert torch.equal(_logits(model, ids), before)


def _sdpa(module, query, key, value, attention_mask, *, scaling, softcap):
    rep = query.shape[1] // key.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, attention.expand_kv(key, rep), attention.expand_kv(value, rep), attn_mask=attention_mask, scale=scaling)


def test_a_hook_sees_an_eager_mask_and_reproduces_the_model():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    before = _logits(model, ids)
    masks = []

    def hook(module, query, key, value, attention_mask, *, scaling, softcap):
        masks.append(attention_mask)
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)

    with attention.hooked(model, hook):
        hooked = _logits(model, ids)
    assert len(masks) == 2 and masks[0].dtype == torch.float32 and masks[0].shape == (1, 1, 24, 24)
    above = torch.ones(24, 24, dtype=torch.bool).triu(1)
    assert bool((masks[0][0, 0][above] < -1e30).all()) and bool((masks[0][0, 0][~above] == 0).all())
    torch.testing.assert_close(hooked, before, atol=1e-5, rtol=1e-5)
    assert attention.active_hook() is None


def test_two_threads_each_see_only_their_own_hook():
    model = tiny_llama()
    attention.install(model)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    seen = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def worker(name: str) -> None:
        def hook(module, query, key, value, attention_mask, *, scaling, softcap):
            seen[name].append(threading.current_thread().name)
            return _sdpa(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)

        barrier.wait()
        with attention.hooked(model, hook):
            for _ in range(5):
                _logits(model, ids)

    threads = [threading.Thread(target=worker, args=(n,), name=n) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] == ["a"] * 10 and seen["b"] == ["b"] * 10
