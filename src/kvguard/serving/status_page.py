"""The live status page of ``kvguard serve`` at ``/``: what a person watching the server wants to see.

Memory saved, the trigger rate against the profile's ceiling (the 5 % line), the rollback level, the requests
and the recent compensation events, refreshed every two seconds from ``GET /v1/kvguard/status``. The page itself
is a static shell with no data in it; the data comes from the status route, which needs the API key when the
server has one: open ``http://HOST:PORT/#key=KEY`` (a URL fragment never leaves the browser) or type it in.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse

REFRESH_MS = 2000

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvguard serve</title><link rel="icon" href="data:,">
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1000px; color: #222; }
.tiles { display: flex; gap: 1em; flex-wrap: wrap; margin: 1em 0; }
.tile { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em 1em; min-width: 12em; }
.tile .value { font-size: 1.8em; font-variant-numeric: tabular-nums; }
.tile .label { font-size: 0.85em; color: #555; }
.bar { position: relative; height: 10px; background: #eee; margin-top: 0.4em; }
.bar .fill { position: absolute; left: 0; top: 0; bottom: 0; background: #4c9a5f; }
.bar .line { position: absolute; top: -3px; bottom: -3px; width: 2px; background: #c8453b; }
.over .value { color: #c8453b; } .bar.over .fill { background: #c8453b; }
table { border-collapse: collapse; font-size: 0.85em; width: 100%; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
#problem { color: #c8453b; } #updated { color: #777; font-size: 0.85em; }
</style></head><body>
<h1>kvguard serve <span id="model"></span></h1>
<p id="updated">waiting for the first status…</p>
<p id="problem" hidden></p>
<form id="keyform" hidden>API key: <input id="key" type="password" size="30" autocomplete="off"> <button>use</button></form>
<div class="tiles">
  <div class="tile"><div class="value" id="saved">–</div><div class="label">KV memory saved against FP16, every
    tier in RAM counted (<span id="saved-basis">–</span>)<br><span id="tiers">–</span></div></div>
  <div class="tile" id="rate-tile"><div class="value" id="rate">–</div>
    <div class="label">trigger rate; ceiling <span id="ceiling">–</span></div>
    <div class="bar" id="rate-bar"><div class="fill" id="rate-fill"></div><div class="line" id="rate-line"></div></div></div>
  <div class="tile"><div class="value" id="level">–</div><div class="label">rollback level (0 = the plan)</div></div>
  <div class="tile"><div class="value" id="requests">–</div><div class="label">requests: <span id="running">–</span>
    running, <span id="waiting">–</span> waiting</div></div>
</div>
<h2>Recent compensation events</h2>
<table><thead><tr><th>time</th><th>request</th><th>token</th><th>alarm</th><th>action</th><th>level</th>
<th>positions</th><th>layers</th></tr></thead><tbody id="events"><tr><td colspan="8">none yet</td></tr></tbody></table>
<script>
(function () {
  var problem = document.getElementById("problem");
  function fail(text) { problem.hidden = false; problem.textContent = text; }
  window.addEventListener("error", function (e) { fail("script error: " + e.message); });
  var key = new URLSearchParams(location.hash.slice(1)).get("key") || sessionStorage.getItem("kvguard-key") || "";
  function set(id, text) { document.getElementById(id).textContent = text; }
  function pct(x) { return (100 * x).toFixed(1) + " %"; }
  function cell(row, text, num) {
    var td = document.createElement("td"); td.textContent = text; if (num) td.className = "num"; row.appendChild(td);
  }
  function events(list) {
    var body = document.getElementById("events");
    if (!list.length) return;
    body.textContent = "";
    list.slice().reverse().forEach(function (e) {
      var tr = document.createElement("tr");
      cell(tr, new Date(e.time * 1000).toLocaleTimeString()); cell(tr, (e.request || "").slice(0, 8));
      cell(tr, e.token, true); cell(tr, e.alarm); cell(tr, e.action); cell(tr, e.level, true);
      cell(tr, e.positions || 0, true); cell(tr, (e.layers || []).join(", "));
      body.appendChild(tr);
    });
  }
  function mib(bytes) { return (bytes / 1048576).toFixed(1) + " MiB"; }
  function show(s) {
    set("model", "— " + s.model); problem.hidden = true;
    var live = s.kv_bytes_fp16 > 0, last = s.last_request;
    var saved = live ? s.memory.memory_saved : (last ? last.memory_saved : null);
    set("saved", saved === null ? "–" : pct(saved));
    set("saved-basis", live ? "requests in flight" : (last ? "last request" : "no request yet"));
    var m = live ? s.memory : (last ? last.memory : null);
    set("tiers", m ? "hot " + mib(m.hot_bytes) + ", overlay " + mib(m.overlay_bytes) + ", originals in RAM " +
        mib(m.backing_ram_bytes) + ", on disk " + mib(m.backing_disk_bytes) : "–");
    set("rate", pct(s.trigger_rate)); set("ceiling", pct(s.max_trigger_rate));
    var over = s.trigger_rate > s.max_trigger_rate, scale = Math.max(2 * s.max_trigger_rate, s.trigger_rate);
    document.getElementById("rate-fill").style.width = (100 * s.trigger_rate / scale) + "%";
    document.getElementById("rate-line").style.left = (100 * s.max_trigger_rate / scale) + "%";
    document.getElementById("rate-tile").className = "tile" + (over ? " over" : "");
    document.getElementById("rate-bar").className = "bar" + (over ? " over" : "");
    set("level", String(s.rollback_level)); set("requests", String(s.requests.requests));
    set("running", s.requests.running); set("waiting", s.requests.waiting);
    events(s.recent_events || []);
    set("updated", "updated " + new Date().toLocaleTimeString() + (s.recalibration_recommended ?
        " — recalibration recommended: the trigger rate stayed above the ceiling" : ""));
  }
  function poll() {
    var headers = key ? {"Authorization": "Bearer " + key} : {};
    fetch("v1/kvguard/status", {headers: headers}).then(function (r) {
      if (r.status === 401) { document.getElementById("keyform").hidden = false; throw new Error("the server needs its API key"); }
      if (!r.ok) throw new Error("status " + r.status);
      return r.json();
    }).then(show).catch(function (err) { fail("cannot read /v1/kvguard/status: " + err.message); });
  }
  document.getElementById("keyform").addEventListener("submit", function (e) {
    e.preventDefault(); key = document.getElementById("key").value; sessionStorage.setItem("kvguard-key", key); poll();
  });
  poll();
  setInterval(poll, REFRESH_MS);
})();
</script></body></html>
""".replace("REFRESH_MS", str(REFRESH_MS))


async def status_page(request: Request) -> HTMLResponse:
    """``GET /``: the live status page (a static shell; its script reads ``/v1/kvguard/status``)."""
    return HTMLResponse(_PAGE)
