"""``--device``: ``auto`` resolves to what torch sees, ``cuda`` without a GPU is refused at once in one line (before
any model loads), every command that runs a model takes the flag, and the API hands the device to the load."""

import pytest
import torch

from kvguard import cli, device, models
from kvguard.device import Device, DeviceUnavailableError
from tests.helpers import small_config, tiny_llama, tiny_profile

# The commands that run a model, with the least each needs to get as far as the device check.
MODEL_COMMANDS = {
    "eval": ["eval", "--methods", "fp16"],
    "eval --task speed": ["eval", "--task", "speed", "--methods", "fp16"],
    "eval --task capacity": ["eval", "--task", "capacity", "--methods", "fp16"],
    "calibrate": ["calibrate", "--out", "{d}/new-profile"],
    "calibrate --monitor-only": ["calibrate", "--out", "{d}/profile", "--monitor-only"],
    "generate": ["generate", "--profile", "{d}/profile", "--prompt", "hi"],
    "serve": ["serve", "--profile", "{d}/profile"],
    "export --memory-budget": ["export", "--profile", "{d}/profile", "--format", "vllm", "--out", "{d}/export",
                               "--memory-budget", "0.5"],
    "run": ["run", "--cache", "{d}/run"],
}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the device was checked")

    monkeypatch.setattr(models, "load", refuse)
    monkeypatch.setattr(models, "resolve", refuse)


def test_auto_is_cuda_only_where_torch_sees_one(no_gpu, monkeypatch):
    assert device.resolve("auto") == torch.device("cpu") == device.resolve(Device.CPU)
    assert device.name("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve("auto") == torch.device("cuda")


def test_auto_here():
    assert device.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cuda_without_a_gpu_names_the_problem_and_the_fix(no_gpu):
    for asked in ("cuda", Device.CUDA, torch.device("cuda", 1)):
        with pytest.raises(DeviceUnavailableError, match=r"torch sees no CUDA GPU here .* use --device cpu"):
            device.resolve(asked)
    with pytest.raises(ValueError, match=r"device has to be one of \[cpu, cuda, auto\] but got 'gpu'"):
        device.resolve("gpu")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("device")
    tiny_profile(d / "profile")
    return d


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_every_model_command_refuses_cuda_at_once(command, inputs, no_gpu, no_model, capsys):
    argv = [a.replace("{d}", str(inputs)) for a in MODEL_COMMANDS[command]] + ["--device", "cuda"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvguard {argv[0]}: error: device 'cuda' was asked for, but torch sees no CUDA GPU"), err
    assert "--device cpu" in err


def test_the_flag_is_on_exactly_the_commands_that_run_a_model():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    with_flag = {name for name, p in sub.items() if any("--device" in a.option_strings for a in p._actions)}
    assert with_flag == {"eval", "calibrate", "generate", "serve", "export", "run"}
    flag = next(a for a in sub["eval"]._actions if "--device" in a.option_strings)
    assert flag.default == "auto" and flag.choices == ["cpu", "cuda", "auto"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer, as a model folder (loads and scores in a second)."""
    out = tmp_path_factory.mktemp("tiny-model")
    tok = models.load_tokenizer("smollm2-135m")
    tiny_llama(vocab_size=len(tok), hidden_size=128).save_pretrained(out)  # head_dim 32: whole groups
    tok.save_pretrained(out)
    return out


def test_device_cpu_end_to_end(tiny_folder, capsys):
    argv = ["eval", "--model", str(tiny_folder), "--device", "cpu", "--methods", "int8", "--tokens", "128"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "| int8 " in out and "| fp16 " in out


def test_load_puts_the_model_on_the_device(tiny_folder):
    model, _ = models.load(tiny_folder, device="auto")
    assert model.device == device.resolve("auto")
    assert all(p.device == model.device for p in model.parameters())


class _Loaded(Exception):
    pass


@pytest.fixture
def load_spy(monkeypatch):
    """Records the device every ``models.load`` is asked for, then stops the caller."""
    seen = []

    def spy(name, **kwargs):
        seen.append(kwargs.get("device"))
        raise _Loaded

    monkeypatch.setattr(models, "load", spy)
    return seen


def test_the_entry_points_hand_the_device_to_the_load(load_spy, inputs, tmp_path):
    from kvguard.calibration import pipeline
    from kvguard.evaluation import capacity, speed
    from kvguard.serving.engine import Engine
    from kvguard.serving.settings import ServeConfig

    calls = [
        lambda: pipeline.calibrate(small_config(tmp_path / "p", device="auto"), progress=False),
        lambda: pipeline.refit_monitor(inputs / "profile", device="auto"),
        lambda: Engine(ServeConfig("smollm2-135m", str(inputs / "profile"), device="auto")),
        lambda: speed.measure("smollm2-135m", "int4", 128, 4, device="auto"),
        lambda: capacity.probe("smollm2-135m", "int4", 1, 64, device="auto"),
    ]
    for call in calls:
        with pytest.raises(_Loaded):
            call()
    assert load_spy == ["auto"] * len(calls)


def test_configs_validate_the_device_and_keep_cpu_digests(tmp_path, no_gpu):
    from kvguard.serving.settings import ServeConfig

    with pytest.raises(ValueError, match=r"device has to be one of \[cpu, cuda, auto\] but got 'tpu'"):
        small_config(tmp_path, device="tpu")
    with pytest.raises(ValueError, match="device has to be one of"):
        ServeConfig("m", "p", device="tpu")
    # Where auto means cpu, the profile digest is the one a run before the device setting had.
    assert small_config(tmp_path, device="auto").key() == small_config(tmp_path, device="cpu").key()
