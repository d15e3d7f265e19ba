"""KVGuardCache: a mixed-precision, quantized KV cache that is a real ``transformers`` ``Cache``.

    cache = KVGuardCache(model.config, precision="int4")          # or one precision per layer / per KV head
    out = model.generate(**inputs, past_key_values=cache)
    cache.nbytes() / cache.fp16_nbytes()                           # measured bytes vs an FP16 cache

Layers follow the model's ``layer_types``: sliding-window layers (Gemma 3) get
:class:`~kvguard.cache_layer.KVGuardSlidingLayer`, the others :class:`~kvguard.cache_layer.KVGuardLayer`.

With ``backing=BackingConfig(enabled=True, max_bytes=...)`` the cache also keeps the full-precision originals
of the tokens it quantizes in a bounded store one level down (:mod:`kvguard.backing`: a file for a CPU cache,
pinned host memory for one on an accelerator); ``restore`` puts them back into a layer's overlay bit for bit.

**Every tier counted.** :meth:`KVGuardCache.memory` gives the bytes of each tier apart (:class:`MemoryUse`): the
hot cache (sinks, codes, scales, window), the overlay, the backing tier in RAM and on disk. A byte resident in RAM
is a byte used, whatever tier holds it: "memory saved" is ``1 - ram / fp16``, not ``1 - hot / fp16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import Cache

from kvguard.backing import BackingConfig, BackingStore
from kvguard.cache_layer import KVGuardLayer, KVGuardSlidingLayer
from kvguard.config import CacheConfig
from kvguard.architecture import Architecture
from kvguard.precision import Precision
from kvguard.rope import Rope

PrecisionLike = "Precision | str | Sequence[Precision | str]"


MIB = 2**20


@dataclass(frozen=True)
class MemoryUse:
    """The bytes a cache (or several) holds, tier by tier, against an FP16 cache of the same tokens.

    Attributes:
        hot: sinks, codes, scales, zero points, rotation signs, window: what attention reads every step.
        overlay: full-precision K/V (and positions) that compensation wrote over codes.
        backing_ram / backing_disk: the backing tier's originals, in memory / in its file.
        fp16: what an FP16 cache of the same tokens would take.
    """

    hot: int = 0
    overlay: int = 0
    backing_ram: int = 0
    backing_disk: int = 0
    fp16: int = 0

    @property
    def kv(self) -> int:
        """The cache's own tensors: hot plus overlay (``nbytes``)."""
        return self.hot + self.overlay

    @property
    def ram(self) -> int:
        """Every tier resident in RAM: hot, overlay and the backing tier's memory."""
        return self.hot + self.overlay + self.backing_ram

    def ratio(self, nbytes: int) -> float:
        return nbytes / self.fp16 if self.fp16 else 1.0

    @property
    def saved(self) -> float:
        """The memory saved against FP16, counting every tier in RAM."""
        return 1.0 - self.ratio(self.ram)

    def __add__(self, other: "MemoryUse") -> "MemoryUse":
        return MemoryUse(self.hot + other.hot, self.overlay + other.overlay, self.backing_ram + other.backing_ram,
                         self.backing_disk + other.backing_disk, self.fp16 + other.fp16)

    def to_json(self) -> dict:
        return {"hot_bytes": self.hot, "overlay_bytes": self.overlay, "backing_ram_bytes": self.backing_ram,
                "backing_disk_bytes": self.backing_disk, "kv_bytes": self.kv, "ram_bytes": self.ram,
                "fp16_bytes": self.fp16,
                "kv_bytes_ratio": self.ratio(self.kv), "ram_bytes_ratio": self.ratio(self.ram),
                "disk_bytes_ratio": self.ratio(self.backing_disk), "memory_saved": self.saved}

    def describe(self) -> str:
        """One line: each tier in MiB, RAM against FP16, and the disk tier apart."""
        text = f"hot {self.hot / MIB:.1f} MiB"
        if self.overlay:
            text += f" + overlay {self.overlay / MIB:.2f} MiB"
        if self.backing_ram:
            text += f" + originals in RAM {self.backing_ram / MIB:.1f} MiB"
        text += f" = {self.ram / MIB:.1f} MiB in RAM, {self.ratio(self.ram):.3f} of FP16's {self.fp16 / MIB:.1f} MiB"
        if self.backing_disk:
            text += f"; originals on disk {self.backing_disk / MIB:.1f} MiB"
        return text


class KVGuardCache(Cache):
    """Quantized KV cache with per-layer and per-KV-head precision.

    Args:
        config: the model's config (``model.config``) or an :class:`~kvguard.architecture.Architecture`.
        precision: one precision for every layer (``"fp16"``, ``"int8"``, ``"int4"``, ``"int2"``), or a list
            with one entry per layer, each a precision or a list of per-KV-head precisions.
        cache_config: layout knobs (window, sinks, group size, storage dtype); see :class:`CacheConfig`.
        backing: keep the originals of quantized tokens for exact restores (:class:`~kvguard.backing.BackingConfig`;
            ``None`` or disabled: not kept).
        rope: the model's RoPE, needed with ``cache_config.prerope_keys`` (``None``: read from ``config``, which
            must then be the model's config, not an ``Architecture``).
    """

    def __init__(self, config, precision: "PrecisionLike | Sequence[PrecisionLike]" = Precision.INT4,
                 cache_config: CacheConfig | None = None, backing: BackingConfig | None = None,
                 rope: Rope | None = None):
        arch = Architecture.from_config(config)
        self.architecture = arch
        self.cache_config = cache_config or CacheConfig()
        if self.cache_config.prerope_keys and rope is None:
            rope = Rope.from_config(config)
        self.backing = BackingStore(backing) if backing is not None and backing.enabled else None
        per_layer = _per_layer(precision, arch.num_layers)
        layers: list[KVGuardLayer] = []
        for idx, p in enumerate(per_layer):
            if arch.is_sliding(idx):
                layers.append(KVGuardSlidingLayer(p, self.cache_config, idx, sliding_window=arch.sliding_window,
                                                  backing=self.backing, rope=rope))
            else:
                layers.append(KVGuardLayer(p, self.cache_config, idx, self.backing, rope))
            if isinstance(layers[-1].precision, tuple) and len(layers[-1].precision) != arch.num_kv_heads:
                raise ValueError(
                    f"layer {idx}: {len(layers[-1].precision)} per-head precisions given, the model has "
                    f"{arch.num_kv_heads} KV heads"
                )
        super().__init__(layers=layers)

    def _layer(self, layer: int) -> KVGuardLayer:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer index {layer} out of range [0, {len(self.layers)})")
        return self.layers[layer]

    def set_precision(self, layer: int, precision: PrecisionLike) -> None:
        """Change the format of layer ``layer`` for tokens stored from now on (one, or one per KV head)."""
        self._layer(layer).set_precision(precision)

    def precisions(self) -> list["Precision | tuple[Precision, ...]"]:
        """The current precision of every layer (a tuple where heads differ)."""
        return [layer.precision for layer in self.layers]

    def write_fp(self, layer: int, positions, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite absolute ``positions`` of ``layer`` with full-precision K/V (``[B, H_kv, P, D]``)."""
        self._layer(layer).write_fp(positions, keys, values)

    def restore(self, layer: int, positions) -> torch.Tensor:
        """Write the backed originals of absolute ``positions`` into ``layer``'s overlay, bit for bit; returns the
        positions restored (the rest are missing from the backing: evicted, not quantized, or none kept)."""
        return self._layer(layer).restore(positions)

    def reencode(self, layer: int, max_extra_bytes: int | None = None) -> int:
        """Store ``layer``'s history again at the tiers it stores new tokens in, from the originals the backing
        holds (:meth:`KVGuardLayer.reencode <kvguard.cache_layer.KVGuardLayer.reencode>`); returns the positions
        re-encoded (0: none held, or more than ``max_extra_bytes`` bytes it would add)."""
        return self._layer(layer).reencode(max_extra_bytes)

    def backing_bytes(self, layer: int | None = None) -> int:
        """Bytes of the backing tier (the originals of quantized tokens), for one layer or the whole cache;
        not counted in :meth:`nbytes`."""
        if layer is not None:
            return self._layer(layer).backing_nbytes()
        return 0 if self.backing is None else self.backing.nbytes()

    def memory(self) -> MemoryUse:
        """The bytes of every tier this cache holds (:class:`MemoryUse`)."""
        overlay = sum(l.overlay_nbytes() for l in self.layers)
        ram = 0 if self.backing is None else self.backing.ram_nbytes()
        disk = 0 if self.backing is None else self.backing.disk_nbytes()
        return MemoryUse(self.nbytes() - overlay, overlay, ram, disk, self.fp16_nbytes())

    def nbytes(self, layer: int | None = None) -> int:
        """Measured bytes of every stored tensor, for one layer or the whole cache (the hot tier: the backing
        tier is :meth:`backing_bytes`)."""
        if layer is not None:
            return self._layer(layer).nbytes()
        return sum(l.nbytes() for l in self.layers)

    def fp16_nbytes(self, layer: int | None = None) -> int:
        """Bytes an FP16 cache of the same shape would take, for one layer or the whole cache."""
        if layer is not None:
            return self._layer(layer).fp16_nbytes()
        return sum(l.fp16_nbytes() for l in self.layers)

    def bytes_ratio(self) -> float:
        """``nbytes() / fp16_nbytes()`` (1.0 while empty)."""
        ref = self.fp16_nbytes()
        return self.nbytes() / ref if ref else 1.0


def _per_layer(precision, num_layers: int) -> list:
    if isinstance(precision, (str, Precision)):
        return [precision] * num_layers
    precision = list(precision)
    if len(precision) != num_layers:
        raise ValueError(f"{len(precision)} layer precisions given, the model has {num_layers} layers")
    return precision
