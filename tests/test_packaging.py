"""kvguard installed the way a user outside this repository installs it: the built wheel, the ``models`` extra and
``kvguard install-assets`` in a fresh virtual environment, run from a folder that is not the checkout."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvguard import assets

ROOT = Path(__file__).resolve().parents[1]


def test_the_models_extra_is_the_clean_half_of_the_assets():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert tuple(extras["models"]) == assets.CLEAN
    assert {a.split("==")[0] for a in assets.ASSETS} - {a.split("==")[0] for a in assets.CLEAN} == set(assets.HEAVY)
    for feature in ("ray", "export", "peers", "report"):
        assert extras[feature], feature


def _run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_lists_the_embedded_models(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)])
    wheel, = wheels.glob("kvguard-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py, kvguard = venv / "bin" / "python", venv / "bin" / "kvguard"
    # The fresh venv sees nothing of this process's: a checkout on PYTHONPATH would show pip its
    # src/kvguard.egg-info (written by the wheel build above) as kvguard already installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The pins of requirements.txt as constraints: the same torch (CPU) and transformers as the checkout's.
    # --no-compile: byte-compiling torch's thousands of modules is most of an install's time, and not under test.
    _run([str(py), "-m", "pip", "install", "-q", "--no-compile", "-c", str(ROOT / "requirements.txt"),
          f"{wheel}[models]"], env=env)
    _run([str(kvguard), "install-assets", "--", "-q", "--no-compile"], env=env)
    home = tmp_path / "home"
    env.update(KVGUARD_HOME=str(home), HF_HUB_OFFLINE="1")
    where = _run([str(py), "-c", "import kvguard; print(kvguard.__file__)"], cwd=tmp_path, env=env)
    assert where.startswith(str(venv))  # the installed package, not the checkout
    out = _run([str(kvguard), "models"], cwd=tmp_path, env=env)
    assert "| smollm2-135m " in out and "| llama " in out and "9 / 3" in out  # cells padded to the widest name
    assert "| gemma3-270m" in out and "4 / 1" in out and str(home / "models") in out
    # The features of the extras not installed here say what to install.
    probe = ("from kvguard.calibration import report\n"
             "from kvguard.peers import PeerUnsupported, quantized_cache\n"
             "try:\n    report.write(None, 'r')\nexcept ImportError as e:\n    print(e)\n"
             "try:\n    quantized_cache.make_cache('hf-quanto-4', None)\nexcept PeerUnsupported as e:\n    print(e)\n")
    hints = _run([str(py), "-c", probe], cwd=tmp_path, env=env)
    assert "pip install 'kvguard[report]'" in hints and "pip install 'kvguard[peers]'" in hints
