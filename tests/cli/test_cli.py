import subprocess
import sys

import pytest

from kvguard import cli
from tests.helpers import kvguard_env


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "kvguard", "--help"], capture_output=True, text=True, check=True,
                         env=kvguard_env()).stdout
    for name in ("models", "run", "eval", "calibrate", "generate", "serve", "report", "export"):
        assert name in out


def test_subcommands_name_their_missing_arguments(capsys):
    for name, missing in (("serve", "--profile"), ("export", "--profile, --format, --out")):
        with pytest.raises(SystemExit) as exc:
            cli.main([name])
        assert exc.value.code == 2 and f"the following arguments are required: {missing}" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["run", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard run: error: ") and "embedded model" in err  # named by the command, one line
    assert err.count("\n") == 1


@pytest.mark.slow
def test_models_lists_the_embedded_models(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()
            if line.startswith("| ") and "-" in line.split("|")[1]}  # model name -> its cells, padding stripped
    assert rows["smollm2-135m"][:5] == ["llama", "30", "9 / 3", "64", "30x full_attention"]
    assert rows["gemma3-270m"][:5] == ["gemma3_text", "18", "4 / 1", "256",
                                       "15x sliding_attention, 3x full_attention (window 512)"]
    assert rows["qwen2.5-coder-0.5b"][:5] == ["qwen2", "24", "14 / 2", "64", "24x full_attention"]
