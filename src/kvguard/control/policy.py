"""The feedback loop's policy: alarms in, actions out, as a pure state machine.

Every ``refresh_tokens`` decoded tokens is one *monitoring step*. The session hands :func:`decide` the step's
evidence (a :class:`Window`: per monitored layer the window-mean entropy drop, the run of consecutive
low-entropy tokens, the risk classifier's output) and the policy's :class:`PolicyState`; it returns the new
state and the :class:`Decision` s to carry out, in order. Nothing here touches a model or a cache, so every
rule is tested on hand-made numbers (``tests/control/test_policy.py``), and the offline replica that
calibration uses to pick the monitored layers (:func:`raw_alarms`) is the same code.

The rules (defaults from :class:`~kvguard.config.MonitorConfig`):

- **severe** (window drop >= ``heavy_drop`` in a monitored layer, or a NaN/Inf read anywhere): one step up the
  rollback ladder and heavy compensation over the ``heavy_layers`` layers up to the worst one. Level 1 stores
  new tokens at INT8 (at least) and doubles the recompute share; level 2 widens every recomputation to all
  layers; level 3 turns quantization off (the session recomputes the whole context at full precision).
  Each level steps down after ``cooldown_steps * 2**(level - 1)`` steps without a severe alarm.
- **warning** (window drop >= ``warn_drop``) or **trigger** (``trigger_consecutive`` tokens in a row at least
  ``trigger_drop`` below baseline): light compensation of the alarming layers, where the risk classifier puts
  the layer at ``alarm_risk`` or more (ordinary text moves entropy more than quantization does). Each acts once
  per episode: a layer re-arms when its window drop is back under half of ``warn_drop``.
- **risk** (dynamic precision): ``promote_steps`` steps at or above ``promote_risk`` (or ``promote_layer_risk``
  while some layer is at ``promote_risk``; one step at the prompt check) promote a layer one tier for new
  tokens (and for its history, where the session keeps a backing tier), at most ``max_promotion_tiers`` above
  the plan, and restore or recompute its top positions. With ``demotion="risk"``, ``demote_steps * 2**demotions``
  steps at or below ``demote_risk`` demote it one tier, never below the plan; by default (``"budget"``) only the
  memory budget takes a promotion back: the classifier sees the error at the promoted tier, so a promoted layer
  looks safe because it was promoted.
- **memory budget**: promotions go riskiest first, each priced by its extra bits (``Window.bit_cost``), as far
  as the hot cache's room under ``min_saving_kept`` of the plan's saving goes (``Window.headroom``); the rest
  wait. Past the budget, the promoted layer at the lowest risk is demoted one tier a step (where that changes
  what new tokens are stored in: not below INT8 while the rollback ladder lifts them there).
- **trigger rate**: more than ``max_trigger_rate`` of the last ``trigger_rate_steps`` steps acting (once at
  least 32 were seen) recommends recalibration, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Sequence

from kvguard.config import Demotion, MonitorConfig
from kvguard.precision import Precision

MAX_LEVEL = 3
MIN_RATE_STEPS = 32  # steps seen before a trigger rate is trusted


class Alarm(str, Enum):
    """What made the loop act."""

    WARNING = "warning"
    TRIGGER = "trigger"
    SEVERE = "severe"
    NONFINITE = "nonfinite"
    RISK = "risk"
    BUDGET = "memory_budget"
    COOLDOWN = "cooldown"
    TRIGGER_RATE = "trigger_rate"


class Action(str, Enum):
    """What the loop does; ``kind`` is the metrics label."""

    LIGHT = "light"
    HEAVY = "heavy"
    PRECISION_UP = "precision_up"
    PRECISION_DOWN = "precision_down"
    ROLLBACK_INT8 = "rollback_int8_double_recompute"
    ROLLBACK_WIDEN = "rollback_widen_recompute_all_layers"
    ROLLBACK_FULL = "rollback_full_precision"
    HOLD_FULL = "hold_full_precision"
    STEP_DOWN = "step_down"
    RECOMMEND_RECALIBRATION = "recommend_recalibration"

    @property
    def kind(self) -> str:
        return _KINDS.get(self, self.value)

    @property
    def recomputes(self) -> bool:
        """Whether the session recomputes positions for this action."""
        return self in (Action.LIGHT, Action.HEAVY)


_KINDS = {Action.ROLLBACK_INT8: "rollback", Action.ROLLBACK_WIDEN: "rollback", Action.ROLLBACK_FULL: "rollback_full",
          Action.HOLD_FULL: "rollback_full", Action.RECOMMEND_RECALIBRATION: "recalibration_recommended"}
METRIC_KINDS = tuple(sorted({a.kind for a in Action}))


@dataclass(frozen=True)
class Window:
    """One monitoring step's evidence, per layer (plain numbers: the policy needs no tensors).

    Attributes:
        drop: window-mean entropy drop against the sequence's own level (0 where not monitored).
        consecutive: tokens in a row, up to now, at least ``trigger_drop`` below baseline.
        monitored: which layers' alarms count.
        risk: the risk classifier's output per layer (every layer is observed), or ``None`` without a classifier.
        nonfinite: a NaN / Inf was read since the last step.
        headroom: what the hot cache may still grow by under the loop's memory budget (it keeps
            ``min_saving_kept`` of the plan's saving), as a fraction of the FP16 bytes; negative: over it;
            ``None``: no budget.
        prompt: the prompt check, the first read of a prefilled prompt: a layer at risk is promoted at once
            (``promote_steps`` guards against flapping between steps, and there was no step before).
        bit_cost: per layer, what one more bit per value in one of its KV heads adds to the hot cache (its
            history stored again, and new tokens alike), as a fraction of the FP16 bytes, so promotions are
            priced against ``headroom``; ``None``: promotions are not priced.
    """

    drop: tuple[float, ...]
    consecutive: tuple[int, ...]
    monitored: tuple[bool, ...]
    risk: tuple[float, ...] | None = None
    nonfinite: bool = False
    headroom: float | None = None
    prompt: bool = False
    bit_cost: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.drop)
        lengths = [len(self.consecutive), len(self.monitored)] + [
            len(x) for x in (self.risk, self.bit_cost) if x is not None]
        if any(m != n for m in lengths):
            raise ValueError(f"window evidence needs one entry per layer ({n}), got lengths {lengths}")


@dataclass(frozen=True)
class AlarmFlags:
    """Per layer: which alarm rules fire on a window (before episodes are taken into account)."""

    warning: tuple[bool, ...]
    trigger: tuple[bool, ...]
    severe: tuple[bool, ...]


def raw_alarms(config: MonitorConfig, drop: Sequence[float], consecutive: Sequence[int],
               monitored: Sequence[bool]) -> AlarmFlags:
    """The alarm rules of one step, per layer (also the offline replica calibration runs on FP16 text)."""
    return AlarmFlags(
        warning=tuple(bool(m and d >= config.warn_drop) for d, m in zip(drop, monitored)),
        trigger=tuple(bool(m and c >= config.trigger_consecutive) for c, m in zip(consecutive, monitored)),
        severe=tuple(bool(m and d >= config.heavy_drop) for d, m in zip(drop, monitored)),
    )


@dataclass(frozen=True)
class Decision:
    """One thing the session does, in order.

    Attributes:
        action, alarm: what and why.
        layers: the layers it concerns (compensation: the layers whose K/V are recomputed).
        level: the rollback level when it is carried out.
        fraction, cap: compensation: the share of a layer's quantized positions to recompute, and the most its
            full-precision overlay may hold.
        previous_level: ladder moves: the level before.
        precision: precision changes: the layer's new per-head tiers.
        risk: precision changes: the layer's risk.
        cooldown_steps: step-downs: the quiet steps that earned it.
        trigger_rate, steps: recalibration: the rate and the steps it was measured over.
    """

    action: Action
    alarm: Alarm
    layers: tuple[int, ...]
    level: int
    fraction: float | None = None
    cap: float | None = None
    previous_level: int | None = None
    precision: tuple[Precision, ...] | None = None
    risk: float | None = None
    cooldown_steps: int | None = None
    trigger_rate: float | None = None
    steps: int | None = None


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between steps.

    Attributes:
        floor: the plan's per-layer, per-head tiers (dynamic precision never goes below them).
        tiers: the dynamic per-layer, per-head tiers (before the rollback level is applied).
        level: rollback ladder level, 0 (plan) to :data:`MAX_LEVEL` (full precision).
        steps_since_severe: monitoring steps since the last severe alarm (or ladder move).
        armed: per layer, whether its next warning / trigger may act.
        high, low: per layer, steps in a row with high / low risk.
        demotions: per layer, demotions so far (each doubles the wait before the next).
        recent: whether each of the last ``trigger_rate_steps`` steps acted.
        recalibration_recommended: the trigger-rate event was sent.
    """

    floor: tuple[tuple[Precision, ...], ...]
    tiers: tuple[tuple[Precision, ...], ...]
    level: int = 0
    steps_since_severe: int = 0
    armed: tuple[bool, ...] = ()
    high: tuple[int, ...] = ()
    low: tuple[int, ...] = ()
    demotions: tuple[int, ...] = ()
    recent: tuple[bool, ...] = ()
    recalibration_recommended: bool = False

    @classmethod
    def initial(cls, floor: Sequence[Sequence[Precision]]) -> "PolicyState":
        floor = tuple(tuple(Precision.parse(p) for p in heads) for heads in floor)
        n = len(floor)
        return cls(floor, floor, armed=(True,) * n, high=(0,) * n, low=(0,) * n, demotions=(0,) * n)

    @property
    def num_layers(self) -> int:
        return len(self.floor)

    def effective(self, layer: int) -> tuple[Precision, ...]:
        """The tiers ``layer`` stores new tokens in: level 1 and 2 lift every head to INT8 at least, level 3 is FP16."""
        return _lifted(self.tiers[layer], self.level)

    @property
    def trigger_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0


def _lifted(heads: tuple[Precision, ...], level: int) -> tuple[Precision, ...]:
    """The tiers new tokens are stored in at rollback ``level``."""
    if level >= MAX_LEVEL:
        return (Precision.FP16,) * len(heads)
    if level >= 1:
        return tuple(p if p.bits >= 8 else Precision.INT8 for p in heads)
    return heads


@dataclass(frozen=True)
class Step:
    """:func:`decide`'s answer: the new state, what to do, which alarms fired, and whether the step acted."""

    state: PolicyState
    decisions: tuple[Decision, ...]
    warning: bool = False
    trigger: bool = False
    severe: bool = False
    acted: bool = False


@dataclass
class _Work:
    """The mutable copy of the state one :func:`decide` call works on."""

    config: MonitorConfig
    state: PolicyState
    armed: list[bool]
    high: list[int]
    low: list[int]
    demotions: list[int]
    tiers: list[tuple[Precision, ...]]
    decisions: list[Decision] = field(default_factory=list)

    @property
    def level(self) -> int:
        return self.state.level

    def freeze(self) -> PolicyState:
        return replace(self.state, armed=tuple(self.armed), high=tuple(self.high), low=tuple(self.low),
                       demotions=tuple(self.demotions), tiers=tuple(self.tiers))

    def shares(self) -> tuple[float, float]:
        lo, hi = self.config.recompute_fraction
        return (2 * lo, 2 * hi) if self.level >= 1 else (lo, hi)

    def widened(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Level 2 and up widen every recomputation to all layers."""
        return tuple(range(self.state.num_layers)) if self.level >= 2 else tuple(layers)

    def compensate(self, action: Action, alarm: Alarm, layers: Sequence[int], *, promoted: bool = False) -> None:
        """Recompute ``layers`` (widened by the ladder); a promoted layer gets its whole share at once."""
        lo, hi = self.shares()
        layers = tuple(layers) if promoted else self.widened(layers)
        self.decisions.append(Decision(action, alarm, layers, self.level, hi if promoted else lo, hi))


def decide(config: MonitorConfig, state: PolicyState, window: Window) -> Step:
    """One monitoring step: the new state and the decisions, in the order the session carries them out."""
    n = state.num_layers
    if len(window.drop) != n:
        raise ValueError(f"window evidence has {len(window.drop)} layers, the policy {n}")
    work = _Work(config, replace(state, steps_since_severe=state.steps_since_severe + 1), list(state.armed),
                 list(state.high), list(state.low), list(state.demotions), list(state.tiers))
    flags = raw_alarms(config, window.drop, window.consecutive, window.monitored)
    for l in range(n):  # re-arm layers whose drop is back well under the warning level
        work.armed[l] = work.armed[l] or window.drop[l] < config.warn_drop / 2
    severe = [l for l in range(n) if flags.severe[l]]
    # Text moves entropy more than quantization does: a warning or trigger acts where the risk classifier also
    # finds the window's quantization error likely to matter (no classifier: everywhere).
    plausible = [window.risk is None or window.risk[l] >= config.alarm_risk for l in range(n)]
    warn = [l for l in range(n) if flags.warning[l] and work.armed[l] and plausible[l]]
    trig = [l for l in range(n) if flags.trigger[l] and work.armed[l] and plausible[l]]
    for l in set(severe) | set(warn) | set(trig):
        work.armed[l] = False
    acted = False
    if window.nonfinite or severe:
        worst = max(severe, key=lambda l: window.drop[l]) if severe else n - 1
        _escalate(work, Alarm.NONFINITE if window.nonfinite else Alarm.SEVERE, worst)
        if work.level < MAX_LEVEL:
            top = worst + 1
            work.compensate(Action.HEAVY, Alarm.SEVERE, range(max(0, top - config.heavy_layers), top))
        acted = True
    elif warn or trig:
        if work.level < MAX_LEVEL:
            work.compensate(Action.LIGHT, Alarm.WARNING if warn else Alarm.TRIGGER, sorted(set(warn) | set(trig)))
        acted = True
    if window.risk is not None and work.level < MAX_LEVEL:
        acted |= _dynamic_precision(work, window, 1 if window.prompt else config.promote_steps)
    acted |= _cool_down(work)
    _count_rate(work, acted)
    return Step(work.freeze(), tuple(work.decisions), bool(warn) and not (window.nonfinite or severe),
                bool(trig) and not (window.nonfinite or severe), bool(window.nonfinite or severe), acted)


def _escalate(work: _Work, alarm: Alarm, layer: int) -> None:
    previous = work.level
    level = min(previous + 1, MAX_LEVEL)
    work.state = replace(work.state, level=level, steps_since_severe=0)
    if level == MAX_LEVEL and previous < MAX_LEVEL:
        action = Action.ROLLBACK_FULL
        work.tiers = [(Precision.FP16,) * len(heads) for heads in work.tiers]
    elif level == MAX_LEVEL:
        action = Action.HOLD_FULL
    else:
        action = Action.ROLLBACK_INT8 if level == 1 else Action.ROLLBACK_WIDEN
    work.decisions.append(Decision(action, alarm, (layer,), level, previous_level=previous))


def _cool_down(work: _Work) -> bool:
    previous = work.level
    if previous == 0:
        return False
    need = work.config.cooldown_steps * 2 ** (previous - 1)
    if work.state.steps_since_severe < need:
        return False
    work.state = replace(work.state, level=previous - 1, steps_since_severe=0)
    if previous == MAX_LEVEL:
        work.tiers = list(work.state.floor)
    work.decisions.append(Decision(Action.STEP_DOWN, Alarm.COOLDOWN, (), previous - 1, previous_level=previous,
                                   cooldown_steps=need))
    return True


# The loop steps between the tiers its thresholds were tuned on. INT3 is a storage tier calibration may choose;
# an INT3 head steps up to INT4 and down to INT2, and nothing is promoted into INT3.
_LADDER = (Precision.INT2, Precision.INT4, Precision.INT8, Precision.FP16)


def _up(p: Precision) -> Precision:
    return next((t for t in _LADDER if t.bits > p.bits), p)


def _down(p: Precision) -> Precision:
    return next((t for t in reversed(_LADDER) if t.bits < p.bits), p)


def _stepped_down(heads: Sequence[Precision], floor: Sequence[Precision]) -> tuple[Precision, ...]:
    """``heads`` one tier down where they are above the plan's ``floor``."""
    return tuple(_down(p) if p.bits > f.bits else p for p, f in zip(heads, floor))


def _raise(precision: Precision, tiers: int) -> Precision:
    for _ in range(tiers):
        precision = _up(precision)
    return precision


def _dynamic_precision(work: _Work, window: Window, promote_steps: int) -> bool:
    cfg, risk = work.config, window.risk
    alarm = max(risk) >= cfg.promote_risk  # the sequence is at risk: look at every elevated layer
    due = []
    for l, r in enumerate(risk):
        elevated = r >= cfg.promote_risk or (alarm and r >= cfg.promote_layer_risk)
        work.high[l] = work.high[l] + 1 if elevated else 0
        work.low[l] = work.low[l] + 1 if r <= cfg.demote_risk else 0
        if work.high[l] >= promote_steps and _promoted(work, l) != work.tiers[l]:
            due.append(l)
    acted = _promote(work, window, due)
    if cfg.demotion is Demotion.RISK:
        acted |= _demote_quiet(work, risk, due)
    if window.headroom is not None and window.headroom < 0:
        acted |= _over_budget(work, risk)
    return acted


def _demote_quiet(work: _Work, risk: Sequence[float], due: Sequence[int]) -> bool:
    """``demotion="risk"``: a promoted layer quiet for ``demote_steps * 2**demotions`` steps goes back one tier."""
    acted = False
    for l, r in enumerate(risk):
        heads, floor = work.tiers[l], work.state.floor[l]
        if (l not in due and work.low[l] >= work.config.demote_steps * 2 ** work.demotions[l]
                and any(p.bits > f.bits for p, f in zip(heads, floor))):
            # Each demotion of a layer doubles the wait before its next one: its risk is low partly because it
            # was promoted, and a layer that keeps coming back must not flap.
            work.tiers[l] = _stepped_down(heads, floor)
            work.low[l] = 0
            work.demotions[l] += 1
            work.decisions.append(Decision(Action.PRECISION_DOWN, Alarm.RISK, (l,), work.level,
                                           precision=work.tiers[l], risk=float(r)))
            acted = True
    return acted


def _promoted(work: _Work, layer: int) -> tuple[Precision, ...]:
    """``layer``'s tiers one step up, at most ``max_promotion_tiers`` above the plan."""
    floor = work.state.floor[layer]
    ceiling = [_raise(f, work.config.max_promotion_tiers) for f in floor]
    return tuple(_up(p) if p.bits < c.bits else p for p, c in zip(work.tiers[layer], ceiling))


def _promote(work: _Work, window: Window, due: Sequence[int]) -> bool:
    """Promote the ``due`` layers, riskiest first, as far as the memory budget's room goes.

    A promotion is priced by its extra bits (``Window.bit_cost``); the first layer that does not fit stops the
    rest, which wait (still due) for room. Promoting every due layer at once and stepping the overshoot back
    down one layer a step made one alarm cost a dozen acting steps."""
    room = window.headroom
    if room is not None and room <= 0:
        return False
    acted = False
    for l in sorted(due, key=lambda i: (-window.risk[i], i)):
        tiers = _promoted(work, l)
        if room is not None and window.bit_cost is not None:
            cost = window.bit_cost[l] * sum(p.bits - q.bits for p, q in zip(tiers, work.tiers[l]))
            if cost > room:
                break
            room -= cost
        work.tiers[l] = tiers
        work.high[l] = 0
        work.decisions.append(Decision(Action.PRECISION_UP, Alarm.RISK, (l,), work.level, precision=tiers,
                                       risk=float(window.risk[l])))
        work.compensate(Action.LIGHT, Alarm.RISK, [l], promoted=True)
        acted = True
    return acted


def _over_budget(work: _Work, risk: Sequence[float]) -> bool:
    """Over the memory budget: the promoted layer at the lowest risk goes back one tier for new tokens (one a
    step, so the cache's growth slows down before it stops).

    Only a step-down that changes what new tokens are stored in counts: while the rollback ladder lifts every
    layer to INT8, taking back a promotion below INT8 frees nothing, and the layer would have to earn it again
    once the ladder steps down."""
    lowered = [_stepped_down(heads, floor) for heads, floor in zip(work.tiers, work.state.floor)]
    promoted = [l for l, (down, heads) in enumerate(zip(lowered, work.tiers))
                if _lifted(down, work.level) != _lifted(heads, work.level)]
    if not promoted:
        return False
    l = min(promoted, key=lambda i: (risk[i], i))
    work.tiers[l] = lowered[l]
    work.low[l] = 0
    work.decisions.append(Decision(Action.PRECISION_DOWN, Alarm.BUDGET, (l,), work.level, precision=work.tiers[l],
                                   risk=float(risk[l])))
    return True


def _count_rate(work: _Work, acted: bool) -> None:
    cfg = work.config
    recent = (work.state.recent + (acted,))[-cfg.trigger_rate_steps:]
    work.state = replace(work.state, recent=recent)
    rate = work.state.trigger_rate
    if (not work.state.recalibration_recommended and len(recent) >= min(MIN_RATE_STEPS, cfg.trigger_rate_steps)
            and rate > cfg.max_trigger_rate):
        work.state = replace(work.state, recalibration_recommended=True)
        work.decisions.append(Decision(Action.RECOMMEND_RECALIBRATION, Alarm.TRIGGER_RATE, (), work.level,
                                       trigger_rate=rate, steps=len(recent)))
