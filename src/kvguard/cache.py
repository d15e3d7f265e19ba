"""KVGuardCache: a mixed-precision, quantized KV cache that is a real ``transformers`` ``Cache``.

    cache = KVGuardCache(model.config, precision="int4")          # or one precision per layer / per KV head
    out = model.generate(**inputs, past_key_values=cache)
    cache.nbytes() / cache.fp16_nbytes()                           # measured bytes vs an FP16 cache

Layers follow the model's ``layer_types``: sliding-window layers (Gemma 3) get
:class:`~kvguard.cache_layer.KVGuardSlidingLayer`, the others :class:`~kvguard.cache_layer.KVGuardLayer`.

With ``backing=BackingConfig(enabled=True, max_bytes=...)`` the cache also keeps the full-precision originals
of the tokens it quantizes in a bounded host-memory store (:mod:`kvguard.backing`); ``restore`` puts them back
into a layer's overlay bit for bit, and ``backing_bytes`` reports the store apart from ``nbytes``.
"""

from __future__ import annotations

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
