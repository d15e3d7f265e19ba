"""Finished calibration stages, kept under ``<out>.partial/`` so ``--resume`` continues after the last one.

Each stage is ``<stage>.json`` (its results, and the digest of the settings that produced it) plus, when it
has tensors, ``<stage>.safetensors``; both are written atomically. A resume with other settings is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvguard import atomic


class Checkpoints:
    """The checkpoint directory of one calibration run (``key``: the digest of its settings)."""

    def __init__(self, out: Path, key: str, resume: bool) -> None:
        self.dir = out.parent / f"{out.name}.partial"
        self.key = key
        if self.dir.exists() and not resume:
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def load(self, stage: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        path = self.dir / f"{stage}.json"
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        if meta.get("config_key") != self.key:
            raise ValueError(f"--resume: {self.dir} holds a run with different settings; rerun without --resume")
        tensor_path = self.dir / f"{stage}.safetensors"
        return meta, (load_file(str(tensor_path)) if tensor_path.is_file() else {})

    def save(self, stage: str, meta: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        from safetensors.torch import save

        if tensors:
            atomic.write_bytes(self.dir / f"{stage}.safetensors", save({k: v.contiguous() for k, v in tensors.items()}))
        atomic.write_text(self.dir / f"{stage}.json", json.dumps(dict(meta, config_key=self.key), indent=1))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
