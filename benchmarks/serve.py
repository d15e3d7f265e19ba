"""Serving many at once: the real server on loopback, driven by the official OpenAI client.

Each row starts ``kvguard serve`` in a fresh process with one plan and one setting, sends ``--requests`` streamed
completions at once (prompts of ``--prompt-tokens`` held-out Wikipedia tokens, sent as ids, each a different
stretch; ``--new-tokens`` tokens each, end-of-sequence ignored, greedy), and reports:

- generated tokens per second over the whole run, and **steady** tokens per second while requests were still
  waiting (from the first token of the last request to be admitted backwards to the first token of the one that
  filled the batch: the stretch where the batch is full);
- time to first token and inter-token latency, p50 / p99, as the client saw them;
- the largest batch the server ran, its peak RSS, and errors.

Tables (``--table``):

- ``batching``: ``fp16`` with ``--requests`` requests, the batch as large as they are against ``--max-batch 1``
  (one sequence per forward, the others waiting): the batching target is >= 3x.
- ``budget``: a KV budget equal to what the server reserves for ``--budget-fp16-seqs`` FP16 requests, a saturating load (more requests
  than fit), each plan's steady tokens/s, then ``fp16`` at each plan's batch size with a budget large enough for it:
  the quantized reads' cost at batch (target >= 0.85x) and what the memory buys (the plain ratio to ``fp16`` at
  the same budget).
- ``churn``: ``--requests`` clients at once (64), a tenth of them disconnecting mid-stream: server errors (0),
  every request answered or cancelled, RSS before and after.

    .venv/bin/python benchmarks/serve.py --table batching --profile benchmarks/profiles/smollm2-135m-512
    .venv/bin/python benchmarks/serve.py --table budget --profile benchmarks/profiles/smollm2-135m-512 \\
        --plans int4,profile,kvguard@0.22:loop --requests 48
    .venv/bin/python benchmarks/serve.py --table churn --profile benchmarks/profiles/smollm2-135m-512 --requests 64 \\
        --prompt-tokens 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return json.loads(body)


@contextlib.contextmanager
def server(model: str, profile: str, *flags: str):
    """``kvguard serve`` in a fresh process on a free loopback port, until the block ends."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvguard", "serve", "--model", model, "--profile", profile, "--port", str(port),
           "--max-prompt-tokens", "2048", "--max-new-tokens", "1024", *flags]
    # The server's log goes to a file: a pipe nobody reads while the load runs fills up (the loop logs every event),
    # and the server then blocks on its next write.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"kvguard serve {' '.join(flags)} exited: {log.read().strip()[-2000:]}")
            try:
                if _get(port, "/healthz")["status"] == "ok":
                    break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("kvguard serve did not come up in 600 s") from None
                time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def prompts(model: str, n: int, tokens: int) -> list[list[int]]:
    """``n`` held-out prose prompts of ``tokens`` token ids each, each a different stretch of the eval split (sent as
    ids, so every prompt is exactly that long and the budget table can size its budget to the token)."""
    from kvguard import data, models

    tok = models.load_tokenizer(models.resolve(model))
    stream = data.token_stream("prose", "eval", tok, n * tokens + 1)[1:]
    return [stream[i * tokens:(i + 1) * tokens].tolist() for i in range(n)]


@dataclass
class Result:
    arrived: float
    tokens: list[float] = field(default_factory=list)  # arrival time of every streamed text chunk
    generated: int = 0
    error: str | None = None
    cancelled: bool = False


def drive(port: int, model: str, texts: list[list[int]], new_tokens: int, disconnect_after: set[int] = frozenset()) -> list[Result]:
    """Send every prompt at once as a streamed completion; collect the chunks' times. Requests in
    ``disconnect_after`` close their connection after three chunks."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    start = threading.Barrier(len(texts))

    def one(i: int) -> Result:
        start.wait()
        result = Result(time.time())
        try:
            stream = client.completions.create(model=model, prompt=texts[i], max_tokens=new_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    result.generated = chunk.usage.completion_tokens
                elif chunk.choices and chunk.choices[0].text:
                    result.tokens.append(time.time())
                    if i in disconnect_after and len(result.tokens) == 3:
                        stream.close()
                        result.cancelled = True
                        break
        except Exception as err:  # noqa: BLE001 - counted and reported
            result.error = f"{type(err).__name__}: {err}"
        return result

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(one, range(len(texts))))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _steady(row: dict) -> str:
    """The steady tokens/s, or a dash where no request waited (the batch was never full with others queued)."""
    return "-" if math.isnan(row["steady_tok_s"]) else f"{row['steady_tok_s']:.1f}"


def summarize(name: str, results: list[Result], status: dict, batch: int, wall: float) -> dict:
    done = [r for r in results if r.error is None and not r.cancelled]
    generated = sum(r.generated for r in done)
    firsts = sorted(r.tokens[0] for r in done if r.tokens)
    ttft = [r.tokens[0] - r.arrived for r in done if r.tokens]
    itl = [b - a for r in done for a, b in zip(r.tokens, r.tokens[1:])]
    steady = float("nan")
    if len(firsts) > batch:  # requests waited: the batch was full between these two first tokens
        t0, t1 = firsts[batch - 1], firsts[-1]
        chunks = sum(1 for r in done for t in r.tokens if t0 <= t <= t1)
        steady = chunks / (t1 - t0) if t1 > t0 else float("nan")
    return {"name": name, "requests": len(results), "errors": sum(r.error is not None for r in results),
            "first_error": next((r.error for r in results if r.error is not None), None),
            "cancelled": sum(r.cancelled for r in results), "generated": generated, "wall_s": wall,
            "tok_s": generated / wall, "steady_tok_s": steady, "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "itl_p50": _pct(itl, 0.5), "itl_p99": _pct(itl, 0.99), "peak_rss_mib": status["peak_rss_bytes"] / MIB,
            "max_batch_seen": status.get("max_batch_seen"), "kv_budget_mib": status["kv_budget_bytes"] / MIB}


class BatchWatch:
    """Polls the server's status while a load runs: the largest number of requests decoding at once."""

    def __init__(self, port: int) -> None:
        self.port, self.most, self.stop = port, 0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.most = max(self.most, _get(self.port, "/v1/kvguard/status")["requests"]["running"])
            time.sleep(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def run(args, name: str, plan: str, loop: bool, budget: str, max_batch: int, texts: list[list[int]],
        disconnect: set[int] = frozenset()) -> dict:
    flags = ["--plan", plan, "--kv-budget", budget, "--max-batch", str(max_batch), "--max-queue", str(len(texts))]
    flags += [] if loop else ["--no-loop"]
    with server(args.model, args.profile, *flags) as port:
        before = _get(port, "/v1/kvguard/status")["rss_bytes"]
        t0 = time.time()
        with BatchWatch(port) as watch:
            results = drive(port, args.model, texts, args.new_tokens, disconnect)
        wall = time.time() - t0
        time.sleep(2.0)  # the requests the clients left end at the server's next step
        status = _get(port, "/v1/kvguard/status")
        status["max_batch_seen"] = watch.most
        row = summarize(name, results, status, watch.most or max_batch, wall)
        row.update(plan=plan, loop=loop, max_batch=max_batch, rss_before_mib=before / MIB,
                   rss_after_mib=status["rss_bytes"] / MIB,
                   left_running=status["requests"]["running"] + status["requests"]["waiting"])
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def fp16_budget(model: str, profile: str, sequences: int, tokens: int) -> int:
    """The KV bytes the server reserves for ``sequences`` FP16 requests of ``tokens`` tokens (prompt and reply)
    under ``profile``'s cache settings."""
    from kvguard import models
    from kvguard.architecture import Architecture
    from kvguard.plan import Plan
    from kvguard.profile import Profile
    from kvguard.serving.scheduler import Sizing

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models.resolve(model))
    plan = Plan.uniform(Architecture.from_config(config), "fp16", Profile.load(profile).plan.cache)
    return sequences * Sizing.of(plan, config).reserve(tokens)


def table(rows: list[dict]) -> str:
    head = ["run", "plan", "loop", "max batch", "batch seen", "KV budget MiB", "tok/s", "steady tok/s", "TTFT p50 / p99 s",
            "ITL p50 / p99 ms", "peak RSS MiB", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['name']} | {r['plan']} | {'on' if r['loop'] else 'off'} | {r['max_batch']} | "
                     f"{r['max_batch_seen']} | {r['kv_budget_mib']:.0f} | {r['tok_s']:.1f} | {_steady(r)} | "
                     f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} | {1000 * r['itl_p50']:.0f} / {1000 * r['itl_p99']:.0f} | "
                     f"{r['peak_rss_mib']:.0f} | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=["batching", "budget", "churn"], required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--plans", default="int4,profile,kvguard@0.22:loop",
                        help="budget: the plans compared with fp16 (':loop' runs the feedback loop over it)")
    parser.add_argument("--budget-fp16-seqs", type=int, default=8)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    texts = prompts(args.model, args.requests, args.prompt_tokens)
    rows = []
    big = "0.5"  # a fraction of RAM: room for any batch here
    if args.table == "batching":
        rows.append(run(args, "one per forward", "fp16", False, big, 1, texts))
        rows.append(run(args, "batched", "fp16", False, big, args.requests, texts))
        print(f"batched / one per forward: {rows[1]['tok_s'] / rows[0]['tok_s']:.2f}x tokens/s")
    elif args.table == "budget":
        budget = str(fp16_budget(args.model, args.profile, args.budget_fp16_seqs, args.prompt_tokens + args.new_tokens))
        rows.append(run(args, "budget", "fp16", False, budget, args.requests, texts))
        for spec in args.plans.split(","):
            plan, _, loop = spec.partition(":")
            row = run(args, "budget", plan, loop == "loop", budget, args.requests, texts)
            rows.append(row)
            n = row["max_batch_seen"]
            reference = run(args, f"fp16 at batch {n}", "fp16", False, big, n, texts)
            rows.append(reference)
            print(f"{spec}: steady {row['steady_tok_s']:.1f} tok/s at batch {n}; fp16 at batch {n}: "
                  f"{reference['steady_tok_s']:.1f} ({row['steady_tok_s'] / reference['steady_tok_s']:.2f}x); "
                  f"fp16 at the same budget: {rows[0]['steady_tok_s']:.1f} "
                  f"({row['steady_tok_s'] / rows[0]['steady_tok_s']:.2f}x)")
    else:
        leave = set(range(0, args.requests, 10))  # a tenth of the clients leave mid-stream
        rows.append(run(args, "churn", "profile", True, big, 16, texts, leave))
        r = rows[0]
        print(f"{r['errors']} errors; {r['cancelled']} cancelled; {r['left_running']} left in flight; RSS "
              f"{r['rss_before_mib']:.0f} MiB before the load, {r['rss_after_mib']:.0f} MiB after "
              f"({r['rss_after_mib'] / r['rss_before_mib'] - 1:+.1%}), {r['peak_rss_mib']:.0f} MiB at the peak")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "table": args.table, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
