"""``kvguard serve``: an OpenAI-compatible HTTP server decoding every request under the feedback loop.

    kvguard serve --model smollm2-135m --profile P [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events), ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus text format) and
``GET /v1/kvguard/status`` (per-layer precision now, rollback level, trigger rate, KV bytes against FP16).

Every request gets its own :class:`~kvguard.live.LiveSession`, so its own quantized cache under the full
feedback loop. Requests run on a bounded pool of worker threads (``--max-concurrency``; torch releases the
GIL inside its kernels) behind a bounded wait queue (``--max-queue``): a request that finds both full is
answered 429 at once. A client that disconnects stops its decoding at the next token and its cache is freed.
The model's attention runs through kvguard's live attention function for the server's lifetime; each worker
thread's session is found through a context variable, so sessions never see each other's state.

Logs: one JSON line per request and one per compensation event, on stderr (or ``--log-file``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import resource
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

DEFAULT_PORT = 8000
MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
# Prometheus histogram buckets (seconds).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ServeConfig:
    """What ``kvguard serve`` was asked for."""

    model: str
    profile: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_concurrency: int = 4
    max_queue: int = 32
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    torch_threads: int = 0  # 0: the machine's cores shared evenly among the workers
    log_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- request parsing
@dataclass
class GenerationRequest:
    """One validated completion request."""

    endpoint: str  # "completions" or "chat.completions"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a number, got {value!r}", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(stops)


def _message_text(message, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise RequestError(400, f"messages[{index}] must be an object with 'role' and 'content'", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise RequestError(400, f"messages[{index}].role must be system, developer, user or assistant, got {role!r}",
                           param="messages")
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts",
                           param="messages")
    return ("system" if role == "developer" else role), content


class Tokenizing:
    """Turns request bodies into :class:`GenerationRequest` (the tokenizer, the model's context, the limits)."""

    def __init__(self, tokenizer, model_name: str, context: int, cfg: ServeConfig) -> None:
        from kvguard import data

        self.tok = tokenizer
        self.model_name = model_name
        self.context = context
        self.cfg = cfg
        self.bos = tokenizer.bos_token_id if data.wants_bos(tokenizer) else None

    def parse(self, endpoint: str, body) -> GenerationRequest:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                               param="model", code="model_not_found")
        n = _integer(body, "n")
        if n not in (None, 1):
            raise RequestError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
        for unsupported in ("logprobs", "top_logprobs", "echo", "tools", "functions", "best_of", "suffix"):
            value = body.get(unsupported)
            if value is None or value is False or (unsupported == "best_of" and value == 1):
                continue
            raise RequestError(400, f"'{unsupported}' is not supported by kvguard serve", param=unsupported)
        ids = self._chat_ids(body) if endpoint == "chat.completions" else self._prompt_ids(body)
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt" if endpoint == "completions" else "messages")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise RequestError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                                    f"{self.cfg.max_prompt_tokens} (--max-prompt-tokens)",
                               param="prompt" if endpoint == "completions" else "messages",
                               code="context_length_exceeded")
        room = min(self.cfg.max_new_tokens, self.context - len(ids))
        if room < 1:
            raise RequestError(400, f"the prompt has {len(ids)} tokens and fills the model's {self.context}-token "
                                    "context", code="context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, name)
        if max_tokens is None:
            max_tokens = min(16, room) if endpoint == "completions" else room  # OpenAI's defaults
        if max_tokens < 1:
            raise RequestError(400, f"'{name}' must be >= 1, got {max_tokens}", param=name)
        if max_tokens > room:
            raise RequestError(400, f"'{name}' is {max_tokens}; at most {room} new tokens fit (--max-new-tokens "
                                    f"{self.cfg.max_new_tokens}, model context {self.context}, prompt {len(ids)})",
                               param=name, code="context_length_exceeded")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "'stream_options' must be an object", param="stream_options")
        stream = _bool(body, "stream")
        return GenerationRequest(
            endpoint=endpoint, prompt_ids=ids, max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            stop=_stop(body), seed=_integer(body, "seed"), stream=stream,
            include_usage=stream and bool(options.get("include_usage")), ignore_eos=_bool(body, "ignore_eos"))

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tok)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:3]}", param="prompt")
            return list(prompt)
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string, a list of one string, or a list of token ids "
                                    "(batches of prompts are not supported: send one request each)", param="prompt")
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None and ids else []) + ids

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", param="messages")
        turns = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ([self.bos] if self.bos is not None else []) + ids


# ---------------------------------------------------------------------- metrics
ACTION_KINDS = {"light": "light", "heavy": "heavy", "precision_up": "precision_up", "precision_down": "precision_down",
                "rollback_int8_double_recompute": "rollback", "rollback_widen_recompute_all_layers": "rollback",
                "rollback_full_precision": "rollback_full", "recommend_recalibration": "recalibration_recommended"}


def action_kind(action: str) -> str:
    """The metrics label of a loop event's action (``step_down_to_level_N`` -> ``step_down``)."""
    if action.startswith("step_down"):
        return "step_down"
    return ACTION_KINDS.get(action, action)


class Metrics:
    """The server's Prometheus metrics, in their own registry (plus the process collector: RSS, CPU)."""

    def __init__(self, num_layers: int, max_trigger_rate: float, window_steps: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.num_layers = num_layers
        self.max_trigger_rate = max_trigger_rate
        self.recent: deque[bool] = deque(maxlen=window_steps)
        self.rate = 0.0
        self.recalibration_recommended = False
        self.lock = threading.Lock()
        self.kv_bytes = Gauge("kvguard_kv_cache_bytes", "KV-cache bytes held by the requests in flight", registry=r)
        self.kv_fp16 = Gauge("kvguard_kv_cache_fp16_bytes", "What the same KV caches would take in FP16", registry=r)
        self.ratio = Gauge("kvguard_kv_compression_ratio",
                           "FP16 bytes / stored bytes of the requests in flight (the last request's when idle)",
                           registry=r)
        self.saved = Gauge("kvguard_kv_memory_saved_ratio", "1 - stored / FP16 bytes, on the same basis", registry=r)
        self.kv_bytes_total = Counter("kvguard_kv_bytes", "Final KV-cache bytes of finished requests, summed",
                                      registry=r)
        self.kv_fp16_total = Counter("kvguard_kv_fp16_bytes", "FP16-equivalent bytes of finished requests, summed",
                                     registry=r)
        self.quantized = Counter("kvguard_quantized_values", "K/V values quantized", ["kind"], registry=r)
        self.clipped = Counter("kvguard_quantized_out_of_range_values",
                               "K/V values quantized outside the calibrated range (clipped)", ["kind"], registry=r)
        self.clip_rate = Gauge("kvguard_kv_clip_rate", "Share of the last request's quantized values outside the "
                               "calibrated range", ["kind"], registry=r)
        self.range_use = Gauge("kvguard_kv_range_use", "Largest |value| quantized / calibrated absmax, last request, "
                               "per layer", ["layer", "kind"], registry=r)
        self.entropy_drop = Gauge("kvguard_attention_entropy_drop", "Window attention-entropy drop against the "
                                  "calibrated baseline at the last monitoring step, per monitored layer", ["layer"],
                                  registry=r)
        self.actions = Counter("kvguard_compensation_actions", "Feedback-loop actions by kind", ["kind"], registry=r)
        self.recomputed = Counter("kvguard_recomputed_positions",
                                  "(layer, position) pairs recomputed at full precision", registry=r)
        self.level = Gauge("kvguard_rollback_level", "Highest rollback level among the requests in flight", registry=r)
        self.steps = Counter("kvguard_monitoring_steps", "Monitoring steps", registry=r)
        self.acted = Counter("kvguard_monitoring_steps_acted", "Monitoring steps that acted", registry=r)
        self.trigger_rate = Gauge("kvguard_trigger_rate", "Share of the last monitoring steps (all requests) that "
                                  "acted", registry=r)
        self.recalibrate = Gauge("kvguard_recalibration_recommended", "1 when the trigger rate over a full window "
                                 "exceeds the profile's max_trigger_rate", registry=r)
        self.requests = Counter("kvguard_requests", "Requests by endpoint and outcome", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("kvguard_request_duration_seconds", "Request latency, arrival to last token",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvguard_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.generated = Counter("kvguard_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("kvguard_prompt_tokens", "Prompt tokens processed", registry=r)
        self.throughput = Gauge("kvguard_decode_tokens_per_second", "Tokens/s of the last finished request "
                                "(first token to last)", registry=r)
        self.in_flight = Gauge("kvguard_requests_running", "Requests decoding now", registry=r)
        self.waiting = Gauge("kvguard_requests_waiting", "Requests admitted and waiting for a worker", registry=r)
        self.max_trigger_gauge = Gauge("kvguard_max_trigger_rate", "The profile's trigger-rate ceiling (the 5 % line)",
                                       registry=r)
        self.max_trigger_gauge.set(max_trigger_rate)
        self.trigger_rate.set(0)
        self.recalibrate.set(0)
        for kind in sorted(set(ACTION_KINDS.values()) | {"step_down"}):
            self.actions.labels(kind)
        for kind in ("key", "value"):
            self.quantized.labels(kind)
            self.clipped.labels(kind)

    def monitoring_step(self, acted: bool, drop: torch.Tensor, monitored: torch.Tensor) -> None:
        self.steps.inc()
        if acted:
            self.acted.inc()
        for l in torch.nonzero(monitored).flatten().tolist():
            self.entropy_drop.labels(str(l)).set(float(drop[l]))
        with self.lock:
            self.recent.append(acted)
            self.rate = sum(self.recent) / len(self.recent)
            self.recalibration_recommended = len(self.recent) == self.recent.maxlen and self.rate > self.max_trigger_rate
        self.trigger_rate.set(self.rate)
        self.recalibrate.set(float(self.recalibration_recommended))

    def event(self, event: dict) -> None:
        self.actions.labels(action_kind(event["action"])).inc()

    def finished(self, session) -> None:
        stored, fp16 = session.cache.nbytes(), session.cache.fp16_nbytes()
        self.kv_bytes_total.inc(stored)
        self.kv_fp16_total.inc(fp16)
        for i, kind in enumerate(("key", "value")):
            quantized = sum(layer.quantized_values[i] for layer in session.cache.layers)
            clipped = sum(layer.out_of_range[i] for layer in session.cache.layers)
            self.quantized.labels(kind).inc(quantized)
            self.clipped.labels(kind).inc(clipped)
            if quantized:
                self.clip_rate.labels(kind).set(clipped / quantized)
            for l, layer in enumerate(session.cache.layers):
                seen, calibrated = layer.running_absmax[i], (layer.key_absmax, layer.value_absmax)[i]
                if seen is not None and calibrated is not None:
                    self.range_use.labels(str(l), kind).set(float((seen.cpu() / calibrated.cpu().clamp_min(1e-6)).max()))


# ---------------------------------------------------------------------- the engine
@dataclass
class Job:
    """One admitted request on its way through a worker."""

    id: str
    request: GenerationRequest
    arrived: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # tokens generated so far (the worker's count)
    snapshot: dict = field(default_factory=dict)

    def put(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy for temperature 0, else nucleus sampling at ``temperature`` / ``top_p``."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Incremental detokenization that never emits half a character or the start of a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text ``token`` makes final ('' while it may still change)."""
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                return self.flush()
        if self.text.endswith("\ufffd"):
            return ""
        end = max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        text = self.text.rstrip("\ufffd")
        out, self.emitted = text[self.emitted:], len(text)
        return out


class Engine:
    """The model, its profile and the bounded worker pool."""

    def __init__(self, cfg: ServeConfig, *, log=None) -> None:
        from kvguard import models
        from kvguard.monitor import ATTN_NAME
        from kvguard.profile import Profile

        self.cfg = cfg
        self.log_stream = log or sys.stderr
        self.log_lock = threading.Lock()
        self.profile = Profile.load(cfg.profile)
        self.model, self.tok = models.load(cfg.model)
        self.profile.check_model(self.model)
        self.model_name = self.profile.model_name if cfg.model == self.profile.model_name else cfg.model
        # Every session's attention runs through the live function; set once, never swapped while serving.
        self.model.set_attn_implementation(ATTN_NAME)
        config = self.model.config
        context = getattr(config, "max_position_embeddings", None) or 2048
        self.tokenizing = Tokenizing(self.tok, self.model_name, int(context), cfg)
        threads = cfg.torch_threads or max(1, (os.cpu_count() or 1) // cfg.max_concurrency)
        torch.set_num_threads(threads)
        self.torch_threads = threads
        monitor = self.profile.monitor
        self.metrics = Metrics(config.num_hidden_layers, float(monitor["max_trigger_rate"]),
                               int(monitor["trigger_rate_steps"]))
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="kvguard-worker")
        self.admit_lock = threading.Lock()
        self.admitted = 0
        self.running = 0
        self.jobs: dict[str, Job] = {}
        self.started = time.time()
        self.totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0}
        self.last_summary: dict | None = None

    # ------------------------------------------------------------------ admission
    def admit(self, request: GenerationRequest, loop) -> Job:
        with self.admit_lock:
            if self.admitted >= self.cfg.max_concurrency + self.cfg.max_queue:
                raise RequestError(429, f"the server is at capacity ({self.cfg.max_concurrency} running, "
                                        f"{self.cfg.max_queue} waiting); retry later",
                                   kind="rate_limit_error", code="server_busy")
            self.admitted += 1
            self.metrics.waiting.set(self.admitted - self.running)
        job = Job(uuid.uuid4().hex[:24], request, time.time(), loop, asyncio.Queue())
        self.jobs[job.id] = job
        future = self.pool.submit(self._run, job)
        future.add_done_callback(lambda f, job=job: self._release(job, f))
        return job

    def _release(self, job: Job, future) -> None:
        with self.admit_lock:
            self.admitted -= 1
            self.metrics.waiting.set(self.admitted - self.running)
        self.jobs.pop(job.id, None)
        self._publish_live()
        error = future.exception()
        if error is not None:  # _run reports its own errors; this is a bug in it
            job.put("error", f"internal error: {error}")

    # ------------------------------------------------------------------ one request
    def _run(self, job: Job) -> None:
        from kvguard.live import LiveSession

        r = job.request
        if job.cancelled.is_set():  # the client left while the request waited
            job.put("done", {"finish_reason": "cancelled", "completion_tokens": 0, "summary": None})
            return
        with self.admit_lock:
            self.running += 1
            self.metrics.in_flight.set(self.running)
            self.metrics.waiting.set(self.admitted - self.running)
        session = None
        try:
            session = LiveSession.from_profile(self.model, self.profile, sequence_id=job.id,
                                               on_event=lambda e, job=job: self._on_event(job, e))
            generator = None
            if r.seed is not None:
                generator = torch.Generator().manual_seed(r.seed)
            elif r.temperature > 0:
                generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
            text = TextStream(self.tok, r.stop)
            logits = session.prefill(torch.tensor(r.prompt_ids))
            eos = None if r.ignore_eos else self.tok.eos_token_id
            finish, first_token_at, generated, steps_seen, recomputed = "length", None, 0, 0, 0
            while generated < r.max_tokens:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                token = sample(logits, r.temperature, r.top_p, generator)
                generated += 1
                job.generated = generated
                if first_token_at is None:
                    first_token_at = time.time()
                    job.put("first", first_token_at)
                if eos is not None and token == eos:
                    finish = "stop"
                    break
                delta = text.add(token)
                if delta:
                    job.put("text", delta)
                if text.stopped:
                    finish = "stop"
                    break
                if generated == r.max_tokens:
                    break
                logits = session.step(token)
                if session.counters.steps != steps_seen and session.last_step is not None:
                    steps_seen = session.counters.steps
                    s = session.last_step
                    self.metrics.monitoring_step(bool(s["acted"]), s["drop"], s["monitored"])
                    self.metrics.recomputed.inc(session.counters.recomputed_positions - recomputed)
                    recomputed = session.counters.recomputed_positions
                if generated % 8 == 0:
                    job.snapshot = _snapshot(session)
                    self._publish_live()
            rest = text.flush() if finish != "cancelled" else ""
            if rest:
                job.put("text", rest)
            summary = session.summary()
            self.metrics.finished(session)
            job.put("done", {"finish_reason": finish, "completion_tokens": generated, "summary": summary,
                             "first_token_at": first_token_at, "finished_at": time.time()})
        except Exception as err:  # noqa: BLE001 - reported to the client and the log, the server keeps going
            job.put("error", f"{type(err).__name__}: {err}")
        finally:
            with self.admit_lock:
                self.running -= 1
                self.metrics.in_flight.set(self.running)
            if session is not None:
                self.last_summary = session.summary()
            job.snapshot = {}
            del session  # frees the cache now, not when the thread is reused

    def _on_event(self, job: Job, event: dict) -> None:
        self.metrics.event(event)
        self.log({"event": "compensation", "request": job.id, **event})

    def _publish_live(self) -> None:
        snaps = [j.snapshot for j in list(self.jobs.values()) if j.snapshot]
        m = self.metrics
        if snaps:
            stored = sum(s["kv_bytes"] for s in snaps)
            fp16 = sum(s["kv_bytes_fp16"] for s in snaps)
            m.kv_bytes.set(stored)
            m.kv_fp16.set(fp16)
            m.level.set(max(s["level"] for s in snaps))
        else:
            m.kv_bytes.set(0)
            m.kv_fp16.set(0)
            m.level.set(0)
            last = self.last_summary
            stored, fp16 = (last["kv_bytes"], last["kv_bytes_fp16"]) if last else (0, 0)
        if stored:
            m.ratio.set(fp16 / stored)
            m.saved.set(1 - stored / fp16)

    # ------------------------------------------------------------------ reporting
    def log(self, record: dict) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record}, default=str)
        with self.log_lock:
            print(line, file=self.log_stream, flush=True)

    def status(self) -> dict:
        plan = self.profile.plan
        jobs = [(j.id, j.snapshot) for j in list(self.jobs.values()) if j.snapshot]
        stored = sum(s["kv_bytes"] for _, s in jobs)
        fp16 = sum(s["kv_bytes_fp16"] for _, s in jobs)
        m = self.metrics
        return {
            "model": self.model_name,
            "profile": str(self.cfg.profile),
            "fingerprint": self.profile.fingerprint,
            "uptime_s": round(time.time() - self.started, 1),
            "plan": [[p.value for p in lp.precision] for lp in plan.layers],
            "monitored_layers": list(self.profile.monitor.get("layers") or []),
            "requests": {"running": self.running, "waiting": self.admitted - self.running,
                         "max_concurrency": self.cfg.max_concurrency, "max_queue": self.cfg.max_queue, **self.totals},
            "active": [{"id": i, **s} for i, s in jobs],
            "rollback_level": max((s["level"] for _, s in jobs), default=0),
            "trigger_rate": m.rate,
            "recalibration_recommended": m.recalibration_recommended,
            "kv_bytes": stored,
            "kv_bytes_fp16": fp16,
            "last_request": self.last_summary and {k: self.last_summary[k] for k in
                                                   ("tokens", "kv_bytes", "kv_bytes_fp16", "memory_saved",
                                                    "trigger_rate", "level", "max_level", "precisions")},
            "torch_threads": self.torch_threads,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def _snapshot(session) -> dict:
    s = session.summary()
    return {"tokens": s["tokens"], "kv_bytes": s["kv_bytes"], "kv_bytes_fp16": s["kv_bytes_fp16"],
            "level": s["level"], "trigger_rate": s["trigger_rate"], "precisions": s["precisions"]}


# ---------------------------------------------------------------------- HTTP
def _error(err: RequestError):
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if err.status == 429 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def build_app(engine: Engine):
    """The Starlette application serving ``engine``."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    cfg = engine.cfg

    class Auth:
        """Bearer-key check on every route but /healthz (pure ASGI: streaming passes through untouched)."""

        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and cfg.api_key is not None and scope["path"] != "/healthz":
                headers = dict(scope["headers"])
                given = headers.get(b"authorization", b"").decode("latin-1")
                if given != f"Bearer {cfg.api_key}":
                    what = "no API key was sent" if not given else "the API key is wrong"
                    response = _error(RequestError(401, f"{what}: send 'Authorization: Bearer <key>'",
                                                   kind="authentication_error", code="invalid_api_key"))
                    await response(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    async def read_body(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is {size} bytes; at most {MAX_BODY_BYTES} are accepted")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(400, f"the request body is not valid JSON: {err}") from None

    def finish(job: Job, endpoint: str, status: str, done: dict | None, completion_tokens: int = 0) -> None:
        r = job.request
        m = engine.metrics
        now = time.time()
        m.requests.labels(endpoint, status).inc()
        m.latency.labels(endpoint).observe(now - job.arrived)
        m.prompt.inc(len(r.prompt_ids))
        m.generated.inc(completion_tokens)
        engine.totals["requests"] += 1
        engine.totals["generated_tokens"] += completion_tokens
        engine.totals["prompt_tokens"] += len(r.prompt_ids)
        record = {"event": "request", "request": job.id, "endpoint": endpoint, "status": status,
                  "stream": r.stream, "prompt_tokens": len(r.prompt_ids), "completion_tokens": completion_tokens,
                  "seconds": round(now - job.arrived, 4)}
        if done and done.get("first_token_at"):
            ttft = done["first_token_at"] - job.arrived
            m.ttft.observe(ttft)
            record["ttft_s"] = round(ttft, 4)
            decode = done["finished_at"] - done["first_token_at"]
            if completion_tokens > 1 and decode > 0:
                m.throughput.set((completion_tokens - 1) / decode)
                record["tokens_per_s"] = round((completion_tokens - 1) / decode, 2)
        summary = done and done.get("summary")
        if summary:
            record.update(finish_reason=done["finish_reason"], kv_bytes=summary["kv_bytes"],
                          kv_bytes_fp16=summary["kv_bytes_fp16"], memory_saved=round(summary["memory_saved"], 4),
                          trigger_rate=round(summary["trigger_rate"], 4), max_level=summary["max_level"],
                          actions=summary["actions"], recomputed_positions=summary["recomputed_positions"])
        engine.log(record)

    def usage(job: Job, completion_tokens: int) -> dict:
        p = len(job.request.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    def kvguard_block(summary: dict | None) -> dict | None:
        if not summary:
            return None
        return {k: summary[k] for k in ("kv_bytes", "kv_bytes_fp16", "memory_saved", "trigger_rate", "max_level",
                                        "recomputed_positions", "actions")}

    async def generate(request: Request, endpoint: str):
        try:
            body = await read_body(request)
            r = engine.tokenizing.parse(endpoint, body)
            job = engine.admit(r, asyncio.get_running_loop())
        except RequestError as err:
            engine.metrics.requests.labels(endpoint, str(err.status)).inc()
            engine.log({"event": "request", "endpoint": endpoint, "status": err.status, "error": err.message})
            return _error(err)
        created = int(job.arrived)
        chat = endpoint == "chat.completions"
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + job.id
        if r.stream:
            return StreamingResponse(stream(job, endpoint, rid, created, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, done = [], None
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled.set()
                    continue
                if kind == "text":
                    text.append(payload)
                elif kind == "done":
                    done = payload
                    break
                elif kind == "error":
                    finish(job, endpoint, "500", None)
                    return _error(RequestError(500, payload, kind="server_error"))
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        n = done["completion_tokens"]
        if done["finish_reason"] == "cancelled":
            finish(job, endpoint, "cancelled", done, n)
            return Response(status_code=499)  # nginx's "client closed request": nobody is left to read it
        finish(job, endpoint, "200", done, n)
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                   "finish_reason": done["finish_reason"]} if chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": done["finish_reason"]})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": engine.model_name, "choices": [choice],
                             "usage": usage(job, n), "kvguard": kvguard_block(done["summary"])})

    async def stream(job: Job, endpoint: str, rid: str, created: int, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish_reason=None, *, role: bool = False, usage_block=None) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}]
            else:
                choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}]
            body = {"id": rid, "object": obj, "created": created, "model": engine.model_name, "choices": choices}
            if usage_block is not None:
                body = {"id": rid, "object": obj, "created": created, "model": engine.model_name, "choices": [],
                        "usage": usage_block}
            return f"data: {json.dumps(body)}\n\n"

        status, done = "cancelled", None
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, payload = await job.queue.get()
                if kind == "text":
                    yield chunk(payload)
                elif kind == "done":
                    done = payload
                    break
                elif kind == "error":
                    status = "500"
                    yield f"data: {json.dumps(RequestError(500, payload, kind='server_error').body())}\n\n"
                    return
            if done["finish_reason"] == "cancelled":
                return
            status = "200"
            yield chunk(None, done["finish_reason"])
            if job.request.include_usage:
                yield chunk(None, usage_block=usage(job, done["completion_tokens"]))
            yield "data: [DONE]\n\n"
        finally:
            if status == "cancelled":
                job.cancelled.set()  # the client went away: the worker stops at its next token
            finish(job, endpoint, status, done, done["completion_tokens"] if done else job.generated)

    async def completions(request: Request):
        return await generate(request, "completions")

    async def chat_completions(request: Request):
        return await generate(request, "chat.completions")

    async def list_models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "created": int(engine.started), "owned_by": "kvguard"}]})

    async def healthz(request: Request):
        return JSONResponse({"status": "ok", "model": engine.model_name})

    async def metrics(request: Request):
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request):
        return JSONResponse(engine.status())

    async def not_found(request: Request, exc):
        return _error(RequestError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def bad_method(request: Request, exc):
        return _error(RequestError(405, f"{request.method} is not allowed on {request.url.path}"))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/kvguard/status", status, methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Auth)],
                     exception_handlers={404: not_found, 405: bad_method})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: ServeConfig) -> None:
    """Load the model and profile, then serve until interrupted."""
    import uvicorn

    log = open(cfg.log_file, "a", buffering=1) if cfg.log_file else sys.stderr
    engine = Engine(cfg, log=log)
    if not is_loopback(cfg.host):
        print(f"[kvguard serve] warning: listening on {cfg.host}, not loopback"
              + ("" if cfg.api_key else " and without --api-key: anyone who can reach it can use it"),
              file=sys.stderr, flush=True)
    print(f"[kvguard serve] {engine.model_name} with profile {cfg.profile} ({engine.profile.meta['plan_summary'][:60]}"
          f"...); {cfg.max_concurrency} workers x {engine.torch_threads} torch threads, queue {cfg.max_queue}; "
          f"http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(build_app(engine), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    engine.pool.shutdown(wait=False, cancel_futures=True)
    if cfg.log_file:
        log.close()
