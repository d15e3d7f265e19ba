"""Storage precisions for the KV cache."""

from __future__ import annotations

from enum import Enum


class Precision(str, Enum):
    """How a cache layer (or one KV head of it) stores the tokens that leave its full-precision window.

    - ``FP16``: unquantized, IEEE half (or the model's own dtype, see ``CacheConfig.fp_dtype``).
    - ``INT8``: symmetric, ``q = clamp(round(x / s), -127, 127)``, ``s = clip * absmax / 127``.
    - ``INT4``: asymmetric with a zero point, 16 levels, two codes per byte.
    - ``INT3``: asymmetric with a zero point, 8 levels, eight codes per three bytes (the tier between).
    - ``INT2``: asymmetric with a zero point, 4 levels, four codes per byte (the aggressive tier).
    """

    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    INT3 = "int3"
    INT2 = "int2"

    @classmethod
    def parse(cls, value: "Precision | str") -> "Precision":
        """``Precision`` from its name, with an error that lists the valid names."""
        if isinstance(value, Precision):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"precision has to be one of [{valid}] but got {value!r}") from None

    @property
    def bits(self) -> int:
        return {"fp16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2}[self.value]

    @property
    def is_quantized(self) -> bool:
        return self is not Precision.FP16

    @property
    def symmetric(self) -> bool:
        """INT8 is symmetric (no zero point); INT4, INT3 and INT2 are asymmetric."""
        return self is Precision.INT8

    def higher(self) -> "Precision":
        """The next more precise tier (FP16 stays FP16)."""
        order = _ORDER
        return order[min(order.index(self) + 1, len(order) - 1)]

    def lower(self) -> "Precision":
        """The next more aggressive tier (INT2 stays INT2)."""
        order = _ORDER
        return order[max(order.index(self) - 1, 0)]

    def below(self, tiers: int) -> "Precision":
        """The tier a head's *values* take when they are stored ``tiers`` steps more aggressive than its keys at
        this tier: INT4 -> INT3 -> INT2, never below INT2. INT8 and FP16 keys keep their values at their own
        tier (a plan only lets the values go lower where the keys are below 8 bits)."""
        if tiers < 0:
            raise ValueError(f"a value tier drop must be >= 0, got {tiers}")
        if self.bits >= 8:
            return self
        return _ORDER[max(_ORDER.index(self) - tiers, 0)]


_ORDER = [Precision.INT2, Precision.INT3, Precision.INT4, Precision.INT8, Precision.FP16]


def value_tiers(precisions, drops) -> tuple[Precision, ...]:
    """Each head's value tier: its keys' tier ``precisions[h]`` lowered by ``drops[h]`` (:meth:`Precision.below`);
    empty ``drops``: the keys' tiers."""
    drops = drops or (0,) * len(precisions)
    return tuple(p.below(d) for p, d in zip(precisions, drops))
