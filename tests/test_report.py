import math
import subprocess
import sys

import pytest
import torch

from kvguard import report
from kvguard.plan import LayerPlan, Plan
from kvguard.profile import Profile

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


def _candidate(name: str, level: int, memory: float, ppl: float, kl: float, feasible: bool = True) -> dict:
    return {"name": name, "level": level, "memory": memory, "ppl_increase_pct": ppl, "ppl_penalty_pct": 100 * kl,
            "quality": {"kl": kl, "top1_agree": 0.99}, "score": memory + ppl, "feasible": feasible}


def _profile(memory_budget=0.4, max_ppl_increase=1.0) -> Profile:
    """4 layers x 2 KV heads, mixed tiers, one clipped layer, heads of layers 1 and 3 measured one by one."""
    plan = Plan((
        LayerPlan(("fp16", "int8")),
        LayerPlan(("int8", "int8"), key_clip=0.9),
        LayerPlan(("int4", "int2")),
        LayerPlan(("int4", "int4")),
    ))
    log = [
        _candidate("L1 all-int8", 1, 0.55, 0.01, 5e-5, feasible=False),
        _candidate("L1 all-int4", 1, 0.34, 0.3, 1e-3),
        _candidate("L1 all-int2", 1, 0.21, 7.8, 6e-2, feasible=False),
        _candidate("L2 mixed, predicted memory <= 0.400", 2, 0.39, -0.02, 5e-4),
        _candidate("L3 layer 1 key clip 0.9", 3, 0.39, -0.08, 5.5e-4),
    ]
    meta = {
        "kvguard_version": "0.1.0",
        "model": {"name": "tiny-test", "fingerprint": "sha256:0123456789abcdef0123456789", "num_layers": 4,
                  "num_kv_heads": 2, "layer_types": ["sliding_attention", "full_attention"] * 2},
        "data": {"samples": 8, "tokens": 512, "domains": {"prose": {"samples": 4, "tokens": 256},
                                                          "code": {"samples": 4, "tokens": 256}}},
        "objective": {"memory_budget": memory_budget, "max_ppl_increase": max_ppl_increase},
        "plan": plan.to_dict(),
        "plan_summary": "0:fp16/int8 1:int8 2:int4/int2 3:int4",
        "chosen": log[4],
        "constraints_met": True,
        "sensitivity": {"layer_ranking": [1, 3, 2, 0]},
        "pareto_front": ["L1 all-int2", "L1 all-int4", "L3 layer 1 key clip 0.9"],
        "search_log": log,
        "run": {"seconds": {"statistics": 1.5, "sensitivity": 12.0, "level1": 3.0}},
    }
    tensors = {
        "sensitivity.alone_kl": torch.tensor([2e-4, 8e-3, 1e-3, 4e-3]),
        "sensitivity.head_alone_kl": torch.tensor([[NAN, NAN], [6e-3, 1e-3], [NAN, NAN], [0.0, 5e-3]]),
    }
    return Profile(meta, tensors)


@pytest.mark.parametrize("limits", [(0.4, 1.0), (None, None)])
def test_write_plots_and_page(tmp_path, limits):
    profile = _profile(*limits)
    page = report.write(profile, tmp_path / "out")

    assert page == tmp_path / "out" / "index.html"
    for name in ("sensitivity.png", "pareto.png", "precision.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG_SIGNATURE)
    text = page.read_text(encoding="utf-8")
    for name in ("sensitivity.png", "pareto.png", "precision.png"):
        assert f'<img src="{name}"' in text
    assert "kvguard calibration report — tiny-test" in text
    assert "sha256:0123456789ab…" in text and "0123456789abc" not in text  # the first 19 characters only
    assert "L2 mixed, predicted memory &lt;= 0.400" in text
    assert "predicted memory <= 0.400" not in text  # every text is escaped
    assert '<tr class="chosen"><td>L3 layer 1 key clip 0.9</td>' in text
    for candidate in profile.meta["search_log"]:
        assert candidate["name"].replace("<", "&lt;") in text


def test_sensitivity_matrix_fills_unmeasured_rows_from_the_layer():
    matrix, measured = report.sensitivity_matrix(_profile())
    assert measured.tolist() == [False, True, False, True]
    expected = [[1e-4, 1e-4], [6e-3, 1e-3], [5e-4, 5e-4], [0.0, 5e-3]]  # unmeasured: alone_kl / 2 heads
    for got_row, want_row in zip(matrix.tolist(), expected):
        assert got_row == pytest.approx(want_row, rel=1e-6)
    assert not any(math.isnan(v) for row in matrix.tolist() for v in row)


def test_import_does_not_load_matplotlib():
    code = "import sys, kvguard.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # None makes the import fail
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.write(_profile(), tmp_path)
