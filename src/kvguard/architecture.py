"""What the KV cache needs to know about a model: layers, heads, head size, which layers slide.

Read from a transformers config (or a multimodal config's ``text_config``), so the cache, the simulation, the
monitor and calibration never look at modeling code. Decoders name their layers in one of two ways, and both
are read as transformers' own ``DynamicCache`` reads them:

- ``layer_types`` (Gemma 2 / 3, Qwen2 / 3): per layer, ``full_attention`` or ``sliding_attention``;
- no ``layer_types`` (Mistral, Phi-3, Llama): every layer slides when the config sets ``sliding_window``, for
  their models build one sliding-window mask for all layers; otherwise every layer is full.

A layer of any other type (Qwen3-Next's ``linear_attention``, which holds a recurrent state, not keys and
values) is refused, naming the model type and the layer, when the architecture is read.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
# Layer types whose attention sees only a recent window of keys (Gemma 3's local layers, Llama 4's chunks).
SLIDING_TYPES = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class Architecture:
    """The attention shape of a decoder.

    Attributes:
        model_type: transformers' ``model_type`` (``llama``, ``gemma3_text``, ...).
        num_layers: attention layers, each with its own cache layer.
        num_query_heads / num_kv_heads: grouped-query attention reads KV head ``i // (Hq / Hkv)`` for query head ``i``.
        head_dim: channels per head.
        layer_types: one entry per layer, ``full_attention`` or one of :data:`SLIDING_TYPES`.
        sliding_window: keys a sliding layer's query sees (``None`` without sliding layers).
    """

    model_type: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @classmethod
    def from_config(cls, config) -> "Architecture":
        """From a transformers config (an ``Architecture`` is returned as is)."""
        if isinstance(config, Architecture):
            return config
        config = getattr(config, "text_config", None) or config
        num_layers = config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or [SLIDING_TYPES[0] if window else FULL_ATTENTION] * num_layers
        sliding = window if any(t in SLIDING_TYPES for t in layer_types) else None
        return cls(
            model_type=config.model_type,
            num_layers=num_layers,
            num_query_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            sliding_window=sliding,
        )

    def __post_init__(self) -> None:
        supported = (FULL_ATTENTION, *SLIDING_TYPES)
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in supported:
                raise ValueError(f"{self.model_type}: layer {i} has type {layer_type!r}, which kvguard's caches cannot "
                                 f"store; supported layer types: [{', '.join(repr(t) for t in supported)}]")
        if self.sliding_window is None and any(t in SLIDING_TYPES for t in self.layer_types):
            raise ValueError(f"{self.model_type}: the config has sliding-window layers but no sliding_window")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_query_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window."""
        return self.layer_types[layer] in SLIDING_TYPES

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sliding(i))

    def layer_type_summary(self) -> str:
        counts: dict[str, int] = {}
        for t in self.layer_types:
            counts[t] = counts.get(t, 0) + 1
        return ", ".join(f"{n}x {t}" for t, n in counts.items())
