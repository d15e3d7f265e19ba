"""The engine behind ``kvguard serve``: the model, its profile, a bounded worker pool, one session per request.

Every request gets its own :class:`~kvguard.control.session.LiveSession`, so its own quantized cache under the
full feedback loop, and decodes through the one decode loop (:func:`kvguard.control.decoding.generate`).
Requests run on a bounded pool of worker threads (``max_concurrency``; torch releases the GIL inside its kernels)
behind a bounded wait queue (``max_queue``): a request that finds both full is refused at once (429). A client
that disconnects sets the job's cancel flag; the worker stops at its next token and its cache is freed. The
model's attention runs through kvguard's harness (:mod:`kvguard.attention`); each worker thread's session
reaches it through a context variable, so sessions never see each other's state. Before any request, the engine
decodes a few tokens through one session of the profile: a profile that loads but cannot serve is refused at start.
"""

from __future__ import annotations

import asyncio
import json
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

from kvguard import attention
from kvguard.control.decoding import FinishReason
from kvguard.control.events import Event
from kvguard.serving.messages import Done, Failed, Message, TextDelta
from kvguard.serving.metrics import Metrics
from kvguard.serving.protocol import GenerationRequest, Limits, RequestError, RequestParser, TextStream
from kvguard.serving.settings import ServeConfig

RECENT_EVENTS = 20  # compensation events GET /v1/kvguard/status returns (the newest last)


@dataclass
class Job:
    """One admitted request on its way through a worker."""

    id: str
    request: GenerationRequest
    arrived: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of serving.messages.Message, in order
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # tokens generated so far (the worker's count)
    snapshot: dict = field(default_factory=dict)

    def put(self, message: Message) -> None:
        """Hand ``message`` to the request's handler (called from the worker thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, message)


class Engine:
    """The model, its profile and the bounded worker pool."""

    def __init__(self, cfg: ServeConfig, *, log=None) -> None:
        from kvguard import models
        from kvguard.profile import Profile

        self.cfg = cfg
        self.log_stream = log or sys.stderr
        self.log_lock = threading.Lock()
        self.profile = Profile.load(cfg.profile)
        self.model, self.tok = models.load(cfg.model, device=cfg.device)
        self.profile.check_model(self.model)
        self.model_name = self.profile.model_name if cfg.model == self.profile.model_name else cfg.model
        attention.install(self.model)  # once, before any worker runs: never switched while serving
        config = self.model.config
        context = int(getattr(config, "max_position_embeddings", None) or 2048)
        self.parser = RequestParser(self.tok, self.model_name, Limits(cfg.max_prompt_tokens, cfg.max_new_tokens, context))
        threads = cfg.torch_threads or max(1, (os.cpu_count() or 1) // cfg.max_concurrency)
        torch.set_num_threads(threads)
        self.torch_threads = threads
        monitor = self.profile.meta.monitor
        self.metrics = Metrics(config.num_hidden_layers, monitor.max_trigger_rate, monitor.trigger_rate_steps)
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="kvguard-worker")
        self.admit_lock = threading.Lock()
        self.admitted = 0
        self.running = 0
        self.jobs: dict[str, Job] = {}
        self.started = time.time()
        self.totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0}
        self.last_summary: dict | None = None
        # The status page lists these; the log and the metrics keep the full history.
        self.recent_events: deque[dict] = deque(maxlen=RECENT_EVENTS)
        self._rehearse()

    def _rehearse(self) -> None:
        """Decode once through a full session before serving: a profile that loads but cannot serve (a plan that
        does not fit the model, a classifier the monitor cannot feed, a missing tensor) stops the server at start,
        with one line naming the profile, instead of a /healthz that answers 200 over completions that all fail."""
        from kvguard.control.session import LiveSession
        from kvguard.profile import ProfileError

        try:
            session = LiveSession.from_profile(self.model, self.profile, sequence_id="startup-check")
            # Long enough that tokens leave the full-precision window and two monitoring steps run.
            steps = 2 * session.config.refresh_tokens
            length = min(session.start_step + 1, self.parser.limits.context - steps)
            text = self.tok("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)["input_ids"]
            prompt = torch.tensor((text * (length // len(text) + 1))[:length])
            session.generate(prompt, steps)
        except ProfileError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever breaks here would break every request
            message = " ".join(f"{type(err).__name__}: {err}".split())
            raise ProfileError(f"profile {self.cfg.profile} cannot serve {self.model_name}: {message}") from None

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
            job.put(Failed(f"internal error: {error}"))

    # ------------------------------------------------------------------ one request
    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while the request waited
            job.put(Done(FinishReason.CANCELLED, 0))
            return
        with self.admit_lock:
            self.running += 1
            self.metrics.in_flight.set(self.running)
            self.metrics.waiting.set(self.admitted - self.running)
        session = None
        try:
            session = self._session(job)
            self._decode(job, session)
        except Exception as err:  # noqa: BLE001 - reported to the client and the log, the server keeps going
            job.put(Failed(f"{type(err).__name__}: {err}"))
        finally:
            with self.admit_lock:
                self.running -= 1
                self.metrics.in_flight.set(self.running)
            if session is not None:
                self.last_summary = session.summary()
            job.snapshot = {}
            del session  # frees the cache now, not when the thread is reused

    def _session(self, job: Job):
        from kvguard.control.session import LiveSession

        return LiveSession.from_profile(self.model, self.profile, sequence_id=job.id,
                                        on_event=lambda e, job=job: self._on_event(job, e),
                                        on_step=self.metrics.monitoring_step)

    def _decode(self, job: Job, session) -> None:
        r = job.request
        text = TextStream(self.tok, r.stop)
        first_token_at = None

        def on_token(token: int) -> bool:
            nonlocal first_token_at
            job.generated += 1
            if first_token_at is None:
                first_token_at = time.time()
            delta = text.add(token)
            if delta:
                job.put(TextDelta(delta))
            if job.generated % 8 == 0:
                job.snapshot = _snapshot(session)
                self._publish_live()
            return text.stopped

        out = session.generate(torch.tensor(r.prompt_ids), r.max_tokens, sampler=r.sampler,
                               eos_token_id=None if r.ignore_eos else self.tok.eos_token_id, on_token=on_token,
                               should_stop=job.cancelled.is_set)
        rest = text.flush() if out.finish_reason is not FinishReason.CANCELLED else ""
        if rest:
            job.put(TextDelta(rest))
        summary = session.summary()
        self.metrics.finished(session)
        job.put(Done(out.finish_reason, len(out.tokens), summary, first_token_at, time.time()))

    def _on_event(self, job: Job, event: Event) -> None:
        self.metrics.event(event)
        record = {"request": job.id, **event.to_json()}
        self.recent_events.append(record)
        self.log({"event": "compensation", **record})

    def _publish_live(self) -> None:
        snaps = [j.snapshot for j in list(self.jobs.values()) if j.snapshot]
        m = self.metrics
        memory = _memory(snaps)
        for tier in _TIERS:
            m.tier_bytes.labels(tier).set(memory.get(f"{tier}_bytes", 0))
        if snaps:
            stored, ram, fp16 = memory["kv_bytes"], memory["ram_bytes"], memory["fp16_bytes"]
            m.kv_bytes.set(stored)
            m.kv_fp16.set(fp16)
            m.level.set(max(s["level"] for s in snaps))
        else:
            m.kv_bytes.set(0)
            m.kv_fp16.set(0)
            m.level.set(0)
            last = self.last_summary
            stored, fp16 = (last["kv_bytes"], last["kv_bytes_fp16"]) if last else (0, 0)
            ram = last["memory"]["ram_bytes"] if last else 0
        if stored:
            m.ratio.set(fp16 / stored)
            m.saved.set(1 - ram / fp16)

    # ------------------------------------------------------------------ reporting
    def log(self, record: dict) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record}, default=str)
        with self.log_lock:
            print(line, file=self.log_stream, flush=True)

    def status(self) -> dict:
        plan = self.profile.plan
        # Each job's snapshot read once: a worker replaces it (and clears it at the end) meanwhile.
        jobs = [(j, j.snapshot) for j in list(self.jobs.values())]
        jobs = [(j, s) for j, s in jobs if s]
        stored = sum(s["kv_bytes"] for _, s in jobs)
        fp16 = sum(s["kv_bytes_fp16"] for _, s in jobs)
        m = self.metrics
        return {
            "model": self.model_name,
            "profile": str(self.cfg.profile),
            "fingerprint": self.profile.fingerprint,
            "uptime_s": round(time.time() - self.started, 1),
            "plan": [[p.value for p in lp.precision] for lp in plan.layers],
            "monitored_layers": list(self.profile.meta.monitor.layers or []),
            "requests": {"running": self.running, "waiting": self.admitted - self.running,
                         "max_concurrency": self.cfg.max_concurrency, "max_queue": self.cfg.max_queue, **self.totals},
            "active": [{"id": j.id, "generated": j.generated, **s} for j, s in jobs],
            "rollback_level": max((s["level"] for _, s in jobs), default=0),
            "trigger_rate": m.rate,
            "max_trigger_rate": m.max_trigger_rate,
            "recalibration_recommended": m.recalibration_recommended,
            "kv_bytes": stored,
            "kv_bytes_fp16": fp16,
            "memory": _memory([s for _, s in jobs]),
            "last_request": self.last_summary and {k: self.last_summary[k] for k in
                                                   ("tokens", "kv_bytes", "kv_bytes_fp16", "memory_saved", "memory",
                                                    "trigger_rate", "level", "max_level", "precisions")},
            "recent_events": list(self.recent_events),
            "torch_threads": self.torch_threads,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def _snapshot(session) -> dict:
    s = session.summary()
    return {"tokens": s["tokens"], "kv_bytes": s["kv_bytes"], "kv_bytes_fp16": s["kv_bytes_fp16"],
            "memory": s["memory"], "level": s["level"], "trigger_rate": s["trigger_rate"],
            "precisions": s["precisions"]}


_TIERS = ("hot", "overlay", "backing_ram", "backing_disk")


def _memory(snaps: list[dict]) -> dict:
    """The requests' bytes summed tier by tier (``hot_bytes`` ... ``ram_bytes``, ``fp16_bytes``), and the share
    of FP16's bytes saved counting every tier in RAM."""
    keys = [f"{t}_bytes" for t in _TIERS] + ["kv_bytes", "ram_bytes", "fp16_bytes"]
    total = {k: sum(s["memory"][k] for s in snaps) for k in keys}
    total["memory_saved"] = 1 - total["ram_bytes"] / total["fp16_bytes"] if total["fp16_bytes"] else 0.0
    return total
