"""The KV-cache methods ``kvguard eval`` compares, by name.

- ``fp16``: the reference, an unquantized KVGuardCache storing float16.
- ``int8`` / ``int4``: kvguard's quantizers on every layer, no calibration, default layout
  (:class:`~kvguard.config.CacheConfig`: 4 sinks, FP window 64, group 32).
- ``kivi-4`` / ``kivi-2``: the KIVI recipe on kvguard's quantizers: keys per channel, values per token,
  group 32, FP window 128, no sinks.
- ``hf-quanto-4`` / ``hf-quanto-2`` / ``hf-hqq-4``: transformers' own ``QuantizedCache`` (see
  :mod:`kvguard.peers`).
- ``kvguard``: the plan a calibration profile chose (``kvguard calibrate``), INT8 heads with its calibrated
  scales; needs ``--profile``.

Static methods (a :class:`~kvguard.plan.Plan`) can be scored by the fast simulation; peers always stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvguard.config import CacheConfig
from kvguard.models import Architecture
from kvguard.plan import Plan, StaticScales

KIVI = CacheConfig(residual=128, sinks=0, group_size=32)


@dataclass(frozen=True)
class Method:
    """A way to store the KV cache.

    Attributes:
        name: what ``--methods`` takes.
        description: one line for listings and docs.
        plan: for kvguard's own static methods, the plan for a given architecture; ``None`` for peers.
        peer: the :mod:`kvguard.peers` name for transformers' caches.
        scales: calibrated INT8 ranges the plan's INT8 heads use (profile methods).
    """

    name: str
    description: str
    plan: Callable[[Architecture], Plan] | None = None
    peer: str | None = None
    scales: StaticScales | None = None

    @property
    def simulatable(self) -> bool:
        return self.plan is not None

    def make_cache(self, model):
        """A fresh cache for one sequence of ``model``."""
        if self.plan is not None:
            return self.plan(Architecture.from_config(model.config)).make_cache(model.config, self.scales)
        from kvguard import peers

        return peers.make_cache(self.peer, model)


def _uniform(precision: str, cache: CacheConfig | None = None) -> Callable[[Architecture], Plan]:
    return lambda arch: Plan.uniform(arch, precision, cache)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("fp16", "reference: unquantized cache, float16 storage", _uniform("fp16")),
        Method("int8", "kvguard INT8 on every layer (symmetric, dynamic scales), 4 sinks, FP window 64, group 32",
               _uniform("int8")),
        Method("int4", "kvguard INT4 on every layer (asymmetric), 4 sinks, FP window 64, group 32", _uniform("int4")),
        Method("int2", "kvguard INT2 on every layer (asymmetric), 4 sinks, FP window 64, group 32", _uniform("int2")),
        Method("kivi-4", "KIVI recipe, 4 bits: keys per channel, values per token, group 32, FP window 128",
               _uniform("int4", KIVI)),
        Method("kivi-2", "KIVI recipe, 2 bits: keys per channel, values per token, group 32, FP window 128",
               _uniform("int2", KIVI)),
        Method("hf-quanto-4", "transformers QuantizedCache, quanto backend, 4 bits", peer="hf-quanto-4"),
        Method("hf-quanto-2", "transformers QuantizedCache, quanto backend, 2 bits", peer="hf-quanto-2"),
        Method("hf-hqq-4", "transformers QuantizedCache, HQQ backend, 4 bits", peer="hf-hqq-4"),
    )
}
# Methods that need a calibration profile (``--profile``); ``kvguard-live`` arrives with the run-time issue.
PROFILE_METHODS = ("kvguard", "kvguard-live")


def from_profile(profile) -> Method:
    """The ``kvguard`` method: the static plan of a :class:`~kvguard.profile.Profile`."""
    plan = profile.plan
    counts = ", ".join(f"{n} {p}" for p, n in sorted(plan.precision_counts().items()))
    return Method("kvguard", f"calibrated plan for {profile.model_name} ({counts} KV heads)", lambda arch: plan,
                  scales=profile.static_scales())


def get(name: str, profile=None) -> Method:
    """The method called ``name`` (profile methods from ``profile``); ``ValueError`` listing the valid names
    otherwise."""
    if name == "kvguard":
        if profile is None:
            raise ValueError("method 'kvguard' needs a calibration profile: pass --profile (see `kvguard calibrate`)")
        return from_profile(profile)
    try:
        return METHODS[name]
    except KeyError:
        if name in PROFILE_METHODS:
            raise ValueError(f"method {name!r} needs the run-time feedback loop, not available yet") from None
        raise ValueError(f"unknown method {name!r}; valid methods are [{', '.join(METHODS)}, kvguard]") from None


def kv_bytes(cache) -> tuple[int, int]:
    """``(stored bytes, FP16 bytes of the same shape)`` of any cache the methods make."""
    if hasattr(cache, "fp16_nbytes"):
        return cache.nbytes(), cache.fp16_nbytes()
    from kvguard import peers

    return peers.cache_nbytes(cache), peers.fp16_nbytes(cache)


def static_kv_bytes(plan: Plan, model_config, tokens: int, scales: StaticScales | None = None) -> tuple[int, int]:
    """``kv_bytes`` of a cache built from ``plan`` after ``tokens`` tokens, without running the model: the
    stored sizes depend only on shapes, so zeros of the right shape are fed through the layers."""
    import torch

    arch = Architecture.from_config(model_config)
    cache = plan.make_cache(model_config, scales)
    zeros = torch.zeros(1, arch.num_kv_heads, tokens, arch.head_dim)
    for idx in range(arch.num_layers):
        cache.update(zeros, zeros, idx)
    return cache.nbytes(), cache.fp16_nbytes()
