"""The README's examples run as written: the Python example against a small profile, every ``kvguard`` command it
shows parses with the real command line, every ``make`` target it names exists, and every link resolves."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _blocks(kind: str = "") -> list[str]:
    """The README's fenced code blocks whose fence names ``kind`` (``""``: plain ones)."""
    blocks, current, lang = [], None, None
    for line in README.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, lang = [], line[3:].strip()
            else:
                if lang == kind:
                    blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _command_lines(prefix: str) -> list[str]:
    """The README's shell lines that start with ``prefix``, continuation lines joined and comments dropped."""
    lines = []
    for block in _blocks():
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefix + " "):
                lines.append(line)
    return lines


@pytest.mark.slow
def test_readme_python_example_runs(capsys, tmp_path, monkeypatch, small_profile_dir):
    """The README's Python example, run as written, against a small calibrated profile at the path it names."""
    blocks = _blocks("python")
    assert blocks, "README has no python example"
    shutil.copytree(small_profile_dir, tmp_path / "profiles" / "smollm2")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    ratio = float(re.search(r"KV cache: ([0-9.]+) of FP16", out).group(1))
    assert 0.1 < ratio < 0.9  # tokens past the FP window and sinks were quantized


def test_readme_kvguard_commands_parse():
    """Every ``kvguard ...`` line of the README is a command the CLI takes, with flags it knows (parsed, not run)."""
    from kvguard.cli import build_parser

    commands = _command_lines("kvguard")
    named = {line.split()[1] for line in commands}
    assert {"calibrate", "eval", "generate", "serve", "export", "check-engine", "report"} <= named
    parser = build_parser()
    for line in commands:
        argv = shlex.split(line)[1:]
        if argv in (["--help"], ["models"]):
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the README's command does not parse: {line}")
        assert callable(args.func)


def test_readme_make_targets_exist():
    """``make run`` and ``make test`` (and any other target the README names) are Makefile targets."""
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"`?make ([a-z][\w-]*)", README.read_text()))
    assert {"run", "test"} <= named
    assert named <= targets, f"the README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    missing = [link for link in links if not (README.parent / link).exists()]
    assert missing == []


def test_readme_is_a_door():
    """A newcomer's page: at most 100 lines, one table of what kvguard buys, the two commands, the Python example."""
    text = README.read_text()
    assert len(text.splitlines()) <= 100
    tables = re.findall(r"^\|---", text, flags=re.M)
    assert len(tables) == 1
    for peer in ("int4", "llama.cpp", "QuantizedCache"):
        assert peer in text


def test_readme_figures_name_their_source():
    """The table's figures come from measured result files that exist."""
    text = README.read_text()
    cited = set(re.findall(r"`(?:benchmarks/results/)?(smollm2-135m)?(-[\w-]+\.json)`", text))
    files = {f"smollm2-135m{suffix}" for _, suffix in cited}
    assert files, "the README quotes no result file"
    missing = [f for f in files if not (ROOT / "benchmarks" / "results" / f).is_file()]
    assert missing == []
