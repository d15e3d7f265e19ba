"""``kvguard run``: the four steps of the mission, on tiny settings over a pre-seeded profile cache."""

import json
import shutil
import subprocess
import sys

import pytest

from kvguard import cli
from tests.helpers import kvguard_env


def test_help_explains_each_step():
    out = subprocess.run([sys.executable, "-m", "kvguard", "run", "--help"], capture_output=True, text=True,
                         check=True, env=kvguard_env()).stdout
    for step in ("1. **Calibrate.**", "2. **Plan and frontier.**", "3. **Live loop.**", "4. **Report.**"):
        assert step in out
    assert "5,000" in out and "--recalibrate" in out and "$KVGUARD_HOME/run" in out


@pytest.mark.slow
def test_run_tells_the_four_steps(tmp_path, small_profile_dir, capsys):
    from kvguard.cli.run import RunConfig, profile_dir

    flags = dict(samples=8, max_tokens=64, heldout_tokens=512, head_layers=1, domains=("prose", "code"))
    # The quick calibration is cached by a digest of its settings: seed the cache with the suite's small profile
    # so that step 1 reuses it (calibrating is covered by tests/calibration/test_pipeline.py).
    _, cached = profile_dir(RunConfig("smollm2-135m", tmp_path, **flags), tmp_path)
    shutil.copytree(small_profile_dir, cached)
    argv = ["run", "--cache", str(tmp_path), "--samples", "8", "--max-tokens", "64", "--heldout-tokens", "512",
            "--head-layers", "1", "--domains", "prose,code", "--tokens", "160", "--peers", "int4",
            "--frontier-points", "2", "--max-new-tokens", "12"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line.startswith("=== ")]
    assert [h[:7] for h in headings] == ["=== 1/4", "=== 2/4", "=== 3/4", "=== 4/4"]
    assert f"reusing the cached profile {cached}" in out and "--samples 5000" in out
    # Step 2: the tiers of all 30 layers, the frontier, and the table against FP16 and the peer.
    assert "Pareto frontier of the search" in out and "(* chosen)" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    methods = [line.split("|")[1].strip() for line in table[1:]]
    assert methods[:2] == ["fp16", "kvguard (chosen)"] and methods[-1] == "int4"
    assert any(m.startswith("frontier ") for m in methods)
    # Step 3: the loop over the most aggressive frontier plan; its events file holds what the timeline tells.
    assert "kvguard-live:kvguard@" in out and "rollback: level" in out
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(events) == 0 or f"token {events[0]['token']:>5}" in out
    # Step 4: the report, with the loop's timeline section.
    page = tmp_path / "report" / "index.html"
    assert f"timeline): {page}" in out
    assert 'id="timeline"' in page.read_text()
    assert len(out.splitlines()) < 120  # two screens
