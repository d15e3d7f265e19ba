"""The KV-cache methods ``kvguard eval`` compares, by name.

- ``fp16``: the reference, an unquantized KVGuardCache storing float16.
- ``int8`` / ``int4`` / ``int3`` / ``int2``: kvguard's quantizers on every layer, no calibration, default layout
  (:class:`~kvguard.config.CacheConfig`: 4 sinks, FP window 64, group 32).
- ``<static method>+rot`` / ``+rotk`` / ``+rotv``: that plan with the Hadamard rotation
  (:mod:`kvguard.rotation`) on keys and values / keys only / values only of every layer below INT8, e.g.
  ``int3+rotv`` or ``kvguard@0.25+rot``; ``<static method>+sb``: that plan with the softmax-bias correction of
  the quantized keys' scores (:mod:`kvguard.score_bias`), e.g. ``int2+sb``; ``+nosb``: without it (calibration
  keeps it in the low-bit frontier plans where it measured a lower KL), e.g. ``kvguard@0.22+nosb``;
  ``<static method>+v1`` / ``+v2``: that plan with every head's values stored one / two tiers below its keys
  (heads below INT8, never below INT2), e.g. ``int4+rot+v1`` (INT4 keys, INT3 values); ``+v0``: values at their
  keys' tier, e.g. ``kvguard@0.24+v0`` (the calibrated plan without the values it stores lower);
  ``+w8`` / ``+w16``: the full-precision window stored as INT8 codes under the profile's calibrated scales / in
  float16 (``CacheConfig.window_bits``), e.g. ``kvguard@0.24+w16``; ``+w8`` needs a profile method;
  ``+prerope`` / ``+postrope``: keys below INT8 stored before RoPE (:mod:`kvguard.rope`) / after it
  (``CacheConfig.prerope_keys``), e.g. ``kvguard@0.30+prerope`` (not with the softmax-bias correction:
  ``kvguard@0.22+nosb+prerope``).
- ``kivi-4`` / ``kivi-2``: the KIVI recipe on kvguard's quantizers: keys per channel, values per token,
  group 32, FP window 128, no sinks.
- ``hf-quanto-4`` / ``hf-quanto-2`` / ``hf-hqq-4``: transformers' own ``QuantizedCache`` (see
  :mod:`kvguard.peers.quantized_cache`).
- ``kvguard``: the plan a calibration profile chose (``kvguard calibrate``), INT8 heads with its calibrated
  scales; needs ``--profile``.
- ``kvguard@<bytes>``: the profile's Pareto-frontier plan storing at most ``<bytes>`` of FP16 (e.g.
  ``kvguard@0.25``), a more aggressive calibrated plan; where calibration ranked the closest plans on longer text,
  the best of those that fits.
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

Static methods (a :class:`~kvguard.plan.Plan`) can be scored by the fast simulation, the ``fp8`` methods by one
pass over the stream (their cache is chunk-invariant); peers always stream, llama.cpp in ``--chunk`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvguard.architecture import Architecture
from kvguard.backing import BackingConfig
from kvguard.config import CacheConfig
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
# Methods that need a calibration profile (``--profile``).
PROFILE_METHODS = ("kvguard", "kvguard-live", "fp8", "fp8:head", "fp8:sglang", "fp8:vllm-cpu")
LIVE = "kvguard-live"
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
    try:
        budget = float(name.split("@", 1)[1])
    except ValueError:
        raise ValueError(f"{name!r}: expected kvguard@<bytes ratio>, e.g. kvguard@0.25") from None
    point = profile.meta.frontier_pick(budget)
    if point is None:
        raise ValueError(f"{name!r}: the profile's Pareto frontier has no plan at or below {budget} of FP16 "
                         f"(its points store {[round(c.memory, 3) for c in profile.meta.frontier()]})")
    plan = point.plan
    return Method(name, f"calibrated frontier plan {point.name} ({point.memory:.3f} of FP16 on held-out text)",
                  lambda arch: plan, scales=profile.static_scales())


def fp8_method(name: str, profile) -> Method:
    """``fp8``, ``fp8:head`` or ``fp8:sglang``: an engine's FP8 cache with the scales ``kvguard export`` writes."""
    kwargs, description = FP8_METHODS[name]
    return Method(name, f"{description} ({profile.model_name} profile)", fp8=fp8_scales(profile, **kwargs))


# ``+<modifier>`` -> (rotate keys, rotate values).
ROTATIONS = {"rot": (True, True), "rotk": (True, False), "rotv": (False, True)}
# ``+sb`` / ``+nosb`` -> the softmax-bias correction of quantized keys' scores (kvguard.score_bias) on / off (the
# search keeps it in the frontier plans it helps), and what the method's description says.
SCORE_CORRECTION = {"sb": (True, "softmax-bias correction of quantized keys' scores"),
                    "nosb": (False, "without the softmax-bias correction")}
# ``+v<n>`` -> every head's values stored n tiers below its keys (LayerPlan.value_drop).
VALUE_DROPS = {"v0": 0, "v1": 1, "v2": 2}
# ``+w<bits>`` -> the window's storage (CacheConfig.window_bits).
WINDOW_BITS = {"w8": 8, "w16": 16}
# ``+prerope`` / ``+postrope`` -> keys below INT8 stored before / after RoPE (CacheConfig.prerope_keys).
KEY_ROPE = {"prerope": (True, "keys below INT8 stored before RoPE"), "postrope": (False, "keys stored after RoPE")}
MODIFIERS = (*ROTATIONS, *SCORE_CORRECTION, *VALUE_DROPS, *WINDOW_BITS, *KEY_ROPE)


def modified_method(name: str, profile=None) -> Method:
    """``<static method>+rot|rotk|rotv|sb|nosb|v0|v1|v2|w8|w16|prerope|postrope``: that method's plan with keys
    and/or values rotated, with the softmax-bias correction on / off, with its values stored below their keys' tier,
    with its window in 8 or 16 bits, or with its keys stored before / after RoPE."""
    base_name, modifier = name.rsplit("+", 1)
    if modifier not in MODIFIERS:
        raise ValueError(f"{name!r}: unknown modifier {modifier!r}; valid modifiers are [{', '.join(MODIFIERS)}]")
    base = get(base_name, profile)
    if not base.simulatable:
        raise ValueError(f"{name!r}: +{modifier} applies to a static kvguard plan; {base_name!r} is not one")
    if modifier in SCORE_CORRECTION:
        on, what = SCORE_CORRECTION[modifier]
        return Method(name, f"{base.description}; {what}",
                      lambda arch: base.plan(arch).with_score_correction(on), scales=base.scales)
    if modifier in WINDOW_BITS:
        bits = WINDOW_BITS[modifier]
        if bits == 8 and base.scales is None:
            raise ValueError(f"{name!r}: +w8 stores the window under calibrated INT8 scales, which {base_name!r} has "
                             "none of; apply it to kvguard or kvguard@<bytes> (with --profile)")
        return Method(name, f"{base.description}; {bits}-bit window", lambda arch: base.plan(arch).with_window_bits(bits),
                      scales=base.scales)
    if modifier in KEY_ROPE:
        on, what = KEY_ROPE[modifier]  # a plan with the score correction refuses it (CacheConfig names both)
        return Method(name, f"{base.description}; {what}", lambda arch: base.plan(arch).with_prerope_keys(on),
                      scales=base.scales)
    if modifier in VALUE_DROPS:
        drop = VALUE_DROPS[modifier]
        what = "values at their keys' tier" if not drop else f"values {drop} tier{'s' * (drop > 1)} below their keys'"
        return Method(name, f"{base.description}; {what}", lambda arch: base.plan(arch).with_value_drop(drop),
                      scales=base.scales)
    keys, values = ROTATIONS[modifier]
    side = {"rot": "keys and values", "rotk": "keys", "rotv": "values"}[modifier]
    return Method(name, f"{base.description}; Hadamard-rotated {side}",
                  lambda arch: base.plan(arch).with_rotation(keys, values), scales=base.scales)


def get(name: str, profile=None) -> Method:
    """The method called ``name`` (profile methods from ``profile``); ``ValueError`` listing the valid names
    otherwise."""
    if "+" in name and not name.startswith(LIVE):
        return modified_method(name, profile)
    if name in FP8_METHODS:
        if profile is None:
            raise ValueError(f"method {name!r} needs a calibration profile: pass --profile (its scales are what "
                             f"`kvguard export` writes)")
        return fp8_method(name, profile)
    if name == "kvguard" or name.startswith("kvguard@") or name == LIVE or name.startswith(LIVE + ":"):
        if profile is None:
            raise ValueError(f"method {name!r} needs a calibration profile: pass --profile (see `kvguard calibrate`)")
        if name == "kvguard":
            return from_profile(profile)
        if name.startswith("kvguard@"):
            return frontier_method(name, profile)
        return live_method(name, profile)
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid methods are [{', '.join(METHODS)}, kvguard, kvguard@<bytes>, "
                         f"kvguard-live, kvguard-live:<static method>, {', '.join(FP8_METHODS)}, "
                         f"<static method>+{'|'.join(MODIFIERS)}]") from None


def live_method(name: str, profile) -> Method:
    """``kvguard-live`` (the profile's plan) or ``kvguard-live:<base>`` (a static method's plan) under the
    feedback loop."""
    base_name = name.split(":", 1)[1] if ":" in name else "kvguard"
    if base_name.startswith(LIVE):
        raise ValueError(f"{name!r}: the loop runs over a static method, not over another live one")
    base = get(base_name, profile)
    if not base.simulatable:
        raise ValueError(f"{name!r}: the loop runs over a kvguard plan; {base_name!r} is not one ({base.description})")
    return Method(name, f"feedback loop over {base_name} (entropy monitor, selective recomputation, dynamic "
                        f"precision, rollback; backing tier)", base.plan, scales=profile.static_scales(), profile=profile,
                  live=True, backing=BackingConfig(enabled=True))


def kv_bytes(cache) -> tuple[int, int]:
    """``(stored bytes, FP16 bytes of the same shape)`` of any cache the methods make."""
    if hasattr(cache, "fp16_nbytes"):
        return cache.nbytes(), cache.fp16_nbytes()
    from kvguard.peers import quantized_cache

    return quantized_cache.cache_nbytes(cache), quantized_cache.fp16_nbytes(cache)
