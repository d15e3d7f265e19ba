"""Calibration under faults: a second run on the same --out, a machine under load, an interrupted and killed
run resumed."""

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvguard import cli, models
from kvguard.calibration.latency import count_latency
from kvguard.calibration.output import locked
from kvguard.calibration.pipeline import STAGES, calibrate
from kvguard.config import CacheConfig
from kvguard.profile import JSON_NAME, Profile
from tests.helpers import kvguard_env, small_config, tiny_llama, tiny_profile


def _no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the lock was checked")

    monkeypatch.setattr(models, "load", refuse)


def test_a_second_calibration_on_the_same_out_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile"
    tiny_profile(out, name="first")
    _no_model(monkeypatch)
    with locked(out):
        for argv in (["calibrate", "--out", str(out)], ["calibrate", "--out", str(out), "--monitor-only"]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith("kvguard calibrate: error: ") and err.count("\n") == 1
            assert f"--out {out} is being written by another calibration (pid {os.getpid()}" in err
    assert Profile.load(out).meta.model.name == "first"  # nothing mixed, nothing deleted
    with locked(out):  # released with the block
        pass


def test_a_killed_runs_lock_does_not_block_the_next(tmp_path):
    out = tmp_path / "profile"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(tmp_path / '.profile.lock')!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="being written by another calibration"):
            with locked(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    with locked(out):  # the kernel released the dead run's lock
        pass


def test_the_latency_model_is_counted_not_timed():
    model = tiny_llama()
    first = count_latency(model, CacheConfig(group_size=16), context=256)
    again = count_latency(model, CacheConfig(group_size=16), context=256)
    assert first == again
    r = first.ratios
    assert r["fp16"] == 1.0 and r["int2"] < r["int4"] < r["int8"] < 1.0
    assert first.step_bytes["fp16"] > first.step_bytes["int4"] > 2 * sum(p.numel() for p in model.parameters())


# One domain and the least held-out text: the faulted run is repeated in full, so it is kept as short as a real
# calibration gets.
TINY = dict(domains=("prose",), heldout_tokens=256)
# The children take SIGINT as a terminal would deliver it: a shell that starts a job in the background (`make
# test &`) leaves SIGINT ignored, which the children would inherit, and then nothing interrupts them.
_CHILD = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
          "from dataclasses import replace; from tests.helpers import small_config; TINY = " + repr(TINY) + "\n")

_KILL_DURING_WRITE = _CHILD + """
import os, signal, sys
import safetensors.torch
from kvguard.calibration.pipeline import calibrate

real = safetensors.torch.save_file

def save_file(tensors, path, *a, **k):
    if os.path.basename(path) == "tensors.safetensors":  # the profile's, not a checkpoint's
        real(tensors, path, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    real(tensors, path, *a, **k)

safetensors.torch.save_file = save_file
calibrate(replace(small_config(sys.argv[1]), model=sys.argv[2], **TINY), resume=True, progress=False)
"""


@pytest.mark.slow
def test_interrupted_then_killed_while_writing_under_load_resumes_to_the_same_plan(smollm2_4_layers, tmp_path):
    """One run that meets every fault: computed on a machine under CPU load (a busy loop), interrupted with
    SIGINT, resumed and SIGKILLed in the middle of writing the profile, resumed again. Its plan and search must
    be those of an uninterrupted run on the idle machine, and the previous profile intact until the end. (Real
    SmolLM2 weights, its first 4 layers: the faulted run is repeated in full.)"""
    model = str(smollm2_4_layers)
    idle = calibrate(replace(small_config(tmp_path / "idle"), model=model, **TINY), progress=False)
    out = tmp_path / "profile"
    tiny_profile(out, name="previous")
    root = str(Path(__file__).resolve().parents[2])
    env = kvguard_env()
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]])  # the children import tests.helpers
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _interrupt(out, model, env, root)
        partial = tmp_path / "profile.partial"
        assert (partial / "statistics.json").is_file() and (partial / "latency.json").is_file()
        kill = subprocess.run([sys.executable, "-c", _KILL_DURING_WRITE, str(out), model], env=env, cwd=root,
                              capture_output=True, text=True, timeout=1200)
    finally:
        busy.kill()
        busy.wait()
    assert kill.returncode == -signal.SIGKILL, kill.stderr[-2000:]
    assert Profile.load(out).meta.model.name == "previous"
    assert not any((p / JSON_NAME).exists() for p in tmp_path.iterdir() if p.name.startswith(".profile.tmp-"))
    resumed = calibrate(replace(small_config(out), model=model, **TINY), resume=True, progress=False)
    assert resumed.meta.objective.beta > 0  # the latency term is in the score
    assert resumed.meta.plan == idle.meta.plan
    assert [(c.name, c.quality, c.latency, c.score) for c in resumed.meta.search_log] == \
           [(c.name, c.quality, c.latency, c.score) for c in idle.meta.search_log]
    assert resumed.meta.record["run"]["resumed_stages"] == list(STAGES)
    assert torch.equal(resumed.tensors["calibrated.key.absmax"], idle.tensors["calibrated.key.absmax"])
    assert Profile.load(out).meta.plan == idle.meta.plan  # and the written profile passes every check on load
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idle.lock", ".profile.lock", "idle", "profile"]


def _interrupt(out: Path, model: str, env: dict, root: str) -> None:
    """A calibration in a subprocess, sent SIGINT once its first stages are checkpointed."""
    script = _CHILD + ("import sys; from kvguard.calibration.pipeline import calibrate; "
                       "calibrate(replace(small_config(sys.argv[1]), model=sys.argv[2], **TINY), progress=False)")
    run = subprocess.Popen([sys.executable, "-c", script, str(out), model], env=env, stderr=subprocess.PIPE,
                           text=True, cwd=root)
    for line in run.stderr:
        if "stage level1 ..." in line:
            run.send_signal(signal.SIGINT)
            break
    run.communicate(timeout=600)
    assert run.returncode != 0
