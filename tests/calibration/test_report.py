import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvguard.calibration import report
from kvguard.config import Objective
from kvguard.plan import LayerPlan, Plan
from kvguard.profile import DataManifest, DomainData, Profile
from tests.helpers import candidate, profile_meta

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


def _profile(memory_budget=0.4, max_ppl_increase=1.0) -> Profile:
    """4 layers x 2 KV heads, mixed tiers, one clipped layer, heads of layers 1 and 3 measured one by one."""
    plan = Plan((
        LayerPlan(("fp16", "int8")),
        LayerPlan(("int8", "int8"), key_clip=0.9),
        LayerPlan(("int4", "int2")),
        LayerPlan(("int4", "int4")),
    ))
    # candidate(): measured increase ``ppl``, score memory + ppl.
    log = (
        candidate("L1 all-int8", plan, level=1, memory=0.55, ppl=0.01, kl=5e-5, feasible=False),
        candidate("L1 all-int4", plan, level=1, memory=0.34, ppl=0.3, kl=1e-3),
        candidate("L1 all-int2", plan, level=1, memory=0.21, ppl=7.8, kl=6e-2, feasible=False),
        candidate("L2 mixed, predicted memory <= 0.400", plan, level=2, memory=0.39, ppl=-0.02, kl=5e-4),
        candidate("L3 layer 1 key clip 0.9", plan, level=3, memory=0.39, ppl=-0.08, kl=5.5e-4),
    )
    meta = profile_meta(
        plan, name="tiny-test", fingerprint="sha256:0123456789abcdef0123456789", head_dim=4,
        layer_types=("sliding_attention", "full_attention") * 2, search_log=log, chosen=log[4],
        pareto_front=("L1 all-int2", "L1 all-int4", "L3 layer 1 key clip 0.9"),
        objective=Objective(memory_budget=memory_budget, max_ppl_increase=max_ppl_increase),
        record={"sensitivity": {"layer_ranking": [1, 3, 2, 0]},
                "run": {"seconds": {"statistics": 1.5, "sensitivity": 12.0, "level1": 3.0}}})
    meta = replace(meta, kvguard_version="0.1.0",
                   data=DataManifest({"prose": DomainData(4, 256, 2, 1, 256), "code": DomainData(4, 256, 2, 1, 256)},
                                     8, 512, 64))
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
    for c in profile.meta.search_log:
        assert c.name.replace("<", "&lt;") in text


def test_the_search_table_shows_the_tail_kl_where_the_profile_has_it(tmp_path):
    profile = _profile()
    log = tuple(replace(c, quality=replace(c.quality, kl_p99=0.0421 if c.level == 3 else None))
                for c in profile.meta.search_log)
    text = report.write(replace(profile, meta=replace(profile.meta, search_log=log)), tmp_path / "t").read_text(
        encoding="utf-8")
    assert "<th>KL p99</th>" in text
    assert '<td class="num">0.00055</td><td class="num">0.0421</td>' in text  # KL, then its p99


def test_the_page_shows_the_outlier_channels_and_what_the_plan_does(tmp_path):
    profile = _profile()
    assert "Outlier channels" not in report.write(profile, tmp_path / "none").read_text(encoding="utf-8")
    absmax, mean = torch.ones(4, 2, 4), torch.zeros(4, 2, 4)
    absmax[2, 1, 0], mean[2, 1, 0] = 50.0, 45.0  # layer 2: one offset key channel, 50x
    stats = {"stats.key.absmax": absmax, "stats.key.mean": mean, "stats.value.absmax": torch.ones(4, 2, 4),
             "stats.value.mean": torch.zeros(4, 2, 4)}
    text = report.write(replace(profile, tensors={**profile.tensors, **stats}), tmp_path / "hit").read_text(
        encoding="utf-8")
    row = text.split("<h2>Outlier channels</h2>", 1)[1].split('<td class="num">2</td>', 1)[1].split("</tr>", 1)[0]
    assert "<td>1 (1 offsets), 50x, absmax 50</td><td>-</td><td>int4/int2</td><td>no</td><td>1</td><td>no</td>" in row
    assert text.count('<td class="num">', text.index("<h2>Outlier channels</h2>"), text.index("<h2>Search</h2>")) == 1


def test_the_search_table_shows_the_ranking_kls(tmp_path):
    profile = _profile()
    assert "ranking streams" not in report.write(profile, tmp_path / "plain").read_text(encoding="utf-8")
    budget = {"share": 0.75, "memory": 0.26, "kl": {"L1 all-int2": 0.25, "L1 all-int4": 0.0123}, "pick": "L1 all-int4"}
    record = {**profile.meta.record, "ranking": {"tokens_per_domain": 1024, "budgets": [budget]}}
    text = report.write(replace(profile, meta=replace(profile.meta, record=record)), tmp_path / "ranked").read_text(
        encoding="utf-8")
    assert "<th>KL, ranking streams</th>" in text and "KL p99" not in text  # no candidate has a tail score
    row = text.split("<td>L1 all-int4</td>", 1)[1].split("</tr>", 1)[0]
    assert '<td class="num">0.0123</td>' in row


def test_sensitivity_matrix_fills_unmeasured_rows_from_the_layer():
    matrix, measured = report.sensitivity_matrix(_profile())
    assert measured.tolist() == [False, True, False, True]
    expected = [[1e-4, 1e-4], [6e-3, 1e-3], [5e-4, 5e-4], [0.0, 5e-3]]  # unmeasured: alone_kl / 2 heads
    for got_row, want_row in zip(matrix.tolist(), expected):
        assert got_row == pytest.approx(want_row, rel=1e-6)
    assert not any(math.isnan(v) for row in matrix.tolist() for v in row)


def test_import_does_not_load_matplotlib():
    code = "import sys, kvguard.calibration.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # None makes the import fail
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.write(_profile(), tmp_path)


@pytest.mark.slow
def test_report_with_the_loops_timeline_renders_in_chromium(tmp_path, small_profile_dir, smollm2):
    """The page a person opens: a real profile's report with the events of a real live session over an
    aggressive plan (INT2 everywhere, so the loop acts), rendered by headless Chromium."""
    import json
    import re

    from kvguard import data
    from kvguard.evaluation import methods
    from tests.helpers import render_page, screenshot_dir

    model, tok = smollm2
    profile = Profile.load(small_profile_dir, model)
    events = tmp_path / "events.jsonl"
    session = methods.get("kvguard-live:int2", profile).session(model, events_path=events)
    session.generate(data.token_stream("prose", "eval", tok, 300), 40)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert records, "the loop over all-INT2 found nothing to do"
    # The frontier on evaluation text from a real `kvguard eval` of the profile's plans next to peers.
    from kvguard.evaluation import harness

    ids = data.token_stream("prose", "eval", tok, 200)
    front = profile.meta.frontier()
    names = ["int4", "int2", "kivi-2", "kvguard"] + [f"kvguard@{c.memory!r}" for c in front[:2]]
    evaluated = tmp_path / "eval.json"
    harness.write_json(evaluated, harness.rows_payload("smollm2-135m", 200, 1, harness.evaluate_stream(
        model, ids, "prose", names, profile=profile, progress=False)))
    page = report.write(profile, tmp_path / "report", events=events, evals=[evaluated])
    shot = screenshot_dir(tmp_path) / "report.png"
    dom, console = render_page(page.resolve().as_uri(), screenshot=shot, size="1200,5600")  # down to the timeline
    assert console == [], console
    assert 'data-figures-loaded="5"' in dom  # sensitivity, frontier, tiers, evaluation frontier, timeline: all drawn
    assert "<h2>Frontier on evaluation text</h2>" in dom and "<td>kivi-2</td>" in dom
    assert re.search(r'<p id="page-problems" hidden', dom)
    assert f"{len(records)} events from <code>events.jsonl</code>" in dom
    assert f"{profile.meta.chosen.memory:.4f} x FP16" in dom
    assert shot.read_bytes().startswith(PNG_SIGNATURE) and shot.stat().st_size > 20_000


def test_eval_frontier_lists_the_peers_below_kvguards_frontier(tmp_path):
    import json

    from kvguard.calibration import eval_frontier

    rows = [dict(method=m, corpus=c, kv_bytes_ratio=b, kl=k) for m, c, b, k in (
        ("fp16", "prose", 1.0, 0.0), ("kvguard", "prose", 0.34, 0.001), ("kvguard@0.2", "prose", 0.2, 0.02),
        ("int4", "prose", 0.344, 0.002),        # above the frontier: more bytes and more KL than kvguard
        ("llamacpp-q4_0", "prose", 0.28, 0.01),  # below: kvguard's only plan at <= 0.28 has KL 0.02
        ("kivi-2", "code", 0.2, 0.05), ("kvguard@0.2", "code", 0.19, 0.04))] + [
        dict(method="hf-hqq-4", corpus="code", error="unsupported")]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": rows}))
    points = eval_frontier.read_points(path)
    assert {p.method for p in points} == {"kvguard", "kvguard@0.2", "int4", "llamacpp-q4_0", "kivi-2"}
    assert [(p.method, p.corpus) for p in eval_frontier.below_frontier(points)] == [("llamacpp-q4_0", "prose")]
    assert [p.bytes_ratio for p in eval_frontier.frontier([p for p in points if p.corpus == "prose"])] == [0.2, 0.34]
    # By the tail: the p99 KLs order the same points differently.
    tails = {("kvguard", "prose"): 0.01, ("kvguard@0.2", "prose"): 0.3, ("int4", "prose"): 0.05,
             ("llamacpp-q4_0", "prose"): 0.4, ("kivi-2", "code"): 0.2, ("kvguard@0.2", "code"): 0.5}
    path.write_text(json.dumps({"results": [dict(r, kl_p99=tails[(r["method"], r["corpus"])])
                                            if (r["method"], r.get("corpus")) in tails else r for r in rows]}))
    tail = eval_frontier.read_points(path, "p99")
    assert [(p.method, p.corpus) for p in eval_frontier.below_frontier(tail)] == [("kivi-2", "code")]
    path.write_text(json.dumps({"results": rows}))
    with pytest.raises(ValueError, match=r"no method with bytes and p99 KL \(kl_p99: rows from before"):
        eval_frontier.read_points(path, "p99")
    with pytest.raises(ValueError, match=r"unknown KL measure 'p50'; one of \[mean, p99\]"):
        eval_frontier.read_points(path, "p50")
    for text, message in (("[1, 2]", "a 'results' list"), ("{", "not a readable JSON"),
                          ('{"results": [{"method": "fp16", "kv_bytes_ratio": 1, "kl": 0}]}', "no method")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            eval_frontier.read_points(path)
