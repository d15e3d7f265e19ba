"""What the feedback loop reports: one :class:`Event` per alarm and action, typed counters, step records.

Every switch the loop makes is logged completely (for root-cause analysis): when, which sequence and token,
why (the alarm), what (the action), the rollback level, the layers concerned with their entropy, baseline, drop
and risk, how many positions were compensated (and, with a backing tier, how many (layer, position) pairs were
restored exactly rather than recomputed) and how long it took.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvguard.control.policy import Action, Alarm


@dataclass(frozen=True)
class Event:
    """One alarm and the action taken on it (``to_json`` is the JSON line ``--events`` files hold)."""

    time: float
    sequence: str
    token: int
    alarm: Alarm
    action: Action
    level: int
    layers: tuple[int, ...]
    entropy: tuple[float, ...]
    baseline: tuple[float | None, ...]
    drop: tuple[float, ...]
    risk: tuple[float, ...] | None
    positions: int = 0
    ms: float = 0.0
    restored: int | None = None  # compensation with a backing tier: (layer, position) pairs restored exactly
    reencoded: int | None = None  # promotion with a backing tier: history positions stored again at the new tier
    restore_ms: float | None = None  # with a backing tier: time spent reading originals back from it
    ram_delta: int | None = None  # bytes in RAM (every tier) the action added (negative: freed)
    previous_level: int | None = None
    precision: tuple[str, ...] | None = None
    cooldown_steps: int | None = None
    trigger_rate: float | None = None
    steps: int | None = None

    def to_json(self) -> dict:
        """Plain JSON values; optional fields that do not apply to this action are left out."""
        out = {k: v for k, v in asdict(self).items() if v is not None or k == "risk"}
        out["alarm"], out["action"] = self.alarm.value, self.action.value
        for name in ("layers", "entropy", "baseline", "drop", "risk", "precision"):
            if out.get(name) is not None:
                out[name] = list(out[name])
        out["ms"] = round(self.ms, 3)
        if self.restore_ms is not None:
            out["restore_ms"] = round(self.restore_ms, 3)
        return out


@dataclass(frozen=True)
class StepRecord:
    """One monitoring step as a server's metrics see it."""

    step: int
    token: int
    drop: tuple[float, ...]
    monitored: tuple[bool, ...]
    acted: bool
    recomputed: int  # (layer, position) pairs recomputed in this step
    restored: int = 0  # (layer, position) pairs restored from the backing tier in this step


@dataclass
class Counters:
    """Running totals of one session."""

    steps: int = 0
    acted_steps: int = 0
    warnings: int = 0
    triggers: int = 0
    severe: int = 0
    recomputed_positions: int = 0  # (layer, position) pairs recomputed and written at full precision
    restored_positions: int = 0  # (layer, position) pairs restored bit for bit from the backing tier
    reencoded_positions: int = 0  # (layer, position) pairs of history stored again at a promoted tier
    recompute_ms: float = 0.0
    max_level: int = 0
    recalibration_recommended: bool = False
    actions: dict[Action, int] = field(default_factory=dict)

    def count(self, action: Action) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1

    def of(self, *actions: Action) -> int:
        return sum(self.actions.get(a, 0) for a in actions)

    @property
    def light(self) -> int:
        return self.of(Action.LIGHT)

    @property
    def heavy(self) -> int:
        return self.of(Action.HEAVY)

    @property
    def rollbacks(self) -> int:
        """Moves up the ladder."""
        return self.of(Action.ROLLBACK_INT8, Action.ROLLBACK_WIDEN, Action.ROLLBACK_FULL)

    @property
    def full_rollbacks(self) -> int:
        return self.of(Action.ROLLBACK_FULL)

    def actions_json(self) -> dict[str, int]:
        return {a.value: n for a, n in self.actions.items()}


def describe(record: dict) -> str:
    """One event (an :meth:`Event.to_json` line) as a line a person reads: what the loop saw and what it did.

    Works on the JSON form so that a report can tell the timeline of an ``--events`` file without the session."""
    action = record["action"]
    layers = record.get("layers") or []
    where = f" on layer{'s' if len(layers) > 1 else ''} {layer_ranges(layers)}" if layers else ""
    text = f"token {record['token']:>5}  {record['alarm']:<12} -> {action}{where}"
    if record.get("positions"):
        restored = record.get("restored")
        how = f"compensated, {restored} (layer, position) pairs restored exactly" if restored else "recomputed"
        text += f": {record['positions']} positions {how} ({record.get('ms', 0):.0f} ms"
        if record.get("restore_ms") is not None and restored:
            text += f", {record['restore_ms']:.1f} ms reading originals"
        text += ")"
    if record.get("precision"):
        tiers = sorted(set(record["precision"]))
        text += f": now {'/'.join(tiers)}"
        if record.get("reencoded"):
            text += f", {record['reencoded']} positions of history re-encoded from the backing tier"
    if record.get("ram_delta"):
        text += f"; {record['ram_delta'] / 2**20:+.2f} MiB in RAM"
    previous = record.get("previous_level")
    if previous is not None and previous != record["level"]:
        text += f"; rollback level {previous} -> {record['level']}"
    if record.get("trigger_rate") is not None:
        text += f"; trigger rate {100 * record['trigger_rate']:.1f} %"
    return text


def layer_ranges(values: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
