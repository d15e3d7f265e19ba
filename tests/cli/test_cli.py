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
    assert "| smollm2-135m | llama" in out and "9 / 3" in out and "30x full_attention" in out
    assert "| gemma3-270m" in out and "4 / 1" in out and "15x sliding_attention, 3x full_attention (window 512)" in out
    assert "| qwen2.5-coder-0.5b | qwen2" in out and "14 / 2" in out and "24x full_attention" in out
