import pytest
import torch

from kvguard.logprob_file import LogprobFile
from kvguard.scoring import score_stream
from tests.test_scoring import FixedLogits


def test_rows_come_back_bit_for_bit_as_log_softmax(tmp_path):
    logits = torch.randn(37, 11) * 5
    with LogprobFile(37, tmp_path) as f:
        f.append(logits[:20])
        f.append(logits[20:])
        assert f.shape == (37, 11) and f.written == 37
        expected = torch.log_softmax(logits, dim=-1)
        assert torch.equal(f[0:37], expected)
        assert torch.equal(f[5:9], expected[5:9])
        assert f[30:99].shape == (7, 11)  # clipped to what was written, like a tensor slice
        path = f.path
        assert path.stat().st_size == 37 * 11 * 4
    assert not path.exists() and not path.parent.exists()  # the file and its directory go with it


def test_bad_use_is_refused(tmp_path):
    with LogprobFile(4, tmp_path) as f:
        f.append(torch.zeros(3, 5))
        with pytest.raises(ValueError, match="3 \\+ 2 rows written to a log-probability file of 4"):
            f.append(torch.zeros(2, 5))
        with pytest.raises(ValueError, match="6 columns appended to a file of 5"):
            f.append(torch.zeros(1, 6))
        with pytest.raises(TypeError, match="row slices"):
            f[0]
        with pytest.raises(ValueError, match="contiguous"):
            f[0:3:2]
    with pytest.raises(FileNotFoundError, match="no directory .*missing"):
        LogprobFile(4, tmp_path / "missing")
    with pytest.raises(ValueError, match="at least one row"):
        LogprobFile(0, tmp_path)


def test_a_file_reference_scores_like_one_in_memory(tmp_path):
    ids = torch.tensor([0, 0, 1, 2, 0, 1, 1])
    other = torch.randn(ids.numel() - 1, 3)  # a reference unlike the model's fixed distribution: KL > 0
    with LogprobFile(ids.numel() - 1, tmp_path) as f:
        f.append(other)
        against_file = score_stream(FixedLogits(), ids, [], chunk=2, reference=f)
    against_memory = score_stream(FixedLogits(), ids, [], chunk=2, reference=torch.log_softmax(other, dim=-1))
    assert against_file.kl == against_memory.kl > 0.01
    assert torch.equal(against_file.token_kl, against_memory.token_kl)


def test_a_scored_run_becomes_a_reference_file(tmp_path):
    ids = torch.tensor([0, 0, 1, 2, 0, 1, 1])
    with LogprobFile(ids.numel() - 1, tmp_path) as f:
        kept = score_stream(FixedLogits(), ids, [], chunk=4, keep_logprobs=f)
        assert kept.logits is None and f.written == ids.numel() - 1
        assert torch.allclose(f[0:6], torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(6, 3))
        again = score_stream(FixedLogits(), ids, [], chunk=1, reference=f)
    assert again.kl == pytest.approx(0.0, abs=1e-7) and again.top1_agree == 1.0
