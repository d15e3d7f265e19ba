"""The engine behind ``kvguard serve``: the model, its profile, the step scheduler, one session per request.

Every request gets its own :class:`~kvguard.control.session.LiveSession`, so its own quantized cache under its own
feedback loop (or the plan's cache alone with ``--no-loop``), and one scheduler loop
(:mod:`kvguard.serving.scheduler`, on the thread that loaded the model under ``kvguard serve``) advances every
request in flight in the same model forward. Admission is by memory: a request reserves the KV bytes its plan stores
for its prompt and ``max_tokens`` (plus what the loop may add, :meth:`Engine.reserve`); it waits while the
reservations in flight would pass ``--kv-budget``, and a request that finds the wait queue full is refused at once
(429 with ``Retry-After``). A client that disconnects sets the job's cancel flag; its sequence leaves the batch at
the next step and its cache is freed. Before any request, the engine decodes a few tokens through one session: a
profile that loads but cannot serve is refused at start.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from kvguard import attention
from kvguard.control.events import Event
from kvguard.serving.messages import Message
from kvguard.serving.metrics import Metrics
from kvguard.serving.protocol import GenerationRequest, Limits, RequestError, RequestParser
from kvguard.serving.scheduler import Budget, Scheduler, Sizing
from kvguard.serving.settings import ServeConfig, kv_budget_bytes

RECENT_EVENTS = 20  # compensation events GET /v1/kvguard/status returns (the newest last)


@dataclass
class Job:
    """One admitted request on its way through the scheduler."""

    id: str
    request: GenerationRequest
    arrived: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of serving.messages.Message, in order
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # tokens generated so far (the scheduler's count)
    snapshot: dict = field(default_factory=dict)

    def put(self, message: Message) -> None:
        """Hand ``message`` to the request's handler (called from the scheduler thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, message)


class Engine:
    """The model, its profile, the plan every request's cache stores, and the scheduler."""

    def __init__(self, cfg: ServeConfig, *, log=None, start: bool = True) -> None:
        """``start``: run the scheduler on a thread of its own; without, the caller runs ``scheduler.run()``."""
        import os

        from kvguard import models
        from kvguard.profile import Profile

        self.cfg = cfg
        self.log_stream = log or sys.stderr
        self.log_lock = threading.Lock()
        self.profile = Profile.load(cfg.profile)
        self.model, self.tok = models.load(cfg.model, device=cfg.device)
        self.profile.check_model(self.model)
        self.model_name = self.profile.model_name if cfg.model == self.profile.model_name else cfg.model
        self.plan = self._plan()
        attention.install(self.model)  # once, before the scheduler runs: never switched while serving
        config = self.model.config
        context = int(getattr(config, "max_position_embeddings", None) or 2048)
        self.parser = RequestParser(self.tok, self.model_name, Limits(cfg.max_prompt_tokens, cfg.max_new_tokens, context))
        self.torch_threads = cfg.torch_threads or os.cpu_count() or 1
        torch.set_num_threads(self.torch_threads)
        monitor = self.profile.meta.monitor
        self.metrics = Metrics(config.num_hidden_layers, monitor.max_trigger_rate, monitor.trigger_rate_steps)
        self.kv_budget = kv_budget_bytes(cfg.kv_budget)
        self.sizing = Sizing.of(self.plan, config, self.profile.static_scales(),
                                self.profile.meta.monitor.min_saving_kept if cfg.loop else None)
        self.metrics.kv_budget.set(self.kv_budget)
        self.jobs: dict[str, Job] = {}
        self.admit_lock = threading.Lock()
        self.started = time.time()
        self.totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0}
        self.last_summary: dict | None = None
        # The status page lists these; the log and the metrics keep the full history.
        self.recent_events: deque[dict] = deque(maxlen=RECENT_EVENTS)
        self._check_budget()
        self._rehearse()
        self.scheduler = Scheduler(self, max_batch=cfg.max_batch, step_tokens=cfg.step_tokens,
                                   budget=Budget(self.kv_budget, self.reserve))
        if start:
            self.scheduler.start()

    def _plan(self):
        """The plan ``--plan`` names: the profile's, a frontier plan of it, or one tier everywhere."""
        from kvguard.architecture import Architecture
        from kvguard.plan import Plan

        name = self.cfg.plan
        if name == "profile":
            return self.profile.plan
        base, at, budget = name.partition("@")
        if at:
            try:
                point = self.profile.meta.frontier_pick(float(budget)) if base == "kvguard" else None
            except ValueError:
                point = None
            if point is None:
                frontier = [round(c.memory, 3) for c in self.profile.meta.frontier()]
                raise ValueError(f"--plan {name}: expected kvguard@<bytes ratio> with a frontier plan of the profile at "
                                 f"or below it (the profile's frontier stores {frontier})")
            return point.plan
        try:
            return Plan.uniform(Architecture.from_config(self.model.config), name, self.profile.plan.cache)
        except ValueError:
            raise ValueError(f"--plan must be 'profile', 'kvguard@<bytes ratio>' or one of fp16, int8, int4, int3, "
                             f"int2; got {name!r}") from None

    def reserve(self, tokens: int) -> int:
        """The KV bytes one sequence of ``tokens`` tokens may hold (:class:`~kvguard.serving.scheduler.Sizing`)."""
        return self.sizing.reserve(tokens)

    def _check_budget(self) -> None:
        """A budget that cannot hold even one request of the longest prompt and reply allowed is refused at start."""
        need = self.reserve(self.cfg.max_prompt_tokens + self.cfg.max_new_tokens)
        if need > self.kv_budget:
            raise ValueError(f"--kv-budget {self.cfg.kv_budget} ({self.kv_budget / 2**20:.0f} MiB) cannot hold one "
                             f"request of --max-prompt-tokens {self.cfg.max_prompt_tokens} and --max-new-tokens "
                             f"{self.cfg.max_new_tokens} ({need / 2**20:.1f} MiB): raise it, or lower those")

    def _rehearse(self) -> None:
        """Decode once through a full session before serving: a profile that loads but cannot serve (a plan that
        does not fit the model, a classifier the monitor cannot feed, a missing tensor) stops the server at start,
        with one line naming the profile, instead of a /healthz that answers 200 over completions that all fail."""
        from kvguard.profile import ProfileError

        try:
            session = self.session(None)
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
        """Queue ``request`` for the batch; 429 when it would have to wait behind ``--max-queue`` others (for a place in
        the batch or for KV memory), 400 when it could never fit the budget."""
        need = self.reserve(len(request.prompt_ids) + request.max_tokens)
        if need > self.kv_budget:
            raise RequestError(400, f"this request needs {need / 2**20:.1f} MiB of KV cache, more than the server's "
                                    f"whole --kv-budget ({self.kv_budget / 2**20:.1f} MiB): shorten the prompt or "
                                    f"max_tokens", param="max_tokens")
        with self.admit_lock:
            ahead = self.scheduler.queued_ahead(need)
            if ahead is not None and ahead >= self.cfg.max_queue:
                raise RequestError(429, f"the server is at capacity ({self.scheduler.in_flight} decoding, "
                                        f"{len(self.scheduler.waiting)} waiting for KV memory or a place in the "
                                        "batch); retry later", kind="rate_limit_error", code="server_busy")
            job = Job(uuid.uuid4().hex[:24], request, time.time(), loop, asyncio.Queue())
            self.jobs[job.id] = job
            self.scheduler.submit(job, need)
        return job

    def session(self, job: Job | None):
        """A fresh session for ``job`` (``None``: the start-up rehearsal): the plan's cache, the loop per
        ``--loop``."""
        from kvguard.control.session import LiveSession

        if job is None:
            return LiveSession.from_profile(self.model, self.profile, self.plan, sequence_id="startup-check",
                                            monitor=self.cfg.loop)
        return LiveSession.from_profile(self.model, self.profile, self.plan, sequence_id=job.id,
                                        on_event=lambda e, job=job: self._on_event(job, e),
                                        on_step=self.metrics.monitoring_step, monitor=self.cfg.loop)

    def snapshot(self, job: Job, session) -> None:
        """Publish an in-flight request's bytes and level (every few tokens)."""
        job.snapshot = _snapshot(session)
        self._publish_live()

    def finished(self, job: Job, session, summary: dict) -> None:
        self.last_summary = summary
        self.metrics.finished(session)

    def released(self, job: Job) -> None:
        """``job`` left the batch (or never entered it): forget it."""
        job.snapshot = {}
        self.jobs.pop(job.id, None)
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.in_flight.set(self.scheduler.in_flight)
        self._publish_live()

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
        plan = self.plan
        # Each job's snapshot read once: the scheduler replaces it (and clears it at the end) meanwhile.
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
            "requests": {"running": self.scheduler.in_flight, "waiting": len(self.scheduler.waiting),
                         "max_batch": self.cfg.max_batch, "max_queue": self.cfg.max_queue, **self.totals},
            "plan_name": self.cfg.plan,
            "loop": self.cfg.loop,
            "kv_budget_bytes": self.kv_budget,
            "kv_reserved_bytes": self.scheduler.reserved,
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
            "rss_bytes": _rss(),
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


def _rss() -> int:
    """The process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0
