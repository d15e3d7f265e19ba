"""Parallel simulation of token-by-token decoding through a :class:`~kvguard.cache.KVGuardCache`.

Feeding ``T`` tokens one at a time through the cache costs ``T`` forward passes. For a static plan the state
the cache is in before query ``t`` depends only on ``t``, so one forward pass can show every query exactly
what chunk-1 decoding would show it:

- key/value ``j == t`` (the token itself): as the model computed it;
- ``j < sinks``, or ``j`` not yet in a quantized group: the stored full-precision copy (``fp_dtype``);
- ``j`` in group ``k`` (positions ``[S + kG, S + (k+1)G)``): quantized once the window has moved past it,
  i.e. for queries ``t >= S + R + (k+1)G`` (``S`` sinks, ``R`` residual, ``G`` group size).

Each attention layer therefore scores every query against both versions of every key and picks per
(query, key) pair. The hook is transformers' ``AttentionInterface`` (plus a matching mask function), so no
modeling code is forked. Memory is ``O(heads * T^2)`` per layer, as for eager attention.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvguard.models import Architecture
from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantSpec, quantize

ATTN_NAME = "kvguard_simulation"


# The plan (and calibrated INT8 scales) the registered attention function simulates; set only inside
# ``simulation()``.
_ACTIVE_PLAN: contextvars.ContextVar[tuple[Plan, StaticScales | None] | None] = contextvars.ContextVar(
    "kvguard_simulation", default=None)
# An optional observer of every simulated layer (``kvguard.signals`` records the monitor's evidence with it):
# called as ``observer(layer, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)``.
OBSERVER: contextvars.ContextVar = contextvars.ContextVar("kvguard_simulation_observer", default=None)


def quantize_switch_points(num_tokens: int, plan: Plan) -> tuple[int, torch.Tensor]:
    """``(end, switch)``: tokens ``[sinks, end)`` lie in whole quantized groups; ``switch[j]`` is the first
    query position that sees key ``j`` quantized (``num_tokens`` or more: never within this stream)."""
    cfg = plan.cache
    s, r, g = cfg.sinks, cfg.residual, cfg.group_size
    groups = max(0, num_tokens - s - r) // g  # groups quantized by the time all tokens are stored
    end = s + groups * g
    switch = torch.full((num_tokens,), num_tokens, dtype=torch.long)
    if groups:
        k = torch.arange(groups * g) // g
        switch[s:end] = s + r + (k + 1) * g
    return end, switch


def _quantized_copy(x: torch.Tensor, precisions, start: int, end: int, axis: Axis, group_size: int,
                    clip: float, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` with positions ``[start, end)`` replaced by their quantize-dequantize values,
    each KV head at its own precision (fp16 heads unchanged; int8 heads with the calibrated ``absmax``
    ``[H, D]`` when given)."""
    out = x.clone()
    if end <= start:
        return out
    for h, precision in enumerate(precisions):
        if precision.is_quantized:
            static = precision is Precision.INT8 and absmax is not None
            spec = QuantSpec(precision, axis, group_size, clip, static)
            amax = absmax[h].view(1, 1, 1, -1) if static else None  # one scale per channel, shared by tokens
            out[:, h:h + 1, start:end] = quantize(x[:, h:h + 1, start:end], spec, amax).dequantize(x.dtype)
    return out


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Attention of every query against the keys/values as chunk-1 decoding through the cache shows them."""
    active = _ACTIVE_PLAN.get()
    if active is None:
        raise RuntimeError(f"the {ATTN_NAME!r} attention only runs inside kvguard.simulate.simulation()")
    plan, scales = active
    layer_idx = module.layer_idx
    lp = plan.layers[layer_idx]
    k_absmax = None if scales is None else scales.key_absmax[layer_idx]
    v_absmax = None if scales is None else scales.value_absmax[layer_idx]
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    if key.shape[2] != t:
        raise RuntimeError("simulation needs the whole stream in one forward pass, without a cache")
    scaling = d ** -0.5 if scaling is None else scaling
    fp_dtype = plan.cache.storage_dtype(key.dtype)
    k_fp, v_fp = key.to(fp_dtype).to(torch.float32), value.to(fp_dtype).to(torch.float32)
    end, switch = quantize_switch_points(t, plan)
    s, g = plan.cache.sinks, plan.cache.group_size
    k_q = _quantized_copy(k_fp, lp.precision, s, end, Axis.CHANNEL, g, lp.key_clip, k_absmax)
    v_q = _quantized_copy(v_fp, lp.precision, s, end, Axis.TOKEN, g, lp.value_clip, v_absmax)

    rep = hq // hkv  # grouped-query attention: query head i reads KV head i // rep

    def expand(x):  # [B, Hkv, T, D] -> [B, Hq, T, D]
        return x.repeat_interleave(rep, dim=1) if rep > 1 else x

    q32 = query.to(torch.float32)
    positions = torch.arange(t, device=query.device)
    quantized = positions[:, None] >= switch.to(query.device)[None, :]  # [T_q, T_k]
    diagonal = torch.eye(t, dtype=torch.bool, device=query.device)
    scores = torch.where(
        quantized, q32 @ expand(k_q).transpose(-1, -2), q32 @ expand(k_fp).transpose(-1, -2)
    ) * scaling
    # The query's own key is used as computed (the cache returns new tokens unrounded).
    exact_self = (q32 * expand(key.to(torch.float32))).sum(-1) * scaling  # [B, Hq, T]
    scores = torch.where(diagonal, exact_self.unsqueeze(-1), scores)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask.to(torch.float32)
    probs = torch.softmax(scores, dim=-1)
    observer = OBSERVER.get()
    if observer is not None:
        observer(layer_idx, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)
    off_diag_fp = probs.masked_fill(quantized | diagonal, 0.0)
    out = probs.masked_fill(~quantized, 0.0) @ expand(v_q) + off_diag_fp @ expand(v_fp)
    out = out + probs.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * expand(value.to(torch.float32))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, eager_mask)


@contextlib.contextmanager
def simulation(model, plan: Plan, scales: StaticScales | None = None):
    """Within this block, ``model``'s forward passes (without a cache) simulate chunk-1 decoding under ``plan``
    (INT8 heads with calibrated ``scales`` when given)."""
    arch = Architecture.from_config(model.config)
    plan.check(arch)
    if scales is not None:
        scales.check(arch)
    previous = model.config._attn_implementation
    token = _ACTIVE_PLAN.set((plan, scales))
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE_PLAN.reset(token)


@torch.no_grad()
def simulate_logits(model, input_ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
                    keep_from: int = 0) -> torch.Tensor:
    """Next-token logits ``[T - keep_from, vocab]`` (float32) for ``input_ids`` (``[T]``) as chunk-1 decoding
    through a cache built from ``plan`` (and ``scales``) would produce them, in one forward pass.
    ``keep_from``: skip the output head for earlier positions (see :func:`first_quantized_query`)."""
    ids = input_ids.reshape(1, -1).to(model.device)
    keep = ids.shape[1] - keep_from
    if not 0 < keep <= ids.shape[1]:
        raise ValueError(f"keep_from must be in [0, {ids.shape[1]}), got {keep_from}")
    with simulation(model, plan, scales):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    return logits[0, -keep:].float()


def first_quantized_query(plan: Plan) -> int:
    """The first position whose attention can see a quantized key under ``plan``: every earlier position's
    logits equal the FP16 cache's exactly, so scoring can skip them."""
    return plan.cache.sinks + plan.cache.residual + plan.cache.group_size
