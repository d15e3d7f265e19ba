"""The model's rotary position embedding (RoPE), for caches that store keys before it.

The attention module applies RoPE to keys before the cache sees them: each pair of channels ``(i, i + D/2)`` is
turned by ``position * inv_freq[i]``. Within a group of tokens quantized per channel, a fast-turning pair's two
channels trade values back and forth, so each channel's range spans both. KVQuant therefore quantizes keys before
RoPE. A cache with :attr:`~kvguard.config.CacheConfig.prerope_keys` undoes the turn of each key it quantizes below
INT8 (:func:`unrope`, an exact rotation per pair up to float rounding), stores that, and turns what it reads back
to its position again (:func:`rerope`). The bytes do not change.

Only the default RoPE (``rope_type == "default"``, full rotary dimension) is rebuilt here, exactly as transformers
builds it (``inv_freq = base ** -(2i / D)``, the angles in float32); other kinds are refused when read, naming
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    """The default RoPE of every attention layer.

    Attributes:
        bases: per layer, the base (``rope_theta``) of its angles; Gemma 3's sliding and full layers differ.
        head_dim: channels per head, all of them turned.
    """

    bases: tuple[float, ...]
    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"RoPE turns pairs of channels: head_dim must be even, got {self.head_dim}")
        if not self.bases or any(not b > 1.0 for b in self.bases):
            raise ValueError(f"RoPE bases must be > 1, got {self.bases}")

    @classmethod
    def from_config(cls, config) -> "Rope":
        """From a transformers config (a multimodal config's ``text_config``): ``rope_parameters``, either one
        entry for every layer or one per layer type (Gemma 3)."""
        config = getattr(config, "text_config", None) or config
        params = getattr(config, "rope_parameters", None)
        if params is None:
            raise ValueError(f"{type(config).__name__} has no rope_parameters: keys cannot be stored before RoPE "
                             "without the model's RoPE")
        n = config.num_hidden_layers
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        per_type = "rope_theta" not in params
        bases = []
        for i, kind in enumerate(types):
            p = params[kind] if per_type else params
            _check_default(p, f"{config.model_type} layer {i} ({kind})")
            bases.append(float(p["rope_theta"]))
        factor = getattr(config, "partial_rotary_factor", None)
        if factor not in (None, 1.0):
            raise ValueError(f"{config.model_type}: partial_rotary_factor={factor}; pre-RoPE keys need every channel "
                             "turned")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(tuple(bases), head_dim)

    def tables(self, layer: int, start: int, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[n, D]`` (float32) of layer ``layer`` at positions ``start .. start + n - 1``, as the
        model's rotary embedding computes them."""
        d = self.head_dim
        inv_freq = 1.0 / (self.bases[layer] ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        positions = torch.arange(start, start + n, device=device).float()
        angles = positions[:, None] * inv_freq[None, :]  # [n, D/2]
        emb = torch.cat((angles, angles), dim=-1)  # [n, D]: channel i and i + D/2 turn together
        return emb.cos(), emb.sin()


def _check_default(params: dict, where: str) -> None:
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"{where} uses rope_type {kind!r}; pre-RoPE keys support only 'default'")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: ``x`` ``[..., n, D]`` turned by the angles of :meth:`Rope.tables` (``[n, D]``)."""
    return x * cos + _rotate_half(x) * sin


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rerope`: ``x`` ``[..., n, D]`` turned back by the same angles."""
    return x * cos - _rotate_half(x) * sin
