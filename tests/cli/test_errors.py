"""Bad input to the real CLI: one line ``kvguard <command>: error: ...`` on stderr, exit status 2, no traceback,
and — where the check needs no model — before any model is loaded."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvguard import cli, models
from tests.helpers import edit_profile, kvguard_env, tiny_profile

CALIBRATE = ["calibrate", "--out", "{d}/new-profile"]
GOOD = "{d}/profiles/good"

# (argv with {d} for the inputs folder, what the message must say). Every case runs with model loading
# disabled: the check has to come first.
CASES = {
    "eval --tokens 0": (["eval", "--tokens", "0"], "--tokens must be a positive integer, got 0"),
    "eval --tokens -5": (["eval", "--tokens", "-5"], "--tokens must be a positive integer, got -5"),
    "eval --tokens 5": (["eval", "--tokens", "5"], "at least 128 tokens are needed"),
    "eval --chunk 0": (["eval", "--chunk", "0"], "--chunk must be a positive integer, got 0"),
    "eval --chunk -3": (["eval", "--chunk", "-3"], "--chunk must be a positive integer, got -3"),
    "eval --windows 0": (["eval", "--windows", "0"], "--windows must be a positive integer"),
    "eval recall --distances 0": (["eval", "--task", "recall", "--distances", "512,0"],
                                  "--distances must be positive token counts"),
    "eval recall --words 1": (["eval", "--task", "recall", "--words", "1"], "--words must be in [2, 512]"),
    "eval --corpus klingon": (["eval", "--corpus", "klingon"], "unknown corpus klingon; valid corpora: prose, dialog"),
    "eval --methods ''": (["eval", "--methods", ""], "--methods is empty"),
    "eval --methods ' , '": (["eval", "--methods", " , "], "--methods is empty"),
    "eval --methods bogus": (["eval", "--methods", "fp16,bogus"], "unknown method 'bogus'"),
    "text file missing": (["eval", "--text-file", "{d}/missing.txt"], "text file not found: {d}/missing.txt"),
    "text file a directory": (["eval", "--text-file", "{d}/adir"], "not a regular file: {d}/adir"),
    "text file empty": (["eval", "--text-file", "{d}/empty.txt"], "text file is empty"),
    "text file whitespace": (["eval", "--text-file", "{d}/ws.txt"], "text file is empty"),
    "text file binary": (["eval", "--text-file", "{d}/binary.bin"], "contains NUL bytes"),
    "text file NUL bytes": (["eval", "--text-file", "{d}/nul.txt"], "contains NUL bytes (offset 5)"),
    "text file Latin-1": (["eval", "--text-file", "{d}/latin1.txt"], "is not UTF-8 text (invalid byte at offset 3)"),
    "text file too short": (["eval", "--text-file", "{d}/short.txt"], "has 5 tokens; at least 128 are needed"),
    "corpus too short": (["eval", "--tokens", "1000000000"], "has only"),
    "longer than the context": (["eval", "--tokens", "8200", "--corpus", "dialog"],
                                "--tokens 8200 is longer than smollm2-135m's context (8192 positions)"),
    "eval --json a directory": (["eval", "--json", "{d}/adir"], "--json {d}/adir is a directory"),
    "eval --json under a file": (["eval", "--json", "{d}/afile/out.json"], "{d}/afile is not a directory"),
    "generate --events a directory": (["generate", "--profile", GOOD, "--prompt", "hi", "--events", "{d}/adir"],
                                      "--events {d}/adir is a directory"),
    "serve --log-file a directory": (["serve", "--profile", GOOD, "--log-file", "{d}/adir"],
                                     "--log-file {d}/adir is a directory"),
    "report --out a file": (["report", "--profile", GOOD, "--out", "{d}/afile"], "--out {d}/afile exists and is not a directory"),
    "export --out its --profile": (["export", "--profile", GOOD, "--format", "vllm", "--out", GOOD, "--force"],
                                   "overlap: the export would replace the profile it reads"),
    "export --out inside --profile": (["export", "--profile", GOOD, "--format", "vllm", "--out", GOOD + "/x"], "overlap"),
    "calibrate --out a file": (CALIBRATE[:2] + ["{d}/afile"], "--out {d}/afile exists and is not a directory"),
    "calibrate --out under a file": (CALIBRATE[:2] + ["{d}/afile/p"], "{d}/afile is not a directory"),
    "calibrate --out another folder": (CALIBRATE[:2] + ["{d}/adir"], "is not a kvguard profile; refusing to overwrite"),
    "--memory-budget -1": (CALIBRATE + ["--memory-budget", "-1"], "--memory-budget must be a finite number >= 0"),
    "--memory-budget 7": (CALIBRATE + ["--memory-budget", "7"], "--memory-budget is a fraction"),
    "--alpha nan": (CALIBRATE + ["--alpha", "nan"], "--alpha must be a finite number >= 0, got nan"),
    "--beta -1": (CALIBRATE + ["--beta", "-1"], "--beta must be a finite number >= 0"),
    "--gamma inf": (CALIBRATE + ["--gamma", "inf"], "--gamma must be a finite number >= 0, got inf"),
    "--max-ppl-increase nan": (CALIBRATE + ["--max-ppl-increase", "nan"], "--max-ppl-increase must be a finite number"),
}

# Bad profiles: every command that takes --profile refuses each one with the same message.
BAD_PROFILES = {
    "edited model name": "profile.json was edited or corrupted",
    "plan of 1 layer for 2": "'plan' has 1 layers but model 'tiny' has 2",
    "plan layer with 3 heads": "'plan' layer 1 has 3 KV heads but model 'tiny' has 2",
    "monitored layer out of range": "monitored layers [0, 7] must be distinct and in [0, 1]",
    "monitor value impossible": "monitor setting warn_drop must be in (0, 1], got 7.0",
    "broken risk classifier": "invalid 'risk_classifier' block",
    "missing tensor": "tensors.safetensors lacks the tensor 'entropy.mean'",
    "tensor of the wrong shape": "'calibrated.key.absmax' must be finite, >= 0 and of shape [2, 2, 4]",
}
PROFILE_COMMANDS = {
    "eval": ["eval", "--methods", "fp16"],
    "generate": ["generate", "--prompt", "hi"],
    "report": ["report", "--out", "{d}/report"],
    "export": ["export", "--format", "vllm", "--out", "{d}/export"],
}


def _bad_profiles(root) -> None:
    import torch

    def monitor(raw, **kw):
        raw["monitor"].update(kw)

    edits = {
        "edited model name": (lambda raw: raw["model"].update(name="other-model"), False),
        "plan of 1 layer for 2": (lambda raw: raw["plan"]["layers"].pop(), True),
        "plan layer with 3 heads": (lambda raw: raw["plan"]["layers"][1]["precision"].append("int4"), True),
        "monitored layer out of range": (lambda raw: monitor(raw, layers=[0, 7]), True),
        "monitor value impossible": (lambda raw: monitor(raw, warn_drop=7.0), True),
        "broken risk classifier": (lambda raw: raw.update(risk_classifier={
            "features": ["drop"], "mean": [0.0], "std": [0.0], "weight": [1.0], "bias": 0.0, "kl_threshold": 0.01}), True),
    }
    for name, (edit, reseal) in edits.items():
        edit_profile(tiny_profile(root / name), edit, reseal=reseal)
    good = tiny_profile(root / "good")
    from kvguard.profile import Profile

    tensors = dict(Profile.load(good).tensors)
    del tensors["entropy.mean"]
    tiny_profile(root / "missing tensor", tensors=tensors)
    tensors = dict(Profile.load(good).tensors, **{"calibrated.key.absmax": torch.ones(2, 2, 3)})
    tiny_profile(root / "tensor of the wrong shape", tensors=tensors)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "afile").write_text("a file\n")
    (d / "adir").mkdir()
    (d / "adir" / "precious.txt").write_text("keep me\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "ws.txt").write_bytes(b"  \n\t\n   ")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (d / "nul.txt").write_bytes(b"Hello\x00world, this is text with a NUL byte in it.\n" * 20)
    (d / "latin1.txt").write_bytes("café au lait, très bien\n".encode("latin-1") * 50)
    (d / "short.txt").write_text("Hello there friend.\n")
    _bad_profiles(d / "profiles")
    return d


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model's weights is a test failure (a tokenizer alone is allowed)."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(models, "load", refuse)


def _fill(argv, d) -> list[str]:
    return [a.replace("{d}", str(d)) for a in argv]


def _one_line_error(capsys, argv, rc) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prefix = f"kvguard {argv[0]}: error: "
    assert lines[0].startswith(prefix), err
    return lines[0][len(prefix):]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_before_any_model(case, inputs, no_model, capsys):
    argv, expected = CASES[case]
    argv = _fill(argv, inputs)
    message = _one_line_error(capsys, argv, cli.main(argv))
    assert expected.replace("{d}", str(inputs)) in message
    assert (inputs / "adir" / "precious.txt").read_text() == "keep me\n"  # nothing overwritten


@pytest.mark.parametrize("bad", list(BAD_PROFILES))
def test_every_command_refuses_a_bad_profile_the_same_way(bad, inputs, no_model, capsys):
    messages = set()
    for command, argv in PROFILE_COMMANDS.items():
        argv = _fill(argv + ["--profile", str(inputs / "profiles" / bad)], inputs)
        messages.add(_one_line_error(capsys, argv, cli.main(argv)))
    assert len(messages) == 1, messages  # the same words from every command
    message = messages.pop()
    assert BAD_PROFILES[bad] in message and str(inputs / "profiles" / bad) in message


def test_the_good_profile_passes_the_same_checks(inputs, capsys):
    argv = _fill(["export", "--profile", GOOD, "--format", "vllm", "--out", "{d}/export-good"], inputs)
    assert cli.main(argv) == 0
    assert "written to" in capsys.readouterr().out


def test_unwritable_model_cache_names_the_directory_and_the_variable(inputs, no_model, monkeypatch, capsys):
    monkeypatch.setenv("KVGUARD_HOME", str(inputs / "afile" / "home"))
    argv = ["eval", "--methods", "fp16"]
    message = _one_line_error(capsys, argv, cli.main(argv))
    assert f"the model cache {inputs}/afile/home/models is not writable" in message
    assert "set $KVGUARD_HOME to a writable directory" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_model_cache_names_the_directory(tmp_path, no_model, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    monkeypatch.setenv("KVGUARD_HOME", str(home))
    message = _one_line_error(capsys, ["eval"], cli.main(["eval"]))
    assert f"the model cache {home}/models is not writable" in message and "$KVGUARD_HOME" in message


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="sentencepiece is installed")
def test_tokenizer_needing_sentencepiece_says_what_to_install(tmp_path, no_model, capsys):
    folder = tmp_path / "spm-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (folder / "tokenizer.model").write_bytes(b"\x0a\x02xx")
    argv = ["eval", "--model", str(folder)]
    message = _one_line_error(capsys, argv, cli.main(argv))
    assert "needs the sentencepiece package; install it with: pip install sentencepiece" in message


@pytest.mark.parametrize("case", ["eval --tokens 0", "export --out its --profile"])
def test_real_process_exit_status_and_stderr(case, inputs):
    argv, expected = CASES[case]
    proc = subprocess.run([sys.executable, "-m", "kvguard", *_fill(argv, inputs)], capture_output=True, text=True,
                          env=kvguard_env(), timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"kvguard {argv[0]}: error: ") and expected in proc.stderr


@pytest.mark.slow
def test_a_failed_final_write_still_prints_the_table(tmp_path, monkeypatch, capsys):
    from kvguard.evaluation import harness

    def disk_full(path, payload):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(harness, "write_json", disk_full)
    argv = ["eval", "--methods", "int4", "--tokens", "128", "--json", str(tmp_path / "out.json")]
    rc = cli.main(argv)
    captured = capsys.readouterr()
    assert rc == 2 and "No space left on device" in captured.err and "Traceback" not in captured.err
    assert "| fp16 " in captured.out and "| int4 " in captured.out  # the computed table came first
