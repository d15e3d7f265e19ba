"""``kvguard calibrate`` end to end on the real SmolLM2 (small settings), resume, and the profile's use."""

import json
from dataclasses import replace

import pytest
import torch

from tests.helpers import small_config as _config
from kvguard import cli
from kvguard.calibration.kv_statistics import KVStatistics
from kvguard.calibration.pipeline import calibrate
from kvguard.profile import Profile, ProfileError
from kvguard.calibration.search import Searcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(small_profile_dir, smollm2):
    return Profile.load(small_profile_dir, smollm2[0])


def test_profile_holds_everything_the_runtime_needs(calibrated, smollm2):
    p = calibrated
    arch_layers, kv_heads, head_dim = 30, 3, 64
    assert p.meta.model.name == "smollm2-135m" and p.fingerprint.startswith("sha256:")
    assert p.meta.data.domains["prose"].samples == 4 and p.meta.data.domains["code"].samples == 4
    assert p.meta.data.split == "calib"
    assert p.meta.monitor.window_tokens == 32 and p.meta.monitor.refresh_tokens == 8 and p.meta.monitor.warn_drop == 0.20
    assert p.meta.libraries["torch"] == torch.__version__
    # Per-batch statistics (2 batches of 4 samples), aggregates, calibrated ranges, entropy baseline, sensitivity.
    assert p.tensors["stats.batch.key.max"].shape == (2, arch_layers, kv_heads, head_dim)
    scales = p.static_scales()
    assert scales.key_absmax.shape == scales.value_absmax.shape == (arch_layers, kv_heads, head_dim)
    assert p.entropy_baseline().mean.shape == (arch_layers, 9, 17)
    assert bool((KVStatistics.aggregate_from(p.tensors)["key.absmax"] > 0).all())
    assert KVStatistics.from_tensors(p.tensors).num_batches == 2
    assert p.tensors["sensitivity.alone_kl"].shape == (arch_layers,)
    assert int((~torch.isnan(p.tensors["sensitivity.head_alone_kl"])).any(1).sum()) == 1  # one layer per head
    # The search: all three levels, a frontier drawn from the log, a chosen plan that meets the constraints.
    log = p.meta.search_log
    assert {c.level for c in log} == {1, 2, 3}
    assert set(p.meta.pareto_front) <= {c.name for c in log}
    chosen = p.meta.chosen
    assert p.meta.constraints_met and chosen.memory <= 0.40 and chosen.ppl_increase_pct <= 2.0
    assert chosen.score == min(c.score for c in log if c.feasible)
    assert p.plan.to_dict() == chosen.plan.to_dict()


def test_resume_continues_after_the_last_finished_stage(smollm2_4_layers, tmp_path, monkeypatch):
    # Real SmolLM2 weights, its first 4 layers: the run is repeated (whole, interrupted, resumed).
    def config(out, **kw):
        return replace(_config(out, domains=("prose",), heldout_tokens=256, **kw), model=str(smollm2_4_layers))

    whole = calibrate(config(tmp_path / "whole"), progress=False)
    out = tmp_path / "profile"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Searcher, "level2", interrupted)
        with pytest.raises(KeyboardInterrupt):
            calibrate(config(out), progress=False)
    assert not out.exists()
    partial = tmp_path / "profile.partial"
    assert sorted(f.name for f in partial.glob("*.json")) == ["latency.json", "level1.json", "sensitivity.json", "statistics.json"]
    # A different configuration cannot resume that run.
    with pytest.raises(ValueError, match="different settings"):
        calibrate(config(out, seed=1), resume=True, progress=False)

    resumed = calibrate(config(out), resume=True, progress=False)
    assert resumed.meta.record["run"]["resumed_stages"] == ["statistics", "latency", "level1", "sensitivity"]
    assert not partial.exists()
    # Same seed, same profile: the plan and every candidate's measured quality are identical.
    assert resumed.meta.plan.to_dict() == whole.meta.plan.to_dict()
    assert [(c.name, c.quality) for c in resumed.meta.search_log] == [(c.name, c.quality) for c in whole.meta.search_log]
    assert torch.equal(resumed.tensors["stats.batch.value.std"], whole.tensors["stats.batch.value.std"])


def test_eval_and_report_use_the_profile(calibrated, tmp_path, capsys):
    path = str(calibrated.path)
    assert cli.main(["eval", "--model", "smollm2-135m", "--profile", path, "--methods", "int4", "--tokens", "300",
                     "--json", str(tmp_path / "eval.json")]) == 0
    rows = json.loads((tmp_path / "eval.json").read_text())["results"]
    row = next(r for r in rows if r["method"] == "kvguard")
    assert row["mode"] == "simulated" and 0 < row["kv_bytes_ratio"] < 1 and row["kl"] > 0
    assert cli.main(["report", "--profile", path, "--out", str(tmp_path / "report")]) == 0
    for name in ("index.html", "sensitivity.png", "pareto.png", "precision.png"):
        assert (tmp_path / "report" / name).is_file()
    capsys.readouterr()
    assert cli.main(["eval", "--model", "gemma3-270m", "--profile", path, "--methods", "int4"]) == 2
    assert "fingerprint" in capsys.readouterr().err


def test_bad_settings_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="domains"):
        _config(tmp_path / "p", domains=("poetry",))
    with pytest.raises(ValueError, match="per domain"):
        _config(tmp_path / "p", heldout_tokens=100)
    assert cli.main(["calibrate", "--out", str(tmp_path / "p"), "--memory-budget", "3"]) == 2
    assert "--memory-budget is a fraction" in capsys.readouterr().err
    with pytest.raises(ProfileError):
        Profile.load(tmp_path / "nothing-here")


def test_profile_carries_a_calibrated_monitor(calibrated):
    p = calibrated
    fit = p.meta.record["monitor_calibration"]
    assert len(fit["fp16_alarm_rate"]) == 30
    # Monitored layers are exactly those whose entropy alarms stayed quiet under FP16 on held-out text.
    assert p.meta.monitor.layers == tuple(l for l, r in enumerate(fit["fp16_alarm_rate"]) if r <= 0.01)
    assert fit["windows"] > 0 and set(fit["heldout_auc"]) >= {"entropy_drop_mean", "werr_k_mean", "risk_max"}
    clf = p.meta.risk_classifier
    assert clf is not None and clf.features == ("drop", "abs_drop", "werr_k", "werr_v") and clf.kl_threshold == 0.01


def test_live_loop_in_eval_and_generate(calibrated, tmp_path, capsys):
    path = str(calibrated.path)
    assert cli.main(["eval", "--model", "smollm2-135m", "--profile", path, "--methods", "kvguard-live,kvguard-live:int2",
                     "--tokens", "200", "--json", str(tmp_path / "eval.json")]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "eval.json").read_text())["results"]}
    for name in ("kvguard-live", "kvguard-live:int2"):
        row = rows[name]
        assert row["mode"] == "live" and row["trigger_rate"] is not None and 0 <= row["trigger_rate"] <= 1
        assert 0 <= row["recompute_fraction"] <= 1 and 0 < row["kv_bytes_ratio"] < 1 and row["kl"] > 0
    # The loop over the profile's own plan changes little: same bytes, similar quality.
    assert abs(rows["kvguard-live"]["kv_bytes_ratio"] - rows["kvguard"]["kv_bytes_ratio"]) < 0.05
    capsys.readouterr()
    events = tmp_path / "events.jsonl"
    assert cli.main(["generate", "--profile", path, "--prompt", "Write a short poem about the sea.",
                     "--max-new-tokens", "24", "--events", str(events)]) == 0
    out = capsys.readouterr().out
    assert "% saved" in out and "monitor:" in out and "rollback: level" in out
    assert events.is_file() and all(json.loads(line)["sequence"] for line in events.read_text().splitlines())
    assert cli.main(["generate", "--profile", path, "--prompt", " ", "--max-new-tokens", "4"]) == 2
    assert cli.main(["generate", "--profile", path, "--prompt", "hi", "--plan", "hf-quanto-4"]) == 2
    assert "'hf-quanto-4' is not one" in capsys.readouterr().err
