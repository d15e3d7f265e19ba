"""Atomic writes survive kills (the previous profile stays readable, no leftover is taken for a profile) and
give the umask's permissions, not owner-only ones."""

import os
import signal
import stat

import pytest

from kvguard import atomic
from kvguard.profile import JSON_NAME, TENSORS_NAME, Profile
from tests.helpers import tiny_profile


def _killed_while(action) -> None:
    """Run ``action()`` in a forked child that SIGKILLs itself where ``action`` says; wait for it."""
    pid = os.fork()
    if pid == 0:
        try:
            action()
        finally:
            os._exit(3)  # action() should never get here
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _kill_self(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)


def test_kill_between_the_two_renames_keeps_the_previous_profile(tmp_path, monkeypatch):
    target = tiny_profile(tmp_path / "prof", name="first")

    def replace_then_die():
        calls = []
        real = os.replace

        def replace(a, b):
            calls.append((a, b))
            real(a, b)
            if len(calls) == 1:
                _kill_self()  # the old profile is aside, the new one not yet in place

        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two-rename path, as on other kernels
        monkeypatch.setattr(os, "replace", replace)
        tiny_profile(target, name="second")

    _killed_while(replace_then_die)
    assert not target.exists() and [p.name for p in tmp_path.iterdir() if ".old-" in p.name]
    assert Profile.load(target).meta.model.name == "first"  # the reader put the previous one back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof"]


def test_kill_during_the_write_leaves_the_previous_profile_and_no_profile_like_leftover(tmp_path, monkeypatch):
    target = tiny_profile(tmp_path / "prof", name="first")

    def write_then_die():
        import safetensors.torch

        real = safetensors.torch.save_file

        def save_file(tensors, path, *a, **k):
            real(tensors, path, *a, **k)
            _kill_self()  # the tensors written, profile.json not yet

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        tiny_profile(target, name="second")

    _killed_while(write_then_die)
    leftovers = [p for p in tmp_path.iterdir() if p.name != "prof"]
    assert leftovers and all(p.name.startswith(".prof.tmp-") for p in leftovers)  # hidden, named as temporary
    assert not any((p / JSON_NAME).exists() for p in leftovers)
    assert Profile.load(target).meta.model.name == "first"
    tiny_profile(target, name="third")  # the next write clears what the killed writer left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof"]
    assert Profile.load(target).meta.model.name == "third"


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    target = tiny_profile(tmp_path / "prof")
    mine = tmp_path / f".prof.tmp-{os.getpid()}-0123abcd"
    mine.mkdir()
    atomic.recover(target)
    assert mine.is_dir()


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_profiles_get_the_umasks_permissions(tmp_path, umask, dir_mode, file_mode):
    old = os.umask(umask)
    try:
        target = tiny_profile(tmp_path / "prof")
        tiny_profile(target)  # and when replacing one
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == dir_mode
    for name in (JSON_NAME, TENSORS_NAME):
        assert stat.S_IMODE((target / name).stat().st_mode) == file_mode
