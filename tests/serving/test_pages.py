"""What a person watching ``kvguard serve`` sees, checked as they would: the live status page at ``/`` rendered by
headless Chromium, and a real Prometheus scraping the server with ``deploy/prometheus.yml`` and answering the
queries of the Grafana dashboard. One server (real SmolLM2, a calibrated profile, an API key) serves both."""

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import Drained, kvguard_env, render_page, screenshot_dir

pytestmark = pytest.mark.slow

KEY = "pages-key"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The dashboard panels this check follows, by title: the series a person reads first.
PANELS = ("Compression ratio", "Trigger rate (against the 5 % line)", "Rollback level", "Request latency")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.status, resp.read().decode()


def _wait(what: str, check, seconds: float, proc) -> None:
    output = Drained(proc)
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            output.thread.join(5)
            pytest.fail(f"{what}: the process exited with {proc.returncode}:\n{output.tail()}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{what}: not ready in {seconds:.0f} s")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(small_profile_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "kvguard", "serve", "--profile", str(small_profile_dir), "--port", str(port),
           "--api-key", KEY, "--max-batch", "1", "--max-new-tokens", "32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=kvguard_env(HF_HUB_OFFLINE="1"))
    _wait("kvguard serve", lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 240, proc)
    yield port
    _stop(proc)


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """A real Prometheus on ``deploy/prometheus.yml`` (a copy naming this server's port and key file, scraping
    every second), after a few requests it has seen arrive: ``(prometheus port, server port)``."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus; `make` does it where apt is usable)")
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "kvguard-api-key").write_text(KEY + "\n")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    job = config["scrape_configs"][0]
    job["authorization"]["credentials_file"] = str(tmp / "kvguard-api-key")
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{server}"]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait("prometheus", lambda: _query(port, 'up{job="kvguard"}') == [1.0], 120, proc)
    from kvguard import data

    article = data.documents("prose", "eval", limit=1, max_chars=1500)[0].text  # long enough to quantize most of
    for prompt in ("Write a short poem about rain.", article):  # traffic Prometheus sees arrive; the last is long
        body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server}/v1/completions", data=body, headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as resp:
            assert resp.status == 200
    time.sleep(3)  # a few scrapes after the last request, so that rate() sees the increase
    yield port, server
    _stop(proc)


def _query(port: int, expr: str) -> list[float]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    payload = json.loads(_get(url)[1])
    assert payload["status"] == "success", payload
    return [float(r["value"][1]) for r in payload["data"]["result"]]


def test_prometheus_answers_the_dashboard_queries(prometheus):
    port, _ = prometheus
    panels = {p["title"]: [t["expr"] for t in p["targets"]]
              for p in json.loads((DEPLOY / "grafana" / "kvguard-dashboard.json").read_text())["panels"]}
    for title in PANELS:
        for expr in panels[title]:
            values = _query(port, expr)
            assert values and all(v == v for v in values), f"{title}: {expr} -> {values}"  # present and not NaN
    ratio, = _query(port, "kvguard_kv_compression_ratio")
    assert ratio > 1.2  # the last request's cache against FP16's bytes (its FP window and sinks stay FP16)
    assert _query(port, "kvguard_max_trigger_rate") == [0.05]
    assert _query(port, "kvguard_rollback_level")[0] in (0, 1, 2, 3)
    assert sum(_query(port, "kvguard_request_duration_seconds_count")) == 2
    p50, = _query(port, panels["Request latency"][0])
    assert 0 < p50 <= 128  # seconds; the top bucket's bound when a loaded machine takes longer


def test_status_page_renders_live_numbers_in_chromium(prometheus, tmp_path):
    _, port = prometheus
    status = json.loads(_get(f"http://127.0.0.1:{port}/v1/kvguard/status", KEY)[1])
    assert status["requests"]["requests"] == 2 and status["max_trigger_rate"] == 0.05
    assert isinstance(status["recent_events"], list)
    shot = screenshot_dir(tmp_path) / "status-page.png"
    dom, console = render_page(f"http://127.0.0.1:{port}/#key={KEY}", screenshot=shot, size="1100,800")
    assert console == [], console  # no script error, no failed request
    saved = re.search(r'id="saved">([^<]*)<', dom).group(1)
    expected = 100 * status["last_request"]["memory_saved"]
    assert saved == f"{expected:.1f} %"
    assert re.search(r'id="rate">(\d+\.\d) %<', dom) and 'id="ceiling">5.0 %<' in dom
    assert f'id="level">{status["rollback_level"]}<' in dom and 'id="requests">2<' in dom
    assert re.search(r'id="problem" hidden', dom) and "updated " in dom
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


def test_status_page_without_the_key_asks_for_it(server):
    dom, console = render_page(f"http://127.0.0.1:{server}/", wait_ms=3000)
    assert re.search(r'<form id="keyform">', dom)  # shown (no longer hidden)
    assert "the server needs its API key" in dom and 'id="saved">–<' in dom  # no data without the key
    assert not [line for line in console if "script error" in line or "Uncaught" in line], console
