"""The real-time feedback loop: decode through a calibrated cache, watch, compensate, roll back, log.

    session = LiveSession.from_profile(model, profile)
    logits = session.prefill(prompt_ids)            # or session.step(token) token by token
    logits = session.step(next_token)
    session.summary()                                # memory saved, alarms, recomputations, level reached

Every ``refresh_tokens`` decoded tokens is one *monitoring step* (:mod:`kvguard.monitor` gathers the
evidence). A step reads, per monitored layer, the window-mean entropy drop against the calibrated baseline,
the run of consecutive low-entropy tokens and the risk classifier's output, then:

- **severe** (window drop >= ``heavy_drop``, or a NaN/Inf anywhere the model read): one step up the rollback
  ladder and heavy compensation (recompute the ``heavy_layers`` layers up to the alarming one). Ladder level
  1: INT8 for all new tokens and twice the recompute share; level 2: every recomputation covers all layers;
  level 3: quantization off: the whole context is recomputed at full precision and decoding continues in
  FP16. Each level steps down after ``cooldown_steps * 2**(level - 1)`` steps without a severe alarm.
- **warning** (window drop >= ``warn_drop``) or **trigger** (``trigger_consecutive`` tokens in a row at
  least ``trigger_drop`` below baseline): light compensation, recompute the alarming layers.
- **dynamic precision**: a layer whose risk stays high is promoted one tier for new tokens
  (INT2 -> INT4 -> INT8 -> FP16, at most ``max_promotion_tiers`` above the plan) and its top positions are
  recomputed; sustained low risk demotes it again, never below the plan.

Compensation recomputes full-precision K/V at the top ``recompute_fraction`` of a layer's quantized positions
ranked by attention mass received x quantization error, by running the model on those tokens at their
positions against the cache, and writes them with ``KVGuardCache.write_fp``. Every alarm and action is one
JSON event (``events``, and a JSON-lines file when given).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvguard.entropy import EntropyBaseline
from kvguard.models import Architecture
from kvguard.monitor import (MonitorConfig, RecomputeView, TokenMonitor, ceil_fraction, live_attention,
                             recompute_spec)
from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision
from kvguard.risk import RiskClassifier

MAX_LEVEL = 3


@dataclass
class Counters:
    steps: int = 0
    acted_steps: int = 0
    warnings: int = 0
    triggers: int = 0
    severe: int = 0
    light: int = 0
    heavy: int = 0
    precision_up: int = 0
    precision_down: int = 0
    rollbacks: int = 0
    full_rollbacks: int = 0
    recomputed_positions: int = 0  # (layer, position) pairs written at full precision
    recompute_ms: float = 0.0
    max_level: int = 0
    recalibration_recommended: bool = False
    kinds: dict = field(default_factory=dict)


class LiveSession:
    """One sequence decoding through a quantized cache under the feedback loop.

    Args:
        model: the causal LM (its attention runs through :mod:`kvguard.monitor` during calls).
        plan: the static plan new tokens start from (a profile's, or any other).
        baseline: the calibrated FP16 attention-entropy baseline.
        scales: calibrated INT8 ranges (also used to count values outside the calibrated range).
        classifier: the risk classifier (``None``: no dynamic precision).
        config: thresholds (:class:`~kvguard.monitor.MonitorConfig`).
        sequence_id: names this sequence in events.
        events_path: also append every event as one JSON line to this file.
        on_event: also call this with every event.
        monitor: ``False`` decodes through the same cache with the loop off (for overhead measurements).
    """

    def __init__(self, model, plan: Plan, baseline: EntropyBaseline, *, scales: StaticScales | None = None,
                 classifier: RiskClassifier | None = None, config: MonitorConfig | None = None,
                 sequence_id: str = "0", events_path: str | Path | None = None,
                 on_event: Callable[[dict], None] | None = None, monitor: bool = True) -> None:
        self.model = model
        self.arch = Architecture.from_config(model.config)
        plan.check(self.arch)
        self.plan = plan
        self.scales = scales
        self.classifier = classifier
        self.config = config or MonitorConfig()
        self.sequence_id = sequence_id
        self.events: list[dict] = []
        self.events_path = Path(events_path) if events_path else None
        self.on_event = on_event
        self.enabled = monitor
        sliding = tuple(i for i, t in enumerate(self.arch.layer_types) if t != "full_attention")
        self.monitor = TokenMonitor(baseline, self.config, self.arch.num_layers,
                                    sliding_window=self.arch.sliding_window, sliding_layers=sliding)
        self.cache = self._new_cache()
        self.ids: list[int] = []
        self.tier = [lp.precision for lp in plan.layers]  # per layer, per KV head: dynamic precision
        self.level = 0
        self.steps_since_severe = 0
        self.high = [0] * self.arch.num_layers
        self.low = [0] * self.arch.num_layers
        self.armed = [True] * self.arch.num_layers  # a layer's warning / trigger acts once per episode
        self.demotions = [0] * self.arch.num_layers
        self.recent: deque[bool] = deque(maxlen=self.config.trigger_rate_steps)
        self.counters = Counters()
        self.start_step = plan.cache.sinks + plan.cache.residual + plan.cache.group_size
        self.rolled_back_at: int | None = None
        self._since_step = 0
        self.last_step: dict | None = None  # the last monitoring step's window drop per layer and whether it acted

    @classmethod
    def from_profile(cls, model, profile, plan: Plan | None = None, **kwargs) -> "LiveSession":
        """A session with the profile's baseline, scales, classifier and thresholds (``plan`` overrides the
        profile's plan; ``monitor_overrides`` adjusts thresholds)."""
        overrides = kwargs.pop("monitor_overrides", None) or {}
        config = MonitorConfig.from_dict(profile.monitor, **overrides)
        classifier = profile.risk_classifier()
        return cls(model, plan or profile.plan, profile.entropy_baseline(), scales=profile.static_scales(),
                   classifier=classifier, config=config, **kwargs)

    # ---------------------------------------------------------------- cache
    def _new_cache(self):
        cache = self.plan.make_cache(self.model.config, self.scales)
        for layer in cache.layers:
            layer.track_error = self.enabled
        return cache

    @property
    def length(self) -> int:
        return len(self.ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.model(input_ids=ids, cache=self.cache, use_cache=True).logits
        with live_attention(self.model, self.monitor, self.cache):
            return self.model(input_ids=ids, cache=self.cache, use_cache=True).logits

    # ---------------------------------------------------------------- decoding
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed a prompt ``[T]`` in one pass (not monitored: it attends to its own full-precision K/V); returns
        the last position's next-token logits ``[vocab]``."""
        ids = torch.as_tensor(ids).reshape(1, -1).to(self.model.device)
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        logits = self._forward(ids)[0, -1].float()
        self.ids.extend(ids[0].tolist())
        return logits

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token; returns its next-token logits ``[vocab]`` (and runs a monitoring step every
        ``refresh_tokens`` tokens)."""
        ids = torch.tensor([[int(token)]], device=self.model.device)
        logits = self._forward(ids)[0, -1].float()
        self.ids.append(int(token))
        if self.enabled:
            self.monitor.end_token()
            self._since_step += 1
            if self._since_step >= self.config.refresh_tokens and self.length >= self.start_step:
                self._since_step = 0
                self._monitoring_step()
        return logits

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | None = None,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy decoding of up to ``max_new_tokens`` tokens after ``prompt_ids``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        logits = self.prefill(prompt_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if on_token is not None:
                on_token(token)
            if eos_token_id is not None and token == eos_token_id:
                break
            logits = self.step(token)
        return out

    # ---------------------------------------------------------------- the monitoring step
    def _monitoring_step(self) -> None:
        cfg = self.config
        c = self.counters
        c.steps += 1
        self.steps_since_severe += 1
        drop, werr, entropy = self.monitor.window()
        monitored = self.monitor.monitored
        drop = torch.where(monitored, drop, torch.zeros(()))
        nonfinite = bool(self.monitor.nonfinite)
        risk = None
        if self.classifier is not None:
            risk = torch.where(monitored, self.classifier.predict(self.monitor.features()), torch.zeros(()))
        base = {"drop": drop, "entropy": entropy, "risk": risk}
        acted = False
        layers = range(self.arch.num_layers)
        for l in layers:  # re-arm layers whose drop is back well under the warning level
            self.armed[l] = self.armed[l] or bool(drop[l] < cfg.warn_drop / 2)
        severe = [l for l in layers if monitored[l] and drop[l] >= cfg.heavy_drop]
        warn = [l for l in layers if monitored[l] and self.armed[l] and drop[l] >= cfg.warn_drop]
        trig = [l for l in layers if monitored[l] and self.armed[l]
                and self.monitor.consecutive[l] >= cfg.trigger_consecutive]
        for l in set(severe) | set(warn) | set(trig):
            self.armed[l] = False
        if nonfinite or severe:
            c.severe += 1
            self.monitor.nonfinite.zero_()
            worst = max(severe, key=lambda l: float(drop[l])) if severe else self.arch.num_layers - 1
            self._escalate("nonfinite" if nonfinite else "severe", worst, base)
            if self.level < MAX_LEVEL:
                top = worst + 1
                layers = self._widened(list(range(max(0, top - cfg.heavy_layers), top)))
                self._compensate("heavy", "severe", layers, base)
            acted = True
        elif warn or trig:
            if warn:
                c.warnings += 1
            if trig:
                c.triggers += 1
            if self.level < MAX_LEVEL:
                self._compensate("light", "warning" if warn else "trigger", self._widened(sorted(set(warn) | set(trig))), base)
            acted = True
        if risk is not None and self.level < MAX_LEVEL:
            acted |= self._dynamic_precision(risk, base)
        acted |= self._cool_down(base)
        c.acted_steps += acted
        self.last_step = {"drop": drop, "monitored": monitored, "acted": acted}
        self.recent.append(acted)
        window_rate = sum(self.recent) / len(self.recent)
        if (not c.recalibration_recommended and len(self.recent) >= min(32, cfg.trigger_rate_steps)
                and window_rate > cfg.max_trigger_rate):
            c.recalibration_recommended = True
            self._event("recalibration_recommended", "recommend_recalibration", [], base,
                        trigger_rate=window_rate, steps=len(self.recent))

    def _widened(self, layers: list[int]) -> list[int]:
        """Level 2 and up widen every recomputation to all layers."""
        return list(range(self.arch.num_layers)) if self.level >= 2 else layers

    def _ratio(self) -> tuple[float, float]:
        lo, hi = self.config.recompute_fraction
        return (2 * lo, 2 * hi) if self.level >= 1 else (lo, hi)

    # ---------------------------------------------------------------- compensation
    def _compensate(self, kind: str, alarm: str, layers: list[int], base: dict, *, share: str = "base") -> None:
        t0 = time.perf_counter()
        positions = self.select_positions(layers, share=share)
        if positions.numel():
            self.recompute(layers, positions)
        ms = 1000 * (time.perf_counter() - t0)
        c = self.counters
        setattr(c, kind, getattr(c, kind) + 1)
        c.recompute_ms += ms
        self._event(alarm, kind, layers, base, positions=int(positions.numel()), ms=ms)

    def select_positions(self, layers: list[int], *, share: str = "base") -> torch.Tensor:
        """The quantized positions to recompute for ``layers``: the top ``recompute_fraction`` (``share``
        ``"base"``: its first value; ``"max"``: up to the cap) by attention mass received x quantization error
        (summed over the layers), excluding positions already at full precision, within the overlay cap."""
        lo, hi = self._ratio()
        lo = hi if share == "max" else lo
        end = self.length
        score = torch.zeros(end)
        first = self.first_recomputable()
        quantized = 0
        room = []
        for l in layers:
            layer = self.cache.layers[l]
            q = layer.quantized_positions().cpu()
            n_q = int(q.numel())
            held = int(layer.overlay_positions().numel())
            room.append(ceil_fraction(hi, n_q) - held)
            quantized = max(quantized, n_q)
            if n_q == 0:
                continue
            err = layer.error_evidence(end).mean(0).sum(-1).cpu()  # [end]: K + V error, mean over heads
            mass = self.monitor.attention_mass(l, end).cpu()
            layer_score = torch.zeros(end)
            layer_score[q] = mass[q] * err[q]
            score += layer_score
        score[:first] = 0.0
        k = min(ceil_fraction(lo, quantized), max(room, default=0))
        candidates = int((score > 0).sum())
        k = min(k, candidates)
        if k <= 0:
            return torch.zeros(0, dtype=torch.long)
        return torch.topk(score, k).indices.sort().values

    def first_recomputable(self) -> int:
        """The first position whose K/V can be recomputed from the cache: a sliding-window layer that has
        dropped old tokens no longer holds the context of positions less than a window after its first
        stored token, and their recomputed K/V would be wrong in every layer above it."""
        first = 0
        for layer in self.cache.layers:
            if layer.is_sliding and layer.offset > 0:
                first = max(first, layer.offset + layer.sliding_window - 1)
        return first

    @torch.no_grad()
    def recompute(self, layers: list[int], positions: torch.Tensor) -> int:
        """Recompute full-precision K/V of ``positions`` (absolute, ascending) by running the model on those
        tokens at their positions against the cache, and write them into ``layers``. Returns the number of
        (layer, position) pairs written. Positions before :meth:`first_recomputable` are refused."""
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1).sort().values
        if positions.numel() == 0:
            return 0
        if int(positions[-1]) >= self.length or int(positions[0]) < 0:
            raise ValueError(f"positions must lie in [0, {self.length})")
        if int(positions[0]) < self.first_recomputable():
            raise ValueError(f"positions before {self.first_recomputable()} cannot be recomputed: the sliding-window "
                             f"layers no longer hold their context")
        device = self.model.device
        ids = torch.tensor(self.ids, device=device)[positions.to(device)].view(1, -1)
        view = RecomputeView(self.cache)
        spec = recompute_spec(self.cache, positions, self.arch.sliding_window)
        dummy_mask = torch.zeros(1, 1, positions.numel(), 1, device=device)  # 4-D: taken as-is; the attention builds its own
        with live_attention(self.model, self.monitor, self.cache, recompute=spec):
            self.model.base_model(input_ids=ids, position_ids=positions.view(1, -1).to(device), cache=view,
                                  attention_mask=dummy_mask, use_cache=True)
        written = 0
        for l in layers:
            layer = self.cache.layers[l]
            keep = positions >= layer.offset
            if not bool(keep.any()):
                continue
            k, v = view.captured(l)
            idx = keep.nonzero().view(-1).to(k.device)
            self.cache.write_fp(l, positions[keep], k.index_select(2, idx), v.index_select(2, idx))
            written += int(keep.sum())
        self.counters.recomputed_positions += written
        return written

    @torch.no_grad()
    def rollback_full(self) -> None:
        """Quantization off: recompute the whole context at full precision into a fresh cache; new tokens are
        stored FP16 from now on."""
        self.tier = [(Precision.FP16,) * self.arch.num_kv_heads for _ in range(self.arch.num_layers)]
        cache = self._new_cache()
        for l in range(self.arch.num_layers):
            cache.set_precision(l, Precision.FP16)
        self.cache = cache
        ids = torch.tensor(self.ids, device=self.model.device).view(1, -1)
        self._forward(ids)
        self.rolled_back_at = self.length
        self.counters.full_rollbacks += 1

    # ---------------------------------------------------------------- the ladder
    def _escalate(self, alarm: str, layer: int, base: dict) -> None:
        previous = self.level
        self.level = min(self.level + 1, MAX_LEVEL)
        self.steps_since_severe = 0
        c = self.counters
        c.rollbacks += self.level > previous
        c.max_level = max(c.max_level, self.level)
        t0 = time.perf_counter()
        if self.level == MAX_LEVEL and previous < MAX_LEVEL:
            self.rollback_full()
            action = "rollback_full_precision"
        elif self.level == MAX_LEVEL:
            action = "hold_full_precision"
        else:
            self._apply_precisions()
            action = {1: "rollback_int8_double_recompute", 2: "rollback_widen_recompute_all_layers"}[self.level]
        self._event(alarm, action, [layer], base, previous_level=previous, ms=1000 * (time.perf_counter() - t0))

    def _cool_down(self, base: dict) -> bool:
        if self.level == 0:
            return False
        need = self.config.cooldown_steps * 2 ** (self.level - 1)
        if self.steps_since_severe < need:
            return False
        previous = self.level
        self.level -= 1
        self.steps_since_severe = 0
        if previous == MAX_LEVEL:
            self.tier = [lp.precision for lp in self.plan.layers]
        self._apply_precisions()
        self._event("cooldown", f"step_down_to_level_{self.level}", [], base, previous_level=previous, cooldown_steps=need)
        return True

    def _effective(self, layer: int) -> tuple[Precision, ...]:
        heads = self.tier[layer]
        if self.level >= MAX_LEVEL:
            return (Precision.FP16,) * len(heads)
        if self.level >= 1:
            return tuple(p if p.bits >= 8 else Precision.INT8 for p in heads)
        return tuple(heads)

    def _apply_precisions(self) -> None:
        for l in range(self.arch.num_layers):
            want = self._effective(l)
            current = self.cache.layers[l].head_precisions
            if tuple(current) != want:
                self.cache.set_precision(l, want[0] if len(set(want)) == 1 else list(want))

    def _dynamic_precision(self, risk: torch.Tensor, base: dict) -> bool:
        cfg = self.config
        acted = False
        alarm = float(risk.max()) >= cfg.promote_risk  # the sequence is at risk: look at every elevated layer
        for l in range(self.arch.num_layers):
            r = float(risk[l])
            elevated = r >= cfg.promote_risk or (alarm and r >= cfg.promote_layer_risk)
            self.high[l] = self.high[l] + 1 if elevated else 0
            self.low[l] = self.low[l] + 1 if r <= cfg.demote_risk else 0
            heads, floor = self.tier[l], self.plan.layers[l].precision
            ceiling = [_raise(f, cfg.max_promotion_tiers) for f in floor]
            if self.high[l] >= cfg.promote_steps and any(p.bits < c.bits for p, c in zip(heads, ceiling)):
                self.tier[l] = tuple(p.higher() if p.bits < c.bits else p for p, c in zip(heads, ceiling))
                self.high[l] = 0
                self.counters.precision_up += 1
                self._event("risk", "precision_up", [l], base, precision=[p.value for p in self.tier[l]], risk=r)
                self._compensate("light", "risk", [l], base, share="max")
                acted = True
            elif (self.low[l] >= cfg.demote_steps * 2 ** self.demotions[l]
                  and any(p.bits > f.bits for p, f in zip(heads, floor))):
                # Each demotion of a layer doubles the wait before its next one: its risk is low partly because
                # it was promoted, and a layer that keeps coming back must not flap.
                self.tier[l] = tuple(p.lower() if p.bits > f.bits else p for p, f in zip(heads, floor))
                self.low[l] = 0
                self.demotions[l] += 1
                self.counters.precision_down += 1
                self._event("risk", "precision_down", [l], base, precision=[p.value for p in self.tier[l]], risk=r)
                acted = True
        if acted:
            self._apply_precisions()
        return acted

    # ---------------------------------------------------------------- log and summary
    def _event(self, alarm: str, action: str, layers: list[int], base: dict, **extra) -> None:
        drop, entropy, risk = base["drop"], base["entropy"], base["risk"]
        expected = [float(entropy[l] / max(1e-6, 1 - float(drop[l]))) if float(drop[l]) < 1 else None for l in layers]
        event = {
            "time": time.time(),
            "sequence": self.sequence_id,
            "token": self.length - 1,
            "alarm": alarm,
            "action": action,
            "level": self.level,
            "layers": layers,
            "entropy": [round(float(entropy[l]), 5) for l in layers],
            "baseline": [None if e is None else round(e, 5) for e in expected],
            "drop": [round(float(drop[l]), 5) for l in layers],
            "risk": None if risk is None else [round(float(risk[l]), 5) for l in layers],
            "positions": 0,
            "ms": 0.0,
        }
        event.update(extra)
        if isinstance(event.get("ms"), float):
            event["ms"] = round(event["ms"], 3)
        kinds = self.counters.kinds
        kinds[action] = kinds.get(action, 0) + 1
        self.events.append(event)
        if self.events_path is not None:
            with open(self.events_path, "a") as f:
                f.write(json.dumps(event) + "\n")
        if self.on_event is not None:
            self.on_event(event)

    @property
    def trigger_rate(self) -> float:
        """Monitoring steps that acted / monitoring steps (0 before the first step)."""
        c = self.counters
        return c.acted_steps / c.steps if c.steps else 0.0

    def recompute_fraction(self) -> float:
        """(layer, position) pairs now held at full precision because the loop recomputed them, over all
        (layer, position) pairs seen; a full rollback counts every pair it recomputed."""
        total = self.length * self.arch.num_layers
        if not total:
            return 0.0
        if self.rolled_back_at is not None:
            return min(1.0, self.rolled_back_at * self.arch.num_layers / total)
        held = sum(int(layer.overlay_positions().numel()) for layer in self.cache.layers)
        return held / total

    def summary(self) -> dict:
        c = self.counters
        stored, fp16 = self.cache.nbytes(), self.cache.fp16_nbytes()
        return {
            "tokens": self.length,
            "kv_bytes": stored,
            "kv_bytes_fp16": fp16,
            "memory_saved": 1 - stored / fp16 if fp16 else 0.0,
            "monitoring_steps": c.steps,
            "trigger_rate": self.trigger_rate,
            "alarms": {"warning": c.warnings, "trigger": c.triggers, "severe": c.severe},
            "actions": dict(c.kinds),
            "recomputed_positions": c.recomputed_positions,
            "recompute_fraction": self.recompute_fraction(),
            "recompute_ms": round(c.recompute_ms, 3),
            "level": self.level,
            "max_level": c.max_level,
            "recalibration_recommended": c.recalibration_recommended,
            "precisions": [[p.value for p in self.cache.layers[l].head_precisions] for l in range(self.arch.num_layers)],
        }


def _raise(precision: Precision, tiers: int) -> Precision:
    for _ in range(tiers):
        precision = precision.higher()
    return precision


@torch.no_grad()
def score_live(session: LiveSession, input_ids: torch.Tensor, *, reference: torch.Tensor | None = None,
               keep_logits: bool = False, progress: bool = False, desc: str = "live"):
    """Teacher-forced scoring through ``session`` token by token (chunk 1), like
    :func:`kvguard.scoring.score_stream`; returns its :class:`~kvguard.scoring.StreamScore`."""
    from tqdm.auto import tqdm

    from kvguard.metrics import TokenMetrics
    from kvguard.scoring import StreamScore

    ids = torch.as_tensor(input_ids).reshape(-1)
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to score, got {ids.numel()}")
    metrics, kept, pending = TokenMetrics(), ([] if keep_logits else None), []
    done = 0

    def flush():
        nonlocal done, pending
        if not pending:
            return
        logits = torch.stack(pending)
        targets = ids[done + 1:done + 1 + logits.shape[0]].to(logits.device)
        ref = None if reference is None else reference[done:done + logits.shape[0]]
        metrics.add(logits, targets, ref)
        if kept is not None:
            kept.append(logits.cpu())
        done += logits.shape[0]
        pending = []

    t0 = time.perf_counter()
    for token in tqdm(ids[:-1].tolist(), desc=desc, unit="tok", disable=not progress, leave=False):
        pending.append(session.step(token))
        if len(pending) == 256:
            flush()
    flush()
    seconds = time.perf_counter() - t0
    return StreamScore(metrics.nll, ids.numel(), metrics.kl, metrics.top1_agree, seconds,
                       torch.cat(kept) if kept else None)
