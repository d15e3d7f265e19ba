"""The frontier on evaluation text: KL against KV bytes for every method of a ``kvguard eval --json`` file.

The search's own plot (``pareto.png``) ranks candidates on held-out *calibration* text; peers never ran there.
This one reads what ``kvguard eval`` measured on the evaluation split, one panel per corpus: kvguard's
calibrated plans (``kvguard`` and ``kvguard@<bytes>``) joined as its frontier, and every other method as a
labelled point. A peer *below* the frontier (no kvguard plan at equal or fewer bytes has a KL as low) is
listed: that is where calibration has not earned its keep.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Rows that are their own engine's reference (KL 0 by construction): not a point on a KL axis.
REFERENCES = ("fp16", "llamacpp-f16")
# What a point's KL is: the mean per-token KL, or its 99th percentile (the tail a mean hides), per eval row field.
MEASURES = {"mean": "kl", "p99": "kl_p99"}


@dataclass(frozen=True)
class Point:
    method: str
    corpus: str
    bytes_ratio: float
    kl: float

    @property
    def calibrated(self) -> bool:
        return self.method == "kvguard" or self.method.startswith("kvguard@")


def read_points(path: str | os.PathLike, measure: str = "mean") -> list[Point]:
    """The measured points of a ``kvguard eval --json`` file, their KL the row's ``measure`` (a :data:`MEASURES`
    key); a clear ``ValueError`` for anything else."""
    if measure not in MEASURES:
        raise ValueError(f"unknown KL measure {measure!r}; one of [{', '.join(MEASURES)}]")
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--eval {path}: not a readable JSON file ({err})") from None
    rows = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"--eval {path}: expected the JSON that `kvguard eval --json` writes (a 'results' list)")
    points = []
    for row in rows:
        if not isinstance(row, dict) or row.get("error") or row.get("method") in REFERENCES:
            continue
        ratio, kl = row.get("kv_bytes_ratio"), row.get(MEASURES[measure])
        if isinstance(ratio, (int, float)) and isinstance(kl, (int, float)):
            points.append(Point(str(row["method"]), str(row.get("corpus", "")), float(ratio), float(kl)))
    if not points:
        what = "KL" if measure == "mean" else f"{measure} KL ({MEASURES[measure]}: rows from before the tail was recorded have none)"
        raise ValueError(f"--eval {path}: no method with bytes and {what} in it (run `kvguard eval` with --methods)")
    return points


def frontier(points: list[Point]) -> list[Point]:
    """kvguard's calibrated points that no other calibrated point beats on both bytes and KL, by bytes."""
    front: list[Point] = []
    for p in sorted((p for p in points if p.calibrated), key=lambda p: (p.bytes_ratio, p.kl)):
        if not front or p.kl < front[-1].kl:
            front.append(p)
    return front


def below_frontier(points: list[Point]) -> list[Point]:
    """Peer points with a lower KL than every calibrated plan at equal or fewer bytes (per corpus)."""
    out = []
    for corpus in dict.fromkeys(p.corpus for p in points):
        mine = [p for p in points if p.corpus == corpus]
        front = frontier(mine)
        for p in mine:
            if not p.calibrated and all(f.kl > p.kl for f in front if f.bytes_ratio <= p.bytes_ratio + 1e-9):
                out.append(p)
    return out


def figure(points: list[Point], title: str, measure: str = "mean"):
    """One panel per corpus: log KL against bytes, kvguard's frontier as a line, peers as labelled points."""
    from matplotlib.figure import Figure

    corpora = list(dict.fromkeys(p.corpus for p in points))
    fig = Figure(figsize=(4.6 * len(corpora), 4.4), dpi=110, layout="constrained")
    axes = fig.subplots(1, len(corpora), squeeze=False)[0]
    below = set(below_frontier(points))
    for ax, corpus in zip(axes, corpora):
        mine = [p for p in points if p.corpus == corpus]
        front = frontier(mine)
        ax.plot([p.bytes_ratio for p in front], [p.kl for p in front], "-o", color="#1f77b4", ms=5,
                label="kvguard (calibrated frontier)", zorder=3)
        for p in mine:
            if p.calibrated:
                continue
            color = "#c8453b" if p in below else "#7f7f7f"
            ax.scatter([p.bytes_ratio], [p.kl], color=color, marker="x" if p.method.startswith("llamacpp") else "^",
                       s=36, zorder=4)
            ax.annotate(p.method, (p.bytes_ratio, p.kl), textcoords="offset points", xytext=(4, 3), fontsize=6.5,
                        color=color)
        ax.set_yscale("log")
        ax.set_xlabel("KV bytes / FP16 bytes")
        ax.set_ylabel("KL to the reference (nats/token)" if measure == "mean" else f"{measure} per-token KL (nats)")
        ax.set_title(corpus, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return fig
