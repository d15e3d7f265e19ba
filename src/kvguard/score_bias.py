"""The softmax bias of key quantization noise, corrected analytically (``CacheConfig.score_correction``).

Rounding noise ``n`` on a stored key adds ``q . n`` to its attention score. Taken as zero-mean noise of variance
``Delta_d^2 / 12`` per channel (uniform rounding with step ``Delta_d``), the score's noise has variance
``s^2 = sum_d q_d^2 Delta_d^2 / 12`` (``q`` already times the score scaling), and it inflates the key's expected
softmax weight by ``exp(s^2 / 2)`` (the mean of a log-normal): keys stored with coarse steps draw more attention
than they should. The correction subtracts ``s^2 / 2`` from the score of every quantized key. It stores nothing:
``Delta`` is the scale the cache keeps for the key's group anyway, and for a rotated side the query is the
rotated one, as the keys are. Measured on / off in ``benchmarks/softmax_bias.py`` (in the history: commit 9242d86).

It applies to keys below INT8 (INT8's step is two orders of magnitude below INT2's, its bias negligible) and
never to full-precision keys: sinks, the window, FP16 heads, restored or recomputed positions.
"""

from __future__ import annotations

import torch

from kvguard.quantizer import Axis, QuantizedTensor, QuantSpec


def applies(spec: QuantSpec) -> bool:
    """Whether keys stored with ``spec`` are corrected (dynamic scales below INT8)."""
    return not spec.static and spec.precision.bits < 8


def corrects(precisions) -> bool:
    """Whether turning the correction on changes a plan whose KV heads store keys at ``precisions``: some are
    below INT8 (only INT8 keys use static scales, and INT8 and FP16 are never corrected)."""
    return any(p.is_quantized and applies(QuantSpec(p, Axis.CHANNEL)) for p in precisions)


def _variance(scale: torch.Tensor) -> torch.Tensor:
    """``Delta^2 / 12`` per stored scale: the variance of uniform rounding with step ``Delta``."""
    return scale.to(torch.float32).square() / 12.0


def step_variance(scale: torch.Tensor, spec: QuantSpec, tokens: int, dim: int) -> torch.Tensor:
    """``[..., tokens, dim]``: the rounding-noise variance ``Delta^2 / 12`` of every element quantized with
    ``spec`` whose scales are ``scale`` (per channel and group of tokens for keys, per token and group of
    channels for values)."""
    var = _variance(scale)
    if spec.axis is Axis.CHANNEL:
        return var.repeat_interleave(spec.group_size, dim=-2)[..., :tokens, :]
    return var.repeat_interleave(spec.group_size, dim=-1)[..., :dim]


def correction(query: torch.Tensor, keys: QuantizedTensor) -> torch.Tensor:
    """``[B, h, R, T]``: what to add to the scores of the ``R`` query rows ``query`` (``[B, h, R, D]``, float32,
    times the score scaling, in the keys' basis) against the stored ``keys`` (``[B, h, T, D]``).

    The torch form of what the fused decode kernels add themselves (``key_scores(..., correct)``): the reference
    their tests compare with; the simulation uses :func:`step_variance`."""
    tokens, dim = keys.shape[-2:]
    q2 = query.square()
    if keys.spec.axis is Axis.CHANNEL:
        # One step per channel and group: one small product per group, then repeated over its tokens.
        per_group = q2 @ _variance(keys.scales()).transpose(-1, -2)  # [B, h, R, T / G]
        return -0.5 * per_group.repeat_interleave(keys.spec.group_size, dim=-1)[..., :tokens]
    return -0.5 * (q2 @ step_variance(keys.scales(), keys.spec, tokens, dim).transpose(-1, -2))
