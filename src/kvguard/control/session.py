"""The real-time feedback loop: decode through a calibrated cache, watch, compensate, roll back, log.

    session = LiveSession.from_profile(model, profile)
    out = session.generate(prompt_ids, 64, sampler=Sampler(temperature=0.7, seed=1))
    session.summary()                                # memory saved, alarms, recomputations, level reached

This is the mechanism; the rules live in :mod:`kvguard.control.policy`. While the session decodes, the monitor
(:mod:`kvguard.control.monitor`) records each monitored layer's attention entropy and the quantization error
it read. Every ``refresh_tokens`` tokens (one *monitoring step*) the session hands the window's evidence to
:func:`~kvguard.control.policy.decide` and carries out its decisions in order:

- compensation (light / heavy): full-precision K/V at the selected positions of the chosen layers, written
  into the cache's overlay: with a backing tier (``backing=BackingConfig(enabled=True)``,
  :mod:`kvguard.backing`) the originals it still holds are restored bit for bit and only the rest is
  recomputed (:mod:`kvguard.control.recompute`); ``restored_positions`` and ``recomputed_positions`` count
  the two apart;
- a full rollback: recompute the whole context at full precision into a fresh FP16 cache;
- precision changes and ladder moves: new tokens are stored at the tiers the policy's state says.

Every decision becomes one :class:`~kvguard.control.events.Event` (kept in ``events``, appended to a
JSON-lines file when given, passed to ``on_event``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from kvguard.architecture import Architecture
from kvguard.backing import BackingConfig
from kvguard.config import MonitorConfig
from kvguard.control import decoding
from kvguard.control.events import Counters, Event, StepRecord
from kvguard.control.monitor import TokenMonitor, live_attention, live_hook
from kvguard.control.policy import Action, Decision, PolicyState, Window, decide
from kvguard.control.recompute import restore_then_recompute, select_positions
from kvguard.risk import RiskClassifier
from kvguard.control.sampling import GREEDY, Sampler
from kvguard.entropy import EntropyBaseline
from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision


class LiveSession:
    """One sequence decoding through a quantized cache under the feedback loop.

    Args:
        model: the causal LM (its attention runs through the monitor during calls).
        plan: the static plan new tokens start from (a profile's, or any other).
        baseline: the calibrated FP16 attention-entropy baseline.
        scales: calibrated INT8 ranges (also used to count values outside the calibrated range).
        classifier: the risk classifier (``None``: no dynamic precision).
        config: thresholds (:class:`~kvguard.config.MonitorConfig`).
        sequence_id: names this sequence in events.
        events_path: also append every event as one JSON line to this file.
        on_event: also call this with every event.
        on_step: called after every monitoring step with its :class:`~kvguard.control.events.StepRecord`.
        monitor: ``False`` decodes through the same cache with the loop off (for overhead measurements).
        backing: keep the originals of quantized tokens so compensation restores them exactly
            (:class:`~kvguard.backing.BackingConfig`; ``None``: recompute everything, as without it).
    """

    def __init__(self, model, plan: Plan, baseline: EntropyBaseline, *, scales: StaticScales | None = None,
                 classifier: RiskClassifier | None = None, config: MonitorConfig | None = None,
                 sequence_id: str = "0", events_path: str | Path | None = None,
                 on_event: Callable[[Event], None] | None = None,
                 on_step: Callable[[StepRecord], None] | None = None, monitor: bool = True,
                 backing: BackingConfig | None = None) -> None:
        self.model = model
        self.arch = Architecture.from_config(model.config)
        plan.check(self.arch)
        self.plan = plan
        self.scales = scales
        self.classifier = classifier
        self.config = config or MonitorConfig()
        self.sequence_id = sequence_id
        self.events: list[Event] = []
        self.events_path = Path(events_path) if events_path else None
        self.on_event = on_event
        self.on_step = on_step
        self.enabled = monitor
        self.backing = backing
        # With a classifier every layer is observed: its risk is fitted on every layer's features, and the layers
        # where quantization hurts most need not be those whose entropy is quiet enough to alarm on.
        self.monitor = TokenMonitor(baseline, self.config, self.arch.num_layers,
                                    sliding_window=self.arch.sliding_window, sliding_layers=self.arch.sliding_layers,
                                    device=model.device, observe_all=classifier is not None)
        self.cache = self._new_cache()
        self.ids: list[int] = []
        self.state = PolicyState.initial([lp.precision for lp in plan.layers])
        self.counters = Counters()
        self.start_step = plan.cache.sinks + plan.cache.residual + plan.cache.group_size
        self.rolled_back_at: int | None = None
        self._since_step = 0
        self._plan_costs = plan.history_costs(model.config, scales)  # what the plan stores, for the memory budget
        self._held = (0, 0, 0)  # sums over the tokens fed of the bytes in RAM, on disk, and FP16's

    @classmethod
    def from_profile(cls, model, profile, plan: Plan | None = None, *, monitor_overrides: dict | None = None,
                     **kwargs) -> "LiveSession":
        """A session with the profile's baseline, scales, classifier and thresholds (``plan`` overrides the
        profile's plan; ``monitor_overrides`` adjusts thresholds)."""
        config = MonitorConfig.from_dict(profile.meta.monitor.to_dict(), **(monitor_overrides or {}))
        return cls(model, plan or profile.plan, profile.entropy_baseline(), scales=profile.static_scales(),
                   classifier=profile.meta.risk_classifier, config=config, **kwargs)

    # ---------------------------------------------------------------- cache
    def _new_cache(self):
        cache = self.plan.make_cache(self.model.config, self.scales, self.backing)
        for layer in cache.layers:
            layer.track_error = self.enabled
        return cache

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def level(self) -> int:
        return self.state.level

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits ``[1, 1, vocab]`` (logits_to_keep=1: a 4,096-token prompt's ``[T, vocab]``
        logits would be 800 MB of float32 on SmolLM2, more than its FP16 cache)."""
        if not self.enabled:
            return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        with live_attention(self.model, self.monitor, self.cache):
            return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits

    # ---------------------------------------------------------------- decoding
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed a prompt ``[T]``; returns the last position's next-token logits ``[vocab]``.

        All but the last token go in one pass, which attends to its own full-precision K/V, so there is nothing
        to watch in it; the last token goes as a decode step, which reads the stored prompt as decoding will.
        With the loop on, that step is the *prompt check*, a monitoring step of its own (risk only: one token is
        no window for the entropy alarms), so a prompt whose storage is at risk is promoted, re-encoded and
        compensated before the first token is drawn, not a window later."""
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if ids.numel() > 1:
            self.ids.extend(ids[:-1].tolist())  # from the caller's tensor, before it is on the device
            self._forward(ids[:-1].view(1, -1).to(self.model.device))
        return self.step(int(ids[-1]), prompt=ids.numel() > 1 and self.config.prompt_check)

    @torch.no_grad()
    def step(self, token: int, *, prompt: bool = False) -> torch.Tensor:
        """Feed one token; returns its next-token logits ``[vocab]`` (and runs a monitoring step every
        ``refresh_tokens`` tokens; ``prompt``: the last token of a prefilled prompt, checked at once)."""
        ids = torch.tensor([[int(token)]], device=self.model.device)
        logits = self._forward(ids)[0, -1].float()
        self.fed_token(token, prompt=prompt)
        return logits

    # ---------------------------------------------------------------- in a packed forward (kvguard.packed)
    def piece(self, ids: torch.Tensor):
        """This sequence's share of a packed forward feeding ``ids`` ``[n]`` (a server batching many sequences):
        its cache, and the monitor's attention when the loop is on. After the forward, say what was fed:
        :meth:`fed_prompt` for a prompt chunk, :meth:`fed_token` for a decoded token (or a prompt's last)."""
        from kvguard.packed import Piece

        return Piece(self.cache, torch.as_tensor(ids).reshape(-1),
                     live_hook(self.monitor, self.cache) if self.enabled else None)

    def fed_prompt(self, ids) -> None:
        """A packed forward fed these prompt tokens (all but the prompt's last): nothing to watch in them, as in
        :meth:`prefill`."""
        self.ids.extend(int(t) for t in torch.as_tensor(ids).reshape(-1).tolist())

    def fed_token(self, token: int, *, prompt: bool = False) -> None:
        """A forward fed ``token`` alone: the run's byte count and, with the loop on, the monitor's window and a
        monitoring step when one is due (``prompt``: the prompt's last token, the prompt check)."""
        self.ids.append(int(token))
        self._hold()
        if self.enabled:
            self.monitor.end_token()
            self._since_step += 1
            due = prompt or self._since_step >= self.config.refresh_tokens
            if due and self.length >= self.start_step:
                self._since_step = 0
                self._monitoring_step(prompt)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, sampler: Sampler = GREEDY,
                 eos_token_id: int | None = None, on_token: Callable[[int], bool | None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> decoding.Generation:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids`` under the loop (see
        :func:`kvguard.control.decoding.generate`)."""
        return decoding.generate(self, prompt_ids, max_new_tokens, sampler=sampler, eos_token_id=eos_token_id,
                                 on_token=on_token, should_stop=should_stop)

    # ---------------------------------------------------------------- the monitoring step
    def _window(self, prompt: bool = False) -> tuple[Window, torch.Tensor, torch.Tensor]:
        """The policy's evidence, plus the window's drop and entropy tensors for the events (``prompt``: the
        prompt check, whose one token of entropy is no window: no drop, no run of low-entropy tokens)."""
        drop, _, entropy = self.monitor.window()
        monitored = self.monitor.monitored
        drop = torch.where(monitored & (not prompt), drop, torch.zeros(()))
        consecutive = torch.zeros_like(self.monitor.consecutive) if prompt else self.monitor.consecutive
        risk = None
        if self.classifier is not None:
            risk = torch.where(self.monitor.observed, self.classifier.predict(self.monitor.features()), torch.zeros(()))
        window = Window(tuple(drop.tolist()), tuple(int(c) for c in consecutive.tolist()),
                        tuple(bool(m) for m in monitored.tolist()), None if risk is None else tuple(risk.tolist()),
                        bool(self.monitor.nonfinite), None if risk is None else self._headroom(), prompt,
                        None if risk is None else self._bit_costs())
        return window, drop, entropy

    def _monitoring_step(self, prompt: bool = False) -> None:
        window, drop, entropy = self._window(prompt)
        step = decide(self.config, self.state, window)
        self.state = step.state
        if window.nonfinite:
            self.monitor.nonfinite.zero_()
        c = self.counters
        c.steps += 1
        c.warnings += step.warning
        c.triggers += step.trigger
        c.severe += step.severe
        c.acted_steps += step.acted
        recomputed, restored = c.recomputed_positions, c.restored_positions
        for decision in step.decisions:
            self._carry_out(decision, window, entropy)
        self._apply_precisions()
        if self.on_step is not None:
            self.on_step(StepRecord(c.steps, self.length - 1, window.drop, window.monitored, step.acted,
                                    c.recomputed_positions - recomputed, c.restored_positions - restored))

    def _carry_out(self, decision: Decision, window: Window, entropy: torch.Tensor) -> None:
        t0 = time.perf_counter()
        ram_before, restore_before = self.cache.memory().ram, self._restore_seconds()
        positions, restored, reencoded = 0, None, None
        c = self.counters
        if decision.action.recomputes:
            selected = select_positions(self.cache, self.monitor, decision.layers, self.length, decision.fraction,
                                        decision.cap)
            if selected.numel():
                restored, recomputed = restore_then_recompute(self.model, self.cache, self.ids, decision.layers,
                                                              selected, self.arch.sliding_window)
                c.restored_positions += restored
                c.recomputed_positions += recomputed
            positions = int(selected.numel())
        elif decision.action is Action.PRECISION_UP:
            reencoded = self._reencode(decision.layers)
        elif decision.action is Action.ROLLBACK_FULL:
            self.rollback_full()
        c.max_level = max(c.max_level, decision.level)
        c.recalibration_recommended |= decision.action is Action.RECOMMEND_RECALIBRATION
        ms = 1000 * (time.perf_counter() - t0)
        if decision.action.recomputes:
            c.recompute_ms += ms
        backed = self.cache.backing is not None
        restore_ms = 1000 * (self._restore_seconds() - restore_before) if backed else None
        self._event(decision, window, entropy, positions, ms, restored if backed else None, reencoded, restore_ms,
                    self.cache.memory().ram - ram_before)

    def _restore_seconds(self) -> float:
        return sum(layer.restore_seconds for layer in self.cache.layers)

    def _reencode(self, layers: tuple[int, ...]) -> int | None:
        """Store the promoted ``layers``' history again at their new tiers from the backing tier's originals, while
        the hot cache keeps ``min_saving_kept`` of the plan's saving; returns the positions re-encoded
        (``None``: no backing tier, or re-encoding is off)."""
        if self.cache.backing is None or not self.config.reencode_history:
            return None
        self._apply_precisions()  # the promoted tiers, before the history is stored in them
        reencoded = 0
        for l in layers:
            n = self.cache.reencode(l, self._byte_room())
            reencoded += n
            self.counters.reencoded_positions += n
        return reencoded

    def _byte_room(self) -> int:
        """Bytes the hot cache may still grow by and keep ``min_saving_kept`` of the memory the plan saves at this
        length: the plan's bytes are the cache's own with each layer's history (and no overlay) priced in the
        plan's layout (:meth:`~kvguard.plan.Plan.history_costs`)."""
        stored, fp16 = self.cache.nbytes(), self.cache.fp16_nbytes()
        plan = stored
        for layer, (first, more) in zip(self.cache.layers, self._plan_costs):
            groups = layer.history_tokens() // self.plan.cache.group_size
            plan += (first + (groups - 1) * more if groups else 0) - layer.history_nbytes() - layer.overlay_nbytes()
        return int(fp16 - self.config.min_saving_kept * (fp16 - plan)) - stored

    def _headroom(self) -> float:
        """:meth:`_byte_room` as a fraction of the FP16 bytes (the policy's ``Window.headroom``)."""
        fp16 = self.cache.fp16_nbytes()
        return self._byte_room() / fp16 if fp16 else 0.0

    def _bit_costs(self) -> tuple[float, ...]:
        """Per layer, the bytes one more bit per value in one KV head adds over its stored history (keys and
        values), as a fraction of the FP16 bytes: what a promotion costs once its history is stored again, and
        about what it keeps costing as new tokens come (scales and zero points left out: they change little
        between tiers)."""
        fp16 = self.cache.fp16_nbytes()
        if not fp16:
            return (0.0,) * self.arch.num_layers
        return tuple(2 * layer.history_tokens() * self.arch.head_dim / 8 / fp16 for layer in self.cache.layers)

    @torch.no_grad()
    def rollback_full(self) -> None:
        """Quantization off: recompute the whole context at full precision into a fresh cache; new tokens are
        stored FP16 from now on."""
        cache = self._new_cache()
        for l in range(self.arch.num_layers):
            cache.set_precision(l, Precision.FP16)
        self.cache = cache
        ids = torch.tensor(self.ids, device=self.model.device).view(1, -1)
        self._forward(ids)
        self.rolled_back_at = self.length

    def _apply_precisions(self) -> None:
        for l in range(self.arch.num_layers):
            want = self.state.effective(l)
            if tuple(self.cache.layers[l].head_precisions) != want:
                self.cache.set_precision(l, want[0] if len(set(want)) == 1 else list(want))

    # ---------------------------------------------------------------- log and summary
    def _event(self, decision: Decision, window: Window, entropy: torch.Tensor, positions: int, ms: float,
               restored: int | None = None, reencoded: int | None = None, restore_ms: float | None = None,
               ram_delta: int | None = None) -> None:
        layers = decision.layers
        drop = [window.drop[l] for l in layers]
        baseline = [float(entropy[l]) / max(1e-6, 1 - d) if d < 1 else None for l, d in zip(layers, drop)]
        event = Event(
            time=time.time(), sequence=self.sequence_id, token=self.length - 1, alarm=decision.alarm,
            action=decision.action, level=decision.level, layers=layers,
            entropy=tuple(round(float(entropy[l]), 5) for l in layers),
            baseline=tuple(None if b is None else round(b, 5) for b in baseline),
            drop=tuple(round(d, 5) for d in drop),
            risk=None if window.risk is None else tuple(round(window.risk[l], 5) for l in layers),
            positions=positions, ms=ms, restored=restored, reencoded=reencoded, restore_ms=restore_ms,
            ram_delta=ram_delta or None, previous_level=decision.previous_level,
            precision=None if decision.precision is None else tuple(p.value for p in decision.precision),
            cooldown_steps=decision.cooldown_steps, trigger_rate=decision.trigger_rate, steps=decision.steps)
        self.counters.count(decision.action)
        self.events.append(event)
        if self.events_path is not None:
            with open(self.events_path, "a") as f:
                f.write(json.dumps(event.to_json()) + "\n")
        if self.on_event is not None:
            self.on_event(event)

    def _hold(self) -> None:
        """Add this token's bytes held to the run's sums (:meth:`held_ratios`)."""
        m = self.cache.memory()
        self._held = (self._held[0] + m.ram, self._held[1] + m.backing_disk, self._held[2] + m.fp16)

    @property
    def trigger_rate(self) -> float:
        """Monitoring steps that acted / monitoring steps (0 before the first step)."""
        c = self.counters
        return c.acted_steps / c.steps if c.steps else 0.0

    def recompute_fraction(self) -> float:
        """(layer, position) pairs now held at full precision because the loop recomputed or restored them, over all
        (layer, position) pairs seen; a full rollback counts every pair it recomputed."""
        total = self.length * self.arch.num_layers
        if not total:
            return 0.0
        if self.rolled_back_at is not None:
            return min(1.0, self.rolled_back_at * self.arch.num_layers / total)
        held = sum(int(layer.overlay_positions().numel()) for layer in self.cache.layers)
        return held / total

    def held_ratios(self) -> tuple[float, float]:
        """``(ram, disk)``: the bytes held in RAM (every tier) and on disk, averaged over every token fed so far, over
        the FP16 bytes of the same tokens (also averaged): what the run cost, not only where it ended."""
        ram, disk, fp16 = self._held
        return (ram / fp16, disk / fp16) if fp16 else (1.0, 0.0)

    def summary(self) -> dict:
        c = self.counters
        memory = self.cache.memory()
        held_ram, held_disk = self.held_ratios()
        return {
            "tokens": self.length,
            "kv_bytes": memory.kv,
            "kv_bytes_fp16": memory.fp16,
            "memory_saved": memory.saved if memory.fp16 else 0.0,  # every tier in RAM counted
            "memory": memory.to_json(),
            "held_ram_ratio": held_ram,
            "held_disk_ratio": held_disk,
            "monitoring_steps": c.steps,
            "trigger_rate": self.trigger_rate,
            "alarms": {"warning": c.warnings, "trigger": c.triggers, "severe": c.severe},
            "actions": c.actions_json(),
            "recomputed_positions": c.recomputed_positions,
            "restored_positions": c.restored_positions,
            "reencoded_positions": c.reencoded_positions,
            "backing_bytes": self.cache.backing_bytes(),
            "recompute_fraction": self.recompute_fraction(),
            "recompute_ms": round(c.recompute_ms, 3),
            "level": self.level,
            "max_level": c.max_level,
            "recalibration_recommended": c.recalibration_recommended,
            "precisions": [[p.value for p in self.cache.layers[l].head_precisions] for l in range(self.arch.num_layers)],
        }
