"""Load test of ``kvguard serve``: N concurrent clients x M streaming requests on real evaluation text.

    .venv/bin/python benchmarks/load.py --profile P --start [--clients 16] [--requests 8] [--max-tokens 32]
    .venv/bin/python benchmarks/load.py --url http://127.0.0.1:8000 [--api-key KEY] ...

``--start`` launches ``kvguard serve`` on a free loopback port for the run (``--serve-args`` passes it more
options) and samples the server's resident memory (``/proc``) every 0.2 s; against a running server the peak
RSS comes from ``/v1/kvguard/status``. Loopback only, bounded in clients, requests and time (``--timeout``).
Each request streams ``/v1/completions`` (odd clients) or ``/v1/chat/completions`` (even clients) with a
prompt cut from a document of the evaluation split (prose, code, dialog in turn), greedy, ``ignore_eos``, so
every request generates ``--max-tokens`` tokens.

Reports: requests, errors by kind, latency p50 / p95 / max, time to first token p50 / p95, generated tokens
per second over the run, peak server RSS, and what the server's loop did (trigger rate, memory saved,
actions). ``--json F`` also writes them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from urllib.parse import urlparse

MAX_CLIENTS = 64
MAX_REQUESTS = 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int, *, seed_chars: int = 240) -> list[str]:
    """``count`` prompts of varied length from the evaluation split's documents, domains in turn."""
    from kvguard import data

    out, docs = [], {c: data.iter_documents(c, "eval") for c in ("prose", "code", "dialog")}
    while len(out) < count:
        for corpus, it in docs.items():
            text = next(it).text.strip()
            n = seed_chars + 80 * (len(out) % 5)  # 240 .. 560 characters
            out.append(text[:n])
    return out[:count]


class Server:
    """``kvguard serve`` in a subprocess for the run, and its peak RSS."""

    def __init__(self, profile: str, model: str, extra: list[str], api_key: str | None) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "kvguard", "serve", "--model", model, "--profile", profile, "--port", str(self.port),
               *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        # Output to a file: a pipe nobody reads while the load runs fills up, and the server blocks on its next write.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.peak_rss = 0
        self._stop = threading.Event()
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"kvguard serve exited with {self.proc.returncode}: {self.log.read()[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError("kvguard serve did not come up in 300 s")
            time.sleep(0.5)
        self.base_rss = self._rss()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self._rss())
            except OSError:
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one_request(host: str, port: int, key: str | None, chat: bool, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streaming request; ``{"ok", "status", "latency", "ttft", "tokens", "error"}``."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return {"ok": False, "status": resp.status, "error": resp.read().decode(errors="replace")[:200],
                    "latency": time.perf_counter() - t0}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"ok": False, "status": 500, "error": chunk["error"]["message"], "latency": time.perf_counter() - t0}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text and ttft is None:
                ttft = time.perf_counter() - t0
        conn.close()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        return {"ok": False, "status": None, "error": f"{type(err).__name__}: {err}", "latency": time.perf_counter() - t0}
    ok = tokens == max_tokens
    return {"ok": ok, "status": 200, "latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens,
            "error": None if ok else f"{tokens} tokens instead of {max_tokens}"}


def _get(host: str, port: int, key: str | None, path: str) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    return resp.read().decode()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (loopback only)")
    parser.add_argument("--start", action="store_true", help="start `kvguard serve` for the run")
    parser.add_argument("--profile", help="with --start: the calibration profile")
    parser.add_argument("--model", default="smollm2-135m", help="with --start: the model (default: %(default)s)")
    parser.add_argument("--serve-args", default="", help="with --start: more `kvguard serve` options, one string")
    parser.add_argument("--api-key", default=os.environ.get("KVGUARD_API_KEY"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.requests <= MAX_REQUESTS:
        parser.error(f"--clients must be in 1..{MAX_CLIENTS} and --requests in 1..{MAX_REQUESTS}")
    if args.start == bool(args.url):
        parser.error("give exactly one of --url and --start")
    if args.start and not args.profile:
        parser.error("--start needs --profile")

    server = None
    if args.start:
        server = Server(args.profile, args.model, args.serve_args.split(), args.api_key)
        host, port = "127.0.0.1", server.port
    else:
        url = urlparse(args.url)
        host, port = url.hostname, url.port or 80
        if host not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--url must be a loopback address, got {host}")
    try:
        texts = prompts(args.clients * args.requests)
        results: list[dict] = []
        lock = threading.Lock()
        deadline = time.perf_counter() + args.timeout

        def client(c: int) -> None:
            for r in range(args.requests):
                left = deadline - time.perf_counter()
                if left <= 0:
                    out = {"ok": False, "status": None, "error": "run timed out before this request"}
                else:
                    out = one_request(host, port, args.api_key, c % 2 == 0, texts[c * args.requests + r],
                                      args.max_tokens, left)
                with lock:
                    results.append(out)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        status = json.loads(_get(host, port, args.api_key, "/v1/kvguard/status"))
        metrics = _get(host, port, args.api_key, "/metrics")
    finally:
        if server is not None:
            server.stop()

    ok = [r for r in results if r["ok"]]
    errors = Counter(f"{r['status']}: {r['error']}" for r in results if not r["ok"])
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    actions = {}
    for line in metrics.splitlines():
        if line.startswith("kvguard_compensation_actions_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            actions[kind] = float(line.rsplit(" ", 1)[1])
    report = {
        "clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
        "requests": len(results), "ok": len(ok), "errors": dict(errors), "wall_s": round(wall, 2),
        "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
        "latency_max_s": round(max(lat, default=float("nan")), 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3), "ttft_p95_s": round(percentile(ttft, 0.95), 3),
        "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
        "server": {"max_batch": status["requests"]["max_batch"], "max_queue": status["requests"]["max_queue"],
                   "torch_threads": status["torch_threads"], "trigger_rate": status["trigger_rate"],
                   "recalibration_recommended": status["recalibration_recommended"],
                   "requests_served": status["requests"]["requests"], "actions": actions},
        "peak_rss_bytes": server.peak_rss if server else status["peak_rss_bytes"],
        "rss_at_start_bytes": server.base_rss if server else None,
    }
    mib = 1 << 20
    print(f"{len(results)} requests ({args.clients} clients x {args.requests}), {args.max_tokens} tokens each: "
          f"{len(ok)} ok, {len(results) - len(ok)} errors")
    for what, n in errors.items():
        print(f"  error x{n}: {what}")
    print(f"wall {wall:.1f} s; latency p50 {report['latency_p50_s']:.2f} s, p95 {report['latency_p95_s']:.2f} s, "
          f"max {report['latency_max_s']:.2f} s; time to first token p50 {report['ttft_p50_s']:.2f} s, "
          f"p95 {report['ttft_p95_s']:.2f} s")
    print(f"throughput {report['tokens_per_s']:.1f} generated tokens/s ({tokens} tokens)")
    rss = report["peak_rss_bytes"]
    print(f"server peak RSS {rss / mib:.0f} MiB" + (f" (at start {server.base_rss / mib:.0f} MiB)" if server else ""))
    print(f"server loop: trigger rate {100 * status['trigger_rate']:.1f} % of recent monitoring steps; actions "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(actions.items()) if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
