"""Several sequences in one packed forward read exactly what each would read alone: the same logits up to float
summation order, the same greedy tokens, through prefill chunks and decode steps mixed in one row, past a sliding
window, with each cache holding only its own tokens."""

import pytest
import torch

from kvguard import attention, packed
from kvguard.cache import KVGuardCache
from kvguard.config import CacheConfig


def _alone(model, cache, prompt: torch.Tensor, chunk: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` in ``chunk``-token pieces, then ``steps`` greedy steps, one sequence at a time."""
    with torch.no_grad(), attention.fused_reads(model):
        for start in range(0, prompt.numel(), chunk):
            logits = model(input_ids=prompt[start:start + chunk].view(1, -1), cache=cache, use_cache=True).logits[0, -1]
        tokens, outs = [int(logits.argmax())], [logits.float()]
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
            outs.append(logits.float())
    return tokens, outs


def _together(model, caches, prompts, chunk: int, steps: int):
    """The same in packed forwards: each sequence's next prompt chunk, or its last token, in every row."""
    fed = [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    outs: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(t) < steps + 1 for t in tokens):
        pieces, emits = [], []
        for i, prompt in enumerate(prompts):
            if len(tokens[i]) == steps + 1:
                continue  # finished: it leaves the row
            if fed[i] < prompt.numel():
                ids = prompt[fed[i]:fed[i] + chunk]
                fed[i] += ids.numel()
                emits.append((i, fed[i] == prompt.numel()))
            else:
                ids = torch.tensor([tokens[i][-1]])
                emits.append((i, True))
            pieces.append(packed.Piece(caches[i], ids))
        for (i, emit), logits in zip(emits, packed.forward(model, pieces)):
            if emit:
                tokens[i].append(int(logits.argmax()))
                outs[i].append(logits)
    return tokens, outs


def _check(model, prompts, precision, chunk, steps, atol, layout=None):
    alone = [_alone(model, KVGuardCache(model.config, precision, layout), p, chunk, steps) for p in prompts]
    caches = [KVGuardCache(model.config, precision, layout) for _ in prompts]
    tokens, outs = _together(model, caches, prompts, chunk, steps)
    for (want_tokens, want_outs), got_tokens, got_outs, cache, prompt in zip(alone, tokens, outs, caches, prompts):
        assert got_tokens == want_tokens
        for want, got in zip(want_outs, got_outs):
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
        assert cache.get_seq_length() == prompt.numel() + steps  # its own tokens, and only those


@pytest.mark.parametrize("precision", ["fp16", "int4", "int2"])
def test_a_packed_row_reads_what_each_sequence_reads_alone(precision):
    from tests.helpers import tiny_llama

    model = tiny_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (150, 9, 230)]
    _check(model, prompts, precision, chunk=64, steps=6, atol=1e-4, layout=CacheConfig(residual=16, sinks=2, group_size=16))


def test_a_packed_forward_needs_a_sequence():
    from tests.helpers import tiny_llama

    with pytest.raises(ValueError, match="at least one sequence"):
        packed.forward(tiny_llama(), [])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_gemma3_past_its_sliding_window(gemma3_6_layers, precision):
    """Gemma 3's sliding layers (a 128-token window here) see each sequence's own window in the packed row."""
    from kvguard import data

    model, tok = gemma3_6_layers
    stream = data.token_stream("prose", "eval", tok, 1200)
    prompts = [stream[:300], stream[400:440], stream[500:1000]]
    # Logits through FP16 storage differ by summation order only; through INT4 a rounding difference can move a
    # stored value across a bin, which later tokens read (Gemma's logits run to the tens).
    _check(model, prompts, precision, chunk=128, steps=5, atol=5e-3 if precision == "fp16" else 0.2)


def test_a_packed_forward_leaves_no_cycle_that_keeps_a_cache_alive():
    """A sequence's cache is freed the moment its last reference goes, not at the next full collection (a server's
    are minutes apart): the packed forward's cache and layers must not form a reference cycle holding it."""
    import gc
    import weakref

    from tests.helpers import tiny_llama

    model = tiny_llama()
    caches = [KVGuardCache(model.config, "int4") for _ in range(2)]
    gc.collect()
    gc.disable()
    try:
        packed.forward(model, [packed.Piece(c, torch.arange(n)) for c, n in zip(caches, (40, 3))])
        refs = [weakref.ref(c) for c in caches]
        assert caches[0].get_seq_length() == 40
        del caches
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
