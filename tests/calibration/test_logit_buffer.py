"""The output head writes into one buffer across scoring passes, and computes the model's own logits."""

import pytest
import torch

from kvguard import data
from kvguard.calibration.logit_buffer import LogitBuffer

pytestmark = pytest.mark.slow


def test_the_head_writes_the_models_own_logits_into_one_buffer_across_passes(smollm2):
    model, tok = smollm2
    ids = data.token_stream("code", "calib", tok, 120).reshape(1, -1)
    head = model.get_output_embeddings()
    with torch.no_grad():
        own = [model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=k).logits for n, k in ((120, 50), (80, 30))]
    buffer = LogitBuffer()
    with buffer.installed(model):
        first = model(input_ids=ids, use_cache=False, logits_to_keep=50).logits  # [1, 50, vocab]
        assert torch.equal(first, own[0])  # bit for bit
        address = first.data_ptr()
        second = model(input_ids=ids[:, :80], use_cache=False, logits_to_keep=30).logits
        assert torch.equal(second, own[1])
        assert second.data_ptr() == address  # the smaller pass reuses the same memory
    assert "forward" not in vars(head)  # the class's forward again after the block
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False, logits_to_keep=50).logits
    assert after.data_ptr() != address and torch.equal(after, own[0])
