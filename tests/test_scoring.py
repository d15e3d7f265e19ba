import math

import pytest
import torch

from kvguard.scoring import score_stream


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are fixed: log-probabilities [log .5, log .25, log .25]."""

    device = torch.device("cpu")

    def forward(self, input_ids, cache=None, use_cache=True):
        n = input_ids.shape[1]
        logits = torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(1, n, 3)
        cache.append(n)
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_nll_hand_computed(chunk):
    ids = torch.tensor([0, 0, 1, 2, 0])  # predictions: 0, 1, 2, 0 -> -log(.5), -log(.25), -log(.25), -log(.5)
    seen = []
    score = score_stream(FixedLogits(), ids, seen, chunk=chunk, keep_logits=True)
    expected = (2 * math.log(2) + 2 * math.log(4)) / 4
    assert score.nll == pytest.approx(expected, abs=1e-6)
    assert score.perplexity == pytest.approx(math.exp(expected))
    assert sum(seen) == 4 and max(seen) <= chunk  # the last token is never fed: it has no target
    assert score.logits.shape == (4, 3)


def test_too_short_stream_is_refused():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        score_stream(FixedLogits(), torch.tensor([1]), [], chunk=1)
