"""A static quantization plan: what every layer and KV head stores, and how.

A plan is what calibration produces and what the cache and the fast simulation both consume, so one object
describes a method exactly whichever way it is evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvguard.config import CacheConfig
from kvguard.architecture import Architecture
from kvguard.precision import Precision, value_tiers
from kvguard.rope import Rope
from kvguard.store import Format


MAX_VALUE_DROP = 2  # INT4 keys with INT2 values; lower than that is where keys are INT2 anyway


@dataclass(frozen=True)
class LayerPlan:
    """One layer: a precision per KV head, the clipping ratios of its quantization ranges, whether its
    keys / values are Hadamard-rotated before quantization (heads below INT8 only; :mod:`kvguard.rotation`),
    and per head how many tiers below its keys the values are stored (``value_drop``; heads below INT8 only,
    see :meth:`Precision.below`: ``(1,)`` on an INT3 head stores INT3 keys and INT2 values). ``precision`` is
    the keys' tier, the one the run-time loop raises and lowers; the values follow it at the same distance."""

    precision: tuple[Precision, ...]
    key_clip: float = 1.0
    value_clip: float = 1.0
    key_rotation: bool = False
    value_rotation: bool = False
    value_drop: tuple[int, ...] = ()  # empty: values at the keys' tier on every head

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", tuple(Precision.parse(p) for p in self.precision))
        if not self.precision:
            raise ValueError("a LayerPlan needs at least one KV head precision")
        for name in ("key_clip", "value_clip"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        object.__setattr__(self, "value_drop", _normalized_drop(self.precision, self.value_drop))

    @property
    def uniform(self) -> Precision | None:
        """The layer's precision when all heads share it, else ``None``."""
        return self.precision[0] if len(set(self.precision)) == 1 else None

    @property
    def value_precision(self) -> tuple[Precision, ...]:
        """The tier each KV head stores its values in."""
        return value_tiers(self.precision, self.value_drop)

    def format(self) -> Format:
        """How a cache layer stores this layer's tokens (:class:`~kvguard.store.Format`)."""
        return Format(self.uniform or self.precision, self.key_clip, self.value_clip, self.key_rotation,
                      self.value_rotation, self.value_drop)


def _normalized_drop(precision: tuple[Precision, ...], drop) -> tuple[int, ...]:
    """``drop`` checked against the heads, with the drops that change nothing (keys at INT8 / FP16 or already at
    INT2) set to 0, and ``()`` when none is left: two plans that store the same thing compare equal."""
    drop = tuple(int(d) for d in drop)
    if not drop:
        return ()
    if len(drop) != len(precision):
        raise ValueError(f"value_drop has {len(drop)} entries, the layer has {len(precision)} KV heads")
    if any(not 0 <= d <= MAX_VALUE_DROP for d in drop):
        raise ValueError(f"value_drop entries must be in [0, {MAX_VALUE_DROP}], got {list(drop)}")
    drop = tuple(d if p.below(d) is not p else 0 for p, d in zip(precision, drop))
    return drop if any(drop) else ()


@dataclass(frozen=True)
class StaticScales:
    """Calibrated INT8 ranges: ``absmax`` per layer, KV head and channel, ``[layers, H_kv, D]`` each.
    INT8 heads quantize with ``scale = clip * absmax / 127`` from these instead of per-group scales."""

    key_absmax: torch.Tensor
    value_absmax: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("key_absmax", "value_absmax"):
            t = getattr(self, name)
            if t.dim() != 3 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise ValueError(f"{name} must be a finite, non-negative [layers, H_kv, D] tensor, got {tuple(t.shape)}")

    def check(self, arch: Architecture) -> None:
        want = (arch.num_layers, arch.num_kv_heads, arch.head_dim)
        for name in ("key_absmax", "value_absmax"):
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(f"static scales {name} has shape {tuple(getattr(self, name).shape)}, the model needs {want}")


@dataclass(frozen=True)
class Plan:
    """Per-layer storage plan plus the cache layout it runs with."""

    layers: tuple[LayerPlan, ...]
    cache: CacheConfig = field(default_factory=CacheConfig)

    @classmethod
    def uniform(cls, arch: Architecture, precision: Precision | str, cache: CacheConfig | None = None) -> "Plan":
        """Every head of every layer at ``precision``."""
        layer = LayerPlan((Precision.parse(precision),) * arch.num_kv_heads)
        return cls((layer,) * arch.num_layers, cache or CacheConfig())

    def check(self, arch: Architecture) -> None:
        """Raise ``ValueError`` unless the plan fits ``arch`` (layer and KV head counts)."""
        if len(self.layers) != arch.num_layers:
            raise ValueError(f"plan has {len(self.layers)} layers, the model has {arch.num_layers}")
        for i, lp in enumerate(self.layers):
            if len(lp.precision) != arch.num_kv_heads:
                raise ValueError(f"plan layer {i} has {len(lp.precision)} head precisions, the model has {arch.num_kv_heads} KV heads")

    def make_cache(self, model_config, scales: StaticScales | None = None, backing=None):
        """A fresh :class:`~kvguard.cache.KVGuardCache` that stores tokens as this plan says (INT8 heads with
        calibrated ``scales`` when given; the originals of quantized tokens kept as ``backing``, a
        :class:`~kvguard.backing.BackingConfig`, says)."""
        from kvguard.cache import KVGuardCache

        arch = Architecture.from_config(model_config)
        self.check(arch)
        if scales is not None:
            scales.check(arch)
        rope = Rope.from_config(model_config) if self.cache.prerope_keys else None
        cache = KVGuardCache(arch, [lp.uniform or lp.precision for lp in self.layers], self.cache, backing, rope)
        for i, layer in enumerate(cache.layers):
            self._configure(layer, i, scales)
        return cache

    def _configure(self, layer, index: int, scales: StaticScales | None) -> None:
        lp = self.layers[index]
        layer.set_clip(lp.key_clip, lp.value_clip)
        layer.set_rotation(lp.key_rotation, lp.value_rotation)
        layer.set_value_drop(lp.value_drop)
        if scales is not None:
            layer.set_static_scales(scales.key_absmax[index], scales.value_absmax[index])

    def history_costs(self, model_config, scales: StaticScales | None = None) -> tuple[tuple[int, int], ...]:
        """Per layer ``(first, more)``: the bytes the first group of one sequence's quantized history takes in
        this plan's layout (codes, scales, zero points, rotation signs), and each group after it. Affine in the
        groups, not linear: a calibrated INT8 scale and the rotation signs are stored once. With them, what this
        plan would store for any token count is known without quantizing anything
        (``KVGuardLayer.history_nbytes`` is what a cache stores)."""
        from kvguard.cache_layer import KVGuardLayer

        arch = Architecture.from_config(model_config)
        self.check(arch)
        scales = self.sizing_scales(arch, scales)
        c = replace(self.cache, prerope_keys=False)  # where keys are turned changes no byte
        costs = []
        for i, lp in enumerate(self.layers):
            sizes = []
            for groups in (1, 2):
                layer = KVGuardLayer(lp.uniform or lp.precision, c, i)
                self._configure(layer, i, scales)
                # sinks, then the window, then exactly `groups` groups leave it
                zeros = torch.zeros(1, arch.num_kv_heads, c.sinks + c.residual + groups * c.group_size, arch.head_dim)
                layer.update(zeros, zeros)
                sizes.append(layer.history_nbytes())
            costs.append((sizes[0], sizes[1] - sizes[0]))
        return tuple(costs)

    def kv_bytes(self, model_config, tokens: int, scales: StaticScales | None = None) -> tuple[int, int]:
        """``(stored bytes, FP16 bytes of the same shape)`` of a cache built from this plan after ``tokens`` tokens
        of one sequence, without running the model: the stored sizes depend only on shapes, so zeros of the right
        shape are fed through the layers."""
        arch = Architecture.from_config(model_config)
        sizing = replace(self, cache=replace(self.cache, prerope_keys=False))  # the same bytes, no RoPE needed
        cache = sizing.make_cache(model_config, self.sizing_scales(arch, scales))
        zeros = torch.zeros(1, arch.num_kv_heads, tokens, arch.head_dim)
        for idx in range(arch.num_layers):
            cache.update(zeros, zeros, idx)
        return cache.nbytes(), cache.fp16_nbytes()

    def sizing_scales(self, arch: Architecture, scales: StaticScales | None) -> StaticScales | None:
        """``scales``, or where an 8-bit window needs some and none are given, placeholder ones: sizes depend on
        shapes only (the INT8 heads are then sized as calibrated ones, which is how such a plan runs)."""
        if scales is not None or self.cache.window_bits != 8:
            return scales
        ones = torch.ones(arch.num_layers, arch.num_kv_heads, arch.head_dim)
        return StaticScales(ones, ones)

    def with_rotation(self, keys: bool, values: bool) -> "Plan":
        """This plan with every layer's key / value rotation set."""
        layers = tuple(replace(lp, key_rotation=keys, value_rotation=values) for lp in self.layers)
        return Plan(layers, self.cache)

    def with_value_drop(self, drop: int) -> "Plan":
        """This plan with every head's values stored ``drop`` tiers below its keys (where the keys are below
        INT8; see :class:`LayerPlan`)."""
        layers = tuple(replace(lp, value_drop=(drop,) * len(lp.precision)) for lp in self.layers)
        return Plan(layers, self.cache)

    def with_window_bits(self, bits: int) -> "Plan":
        """This plan with its window stored in ``bits`` (``CacheConfig.window_bits``: 16 or 8)."""
        return Plan(self.layers, replace(self.cache, window_bits=bits))

    def with_score_correction(self, on: bool = True) -> "Plan":
        """This plan with the softmax-bias correction of quantized keys' scores on or off
        (``CacheConfig.score_correction``)."""
        return Plan(self.layers, replace(self.cache, score_correction=on))

    def with_prerope_keys(self, on: bool = True) -> "Plan":
        """This plan with its keys below INT8 stored before RoPE or after it (``CacheConfig.prerope_keys``)."""
        return Plan(self.layers, replace(self.cache, prerope_keys=on))

    def replace_layer(self, index: int, layer: LayerPlan) -> "Plan":
        """This plan with layer ``index`` replaced."""
        layers = list(self.layers)
        layers[index] = layer
        return Plan(tuple(layers), self.cache)

    def summary(self) -> str:
        """One token per layer: its tier, or the per-head tiers joined by ``/``; ``c`` marks a key clip < 1,
        ``rk`` / ``rv`` rotated keys / values, ``[v:...]`` the values' tiers where they are stored lower."""
        out = []
        for i, lp in enumerate(self.layers):
            tiers = lp.uniform.value if lp.uniform else "/".join(p.value for p in lp.precision)
            marks = (f"c{lp.key_clip:g}" if lp.key_clip < 1 else "") + ("rk" if lp.key_rotation else "")
            marks += "rv" if lp.value_rotation else ""
            if lp.value_drop:
                marks += "[v:" + "/".join(p.value for p in lp.value_precision) + "]"
            out.append(f"{i}:{tiers}" + marks)
        return " ".join(out)

    def precision_counts(self) -> dict[str, int]:
        """How many KV heads (over all layers) each precision holds: ``int3``, or ``int3/int2`` for INT3 keys over
        INT2 values."""
        counts: dict[str, int] = {}
        for lp in self.layers:
            for k, v in zip(lp.precision, lp.value_precision):
                name = k.value if k is v else f"{k.value}/{v.value}"
                counts[name] = counts.get(name, 0) + 1
        return counts

    def to_dict(self) -> dict:
        return {
            "cache": self.cache.to_dict(),
            "layers": [_layer_dict(lp) for lp in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        layers = tuple(
            LayerPlan(tuple(entry["precision"]), entry.get("key_clip", 1.0), entry.get("value_clip", 1.0),
                      bool(entry.get("key_rotation", False)), bool(entry.get("value_rotation", False)),
                      tuple(entry.get("value_drop", ())))
            for entry in data["layers"]
        )
        return cls(layers, CacheConfig.from_dict(data.get("cache", {})))


def _layer_dict(lp: LayerPlan) -> dict:
    out = {"precision": [p.value for p in lp.precision], "key_clip": lp.key_clip, "value_clip": lp.value_clip}
    # Written only when set, so plans without rotation read exactly as before.
    if lp.key_rotation:
        out["key_rotation"] = True
    if lp.value_rotation:
        out["value_rotation"] = True
    if lp.value_drop:
        out["value_drop"] = list(lp.value_drop)
    return out
