"""The process's memory against the cache's stored bytes: does a process hold what its KV cache stores?

For each method and allocator setting, a fresh process loads the model, feeds ``--batch`` sequences of ``--context``
held-out tokens as the server does (each its own cache, 256-token chunks, the history read through the reads'
attention), then runs 64 decode steps over all of them in packed forwards (:func:`kvguard.evaluation.capacity.probe`). The row compares the process's peak RSS above the loaded model with the
bytes the cache stores at the end, against the bound ``1.15 x stored + 64 MiB`` (64 MiB: the model's own activations for one chunk). The allocator settings are glibc's defaults (``MALLOC_ARENA_MAX`` unset) and
``MALLOC_ARENA_MAX=2``; ``--beside-load`` runs the same beside a process that keeps one core busy with matmuls.

    .venv/bin/python benchmarks/memory.py --model smollm2-135m --batch 8 --context 4096 \\
        --methods fp16,int4,kvguard,kvguard@0.22 --profile benchmarks/profiles/smollm2-135m-512
    .venv/bin/python benchmarks/memory.py --model gemma3-270m --batch 1 --context 32768 --methods fp16,int4

Prints a markdown table (and ``--json`` writes the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

MIB = 2**20
SLACK_MIB = 64
FACTOR = 1.15
LOAD = "import torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def probe(model: str, method: str, batch: int, context: int, profile: str | None, arena: str | None) -> dict:
    """One :func:`~kvguard.evaluation.capacity.probe` in a fresh process with ``MALLOC_ARENA_MAX`` = ``arena``."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["HF_HUB_OFFLINE"] = "1"
    if arena is not None:
        env["MALLOC_ARENA_MAX"] = arena
    cmd = [sys.executable, "-m", "kvguard.evaluation.capacity", "--model", model, "--method", method,
           "--batch", str(batch), "--context", str(context)] + (["--profile", profile] if profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"method": method, "error": (proc.stderr.strip() or "no output").splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def beside_load(on: bool):
    """A busy process on one core while the block runs (``on``), killed after."""
    if not on:
        yield
        return
    load = subprocess.Popen([sys.executable, "-c", LOAD])
    try:
        yield
    finally:
        load.kill()
        load.wait()


def row(result: dict, arena: str | None, load: bool) -> dict:
    over = (result["peak_rss"] - result["model_rss"]) / MIB
    stored = result["kv_bytes"] / MIB
    bound = FACTOR * stored + SLACK_MIB
    return {"method": result["method"], "arena": arena or "unset", "beside_load": load, "stored_mib": stored,
            "over_model_mib": over, "bound_mib": bound, "holds": over <= bound, "model_rss_mib": result["model_rss"] / MIB,
            "prefill_peak_mib": (max(p[3] for p in result["points"]) - result["model_rss"]) / MIB,
            "decode_peak_mib": (result["decode_peak"] - result["model_rss"]) / MIB}


def table(rows: list[dict]) -> str:
    lines = ["| method | MALLOC_ARENA_MAX | beside a load | stored KV MiB | peak - model MiB | bound MiB | holds | "
             "prefill / decode peak - model MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r.get('arena', '')} | | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['method']} | {r['arena']} | {'yes' if r['beside_load'] else 'no'} | {r['stored_mib']:.0f} | "
                     f"{r['over_model_mib']:.0f} | {r['bound_mib']:.0f} | {'yes' if r['holds'] else 'NO'} | "
                     f"{r['prefill_peak_mib']:.0f} / {r['decode_peak_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="fp16,int4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--profile", help="calibration profile, for the kvguard methods")
    parser.add_argument("--arenas", default="unset,2", help="MALLOC_ARENA_MAX settings ('unset': glibc's default)")
    parser.add_argument("--beside-load", action="store_true", help="also run each beside a busy process")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for load in ([False, True] if args.beside_load else [False]):
        with beside_load(load):
            for method in args.methods.split(","):
                for arena in args.arenas.split(","):
                    arena = None if arena == "unset" else arena
                    result = probe(args.model, method, args.batch, args.context, args.profile, arena)
                    rows.append({**result, "arena": arena or "unset"} if "error" in result else row(result, arena, load))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "context": args.context, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
