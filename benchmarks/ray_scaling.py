"""Wall time of `kvguard calibrate --ray` with 1 vs 2 (or more) Ray workers on this machine.

Runs the full calibration once per worker count, each on a private local Ray (`--ray --ray-workers N`,
1 torch thread per worker), times it end to end and per stage (from the profile's `run.seconds`), and
checks that the runs agree: the statistics, entropy-baseline and sensitivity tensors bit for bit, and the
plan (the latency stage is a timing measurement made in each run, so the plan could only differ through it).

    .venv/bin/python benchmarks/ray_scaling.py --samples 512 --workers 1,2 \
        --out benchmarks/results/smollm2-135m-ray-scaling.md

About 20 min (1 worker) + 12 min (2 workers) for 512 SmolLM2 samples on 2 quiet CPU cores. Arguments after
`--` go to `kvguard calibrate` unchanged (e.g. `-- --domains prose --heldout-tokens 256` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvguard.profile import Profile

DISTRIBUTED = ("statistics", "level1", "sensitivity", "level2", "level3")
SERIAL = ("load", "latency", "monitor")
COMPARED = ("stats.", "entropy.", "sensitivity.")  # what does not depend on the latency stage's timing


def run(model: str, samples: int, workers: int, out: Path, extra: list[str]) -> tuple[float, Profile]:
    cmd = [sys.executable, "-m", "kvguard", "calibrate", "--model", model, "--samples", str(samples), "--out", str(out),
           "--ray", "--ray-workers", str(workers), *extra]
    print("$ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - t0, Profile.load(out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default: %(default)s)")
    parser.add_argument("--out", help="also write the table here (and the numbers as JSON next to it)")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvguard-ray-scaling-") as tmp:
        for n in counts:
            wall, profile = run(args.model, args.samples, n, Path(tmp) / f"workers-{n}", extra)
            rows.append({"workers": n, "wall_s": wall, "seconds": profile.meta.record["run"]["seconds"], "profile": profile})
    first = rows[0]["profile"]
    for row in rows:
        p = row.pop("profile")
        row["tensors_equal"] = all(same_bits(t, p.tensors[k]) for k, t in first.tensors.items() if k.startswith(COMPARED))
        row["plan_equal"] = p.plan == first.plan
        row["distributed_s"] = sum(row["seconds"].get(s, 0.0) for s in DISTRIBUTED)

    base = rows[0]
    head = ["workers", "wall s", *DISTRIBUTED, "distributed stages s", "speed-up", *SERIAL[1:],
            "stats/entropy/sensitivity bitwise equal", "same plan"]
    lines = [f"`kvguard calibrate --model {args.model} --samples {args.samples} --ray --ray-workers N"
             + (" " + " ".join(extra) if extra else "") + "`, 1 torch thread per worker, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["seconds"]
        lines.append("| " + " | ".join([str(r["workers"]), f"{r['wall_s']:.0f}", *(f"{s.get(k, 0.0):.0f}" for k in DISTRIBUTED),
                                        f"{r['distributed_s']:.0f}", f"{base['distributed_s'] / r['distributed_s']:.2f}x",
                                        *(f"{s.get(k, 0.0):.0f}" for k in SERIAL[1:]),
                                        "yes" if r["tensors_equal"] else "NO", "yes" if r["plan_equal"] else "no"]) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["tensors_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
