"""Parallel simulation of token-by-token decoding through a :class:`~kvguard.cache.KVGuardCache`.

Feeding ``T`` tokens one at a time through the cache costs ``T`` forward passes. For a static plan the state
the cache is in before query ``t`` depends only on ``t``, so one forward pass can show every query exactly
what chunk-1 decoding would show it:

- key/value ``j == t`` (the token itself): as the model computed it;
- ``j < sinks``, or ``j`` not yet in a quantized group: the stored full-precision copy (``fp_dtype``);
- ``j`` in group ``k`` (positions ``[S + kG, S + (k+1)G)``): quantized once the window has moved past it,
  i.e. for queries ``t >= S + R + (k+1)G`` (``S`` sinks, ``R`` residual, ``G`` group size).

Each attention layer therefore scores every query against both versions of every key and picks per
(query, key) pair, through the attention harness (:mod:`kvguard.attention`), so no modeling code is forked. Queries are
attended a block at a time (:data:`_QUERY_BLOCK`), so the temporaries are ``O(heads * block * T)`` per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from kvguard import attention, rotation, score_bias as key_noise
from kvguard.architecture import Architecture
from kvguard.config import CacheConfig, window_scale
from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision
from kvguard.quantizer import Axis, QuantSpec, quantize, static_int8_codes
from kvguard.rope import Rope, rerope, unrope

# Called for every simulated layer (``kvguard.calibration.signals`` records the monitor's evidence with it):
# ``observer(layer, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)``.
Observer = Callable[..., None]
# How one KV head's quantized span is stored and read back, ``codec(x, spec, layer, keys) -> x'`` (``x`` float32
# ``[B, 1, T, D]``, after the rotation when the plan rotates that side). ``None``: the quantizer's own round
# trip, as the cache stores it. Storage formats are measured through here before the cache learns them
# (``benchmarks/codebook_outliers.py``).
Codec = Callable[[torch.Tensor, QuantSpec, int, bool], torch.Tensor]
# A correction added to the attention scores of keys that have left the full-precision window (not sinks, not the
# query's own key), ``score_bias(layer, query, k_fp) -> [B, H_q, T, T]`` (``query`` float32 ``[B, H_q, T, D]``,
# already times the score scaling; ``k_fp`` the stored full-precision keys ``[B, H_kv, T, D]``; 0 where a head
# stays FP16): how an analytic
# correction of the softmax is measured before the cache learns it (``benchmarks/softmax_bias.py``).
ScoreBias = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _round_trip(x: torch.Tensor, spec: QuantSpec, absmax: torch.Tensor | None, codec: Codec | None, layer: int,
                keys: bool) -> torch.Tensor:
    if codec is None or spec.static:
        return quantize(x, spec, absmax).dequantize(torch.float32)
    return codec(x.to(torch.float32), spec, layer, keys)


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


def _quantized_copy(x: torch.Tensor, precisions, start: int, end: int, axis: Axis, cache: CacheConfig,
                    clip: float, absmax: torch.Tensor | None = None, rot: torch.Tensor | None = None,
                    codec: Codec | None = None, layer: int = 0,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` with positions ``[start, end)`` replaced by their quantize-dequantize values,
    each KV head at its own precision (fp16 heads unchanged; int8 heads with the calibrated ``absmax``
    ``[H, D]`` when given; heads below INT8 through the rotation with the ``[H, D]`` signs ``rot`` when given, as the
    ``cache`` layout stores them; and, given ``rope`` (the ``cos`` / ``sin`` ``[T, D]`` of positions ``0..T-1``),
    stored before RoPE: turned back before quantizing and turned again when read, as ``prerope_keys`` stores
    keys)."""
    out = x.clone()
    if end <= start:
        return out
    for h, precision in enumerate(precisions):
        if precision.is_quantized:
            static = precision is Precision.INT8 and absmax is not None
            spec = cache.quant_spec(precision, axis, clip, static)
            amax = absmax[h].view(1, 1, 1, -1) if static else None  # one scale per channel, shared by tokens
            part = x[:, h:h + 1, start:end]  # [B, 1, T', D]
            keys = axis is Axis.CHANNEL
            turned = rope is not None and precision.bits < 8
            if turned:
                cos, sin = rope[0][start:end], rope[1][start:end]  # [T', D]
                part = unrope(part, cos, sin)
            if rot is not None and precision.bits < 8:
                r = rot[h:h + 1]
                read = rotation.unrotate(_round_trip(rotation.rotate(part, r), spec, None, codec, layer, keys), r)
            else:
                read = _round_trip(part, spec, amax, codec, layer, keys)
            if turned:
                read = rerope(read, cos, sin)
            out[:, h:h + 1, start:end] = read.to(x.dtype)
    return out


def _window_round(x: torch.Tensor, absmax: torch.Tensor, sinks: int, fp_dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` (float32 of ``fp_dtype`` values) past the sinks as an 8-bit window stores and reads it
    (``KVGuardLayer.window_tensors``): INT8 codes under the calibrated ``absmax`` ``[H, D]`` times
    :data:`~kvguard.config.WINDOW_HEADROOM`, decoded through ``fp_dtype``. Every token passes through the window,
    so the history is quantized from these too."""
    scale = window_scale(absmax.to(x.device))  # [1, H, 1, D]
    codes = static_int8_codes(x[:, :, sinks:], scale)
    return torch.cat([x[:, :, :sinks], (codes * scale).to(fp_dtype).to(torch.float32)], dim=2)


def _key_step_variance(k_fp: torch.Tensor, precisions, start: int, end: int, cache: CacheConfig, clip: float,
                       rot: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, T, D]``: the rounding-noise variance of every key element positions ``[start, end)`` store, in the
    rotated basis where the keys are rotated; 0 where :func:`kvguard.score_bias.applies` says no correction."""
    var = torch.zeros_like(k_fp)
    for h, precision in enumerate(precisions):
        if end <= start or not precision.is_quantized:
            continue
        spec = cache.quant_spec(precision, Axis.CHANNEL, clip)
        if not key_noise.applies(spec):
            continue
        part = k_fp[:, h:h + 1, start:end]  # [B, 1, T', D]
        if rot is not None:
            part = rotation.rotate(part, rot[h:h + 1])
        scale = quantize(part, spec).scales()
        var[:, h:h + 1, start:end] = key_noise.step_variance(scale, spec, end - start, k_fp.shape[-1])
    return var


def _score_noise(query: torch.Tensor, k_fp: torch.Tensor, plan: Plan, layer: int, end: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two factors of :mod:`kvguard.score_bias`'s correction of every (query, key) score, as the cache applies
    it to keys read from their codes: ``-0.5 * q2 @ var.T`` is ``[B, H_q, T_q, T_k]`` (``query`` times the score
    scaling; ``q2`` ``[B, H_q, T, D]`` the squared queries, rotated where the keys are; ``var`` the keys' rounding
    variance expanded to the query heads; the caller masks the product to the quantized keys)."""
    lp = plan.layers[layer]
    rot = rotation.signs(k_fp.shape[-1], k_fp.shape[1], layer, k_fp.device) if lp.key_rotation else None
    var = _key_step_variance(k_fp, lp.precision, plan.cache.sinks, end, plan.cache, lp.key_clip, rot)
    rep = query.shape[1] // k_fp.shape[1]
    q = query if rot is None else rotation.rotate(query, rot.repeat_interleave(rep, dim=0))
    return q.square(), attention.expand_kv(var, rep)


# Queries attended per step. Each step's [B, H, queries, T] temporaries are then a few MiB, read and written in
# cache rather than main memory: on 2,048-token streams a pass takes half the time of the whole [B, H, T, T] at
# once. Every query still scores all T keys (later ones masked), so each row's softmax and each output's sum over
# keys run over the same T values in the same order: the same numbers, bit for bit (benchmarks/simulation_speed.py).
_QUERY_BLOCK = 128


@dataclass(frozen=True)
class _Reads:
    """One layer's queries and what each (query, key) pair reads, attended a block of queries at a time
    (:meth:`attend`). Queries, keys and values are float32 ``[B, H_q, T, D]`` (KV heads expanded to the query
    heads)."""

    q32: torch.Tensor
    k_fp: torch.Tensor
    k_q: torch.Tensor
    v_fp: torch.Tensor
    v_q: torch.Tensor
    value: torch.Tensor  # as computed: each query reads its own value unrounded
    exact_self: torch.Tensor  # [B, H_q, T]: each query's score against its own key as computed
    quantized: torch.Tensor  # [T_q, T_k] bool: the pair reads the quantized copy
    mask: torch.Tensor | None  # [B, 1, T, T] additive
    scaling: float
    softcap: float | None
    bias: torch.Tensor | None = None  # [B, H_q, T, T]: a ScoreBias's correction
    noise: tuple[torch.Tensor, torch.Tensor] | None = None  # _score_noise's factors

    def attend(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, out)`` of queries ``[start, stop)`` over every key: ``[B, H_q, n, T]`` and ``[B, H_q, n, D]``
        (``n = stop - start``)."""
        q = self.q32[:, :, start:stop]
        read_q = self.quantized[start:stop].to(torch.float32)
        read_fp = 1.0 - read_q
        # Which version each (query, key) pair reads, as 0 / 1 factors: a blend by products is exact (one product of
        # each sum is 0, and scores and probabilities are finite) and on CPU several times faster over [B, H, T, T]
        # than torch.where or masked_fill with a broadcast boolean mask.
        scores = torch.addcmul(q @ self.k_fp.transpose(-1, -2) * read_fp,
                               q @ self.k_q.transpose(-1, -2), read_q) * self.scaling
        scores.diagonal(start, dim1=-2, dim2=-1).copy_(  # query start + i's own key: offset `start`
            self.exact_self[:, :, start:stop])
        if self.bias is not None:
            scores = scores + self.bias[:, :, start:stop] * read_q
        elif self.noise is not None:
            q2, var = self.noise
            scores = scores + -0.5 * (q2[:, :, start:stop] @ var.transpose(-1, -2)) * read_q
        scores = attention.softcapped(scores, self.softcap)
        if self.mask is not None:
            scores = scores + self.mask[..., start:stop, :].to(torch.float32)
        probs = torch.softmax(scores, dim=-1)
        read_fp.diagonal(start).fill_(0.0)  # the query's own value is added below, as computed
        out = (probs * read_q) @ self.v_q + (probs * read_fp) @ self.v_fp
        out = out + probs.diagonal(start, dim1=-2, dim2=-1).unsqueeze(-1) * self.value[:, :, start:stop]
        return probs, out


class _SimulationHook:
    """Attention of every query against the keys/values as chunk-1 decoding through the cache shows them."""

    def __init__(self, plan: Plan, scales: StaticScales | None, observer: Observer | None,
                 codec: Codec | None = None, score_bias: ScoreBias | None = None, rope: Rope | None = None) -> None:
        self.plan, self.scales, self.observer, self.codec = plan, scales, observer, codec
        self.score_bias = score_bias
        self.rope = rope  # the model's RoPE, for plans that store keys before it

    def stored(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """``(k_fp, v_fp, k_q, v_q, end, switch)``: layer ``layer_idx``'s keys and values ``[B, H_kv, T, D]`` as the
        cache stores them at full precision (window and sinks, float32) and as read from their quantized copies,
        with :func:`quantize_switch_points`."""
        plan, scales = self.plan, self.scales
        lp = plan.layers[layer_idx]
        k_absmax = None if scales is None else scales.key_absmax[layer_idx]
        v_absmax = None if scales is None else scales.value_absmax[layer_idx]
        t = key.shape[2]
        fp_dtype = plan.cache.storage_dtype(key.dtype)
        k_fp, v_fp = key.to(fp_dtype).to(torch.float32), value.to(fp_dtype).to(torch.float32)
        end, switch = quantize_switch_points(t, plan)
        s = plan.cache.sinks
        if plan.cache.window_bits == 8:
            if k_absmax is None:
                raise ValueError("window_bits=8 stores the window under the calibrated INT8 scales: pass scales")
            k_fp, v_fp = _window_round(k_fp, k_absmax, s, fp_dtype), _window_round(v_fp, v_absmax, s, fp_dtype)
        rot = None
        if lp.key_rotation or lp.value_rotation:
            rot = rotation.signs(key.shape[-1], key.shape[1], layer_idx, key.device)
        turn = self.rope.tables(layer_idx, 0, t, key.device) if plan.cache.prerope_keys else None
        k_q = _quantized_copy(k_fp, lp.precision, s, end, Axis.CHANNEL, plan.cache, lp.key_clip, k_absmax,
                              rot if lp.key_rotation else None, self.codec, layer_idx, turn)
        v_q = _quantized_copy(v_fp, lp.value_precision, s, end, Axis.TOKEN, plan.cache, lp.value_clip, v_absmax,
                              rot if lp.value_rotation else None, self.codec, layer_idx)
        return k_fp, v_fp, k_q, v_q, end, switch

    def __call__(self, module, query, key, value, attention_mask, *, scaling, softcap):
        plan, layer_idx, t = self.plan, module.layer_idx, query.shape[2]
        if key.shape[2] != t:
            raise RuntimeError("simulation needs the whole stream in one forward pass, without a cache")
        k_fp, v_fp, k_q, v_q, end, switch = self.stored(layer_idx, key, value)
        rep = query.shape[1] // key.shape[1]
        q32 = query.to(torch.float32)
        positions = torch.arange(t, device=query.device)
        quantized = positions[:, None] >= switch.to(query.device)[None, :]  # [T_q, T_k]
        k_fp_e, k_q_e, v_fp_e, v_q_e, key_e, value_e = (attention.expand_kv(x.to(torch.float32), rep)
                                                        for x in (k_fp, k_q, v_fp, v_q, key, value))
        # The query's own key is used as computed (the cache returns new tokens unrounded).
        exact_self = (q32 * key_e).sum(-1) * scaling  # [B, Hq, T]
        bias = None if self.score_bias is None else self.score_bias(layer_idx, q32 * scaling, k_fp)
        noise = None
        if bias is None and plan.cache.score_correction:
            noise = _score_noise(q32 * scaling, k_fp, plan, layer_idx, end)
        reads = _Reads(q32, k_fp_e, k_q_e, v_fp_e, v_q_e, value_e, exact_self, quantized, attention_mask, scaling,
                       softcap, bias, noise)
        if self.observer is not None:  # it sees the whole [B, H, T, T] at once
            probs, out = reads.attend(0, t)
            self.observer(layer_idx, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)
            return out.to(query.dtype)
        outs = [reads.attend(start, min(start + _QUERY_BLOCK, t))[1] for start in range(0, t, _QUERY_BLOCK)]
        return torch.cat(outs, dim=2).to(query.dtype)  # [B, H_q, T, D]


@contextlib.contextmanager
def simulation(model, plan: Plan, scales: StaticScales | None = None, *, observer: Observer | None = None,
               codec: Codec | None = None, score_bias: ScoreBias | None = None):
    """Within this block, ``model``'s forward passes (without a cache) simulate chunk-1 decoding under ``plan``
    (INT8 heads with calibrated ``scales`` when given); ``observer`` sees every layer's attention; ``codec``
    replaces the quantizer's round trip of heads with dynamic scales (see :data:`Codec`); ``score_bias``
    corrects the scores of quantized keys (see :data:`ScoreBias`)."""
    arch = Architecture.from_config(model.config)
    plan.check(arch)
    if scales is not None:
        scales.check(arch)
    rope = Rope.from_config(model.config) if plan.cache.prerope_keys else None
    with attention.hooked(model, _SimulationHook(plan, scales, observer, codec, score_bias, rope)):
        yield


@torch.no_grad()
def simulate_logits(model, input_ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
                    keep_from: int = 0, observer: Observer | None = None, codec: Codec | None = None,
                    score_bias: ScoreBias | None = None) -> torch.Tensor:
    """Next-token logits ``[T - keep_from, vocab]`` (float32) for ``input_ids`` (``[T]``) as chunk-1 decoding
    through a cache built from ``plan`` (and ``scales``) would produce them, in one forward pass.
    ``keep_from``: skip the output head for earlier positions (see :func:`first_quantized_query`)."""
    ids = input_ids.reshape(1, -1).to(model.device)
    keep = ids.shape[1] - keep_from
    if not 0 < keep <= ids.shape[1]:
        raise ValueError(f"keep_from must be in [0, {ids.shape[1]}), got {keep_from}")
    with simulation(model, plan, scales, observer=observer, codec=codec, score_bias=score_bias):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    return logits[0, -keep:].float()


def first_quantized_query(plan: Plan) -> int:
    """The first position whose attention can see a quantized key under ``plan``: every earlier position's
    logits equal the FP16 cache's exactly, so scoring can skip them."""
    return plan.cache.sinks + plan.cache.residual + plan.cache.group_size
