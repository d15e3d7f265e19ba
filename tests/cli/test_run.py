"""``kvguard run``: the four steps of the mission, on tiny settings over a pre-seeded profile cache."""

import json
import shutil
import subprocess
import sys

import pytest

from kvguard import cli
from tests.helpers import candidate, eval_row, kvguard_env, profile_meta


def test_help_explains_each_step():
    out = subprocess.run([sys.executable, "-m", "kvguard", "run", "--help"], capture_output=True, text=True,
                         check=True, env=kvguard_env()).stdout
    for step in ("1. **Calibrate.**", "2. **Plan and frontier.**", "3. **Live loop.**", "4. **Report.**"):
        assert step in out
    assert "5,000" in out and "--recalibrate" in out and "$KVGUARD_HOME/run" in out and "--memory-budget" in out


def _profile(memories_kls: dict, chosen: str):
    """A profile stand-in whose search log holds level 1's all-INT4 plan (B4 = 0.344) and the named candidates."""
    from types import SimpleNamespace

    from kvguard.plan import Plan
    from kvguard.precision import Precision

    plan = Plan(tuple(Plan.uniform(SimpleNamespace(num_layers=2, num_kv_heads=1), Precision.INT4).layers))
    log = [candidate("L1 all-int4 window-64", plan, memory=0.344, kl=0.0010)]
    log += [candidate(name, plan, memory=m, kl=kl) for name, (m, kl) in memories_kls.items()]
    by_name = {c.name: c for c in log}
    front = tuple(c.name for c in log if c.name != "L1 all-int4 window-64")
    return SimpleNamespace(meta=profile_meta(plan, search_log=tuple(log), pareto_front=front, chosen=by_name[chosen]))


def test_step_2_shows_the_plan_nearest_int4_and_the_loops_plan():
    from kvguard.cli.run import RunConfig, shown_plans

    profile = _profile({"floor": (0.15, 0.05), "p60": (0.21, 0.012), "p85": (0.29, 0.002), "near": (0.338, 0.0008),
                        "int8ish": (0.50, 0.0001)}, chosen="near")
    rows = shown_plans(RunConfig("m", frontier_points=1), profile)
    labels = dict(rows)
    # Largest first; the chosen plan is the one nearest int4's bytes, step 3's the one nearest 0.6 x 0.344 = 0.206,
    # and one more frontier plan below int4's bytes (the first of the rest: the floor); never one above int4's bytes.
    assert [n for n, _ in rows] == ["kvguard", "kvguard@0.21", "kvguard@0.15"]
    assert labels["kvguard"] == "kvguard@0.338 (chosen, nearest int4's bytes)"
    assert labels["kvguard@0.21"] == "kvguard@0.210 (step 3's plan)"


def test_the_verdict_says_whether_the_plan_beats_int4_on_both_and_why_not():
    from kvguard.cli.run import RunConfig, verdict

    profile = _profile({"near": (0.338, 0.0008), "p85": (0.29, 0.002)}, chosen="near")
    int4 = eval_row("int4", "prose", "simulated", 4, 0.344, 12.6, -0.3, 0.00091, 0.98, 100.0, kl_p999=0.2,
                    ram_bytes_ratio=0.344)
    good = eval_row("kvguard", "prose", "simulated", 3, 0.337, 12.6, 0.1, 0.00079, 0.98, 100.0, kl_p999=0.1,
                    ram_bytes_ratio=0.337)
    lines = verdict(RunConfig("m"), profile, good, int4, [int4, good], {})
    assert lines == ["the chosen plan beats int4 on both bytes and KL: 0.337 of FP16's bytes against int4's 0.344 "
                     "(2.0 % fewer), mean KL 0.00079 against 0.00091 (13.2 % lower), p99.9 0.1000 against 0.2000."]
    worse = eval_row("kvguard", "prose", "simulated", 3, 0.337, 12.6, 0.1, 0.00120, 0.98, 100.0, kl_p999=0.3,
                     ram_bytes_ratio=0.337)
    frontier = eval_row("kvguard@0.29", "prose", "simulated", 3, 0.290, 12.6, 0.1, 0.00080, 0.98, 100.0,
                        kl_p999=0.1, ram_bytes_ratio=0.290)
    lines = verdict(RunConfig("m"), profile, worse, int4, [int4, worse, frontier], {"kvguard@0.29": "kvguard@0.290"})
    assert lines[0].startswith("the chosen plan does NOT beat int4 on both bytes and KL here: 0.337 of FP16's bytes "
                               "against int4's 0.344 (2.0 % fewer), mean KL 0.00120 against 0.00091 (31.9 % higher)")
    assert any("why: the quick calibration ranked its candidates on 512 held-out tokens" in line for line in lines)
    assert lines[-1] == "  on the frontier, kvguard@0.290 does: 0.290 of FP16's bytes, mean KL 0.00080."


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
    assert f"reusing the cached quick profile {cached}" in out and "--samples 5000" in out and "QUICK profile" in out
    # Step 2: the tiers of all 30 layers, the frontier, and the table against FP16 and int4, with the KL's tail.
    assert "Pareto frontier of the search" in out and "(* chosen)" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert "KL p99.9" in table[0] and "bytes held / FP16" in table[0]
    methods = [line.split("|")[1].strip() for line in table[1:]]
    assert methods[:2] == ["fp16", "int4"] and any("(chosen" in m for m in methods)
    assert any("nearest int4's bytes" in m for m in methods) and any("step 3's plan" in m for m in methods)
    assert "beats int4 on both bytes and KL" in out or "does NOT beat int4" in out
    # Step 3: the loop over a low-bit frontier plan, every tier of its bytes, the same reply scored statically.
    assert "kvguard-live:kvguard@" in out and "rollback: level" in out and "every tier in RAM counted" in out
    assert "teacher-forced, KL from FP16" in out and "the frontier plan nearest those bytes" in out
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(events) == 0 or f"token {events[0]['token']:>5}" in out
    # Step 4: the report, with the loop's timeline section.
    page = tmp_path / "report" / "index.html"
    assert f"timeline): {page}" in out
    assert 'id="timeline"' in page.read_text()
    assert len(out.splitlines()) < 120  # two screens
