"""A reference's next-token log-probabilities on disk, so that the length of a scored text is not bounded by RAM.

KL against a reference needs the reference's whole ``[predictions, vocab]`` distribution at every position. Held in
the process that is 8,191 x 151,936 x 4 bytes = 5.0 GB for Qwen2.5 at 8,192 tokens and 8.6 GB for Gemma 3 (17 GB at
16,384), next to the model and the logits being scored. :class:`LogprobFile` writes the rows once, in order, with
ordinary file writes and reads back the slice a scorer asks for: the process holds one slice, and what the kernel keeps
of the file is page cache it can reclaim. The file lives in a fresh temporary directory (``TMPDIR``, or ``directory``)
removed by :meth:`LogprobFile.close`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

_FLOAT32 = 4  # bytes per stored value


class LogprobFile:
    """``[rows, vocab]`` float32 log-probabilities, appended in row order as logits (:meth:`append` takes the
    log-softmax) and read back by contiguous row slices (``file[start:stop]`` is a ``[stop - start, vocab]`` tensor).
    The vocabulary size is learnt from the first append."""

    def __init__(self, rows: int, directory: str | os.PathLike | None = None) -> None:
        if rows < 1:
            raise ValueError(f"a log-probability file needs at least one row, got {rows}")
        if directory is not None and not Path(directory).is_dir():
            raise FileNotFoundError(f"no directory {directory} to hold the reference log-probabilities in")
        self.rows, self.vocab, self.written = rows, 0, 0
        self._dir = Path(tempfile.mkdtemp(prefix="kvguard-logprobs-", dir=directory))
        self.path = self._dir / "logprobs.f32"
        self._file = open(self.path, "w+b")

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.vocab

    def append(self, logits: torch.Tensor) -> None:
        """Store the log-softmax of ``logits`` ``[n, vocab]`` as the next ``n`` rows."""
        n = logits.shape[0]
        if self.written + n > self.rows:
            raise ValueError(f"{self.written} + {n} rows written to a log-probability file of {self.rows}")
        if self.vocab == 0:
            self.vocab = logits.shape[-1]
        elif logits.shape[-1] != self.vocab:
            raise ValueError(f"logits of {logits.shape[-1]} columns appended to a file of {self.vocab}")
        rows = torch.log_softmax(logits.float(), dim=-1).cpu().contiguous()
        try:
            self._file.seek(self.written * self.vocab * _FLOAT32)
            self._file.write(rows.numpy().data)
        except OSError as err:
            need = self.rows * self.vocab * _FLOAT32
            raise OSError(f"could not write the reference log-probabilities to {self.path} ({need / 2**30:.1f} GiB in "
                          f"all): {err}; point TMPDIR at a directory with room") from err
        self.written += n

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice):
            raise TypeError(f"a log-probability file is read by row slices, not {type(rows).__name__}")
        start, stop, step = rows.indices(self.written)
        if step != 1:
            raise ValueError("a log-probability file is read by contiguous row slices")
        out = torch.empty(max(0, stop - start), self.vocab, dtype=torch.float32)
        if out.numel():
            self._file.flush()
            self._file.seek(start * self.vocab * _FLOAT32)
            got = self._file.readinto(out.numpy().data)
            if got != out.numel() * _FLOAT32:
                raise OSError(f"{self.path} ended after {got} of {out.numel() * _FLOAT32} bytes")
        return out

    def close(self) -> None:
        """Delete the file and its directory (idempotent)."""
        if not self._file.closed:
            self._file.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LogprobFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
