"""Randomized Hadamard rotation of K/V before quantization.

A KV head's vectors ``x`` (``[..., D]``) are stored as ``quantize(x @ R)`` and read back as
``dequantize(...) @ R.T``, with ``R = diag(s) H / sqrt(D)``: ``H`` the Sylvester Hadamard matrix, ``s`` a
random sign per channel, one sign vector per KV head. ``R`` is orthonormal, so full-precision storage with
rotation equals storage without it up to float rounding, and attention (``q . k``, ``p @ v``) is unchanged.
What changes is quantization: the rotation spreads a channel's outlier over all channels, so a per-token
group (values; llama.cpp's q4_0 blocks) sees a flatter range (QuaRot, llama.cpp's rotated KV cache). It
competes with per-channel key grouping, which already isolates outlier channels, so calibration chooses it per
layer and side.

The signs come from a fixed seed, so the cache, the simulation and every process agree on ``R`` without storing
it; a plan records only which layers and sides are rotated (``D`` sign bits per head, counted in the bytes).
"""

from __future__ import annotations

from functools import lru_cache

import torch

SEED = 0x6B76  # fixed: every reader must rebuild the same rotation


def _hadamard(d: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``d`` (a power of two), entries +-1, float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=64)
def _signs(head_dim: int, num_heads: int, layer: int) -> torch.Tensor:
    _hadamard(head_dim)  # refuse a head_dim the transform cannot take
    gen = torch.Generator().manual_seed(SEED + 7919 * layer)
    return (torch.randint(0, 2, (num_heads, head_dim), generator=gen) * 2 - 1).to(torch.float32)


def signs(head_dim: int, num_heads: int, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[H_kv, D]`` random signs of ``layer``'s KV heads (float32 +-1): ``R = diag(s) H / sqrt(D)``."""
    return _signs(head_dim, num_heads, layer).to(device)


def matrix(head_dim: int, num_heads: int, layer: int) -> torch.Tensor:
    """The orthonormal ``[H_kv, D, D]`` rotation matrices (float32), for references and engines that store them."""
    h = _hadamard(head_dim) / head_dim ** 0.5
    return (_signs(head_dim, num_heads, layer).to(torch.float64).unsqueeze(-1) * h).to(torch.float32)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last axis (Sylvester order), by butterflies: only elementwise adds, so the result is
    the same bit for bit whatever the batch shape (a matmul's blocking would vary the rounding)."""
    *lead, d = x.shape
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)  # [..., blocks, (top, bottom), h]
        out = torch.empty_like(pairs)
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 0, :])  # written in place: no stacked copy
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 1, :])
        x = out.reshape(*lead, d)
        h *= 2
    return x


def rotate(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x @ R`` per head: ``x`` ``[B, h, T, D]``, ``s`` the heads' ``[h, D]`` signs -> float32 ``[B, h, T, D]``."""
    return _fwht(x.to(torch.float32) * s.unsqueeze(-2)) * x.shape[-1] ** -0.5


def unrotate(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate` (``x @ R.T``; ``H`` is symmetric), float32."""
    return _fwht(x.to(torch.float32)) * x.shape[-1] ** -0.5 * s.unsqueeze(-2)


def sign_bytes(head_dim: int, num_heads: int) -> int:
    """Bytes a stored rotation would take: one sign bit per channel and head (the seed makes it free here,
    but an engine without the seed needs it)."""
    return (head_dim * num_heads + 7) // 8
