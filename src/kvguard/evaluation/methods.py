"""The KV-cache methods ``kvguard eval`` compares, by name.

- ``fp16``: the reference, an unquantized KVGuardCache storing float16.
- ``int8`` / ``int4`` / ``int3`` / ``int2``: kvguard's quantizers on every layer, no calibration, default layout
  (:class:`~kvguard.config.CacheConfig`: 4 sinks, FP window 64, group 32).
- ``<static method>+<modifier>...``: that plan changed, left to right, by each
  :class:`~kvguard.evaluation.method_spec.Modifier`: ``rot`` / ``rotk`` / ``rotv`` (the Hadamard rotation), ``sb``
  / ``nosb`` (the softmax-bias correction on / off), ``v0`` / ``v1`` / ``v2`` (values stored that many tiers below
  their keys), ``w8`` / ``w16`` (the window's storage; ``w8`` needs a profile method), ``prerope`` / ``postrope``
  (keys stored before / after RoPE), e.g. ``int3+rotv``, ``int4+rot+v1`` (INT4 keys, INT3 values),
  ``kvguard@0.24+v0`` (the calibrated plan without the values it stores lower), ``kvguard@0.22+nosb+prerope``.
- ``kivi-4`` / ``kivi-2``: the KIVI recipe on kvguard's quantizers: keys per channel, values per token,
  group 32, FP window 128, no sinks.
- ``hf-quanto-4`` / ``hf-quanto-2`` / ``hf-hqq-4``: transformers' own ``QuantizedCache`` (see
  :mod:`kvguard.peers.quantized_cache`).
- ``kvguard``: the plan a calibration profile chose (``kvguard calibrate``), INT8 heads with its calibrated
  scales; needs ``--profile``.
- ``kvguard@<bytes>``: the profile's Pareto-frontier plan storing at most ``<bytes>`` of FP16 (e.g.
  ``kvguard@0.25``), a more aggressive calibrated plan; where calibration ranked the closest plans on longer text,
  the best of those that fits. ``kvguard@<bytes>/p99``: the searched plan within the bytes with the lowest held-out
  p99 per-token KL instead.
- ``fp8`` / ``fp8:head`` / ``fp8:sglang``: the FP8-E4M3 cache a serving engine keeps with the scales
  ``kvguard export`` writes from the profile (:mod:`kvguard.fp8`): vLLM per tensor (the plan's FP16 layers
  skipped), vLLM per KV head, SGLang (one scale per layer for K and V, no layer skipped); ``fp8:vllm-cpu``:
  ``fp8`` with the rounding of vLLM's CPU build (toward zero). Needs ``--profile``.
- ``vllm-int8_per_token_head`` / ``vllm-int4_per_token_head``: vLLM's dynamic per-token-head caches
  (:mod:`kvguard.per_token_head`), reproduced from its kernels: no calibration, every layer quantized.
- ``llamacpp-f16`` / ``llamacpp-q8_0`` / ``llamacpp-q5_0`` / ``llamacpp-q4_1`` / ``llamacpp-q4_0`` /
  ``llamacpp-iq4_nl`` / ``llamacpp-q8_0-q4_0`` (K q8_0, V q4_0): llama.cpp's own KV types, run in llama.cpp on
  the embedded model's GGUF (:mod:`kvguard.peers.llamacpp`); their deltas are against ``llamacpp-f16``.
- ``kvguard-live``: that plan decoded under the run-time feedback loop (:mod:`kvguard.control.session`);
  ``kvguard-live:<static method>`` runs the loop over another plan (e.g. ``kvguard-live:int2``) with the
  profile's baseline, classifier and thresholds, and a backing tier (:mod:`kvguard.backing`, 256 MiB) so that
  compensation restores the original K/V and a promotion re-encodes the layer's history. Needs ``--profile``;
  always streamed token by token.

A name is parsed once into a :class:`~kvguard.evaluation.method_spec.MethodSpec` (:func:`get`), and
:func:`build` makes the method from it and this registry (:data:`METHODS`, :data:`FP8_METHODS`, the profile).

Static methods (a :class:`~kvguard.plan.Plan`) can be scored by the fast simulation, the ``fp8`` methods by one
pass over the stream (their cache is chunk-invariant); peers always stream, llama.cpp in ``--chunk`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvguard.architecture import Architecture
from kvguard.backing import BackingConfig
from kvguard.config import CacheConfig
from kvguard.evaluation import method_spec
from kvguard.evaluation.method_spec import MethodSpec, Modifier
from kvguard.fp8 import FP8Scales, Granularity, Rounding, fp8_scales
from kvguard.peers import llamacpp
from kvguard.per_token_head import TokenHeadCache, TokenHeadFormat
from kvguard.plan import Plan, StaticScales

KIVI = CacheConfig(residual=128, sinks=0, group_size=32)


@dataclass(frozen=True)
class Method:
    """A way to store the KV cache.

    Attributes:
        name: what ``--methods`` takes.
        description: one line for listings and docs.
        plan: for kvguard's own static methods, the plan for a given architecture; ``None`` for peers.
        peer: the :mod:`kvguard.peers.quantized_cache` name for transformers' caches.
        scales: calibrated INT8 ranges the plan's INT8 heads use (profile methods).
        fp8: the static FP8 scales of the ``fp8`` methods (an engine's FP8 cache, :mod:`kvguard.fp8`).
        token_head: the vLLM per-token-head format of the ``vllm-*_per_token_head`` methods.
        llamacpp: the llama.cpp cache of the ``llamacpp-*`` methods (run in llama.cpp, no transformers cache).
    """

    name: str
    description: str
    plan: Callable[[Architecture], Plan] | None = None
    peer: str | None = None
    scales: StaticScales | None = None
    profile: object = None  # the calibration profile of live methods
    live: bool = False
    backing: BackingConfig | None = None  # the backing tier of live methods' sessions
    fp8: FP8Scales | None = None
    token_head: TokenHeadFormat | None = None
    llamacpp: llamacpp.KVSpec | None = None

    @property
    def reference(self) -> str:
        """The method the quality columns are measured against: llama.cpp's own FP16 cache for llama.cpp's
        types (the same engine), kvguard's ``fp16`` for everything else."""
        return llamacpp.REFERENCE if self.llamacpp is not None else "fp16"

    @property
    def simulatable(self) -> bool:
        return self.plan is not None and not self.live

    @property
    def chunk_invariant(self) -> bool:
        """The cache gives attention the same inputs however the stream is chunked (static scales, every token
        quantized once, new tokens included), so a few long chunks score chunk-1 decoding exactly."""
        return self.fp8 is not None or self.token_head is not None

    def session(self, model, **kwargs):
        """A fresh :class:`~kvguard.control.session.LiveSession` for one sequence (live methods only)."""
        from kvguard.control.session import LiveSession

        if not self.live:
            raise ValueError(f"method {self.name!r} does not run the feedback loop")
        plan = self.plan(Architecture.from_config(model.config))
        kwargs.setdefault("backing", self.backing)
        return LiveSession.from_profile(model, self.profile, plan=plan, **kwargs)

    def make_cache(self, model):
        """A fresh cache for one sequence of ``model``."""
        if self.live:
            raise ValueError(f"method {self.name!r} decodes through a LiveSession (Method.session), not a bare cache")
        if self.plan is not None:
            return self.plan(Architecture.from_config(model.config)).make_cache(model.config, self.scales)
        if self.fp8 is not None:
            return self.fp8.make_cache(model.config)
        if self.token_head is not None:
            return TokenHeadCache(model.config, self.token_head)
        if self.llamacpp is not None:
            raise ValueError(f"method {self.name!r} runs inside llama.cpp, which keeps its own cache: it is scored by "
                             f"`kvguard eval --task ppl` only")
        from kvguard.peers import quantized_cache

        return quantized_cache.make_cache(self.peer, model)


def _uniform(precision: str, cache: CacheConfig | None = None) -> Callable[[Architecture], Plan]:
    return lambda arch: Plan.uniform(arch, precision, cache)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("fp16", "reference: unquantized cache, float16 storage", _uniform("fp16")),
        Method("int8", "kvguard INT8 on every layer (symmetric, dynamic scales), 4 sinks, FP window 64, group 32",
               _uniform("int8")),
        Method("int4", "kvguard INT4 on every layer (asymmetric), 4 sinks, FP window 64, group 32", _uniform("int4")),
        Method("int3", "kvguard INT3 on every layer (asymmetric, 8 codes per 3 bytes), 4 sinks, FP window 64, "
               "group 32", _uniform("int3")),
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

# vLLM's own dynamic KV dtypes (``--kv-cache-dtype int8_per_token_head`` / ``int4_per_token_head``): what the
# engine does with no calibration at all, every layer quantized.
VLLM_PREFIX = "vllm-"
METHODS.update({
    VLLM_PREFIX + fmt.value: Method(VLLM_PREFIX + fmt.value, f"vLLM --kv-cache-dtype {fmt.value}: {what}",
                                    token_head=fmt)
    for fmt, what in (
        (TokenHeadFormat.INT8, "symmetric INT8, one float32 scale per token and KV head"),
        (TokenHeadFormat.INT4, "asymmetric INT4 after a Hadamard rotation, one float32 scale per token and KV head"),
    )
})
# llama.cpp's own KV types, in llama.cpp (:mod:`kvguard.peers.llamacpp`).
METHODS.update({name: Method(name, spec.description(), llamacpp=spec) for name, spec in llamacpp.SPECS.items()})
# The engine FP8 caches: name -> (fp8_scales arguments, description).
FP8_METHODS: dict[str, tuple[dict, str]] = {
    "fp8": (dict(granularity=Granularity.TENSOR),
            "vLLM FP8-E4M3 cache, exported per-tensor scales, the plan's FP16 layers skipped"),
    "fp8:head": (dict(granularity=Granularity.HEAD),
                 "vLLM FP8-E4M3 cache, exported per-KV-head scales, the plan's FP16 layers skipped"),
    "fp8:sglang": (dict(granularity=Granularity.TENSOR, shared_kv=True, skip_fp16=False),
                   "SGLang FP8-E4M3 cache, one exported scale per layer for K and V, no layer skipped"),
    "fp8:vllm-cpu": (dict(granularity=Granularity.TENSOR, rounding=Rounding.TOWARD_ZERO),
                     "vLLM's CPU FP8-E4M3 cache (rounds toward zero), exported per-tensor scales, FP16 layers skipped"),
}


def reference_of(name: str) -> str:
    """The reference row of method ``name`` (see :attr:`Method.reference`); ``fp16`` for the profile methods."""
    method = METHODS.get(name)
    return method.reference if method is not None else "fp16"


def from_profile(profile) -> Method:
    """The ``kvguard`` method: the static plan of a :class:`~kvguard.profile.Profile`."""
    plan = profile.plan
    counts = ", ".join(f"{n} {p}" for p, n in sorted(plan.precision_counts().items()))
    return Method("kvguard", f"calibrated plan for {profile.model_name} ({counts} KV heads)", lambda arch: plan,
                  scales=profile.static_scales())


def frontier_method(name: str, profile) -> Method:
    """``kvguard@<bytes>``: the profile's Pareto-frontier plan with the lowest held-out KL among those storing
    at most ``<bytes>`` of FP16, or where calibration ranked that plan on longer text, the best ranked with it
    that fits (:meth:`~kvguard.profile.ProfileMeta.frontier_pick`): a more aggressive plan than the chosen one."""
    spec = method_spec.parse(name)
    if spec.budget is None:
        raise ValueError(f"{name!r}: expected {method_spec.KVGUARD}@<bytes ratio>, e.g. {method_spec.KVGUARD}@0.25")
    try:
        point = profile.meta.frontier_pick(spec.budget, tail=spec.tail)
    except ValueError as err:
        raise ValueError(f"{name!r}: {err}") from None
    if point is None:
        raise ValueError(f"{name!r}: the profile's Pareto frontier has no plan at or below {spec.budget} of FP16 "
                         f"(its points store {[round(c.memory, 3) for c in profile.meta.frontier()]})")
    plan = point.plan
    ranked = ", lowest p99 KL" if spec.tail else ""
    return Method(name, f"calibrated frontier plan {point.name} ({point.memory:.3f} of FP16 on held-out text{ranked})",
                  lambda arch: plan, scales=profile.static_scales())


def fp8_method(name: str, profile) -> Method:
    """``fp8``, ``fp8:head`` or ``fp8:sglang``: an engine's FP8 cache with the scales ``kvguard export`` writes."""
    kwargs, description = FP8_METHODS[name]
    return Method(name, f"{description} ({profile.model_name} profile)", fp8=fp8_scales(profile, **kwargs))


def get(name: str, profile=None) -> Method:
    """The method called ``name`` (profile methods from ``profile``); ``ValueError`` listing the valid names
    otherwise."""
    return build(method_spec.parse(name), profile)


def build(spec: MethodSpec, profile=None) -> Method:
    """The method ``spec`` describes: its base from the registry (or the profile), then its modifiers in order,
    or the feedback loop over its static method."""
    if spec.needs_profile and profile is None:
        raise ValueError(f"method {spec.name!r} needs a calibration profile: pass --profile (see `kvguard calibrate`)")
    if spec.live:
        return live_method(spec, profile)
    method = _base(spec, profile)
    for i, modifier in enumerate(spec.modifiers):
        method = _modified(method, modifier, spec.prefix(i + 1))
    return method


def _base(spec: MethodSpec, profile) -> Method:
    """The method ``spec``'s modifiers apply to: the profile's plan or frontier plan, an FP8 method, or a
    registered one."""
    name = spec.prefix(0)
    if spec.base == method_spec.KVGUARD:
        return from_profile(profile) if spec.budget is None else frontier_method(name, profile)
    if spec.base in FP8_METHODS:
        if profile is None:
            raise ValueError(f"method {name!r} needs a calibration profile: pass --profile (its scales are what "
                             f"`kvguard export` writes)")
        return fp8_method(spec.base, profile)
    try:
        return METHODS[spec.base]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid methods are [{', '.join(METHODS)}, {method_spec.KVGUARD}, "
                         f"{method_spec.KVGUARD}@<bytes>, {method_spec.LIVE}, {method_spec.LIVE}:<static method>, "
                         f"{', '.join(FP8_METHODS)}, <static method>+{'|'.join(method_spec.MODIFIERS)}]") from None


def _modified(base: Method, modifier: Modifier, name: str) -> Method:
    """``base`` (a static kvguard plan) with ``modifier``'s change, called ``name``."""
    if not base.simulatable:
        raise ValueError(f"{name!r}: +{modifier.value} applies to a static kvguard plan; {base.name!r} is not one")
    if modifier.needs_scales and base.scales is None:
        raise ValueError(f"{name!r}: +{modifier.value} stores the window under calibrated INT8 scales, which "
                         f"{base.name!r} has none of; apply it to kvguard or kvguard@<bytes> (with --profile)")
    return Method(name, f"{base.description}; {modifier.description}", lambda arch: modifier.apply(base.plan(arch)),
                  scales=base.scales)


def live_method(spec: MethodSpec, profile) -> Method:
    """``kvguard-live`` (the profile's plan) or ``kvguard-live:<static method>`` (that method's plan) under the
    feedback loop, with the profile's baseline, classifier and thresholds and a backing tier."""
    base = build(spec.over, profile)
    if not base.simulatable:
        raise ValueError(f"{spec.name!r}: the loop runs over a kvguard plan; {spec.over.name!r} is not one "
                         f"({base.description})")
    return Method(spec.name, f"feedback loop over {spec.over.name} (entropy monitor, selective recomputation, "
                             f"dynamic precision, rollback; backing tier)", base.plan, scales=profile.static_scales(),
                  profile=profile, live=True, backing=BackingConfig(enabled=True))


def kv_bytes(cache) -> tuple[int, int]:
    """``(stored bytes, FP16 bytes of the same shape)`` of any cache the methods make."""
    if hasattr(cache, "fp16_nbytes"):
        return cache.nbytes(), cache.fp16_nbytes()
    from kvguard.peers import quantized_cache

    return quantized_cache.cache_nbytes(cache), quantized_cache.fp16_nbytes(cache)
