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
from typing import Callable, Iterator

import torch

from kvguard import attention, rotation, score_bias as key_noise
from kvguard.architecture import Architecture
from kvguard.plan import Plan, StaticScales
from kvguard.rope import Rope
from kvguard.store import Store

# Called for every simulated layer (``kvguard.calibration.signals`` records the monitor's evidence with it):
# ``observer(layer, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)``.
Observer = Callable[..., None]


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


def _score_noise(query: torch.Tensor, k_fp: torch.Tensor, store: Store, plan: Plan, layer: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two factors of :mod:`kvguard.score_bias`'s correction of every (query, key) score, as the cache applies
    it to keys read from their codes: ``-0.5 * q2 @ var.T`` is ``[B, H_q, T_q, T_k]`` (``query`` times the score
    scaling; ``q2`` ``[B, H_q, T, D]`` the squared queries, rotated where the keys are; ``var`` the rounding variance
    of every key ``store`` holds as codes the correction applies to, expanded to the query heads, in the basis the
    keys are stored in; the caller masks the product to the quantized keys)."""
    var = torch.zeros_like(k_fp)  # [B, H_kv, T, D]
    for seg in store.read().segments:
        if seg.quantized and key_noise.applies(seg.keys.spec):
            step = key_noise.step_variance(seg.keys.scales(), seg.keys.spec, seg.length, k_fp.shape[-1])
            heads = slice(None) if seg.heads is None else seg.heads
            var[:, heads, seg.start:seg.stop] = step.to(var.dtype)
    rep = query.shape[1] // k_fp.shape[1]
    q = query
    if plan.layers[layer].key_rotation:
        rot = rotation.signs(k_fp.shape[-1], k_fp.shape[1], layer, k_fp.device)
        q = rotation.rotate(query, rot.repeat_interleave(rep, dim=0))
    return q.square(), attention.expand_kv(var, rep)


# Queries attended per step. Each step's [B, H, queries, T] temporaries are then a few MiB, read and written in
# cache rather than main memory: on 2,048-token streams a pass takes half the time of the whole [B, H, T, T] at
# once. Every query still scores all T keys (later ones masked), so each row's softmax and each output's sum over
# keys run over the same T values in the same order: the same numbers, bit for bit (measured in commit 9242d86's benchmarks/simulation_speed.py).
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
        if self.noise is not None:
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
                 rope: Rope | None = None) -> None:
        self.plan, self.scales, self.observer = plan, scales, observer
        self.rope = rope  # the model's RoPE, for plans that store keys before it

    def stored(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """``(k_fp, v_fp, k_q, v_q, end, switch, store)``: layer ``layer_idx``'s keys and values ``[B, H_kv, T, D]``
        as the cache holds them at full precision (sinks, window; float32) and as read from the store once the
        whole stream is in it (codes at ``[sinks, end)``), with :func:`quantize_switch_points` and the store.

        The stream goes into a real :class:`~kvguard.store.Store` in one append: a group's codes depend only on
        its own tokens, so they are those chunk-1 decoding stores, and they are read back through the same
        :class:`~kvguard.stored_read.StoredRead` every other reader takes."""
        plan, scales = self.plan, self.scales
        store = Store(plan.cache, layer_idx, self.rope, plan.layers[layer_idx].format())
        if scales is not None:
            store.key_absmax, store.value_absmax = scales.key_absmax[layer_idx], scales.value_absmax[layer_idx]
        elif plan.cache.window_bits == 8:
            raise ValueError("window_bits=8 stores the window under the calibrated INT8 scales: pass scales")
        store.initialize(key)
        s = plan.cache.sinks
        # Every token is read from the window before it leaves it (sinks: as stored).
        k_fp = torch.cat([key[:, :, :s].to(store.fp_dtype), store.as_window(key[:, :, s:], 0)], dim=2).float()
        v_fp = torch.cat([value[:, :, :s].to(store.fp_dtype), store.as_window(value[:, :, s:], 1)], dim=2).float()
        store.append(key, value)
        k_q, v_q = store.read().materialize(torch.float32, key.device)
        end, switch = quantize_switch_points(key.shape[2], plan)
        return k_fp, v_fp, k_q, v_q, end, switch, store

    def __call__(self, module, query, key, value, attention_mask, *, scaling, softcap):
        plan, layer_idx, t = self.plan, module.layer_idx, query.shape[2]
        if key.shape[2] != t:
            raise RuntimeError("simulation needs the whole stream in one forward pass, without a cache")
        k_fp, v_fp, k_q, v_q, end, switch, store = self.stored(layer_idx, key, value)
        rep = query.shape[1] // key.shape[1]
        q32 = query.to(torch.float32)
        positions = torch.arange(t, device=query.device)
        quantized = positions[:, None] >= switch.to(query.device)[None, :]  # [T_q, T_k]
        k_fp_e, k_q_e, v_fp_e, v_q_e, key_e, value_e = (attention.expand_kv(x.to(torch.float32), rep)
                                                        for x in (k_fp, k_q, v_fp, v_q, key, value))
        # The query's own key is used as computed (the cache returns new tokens unrounded).
        exact_self = (q32 * key_e).sum(-1) * scaling  # [B, Hq, T]
        noise = _score_noise(q32 * scaling, k_fp, store, plan, layer_idx) if plan.cache.score_correction else None
        reads = _Reads(q32, k_fp_e, k_q_e, v_fp_e, v_q_e, value_e, exact_self, quantized, attention_mask, scaling,
                       softcap, noise)
        if self.observer is not None:  # it sees the whole [B, H, T, T] at once
            probs, out = reads.attend(0, t)
            self.observer(layer_idx, probs, quantized, k_fp, k_q, v_fp, v_q, attention_mask)
            return out.to(query.dtype)
        outs = [reads.attend(start, min(start + _QUERY_BLOCK, t))[1] for start in range(0, t, _QUERY_BLOCK)]
        return torch.cat(outs, dim=2).to(query.dtype)  # [B, H_q, T, D]


@contextlib.contextmanager
def simulation(model, plan: Plan, scales: StaticScales | None = None, *, observer: Observer | None = None):
    """Within this block, ``model``'s forward passes (without a cache) simulate chunk-1 decoding under ``plan``
    (INT8 heads with calibrated ``scales`` when given); ``observer`` sees every layer's attention."""
    arch = Architecture.from_config(model.config)
    plan.check(arch)
    if scales is not None:
        scales.check(arch)
    rope = Rope.from_config(model.config) if plan.cache.prerope_keys else None
    with attention.hooked(model, _SimulationHook(plan, scales, observer, rope)):
        yield


@torch.no_grad()
def simulate_logits(model, input_ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
                    keep_from: int = 0, observer: Observer | None = None) -> torch.Tensor:
    """Next-token logits ``[T - keep_from, vocab]`` (float32) for ``input_ids`` (``[T]``) as chunk-1 decoding
    through a cache built from ``plan`` (and ``scales``) would produce them, in one forward pass.
    ``keep_from``: skip the output head for earlier positions (see :func:`first_quantized_query`)."""
    ids = input_ids.reshape(1, -1).to(model.device)
    keep = ids.shape[1] - keep_from
    if not 0 < keep <= ids.shape[1]:
        raise ValueError(f"keep_from must be in [0, {ids.shape[1]}), got {keep_from}")
    with simulation(model, plan, scales, observer=observer):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    return logits[0, -keep:].float()


@torch.no_grad()
def simulate_logit_slices(model, input_ids: torch.Tensor, plan: Plan, scales: StaticScales | None = None, *,
                          keep_from: int = 0, rows: int = 256, observer: Observer | None = None,
                          ) -> Iterator[torch.Tensor]:
    """:func:`simulate_logits`, ``rows`` positions at a time (``[<= rows, vocab]`` float32 each, in order): the
    decoder runs once over the whole stream and the output head a slice at a time, so a long text never holds its
    ``[T, vocab]`` logits at once (5 GB for Qwen2.5 at 8,192 tokens). Calibration keeps :func:`simulate_logits`, one
    head call per pass that its :class:`~kvguard.calibration.logit_buffer.LogitBuffer` writes into (a slice here
    would alias the previous one there)."""
    ids = input_ids.reshape(1, -1).to(model.device)
    if not 0 <= keep_from < ids.shape[1]:
        raise ValueError(f"keep_from must be in [0, {ids.shape[1]}), got {keep_from}")
    with simulation(model, plan, scales, observer=observer):
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]  # [T, hidden]
    for start in range(keep_from, hidden.shape[0], rows):
        yield _output_head(model, hidden[start:start + rows]).float()


def _output_head(model, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits for ``hidden`` ``[n, hidden]``, as its own forward computes them after the decoder:
    the head, then the final soft-capping where the config sets one (Gemma 2; ``None`` for Llama, Qwen2, Gemma 3)."""
    logits = model.lm_head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def first_quantized_query(plan: Plan) -> int:
    """The first position whose attention can see a quantized key under ``plan``: every earlier position's
    logits equal the FP16 cache's exactly, so scoring can skip them."""
    return plan.cache.sinks + plan.cache.residual + plan.cache.group_size
