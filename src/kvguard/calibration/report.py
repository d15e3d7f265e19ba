"""A calibration report: three plots and one self-contained HTML page for a profile.

``write(profile, out_dir)`` produces, in ``out_dir``:

- ``sensitivity.png`` — layer x KV-head heat map of the KL a layer (or one head) costs at INT2 alone;
- ``pareto.png`` — every searched candidate, memory against perplexity increase, with the Pareto
  frontier, the chosen plan and the objective's limits;
- ``precision.png`` — the chosen plan's KV heads per tier, layer by layer;
- ``timeline.png`` — with ``events=`` (a ``--events`` file of the live loop): rollback level and actions
  token by token;
- ``frontier-eval.png`` — with ``evals=`` (``kvguard eval --json`` files): KL against bytes on evaluation
  text, kvguard's calibrated plans as a frontier and every peer's point on it
  (:mod:`kvguard.calibration.eval_frontier`);
- ``index.html`` — a summary, the sensitivity ranking, the plots, the search log and the loop's timeline,
  linking the PNGs by relative path so the directory can be copied or served as it is.

matplotlib is optional: it is imported only when a report is written.
"""

from __future__ import annotations

import html
import os
from dataclasses import fields
from pathlib import Path

from kvguard.config import penalty
from kvguard.profile import DomainData

SENSITIVITY_PNG = "sensitivity.png"
PARETO_PNG = "pareto.png"
PRECISION_PNG = "precision.png"
TIMELINE_PNG = "timeline.png"
EVAL_FRONTIER_PNG = "frontier-eval.png"
INDEX_HTML = "index.html"
TIMELINE_ROWS = 60     # events listed in the page's table; the plot shows them all

# Fixed so that plots of different profiles compare at a glance: cool = safe, warm = aggressive.
TIER_COLORS = {"fp16": "#3b5b92", "int8": "#4c9a5f", "int4": "#e6a23c", "int3": "#d9734a", "int2": "#c8453b"}
LEVEL_STYLES = {1: ("#7f7f7f", "o"), 2: ("#1f77b4", "s"), 3: ("#9467bd", "D")}
LAYER_TYPE_HATCHES = ("", "//", "..", "xx")
KL_FLOOR = 1e-6        # a log color scale cannot show 0; a KL this small is "no measurable change"
RANKING_ROWS = 12


def write(profile, out_dir: str | os.PathLike, events: str | os.PathLike | None = None,
          evals: list[str | os.PathLike] = (), measure: str = "mean") -> Path:
    """Write the plots and ``index.html`` for ``profile`` into ``out_dir`` (created); return the page's path.
    ``events``: a JSON-lines events file of the live loop (``kvguard generate --events``), shown as a timeline;
    ``evals``: ``kvguard eval --json`` files, drawn as the frontier on evaluation text, ranked by the mean
    per-token KL or, ``measure="p99"``, by its 99th percentile."""
    from kvguard.calibration import eval_frontier

    points = [p for path in evals for p in eval_frontier.read_points(path, measure)]  # bad files fail before any plot
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401  (fail early, with the hint)
    except ImportError as err:
        raise ImportError("kvguard report needs matplotlib: pip install 'kvguard[report]' (or: pip install matplotlib)") from err
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(_sensitivity_figure(profile), out / SENSITIVITY_PNG)
    _save(_pareto_figure(profile), out / PARETO_PNG)
    _save(_precision_figure(profile), out / PRECISION_PNG)
    timeline = ""
    if events is not None:
        records = read_events(events)
        _save(_timeline_figure(records), out / TIMELINE_PNG)
        timeline = _timeline_html(records, Path(events).name)
    if points:
        fig = eval_frontier.figure(points, f"{profile.model_name}: frontier on evaluation text", measure)
        FigureCanvasAgg(fig)
        _save(fig, out / EVAL_FRONTIER_PNG)
        timeline = _eval_html(points, measure) + timeline
    page = out / INDEX_HTML
    page.write_text(_html(profile, timeline), encoding="utf-8")
    return page


def _figure(width: float, height: float):
    """A figure on the Agg canvas, made without pyplot: pyplot would pick (and keep) a global backend
    and a registry of open figures, which a library must not touch in its caller's process."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=120)  # nothing to close: without pyplot no registry keeps the figure alive


# ---------------------------------------------------------------------------------------------- plots
def sensitivity_matrix(profile):
    """``(matrix [layers, H_kv], measured [layers] bool)``: the per-head INT2-alone KL where it was measured,
    else the layer's INT2-alone KL split evenly over its heads (per-head costs add up to the layer's)."""
    import numpy as np

    alone = profile.tensors["sensitivity.alone_kl"].double().numpy()                # [layers]
    heads = profile.tensors["sensitivity.head_alone_kl"].double().numpy()           # [layers, H_kv]
    measured = ~np.isnan(heads).all(axis=1)
    spread = np.repeat((alone / heads.shape[1])[:, None], heads.shape[1], axis=1)   # [layers, H_kv]
    return np.where(np.isnan(heads), spread, heads), measured


def _sensitivity_figure(profile):
    import numpy as np
    from matplotlib.colors import LogNorm

    matrix, measured = sensitivity_matrix(profile)
    layers, heads = matrix.shape
    fig = _figure(2.8 + 0.6 * heads, 1.6 + 0.22 * layers)
    ax = fig.add_subplot()
    finite = matrix[np.isfinite(matrix)]
    if finite.size and finite.max() > 0:
        shown = np.clip(matrix, KL_FLOOR, None)
        norm = LogNorm(vmin=max(KL_FLOOR, float(finite[finite > 0].min())), vmax=float(finite.max()))
    else:
        shown, norm = matrix, None
    image = ax.imshow(shown, aspect="auto", cmap="magma_r", norm=norm, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="KL (nats/token), INT2 alone")
    ax.set_yticks(range(layers), [f"{i}*" if measured[i] else str(i) for i in range(layers)],
                  fontsize=7 if layers > 24 else 9)
    ax.set_xticks(range(heads), [str(h) for h in range(heads)])
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer  (* = heads measured one by one)")
    ax.set_title(f"{profile.model_name}: sensitivity", fontsize=10)
    return fig


def _y(c) -> float:
    """The frontier and the score use the perplexity increase the held-out KL predicts (see
    :mod:`kvguard.calibration.search`)."""
    return penalty(c.quality.kl)


def _pareto_figure(profile):
    meta = profile.meta
    log = meta.search_log
    budget = meta.objective.memory_budget
    max_ppl = meta.objective.max_ppl_increase
    ys = [_y(c) for c in log]
    # An all-INT2 plan can cost +7 % while the interesting plans sit within 1 %; a linear axis clipped
    # near the limit keeps those apart, and the outliers are drawn on the edge with their value written.
    top = max(2.0, 2.0 * max_ppl) if max_ppl is not None else max(2.0, min(max(ys), 5.0))
    bottom = min(-1.0, min(ys) - 0.1)

    fig = _figure(7.5, 4.8)
    ax = fig.add_subplot()
    for level, (color, marker) in LEVEL_STYLES.items():
        members = [c for c in log if c.level == level]
        inside = [c for c in members if _y(c) <= top]
        ax.scatter([c.memory for c in inside], [_y(c) for c in inside], color=color,
                   marker=marker, s=36, alpha=0.8, label=f"level {level}", zorder=3)
        clipped = [c for c in members if _y(c) > top]
        ax.scatter([c.memory for c in clipped], [top] * len(clipped), color=color, marker="^", s=50, zorder=3)
        for k, c in enumerate(clipped):
            ax.annotate(f"{_y(c):+.1f} %", (c.memory, top), textcoords="offset points",
                        xytext=(0, -12 - 9 * (k % 2)), ha="center", fontsize=7, color=color)

    front = meta.frontier()
    if front:
        ax.plot([c.memory for c in front], [min(_y(c), top) for c in front],
                color="black", lw=1, alpha=0.6, label="Pareto frontier", zorder=2)

    chosen = meta.chosen
    ax.scatter([chosen.memory], [min(_y(chosen), top)], marker="*", s=320, color="gold",
               edgecolor="black", linewidth=0.8, label="chosen", zorder=4)
    ax.annotate(f"{chosen.name}\n{chosen.memory:.3f} x FP16, {_y(chosen):+.2f} %",
                (chosen.memory, min(_y(chosen), top)), textcoords="offset points",
                xytext=(12, 14), fontsize=8, arrowprops={"arrowstyle": "-", "lw": 0.6})

    if budget is not None:
        ax.axvline(budget, ls="--", color="#c8453b", lw=1, label=f"memory budget {budget:g}")
    if max_ppl is not None:
        ax.axhline(max_ppl, ls="--", color="#c8453b", lw=1, alpha=0.6, label=f"max ppl increase {max_ppl:g} %")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_ylim(bottom, top * 1.05)
    ax.set_xlabel("KV memory (bytes / FP16 bytes)")
    ax.set_ylabel("expected perplexity increase (%), from held-out KL")
    ax.set_title(f"{profile.model_name}: search ({len(log)} candidates; ▲ = above the axis)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def _precision_figure(profile):
    from matplotlib.patches import Patch

    plan = profile.plan
    layer_types = profile.meta.model.layer_types
    kinds = list(dict.fromkeys(layer_types))  # in order of first appearance, so the most common is usually plain
    hatch = {kind: LAYER_TYPE_HATCHES[i % len(LAYER_TYPE_HATCHES)] for i, kind in enumerate(kinds)}
    n = len(plan.layers)
    heads = max(len(lp.precision) for lp in plan.layers)

    fig = _figure(max(6.0, 0.28 * n + 2.0), 3.8)
    ax = fig.add_subplot()
    bottoms = [0] * n
    for tier, color in TIER_COLORS.items():
        counts = [sum(p.value == tier for p in lp.precision) for lp in plan.layers]
        for i, count in enumerate(counts):
            if count:
                ax.bar(i, count, bottom=bottoms[i], color=color, edgecolor="white", hatch=hatch[layer_types[i]], width=0.85)
        bottoms = [b + c for b, c in zip(bottoms, counts)]
    for i, lp in enumerate(plan.layers):
        if lp.key_clip < 1.0:
            ax.annotate(f"k{lp.key_clip:g}", (i, bottoms[i]), textcoords="offset points", xytext=(0, 2),
                        ha="center", fontsize=7, rotation=90)

    handles = [Patch(color=color, label=tier) for tier, color in TIER_COLORS.items()]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=hatch[kind], label=kind) for kind in kinds]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xticks(range(n), [str(i) for i in range(n)], fontsize=7 if n > 24 else 9)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, heads * 1.25)  # headroom for the key-clip labels
    ax.set_yticks(range(heads + 1))
    ax.set_xlabel("layer  (kX = keys clipped to X of their range)")
    ax.set_ylabel("KV heads")
    ax.set_title(f"{profile.model_name}: chosen plan, KV heads per tier", fontsize=10)
    return fig


# ----------------------------------------------------------------------------------------------- HTML
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen { background: #fff4c2; font-weight: bold; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; } figcaption { font-size: 0.9em; color: #555; }
code { font-size: 0.85em; }
"""


def _e(value) -> str:
    return html.escape(str(value))


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _table(header: list[str] | None, rows: list[list], numeric: set[int] = frozenset(), row_class=None) -> str:
    """An HTML table; every cell is escaped, columns in ``numeric`` are right-aligned."""
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for r, row in enumerate(rows):
        cls = row_class(r) if row_class else None
        cells = "".join(f'<td class="num">{_e(v)}</td>' if i in numeric else f"<td>{_e(v)}</td>"
                        for i, v in enumerate(row))
        out.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _search_table(meta, ranked: dict[str, float]) -> str:
    """Every candidate of the search log; the ranking streams' KL in a column of its own where there is one."""
    front, log = set(meta.pareto_front), meta.search_log
    tail = any(c.quality.kl_p99 is not None for c in log)  # profiles from before the tail was recorded have none
    extra = (["KL p99"] if tail else []) + (["KL, ranking streams"] if ranked else [])  # columns where there is data
    return _table(
        ["name", "level", "memory", "ppl increase % (measured)", "ppl increase % (from KL)", "KL", *extra, "score",
         "feasible", "on frontier"],
        [[c.name, c.level, f"{c.memory:.4f}", f"{c.ppl_increase_pct:+.3f}", f"{_y(c):+.3f}", f"{c.quality.kl:.3g}",
          *([_g(c.quality.kl_p99)] if tail else []),
          *([f"{ranked[c.name]:.3g}" if c.name in ranked else ""] if ranked else []),
          f"{c.score:.4g}", "yes" if c.feasible else "no", "yes" if c.name in front else ""] for c in log],
        numeric=set(range(1, 7 + len(extra))),
        row_class=lambda r: "chosen" if log[r].name == meta.chosen.name else None)


def _outliers_html(profile) -> str:
    """Which layers hold outlier channels (:mod:`kvguard.calibration.outliers`), how large, and what the plan
    stores those layers as."""
    from kvguard.calibration import outliers

    if "stats.key.absmax" not in profile.tensors:
        return ""
    keys, values = outliers.find(profile.tensors, "key"), outliers.find(profile.tensors, "value")
    intro = (f"<h2>Outlier channels</h2><p>Channels whose range exceeds {outliers.OUTLIER_FACTOR:g}x the median "
             f"channel's of their KV head (calibration statistics; keys after RoPE); an offset is a channel whose "
             f"mean is at least {outliers.OFFSET_SHARE:g} of its range, a bias rather than spikes. Keys are "
             f"quantized per channel, so an outlier channel gets a range of its own; a rotation mixes it into "
             f"the others.</p>")
    hit = [layer for layer in range(len(keys)) if keys[layer].channels or values[layer].channels]
    if not hit:
        return intro + "<p>None in this model.</p>"
    prerope = "yes" if profile.plan.cache.prerope_keys else "no"

    def side(r) -> str:
        return f"{len(r.channels)} ({r.offsets} offsets), {r.ratio:.0f}x, absmax {r.absmax:.3g}" if r.channels else "-"

    rows = []
    for layer in hit:
        lp = profile.plan.layers[layer]
        rows.append([layer, side(keys[layer]), side(values[layer]), "/".join(p.value for p in lp.precision),
                     "yes" if lp.key_rotation else "no", f"{lp.key_clip:g}", prerope])
    return intro + _table(["layer", "key outliers: channels, largest / median, absmax", "value outliers",
                           "plan: tiers per KV head", "keys rotated", "key clip", "keys before RoPE"], rows,
                          numeric={0})


def _html(profile, timeline: str = "") -> str:
    meta = profile.meta
    chosen = meta.chosen
    data = meta.data
    objective = meta.objective
    alone = profile.tensors["sensitivity.alone_kl"].tolist()
    _, measured = sensitivity_matrix(profile)
    plan = profile.plan

    summary = _table(None, [
        ["model", profile.model_name],
        ["fingerprint", profile.fingerprint[:19] + "…"],
        ["kvguard version", meta.kvguard_version],
        ["calibration data", f"{data.samples} samples, {data.tokens} tokens"],
        ["chosen plan", chosen.name],
        ["KV memory", f"{chosen.memory:.4f} x FP16"],
        ["perplexity increase (measured, worst domain)", f"{chosen.ppl_increase_pct:+.3f} %"],
        ["perplexity increase (expected from KL)", f"{_y(chosen):+.3f} %"],
        ["KL", f"{chosen.quality.kl:.3g} nats/token"],
        ["memory budget", "none" if objective.memory_budget is None else f"{objective.memory_budget:g} x FP16"],
        ["max perplexity increase", "none" if objective.max_ppl_increase is None else f"{objective.max_ppl_increase:g} %"],
        ["constraints met", "yes" if meta.constraints_met else "NO"],
    ])

    keys = [f.name for f in fields(DomainData)]
    domain_table = _table(["domain", *keys], [[name, *(getattr(d, k) for k in keys)] for name, d in data.domains.items()],
                          numeric=set(range(1, len(keys) + 1)))

    ranking = meta.record.get("sensitivity", {}).get("layer_ranking", [])[:RANKING_ROWS]
    ranking_table = _table(
        ["rank", "layer", "KL, INT2 alone", "heads measured", "chosen precision"],
        [[r + 1, layer, f"{alone[layer]:.3g}", "yes" if measured[layer] else "no",
          "/".join(p.value for p in plan.layers[layer].precision)] for r, layer in enumerate(ranking)],
        numeric={0, 1, 2})

    # The closest candidates at the mid budgets, scored again on the ranking streams (calibration/ranking.py).
    ranked = {name: kl for b in meta.ranked() for name, kl in b.kl.items()}
    search_table = _search_table(meta, ranked)

    seconds = meta.record.get("run", {}).get("seconds", {})
    timing_table = _table(["stage", "seconds"],
                          [[stage, f"{s:.1f}"] for stage, s in seconds.items()] + [["total", f"{sum(seconds.values()):.1f}"]],
                          numeric={1})

    title = f"kvguard calibration report — {profile.model_name}"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        summary,
        "<h2>Calibration data</h2>",
        domain_table,
        f"<h2>Plan</h2><p><code>{_e(meta.plan_summary())}</code></p>",
        f'<figure><img src="{PRECISION_PNG}" alt="KV heads per precision tier, per layer">'
        "<figcaption>The chosen plan: KV heads of each layer per tier; hatching marks the layer type, "
        "kX labels layers whose keys are clipped to X of their range.</figcaption></figure>",
        f"<h2>Sensitivity</h2><p>The {len(ranking)} layers that cost most when only they are stored at INT2, "
        "most sensitive first.</p>",
        ranking_table,
        f'<figure><img src="{SENSITIVITY_PNG}" alt="sensitivity heat map, layer by KV head">'
        "<figcaption>KL to the FP16 model when a single layer (rows marked *: a single KV head) is INT2 and "
        "everything else is unchanged; unmeasured heads show their layer's KL split evenly.</figcaption></figure>",
        _outliers_html(profile),
        "<h2>Search</h2>",
        f'<figure><img src="{PARETO_PNG}" alt="memory against perplexity increase for every candidate">'
        "<figcaption>Every candidate of the three search levels; the line joins the Pareto frontier, the star "
        "is the chosen plan, dashed lines are the objective's limits.</figcaption></figure>",
        "<p>KL is measured on the held-out slice. At 0.75 and 0.60 of the all-INT4 bytes the closest candidates "
        "were also scored on longer, unread calibration text (the ranking streams); kvguard@&lt;bytes&gt; at those "
        "budgets runs the lowest KL there.</p>" if ranked else "",
        search_table,
        timeline, "<h2>Run time</h2>", timing_table, _PAGE_CHECKS, "</body></html>", "",
    ])


def _eval_html(points, measure: str = "mean") -> str:
    from kvguard.calibration import eval_frontier

    below = eval_frontier.below_frontier(points)
    kl = "KL" if measure == "mean" else f"{measure} KL"
    rows = [[p.corpus, p.method, f"{p.bytes_ratio:.3f}", f"{p.kl:.3g}", "BELOW" if p in below else ""]
            for p in sorted(points, key=lambda p: (p.corpus, p.bytes_ratio))]
    verdict = (f"{len(below)} peer point(s) lie below kvguard's frontier." if below
               else f"No peer point lies below kvguard's frontier (lower {kl} at equal or fewer bytes).")
    return "\n".join([
        "<h2>Frontier on evaluation text</h2>" if measure == "mean" else
        f"<h2>Frontier on evaluation text, by the {_e(measure)} per-token KL</h2>",
        f"<p>What <code>kvguard eval</code> measured on the evaluation split (never calibration text). {_e(verdict)}</p>",
        f'<figure><img src="{EVAL_FRONTIER_PNG}" alt="KL against KV bytes per corpus, kvguard and peers">'
        "<figcaption>KL to each engine's own unquantized reference against KV bytes; the line joins kvguard's "
        "calibrated plans (kvguard, kvguard@&lt;bytes&gt;), red points are peers below it.</figcaption></figure>",
        _table(["corpus", "method", "bytes / FP16", kl, "below kvguard's frontier"], rows, numeric={2, 3}),
    ])


# ----------------------------------------------------------------------------------- the loop's timeline
def read_events(path: str | os.PathLike) -> list[dict]:
    """The events of a JSON-lines events file (one :meth:`kvguard.control.events.Event.to_json` per line)."""
    import json

    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# Actions drawn on the timeline, by the metrics kind of the action: marker colour and shape.
ACTION_STYLES = {"light": ("#4c9a5f", "o"), "heavy": ("#e6a23c", "s"), "precision_up": ("#c8453b", "^"),
                 "precision_down": ("#3b5b92", "v"), "rollback": ("#9467bd", "D"), "rollback_full": ("#222222", "X")}


def _timeline_figure(records: list[dict]):
    """Rollback level after each event (a step line) and the actions as markers, by token."""
    fig = _figure(7.5, 3.2)
    ax = fig.add_subplot()
    if records:
        tokens = [r["token"] for r in records]
        ax.step(tokens, [r["level"] for r in records], where="post", color="grey", lw=1, label="rollback level")
        for kind, (color, marker) in ACTION_STYLES.items():
            hits = [r for r in records if _kind(r["action"]) == kind]
            if hits:
                ax.scatter([r["token"] for r in hits], [r["level"] for r in hits], color=color, marker=marker, s=40,
                           label=kind, zorder=3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.text(0.5, 0.5, "no events: the loop never had to act", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("token (position in the sequence)")
    ax.set_ylabel("rollback level")
    ax.set_ylim(-0.3, 4.3)
    ax.set_title(f"the live loop: {len(records)} events", fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def _kind(action: str) -> str:
    """The metrics kind of an action's value (rollbacks share one)."""
    from kvguard.control.policy import Action

    return Action(action).kind


def _timeline_html(records: list[dict], source: str) -> str:
    from kvguard.control.events import describe

    levels = [r["level"] for r in records]
    recomputed = sum(r.get("positions", 0) for r in records)
    intro = (f"<p>{len(records)} events from <code>{_e(source)}</code>; {recomputed} positions recomputed; "
             f"highest rollback level {max(levels, default=0)}.</p>")
    rows = [[r["token"], r["alarm"], r["action"], r["level"], r.get("positions", 0), describe(r)]
            for r in records[:TIMELINE_ROWS]]
    more = (f"<p>… and {len(records) - TIMELINE_ROWS} more in the events file.</p>"
            if len(records) > TIMELINE_ROWS else "")
    return "\n".join([
        '<h2 id="timeline">The live loop</h2>', intro,
        f'<figure><img src="{TIMELINE_PNG}" alt="rollback level and actions by token">'
        "<figcaption>What the feedback loop did while decoding: each marker is an action at that token, the line "
        "the rollback level after it.</figcaption></figure>",
        _table(["token", "alarm", "action", "level", "positions", "what happened"], rows, numeric={0, 3, 4}) if rows
        else "<p>The loop never had to act: every monitored layer stayed near its calibrated entropy.</p>",
        more])


# A reader who copied index.html without its PNGs (or a broken page) should see it said on the page, not guess.
_PAGE_CHECKS = """<p id="page-problems" hidden></p>
<script>
(function () {
  var note = document.getElementById("page-problems");
  function say(text) { note.hidden = false; note.textContent += text + " "; }
  window.addEventListener("error", function (e) { say("script error: " + e.message); });
  window.addEventListener("load", function () {
    var missing = Array.prototype.filter.call(document.images, function (i) { return !i.naturalWidth; });
    if (missing.length) say(missing.length + " figure(s) did not load: keep the PNGs next to index.html.");
    document.body.dataset.figuresLoaded = String(document.images.length - missing.length);
  });
})();
</script>"""
