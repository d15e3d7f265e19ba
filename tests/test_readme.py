import re
import shutil
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_example_runs(capsys, tmp_path, monkeypatch, small_profile_dir):
    """The README's Python example, run as written, against a small calibrated profile at the path it names."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    shutil.copytree(small_profile_dir, tmp_path / "profiles" / "smollm2")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    ratio = float(re.search(r"KV cache: ([0-9.]+) of FP16", out).group(1))
    assert 0.1 < ratio < 0.9  # tokens past the FP window and sinks were quantized


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    missing = [link for link in links if not (README.parent / link).exists()]
    assert missing == []
    assert "make run" in text and "make test" in text
