"""``kvguard serve`` as a user runs it: a real server (real SmolLM2, a calibrated profile) in a subprocess on a
loopback port, driven by the official ``openai`` client and by raw HTTP for the error paths."""

import http.client
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import kvguard_env

pytestmark = pytest.mark.slow

KEY = "test-key"
MAX_NEW = 64
WORKERS = 2
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(small_profile_dir, tmp_path_factory):
    """(port, log path): two workers and one waiting slot, so three requests fill it. The server uses as many
    torch threads as this process, so its greedy decoding can be compared with an in-process one."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    cmd = [sys.executable, "-m", "kvguard", "serve", "--profile", str(small_profile_dir), "--port", str(port),
           "--api-key", KEY, "--max-concurrency", str(WORKERS), "--max-queue", "1", "--max-prompt-tokens", "200",
           "--max-new-tokens", str(MAX_NEW), "--log-file", str(log), "--torch-threads", str(torch.get_num_threads())]
    # The server runs the kvguard this process imports (not whichever one the interpreter has installed).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=kvguard_env(HF_HUB_OFFLINE="1"))
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"kvguard serve exited with {proc.returncode}:\n{proc.stdout.read().decode()}")
        try:
            if _request(port, "GET", "/healthz")[0] == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("kvguard serve did not come up in 180 s")
    yield port, log
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _request(port, method, path, body=None, *, key=KEY, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    payload = raw if raw is not None else (None if body is None else json.dumps(body))
    conn.request(method, path, body=payload, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data), resp
    except json.JSONDecodeError:
        return resp.status, data.decode(), resp


def _client(port):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)


def _log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _prose(tok, tokens: int) -> str:
    from kvguard import data

    return tok.decode(data.token_stream("prose", "eval", tok, tokens)[1:].tolist())


def test_openai_client_completions_chat_and_streaming(server, smollm2, small_profile_dir):
    from kvguard import data
    from kvguard.control.session import LiveSession
    from kvguard.profile import Profile

    port, log = server
    client = _client(port)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]

    prompt = "The capital of France is"
    out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 0 and choice.finish_reason in ("length", "stop")
    # The server decodes exactly what an in-process LiveSession over the same profile decodes (greedy).
    model, tok = smollm2
    session = LiveSession.from_profile(model, Profile.load(small_profile_dir, model))
    bos = [tok.bos_token_id] if data.wants_bos(tok) else []
    ids = torch.tensor(bos + tok(prompt, add_special_tokens=False)["input_ids"])
    assert out.usage.prompt_tokens == ids.numel()
    expected = session.generate(ids, 12, eos_token_id=tok.eos_token_id)  # greedy
    assert choice.text == tok.decode(expected.tokens, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(expected.tokens)
    assert choice.finish_reason == expected.finish_reason.value

    messages = [{"role": "user", "content": "Name three colors."}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
    reply = chat.choices[0].message
    assert reply.role == "assistant" and reply.content.strip()
    # Streaming gives the same text as one response, then the usage.
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    streamed = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    # Sampling with a seed is reproducible.
    a, b = (client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=10, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    # A stop string ends the text before it.
    stopped = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0, stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    records = [r for r in _log(log) if r["event"] == "request" and r["status"] == "200"]
    assert len(records) >= 7 and all("ttft_s" in r and "kv_bytes_fp16" in r for r in records)


def test_bad_requests_get_clear_4xx(server, smollm2):
    port, _ = server
    status, body, _ = _request(port, "POST", "/v1/completions", raw="{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = _request(port, "POST", "/v1/completions", {"prompt": _prose(smollm2[1], 300), "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "--max-prompt-tokens" in body["error"]["message"]
    status, body, _ = _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_NEW + 1})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    for bad, param in (({"prompt": "hi", "n": 2}, "n"), ({"prompt": "hi", "temperature": -1}, "temperature"),
                       ({"prompt": ["a", "b"]}, "prompt"), ({"messages": []}, "messages"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "messages")):
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        status, body, _ = _request(port, "POST", path, bad)
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    status, body, _ = _request(port, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and "smollm2-135m" in body["error"]["message"]
    # The key: required everywhere but /healthz.
    status, body, _ = _request(port, "POST", "/v1/completions", {"prompt": "hi"}, key="wrong")
    assert status == 401 and "wrong" in body["error"]["message"]
    for path in ("/v1/models", "/metrics", "/v1/kvguard/status"):
        assert _request(port, "GET", path, key=None)[0] == 401
    assert _request(port, "GET", "/healthz", key=None)[0] == 200
    assert _request(port, "GET", "/v1/nothing")[0] == 404
    assert _request(port, "GET", "/v1/completions")[0] == 405


def test_concurrent_requests_decode_as_they_do_alone(server):
    port, _ = server
    client = _client(port)
    prompts = ["The Roman Empire", "def fibonacci(n):", "Once upon a time"]

    def complete(prompt):
        return client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # two decode together, the third waits in the queue
        together = list(pool.map(complete, prompts))
    assert together == alone


def _open_stream(port, max_tokens):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"messages": [{"role": "user", "content": "Count from one to one hundred."}], "max_tokens": max_tokens,
         "temperature": 0, "stream": True, "ignore_eos": True}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the role chunk: admitted
    return conn


def _wait_idle(port, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        status = _request(port, "GET", "/v1/kvguard/status")[1]
        if status["requests"]["running"] == 0 and status["requests"]["waiting"] == 0:
            return status
        time.sleep(0.2)
    pytest.fail(f"requests still in flight after {seconds} s: {status['requests']}")


def test_full_queue_answers_429_and_a_disconnect_frees_the_request(server):
    port, log = server
    _wait_idle(port)
    streams = [_open_stream(port, MAX_NEW) for _ in range(WORKERS + 1)]  # every worker busy, the queue full
    status, body, resp = _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 429 and body["error"]["code"] == "server_busy" and resp.getheader("Retry-After") == "1"
    for conn in streams:
        conn.close()
    idle = _wait_idle(port)
    assert idle["active"] == [] and idle["kv_bytes"] == 0
    cancelled = [r for r in _log(log) if r["event"] == "request" and r["status"] == "cancelled"]
    assert len(cancelled) == WORKERS + 1 and all(r["completion_tokens"] < MAX_NEW for r in cancelled)
    # Capacity is back.
    assert _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def _families(port) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    status, text, resp = _request(port, "GET", "/metrics")
    assert status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, **labels) -> float:
    return sum(s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())
               and not s.name.endswith(("_created",)))


def test_metrics_status_and_dashboard(server, smollm2):
    port, log = server
    _wait_idle(port)
    before = _families(port)
    # A prompt long enough that tokens leave the full-precision window and the monitor runs.
    status, body, _ = _request(port, "POST", "/v1/completions",
                               {"prompt": _prose(smollm2[1], 180), "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 40
    assert body["kvguard"]["kv_bytes"] < body["kvguard"]["kv_bytes_fp16"]
    after = _families(port)
    steps = _value(after["kvguard_monitoring_steps"]) - _value(before["kvguard_monitoring_steps"])
    assert steps >= 3
    assert _value(after["kvguard_generated_tokens"]) - _value(before["kvguard_generated_tokens"]) == 40
    assert _value(after["kvguard_requests"], endpoint="completions", status="200") >= 1
    assert _value(after["kvguard_kv_compression_ratio"]) > 1
    assert 0 < _value(after["kvguard_kv_memory_saved_ratio"]) < 1
    assert 0 <= _value(after["kvguard_kv_clip_rate"], kind="key") < 1
    assert _value(after["kvguard_kv_range_use"], layer="0", kind="key") > 0
    assert {s.labels["layer"] for s in after["kvguard_attention_entropy_drop"].samples}  # monitored layers reported
    assert 0 <= _value(after["kvguard_trigger_rate"]) <= 1 and _value(after["kvguard_max_trigger_rate"]) == 0.05
    assert _value(after["kvguard_time_to_first_token_seconds"]) > 0
    assert _value(after["process_resident_memory_bytes"]) > 0
    assert {s.labels["kind"] for s in after["kvguard_compensation_actions"].samples} >= {"light", "heavy", "rollback"}
    status = _request(port, "GET", "/v1/kvguard/status")[1]
    assert len(status["plan"]) == 30 and status["last_request"]["tokens"] >= 180
    assert status["requests"]["max_concurrency"] == WORKERS and status["peak_rss_bytes"] > 0
    # Every metric the Grafana dashboard plots is one the server exports.
    dashboard = json.loads((DEPLOY / "grafana" / "kvguard-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", m) for e in exprs for m in re.findall(r"\b(?:kvguard|process)_[a-z0-9_]+", e)}
    assert used and used <= set(after), used - set(after)
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["authorization"]["type"] == "Bearer"


class _CharTokenizer:
    """Token i is the i-th character of ``chars``; 99 is a lone UTF-8 lead byte (decodes to U+FFFD)."""

    def __init__(self, chars):
        self.chars = chars

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 99 else self.chars[i] for i in ids)


def test_text_stream_holds_back_stop_prefixes_and_half_characters():
    from kvguard.serving.protocol import TextStream

    tok = _CharTokenizer("ab.cEND")
    stream = TextStream(tok, ("END",))
    out = [stream.add(t) for t in (0, 1, 2, 3)]  # "ab.c": the last 2 characters may start "END"
    assert "".join(out) == "ab" and not stream.stopped
    assert stream.add(4) == "." and stream.add(5) == "c" and not stream.stopped  # "ab.cEN": "EN" held back
    assert stream.add(6) == "" and stream.stopped and stream.text == "ab.c"  # "END" cut, nothing of it sent
    plain = TextStream(tok, ())
    assert plain.add(0) == "a" and plain.add(99) == "" and plain.flush() == ""


def test_sampling_greedy_and_nucleus():
    from kvguard.control.sampling import GREEDY, Sampler

    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])
    assert GREEDY.greedy and Sampler(0.0).start()(logits) == 1
    # top_p 0.5 keeps only the most likely token (it alone has about half the mass).
    draw = Sampler(1.0, 0.5, seed=0).start()
    assert {draw(logits) for _ in range(50)} == {1}
    draw = Sampler(1.0, 1.0, seed=0).start()
    assert {draw(logits) for _ in range(200)} == {0, 1, 2}  # token 3 has ~0.0002 of the mass
    # A seed makes a generation's draws reproducible; each start() is a fresh stream.
    sampler = Sampler(1.0, seed=7)
    first, second = sampler.start(), sampler.start()
    assert [first(logits) for _ in range(20)] == [second(logits) for _ in range(20)]
    for bad, message in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(seed=2 ** 64), "seed")):
        with pytest.raises(ValueError, match=message):
            Sampler(**bad)
