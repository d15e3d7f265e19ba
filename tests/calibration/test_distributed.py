"""Calibration on Ray equals the single-process run bit for bit; Ray stays optional.

The end-to-end comparison calibrates twice (in this process, then on a local Ray with 2 workers started by
the test), so to stay near a minute on 2 cores it uses SmolLM2's real weights cut to its first 4 layers: a
real model folder with the same heads and vocabulary, whose sensitivity sweep has 12 trials instead of 64.
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvguard
from tests.helpers import small_config
from kvguard import cli
from kvguard.calibration.pipeline import calibrate
from kvguard.calibration.distributed import RayConfig
from kvguard.profile import Profile


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (make ray, or pip install 'kvguard[ray]')")
    # Workers import the kvguard under test, wherever it lives, not another installed copy.
    package_root = str(Path(kvguard.__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": package_root, "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equal bytes is bitwise equality (NaN where NaN, -0.0 apart from 0.0)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.slow
def test_ray_calibration_equals_the_single_process_run(ray_cluster, smollm2_4_layers, tmp_path, capsys):
    model = str(smollm2_4_layers)
    # This process computes with 2 torch threads, the workers with 1: the results must not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        local = calibrate(replace(small_config(tmp_path / "local"), model=model), progress=False)
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    distributed = calibrate(replace(small_config(tmp_path / "ray"), model=model), progress=False, ray=RayConfig(workers=2))
    log = capsys.readouterr().err
    assert "ray: 2 worker(s) x 1 thread(s) on 1 node(s)" in log
    assert f"from {Path(kvguard.__file__).parent}" in log  # the workers ran this kvguard

    # Every tensor: per-batch statistics (2 batches) and aggregates, entropy baseline, sensitivity, scales.
    assert sorted(distributed.tensors) == sorted(local.tensors)
    assert distributed.tensors["stats.batch.key.max"].shape[0] == 2
    assert int((~torch.isnan(distributed.tensors["sensitivity.head_alone_kl"])).any(1).sum()) == 1
    different = [k for k, t in local.tensors.items() if not torch.equal(_bits(t), _bits(distributed.tensors[k]))]
    assert different == []
    # Everything else: the sensitivity ranking, every candidate of the search log with its measured quality,
    # the chosen plan, the frontier, the monitor fitted on the chosen plan. Only the stage times differ.
    def without_run(meta):
        return replace(meta, record={k: v for k, v in meta.record.items() if k != "run"})

    meta = without_run(distributed.meta)
    assert meta == without_run(local.meta)
    assert set(meta.record) == {"latency_model", "sensitivity", "monitor_calibration"}
    assert {c.level for c in meta.search_log} == {1, 2, 3}
    assert Profile.load(tmp_path / "ray").plan.to_dict() == local.plan.to_dict()


def test_ray_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert cli.main(["calibrate", "--out", str(tmp_path / "p"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "needs Ray, which is not installed" in err and "pip install 'kvguard[ray]'" in err
    assert not (tmp_path / "p").exists()


def test_ray_settings_are_checked(tmp_path, capsys):
    assert cli.main(["calibrate", "--out", str(tmp_path / "p"), "--ray-workers", "2"]) == 2
    assert "need --ray" in capsys.readouterr().err
    assert cli.main(["calibrate", "--out", str(tmp_path / "p"), "--ray", "--ray-workers", "0"]) == 2
    assert "workers must be a positive integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="address"):
        RayConfig(address="")
