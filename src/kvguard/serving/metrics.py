"""The Prometheus metrics of ``kvguard serve`` (their own registry, plus the process collector: RSS, CPU).

Quantization effect (KV bytes against FP16, compression ratio, clipped values, range use), error accumulation
(entropy drop per monitored layer), compensation (actions by kind, recomputed positions, rollback level), the
trigger rate against the profile's ceiling, and the request metrics (latency, time to first token, tokens).
"""

from __future__ import annotations

import threading
from collections import deque

from kvguard.control.events import Event, StepRecord
from kvguard.control.policy import METRIC_KINDS

# Prometheus histogram buckets (seconds).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)


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
        self.saved = Gauge("kvguard_kv_memory_saved_ratio", "1 - bytes in RAM (every tier) / FP16 bytes, on the same "
                           "basis", registry=r)
        self.tier_bytes = Gauge("kvguard_kv_tier_bytes", "Bytes the requests in flight hold, by tier (hot cache, "
                                "overlay, backing tier in RAM and on disk)", ["tier"], registry=r)
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
        self.in_flight = Gauge("kvguard_requests_running", "Requests in the batch now (prefilling or decoding)",
                               registry=r)
        self.waiting = Gauge("kvguard_requests_waiting", "Requests queued for KV memory or a place in the batch",
                             registry=r)
        self.batch_size = Gauge("kvguard_batch_size", "Sequences fed by the last model forward", registry=r)
        self.kv_reserved = Gauge("kvguard_kv_reserved_bytes", "KV bytes the requests in the batch have reserved "
                                 "against the budget", registry=r)
        self.kv_budget = Gauge("kvguard_kv_budget_bytes", "The KV bytes the requests in flight may hold (--kv-budget)",
                               registry=r)
        self.itl = Histogram("kvguard_inter_token_latency_seconds", "Time between two tokens of one request",
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4), registry=r)
        self.max_trigger_gauge = Gauge("kvguard_max_trigger_rate", "The profile's trigger-rate ceiling (the 5 % line)",
                                       registry=r)
        self.max_trigger_gauge.set(max_trigger_rate)
        self.trigger_rate.set(0)
        self.recalibrate.set(0)
        for kind in METRIC_KINDS:
            self.actions.labels(kind)
        for kind in ("key", "value"):
            self.quantized.labels(kind)
            self.clipped.labels(kind)

    def monitoring_step(self, step: StepRecord) -> None:
        self.steps.inc()
        if step.acted:
            self.acted.inc()
        self.recomputed.inc(step.recomputed)
        for l, watched in enumerate(step.monitored):
            if watched:
                self.entropy_drop.labels(str(l)).set(step.drop[l])
        with self.lock:
            self.recent.append(step.acted)
            self.rate = sum(self.recent) / len(self.recent)
            self.recalibration_recommended = len(self.recent) == self.recent.maxlen and self.rate > self.max_trigger_rate
        self.trigger_rate.set(self.rate)
        self.recalibrate.set(float(self.recalibration_recommended))

    def event(self, event: Event) -> None:
        self.actions.labels(event.action.kind).inc()

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
