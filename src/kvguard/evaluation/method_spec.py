"""A method name, parsed once: what it builds on, which budget, which plan changes, whether the loop runs it.

The grammar of ``kvguard eval``'s method names (:mod:`kvguard.evaluation.methods` lists the names themselves)::

    name     := live | static
    live     := "kvguard-live" [":" static]          the feedback loop over a static method (default: kvguard)
    static   := base ("+" modifier)*                  modifiers apply left to right
    base     := "kvguard" ["@" bytes ["/p99"]] | <registered>
                                                      the profile's plan, its frontier plan (ranked by the mean
                                                      KL, or by its 99th percentile), or a listed method

:func:`parse` reads a name into a :class:`MethodSpec` and refuses what the grammar does not allow (an unknown
modifier, a budget that is not a number, a loop over a loop), naming the valid values; whether a base is
registered, static, or has the calibrated scales ``+w8`` needs is for
:func:`~kvguard.evaluation.methods.build` to say, which knows the registry. Nothing else splits a method name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from kvguard.plan import Plan

KVGUARD = "kvguard"  # the profile's chosen plan; ``kvguard@<bytes>``: its frontier plan within a budget
LIVE = "kvguard-live"  # the feedback loop, over ``kvguard`` or over ``kvguard-live:<static method>``
TAIL = "/p99"  # ``kvguard@<bytes>/p99``: the budget's plan ranked by its tail KL


class Modifier(str, Enum):
    """A change to a static method's plan, written ``+<value>`` after it.

    - ``rot`` / ``rotk`` / ``rotv``: the Hadamard rotation (:mod:`kvguard.rotation`) on keys and values / keys
      only / values only of every layer below INT8.
    - ``sb`` / ``nosb``: the softmax-bias correction of the quantized keys' scores (:mod:`kvguard.score_bias`)
      on / off (calibration keeps it in the low-bit frontier plans where it measured a lower KL).
    - ``v0`` / ``v1`` / ``v2``: every head's values stored zero / one / two tiers below its keys (heads below
      INT8, never below INT2).
    - ``w8`` / ``w16``: the full-precision window stored as INT8 codes under the profile's calibrated scales /
      in float16 (``CacheConfig.window_bits``); ``w8`` needs a profile method.
    - ``prerope`` / ``postrope``: keys below INT8 stored before / after RoPE (``CacheConfig.prerope_keys``;
      not with the softmax-bias correction).
    """

    ROT = "rot"
    ROTK = "rotk"
    ROTV = "rotv"
    SB = "sb"
    NOSB = "nosb"
    V0 = "v0"
    V1 = "v1"
    V2 = "v2"
    W8 = "w8"
    W16 = "w16"
    PREROPE = "prerope"
    POSTROPE = "postrope"

    @property
    def needs_scales(self) -> bool:
        """Whether the changed plan needs calibrated INT8 scales (the 8-bit window is stored under them)."""
        return self is Modifier.W8

    @property
    def description(self) -> str:
        """What the change does, appended to the method's description."""
        return _CHANGES[self][0]

    def apply(self, plan: Plan) -> Plan:
        """``plan`` with this change."""
        return _CHANGES[self][1](plan)


_CHANGES: dict[Modifier, tuple[str, Callable[[Plan], Plan]]] = {
    Modifier.ROT: ("Hadamard-rotated keys and values", lambda p: p.with_rotation(True, True)),
    Modifier.ROTK: ("Hadamard-rotated keys", lambda p: p.with_rotation(True, False)),
    Modifier.ROTV: ("Hadamard-rotated values", lambda p: p.with_rotation(False, True)),
    Modifier.SB: ("softmax-bias correction of quantized keys' scores", lambda p: p.with_score_correction(True)),
    Modifier.NOSB: ("without the softmax-bias correction", lambda p: p.with_score_correction(False)),
    Modifier.V0: ("values at their keys' tier", lambda p: p.with_value_drop(0)),
    Modifier.V1: ("values 1 tier below their keys'", lambda p: p.with_value_drop(1)),
    Modifier.V2: ("values 2 tiers below their keys'", lambda p: p.with_value_drop(2)),
    Modifier.W8: ("8-bit window", lambda p: p.with_window_bits(8)),
    Modifier.W16: ("16-bit window", lambda p: p.with_window_bits(16)),
    # a plan with the score correction refuses keys before RoPE (CacheConfig names both)
    Modifier.PREROPE: ("keys below INT8 stored before RoPE", lambda p: p.with_prerope_keys(True)),
    Modifier.POSTROPE: ("keys stored after RoPE", lambda p: p.with_prerope_keys(False)),
}
MODIFIERS = tuple(m.value for m in Modifier)


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name.

    Attributes:
        name: the name as written (result rows keep it).
        base: what the method builds on: ``kvguard`` (the profile's plan, or with ``budget`` its frontier plan),
            ``kvguard-live`` (the loop), or any other name, looked up in the registry when built.
        budget: ``kvguard@<bytes>``'s bytes, a fraction of FP16; ``None`` otherwise.
        modifiers: the plan changes, in the order they apply.
        live: the method decodes under the feedback loop.
        over: for a live method, the static method the loop runs over (``kvguard`` unless named).
        tail: ``kvguard@<bytes>/p99``: the plan within the budget with the lowest p99 per-token KL, not mean KL.
    """

    name: str
    base: str
    budget: float | None = None
    modifiers: tuple[Modifier, ...] = ()
    live: bool = False
    over: MethodSpec | None = None
    tail: bool = False

    def __post_init__(self) -> None:
        if self.live != (self.over is not None):
            raise ValueError(f"{self.name!r}: a live method, and only one, names the method its loop runs over")
        if self.budget is not None and self.base != KVGUARD:
            raise ValueError(f"{self.name!r}: only {KVGUARD}@<bytes> takes a budget")
        if self.tail and self.budget is None:
            raise ValueError(f"{self.name!r}: only {KVGUARD}@<bytes> ranks by the tail ({KVGUARD}@<bytes>{TAIL})")

    @property
    def needs_profile(self) -> bool:
        """Whether the method is the profile's (its plan, its frontier, its loop); the FP8 methods, which need the
        profile's scales, are the registry's to say."""
        return self.base == KVGUARD or self.live

    def prefix(self, modifiers: int) -> str:
        """The name up to its first ``modifiers`` modifiers: the name of each method on the way to this one."""
        return "+".join(self.name.split("+")[:modifiers + 1])


def parse(name: str) -> MethodSpec:
    """``name`` as a :class:`MethodSpec`; ``ValueError`` naming the valid values where the grammar refuses it."""
    if name == LIVE or name.startswith(LIVE + ":"):
        over = name.split(":", 1)[1] if ":" in name else KVGUARD
        if over.startswith(LIVE):
            raise ValueError(f"{name!r}: the loop runs over a static method, not over another live one")
        return MethodSpec(name, LIVE, live=True, over=parse(over))
    base, *written = name.split("+")
    modifiers = []
    for i, modifier in enumerate(written):
        if modifier not in MODIFIERS:
            prefix = "+".join([base, *written[:i + 1]])
            raise ValueError(f"{prefix!r}: unknown modifier {modifier!r}; valid modifiers are [{', '.join(MODIFIERS)}]")
        modifiers.append(Modifier(modifier))
    budget, tail = None, False
    if base.startswith(KVGUARD + "@"):
        written_budget = base.split("@", 1)[1]
        tail = written_budget.endswith(TAIL)
        try:
            budget = float(written_budget.removesuffix(TAIL))
        except ValueError:
            raise ValueError(f"{base!r}: expected {KVGUARD}@<bytes ratio>[{TAIL}], e.g. {KVGUARD}@0.25 or "
                             f"{KVGUARD}@0.25{TAIL}") from None
        base = KVGUARD
    return MethodSpec(name, base, budget, tuple(modifiers), tail=tail)
