"""The one attention harness: how kvguard sees and changes attention without forking modeling code.

Three parts of kvguard need to be inside the attention of a transformers model: the decoding simulation
(:mod:`kvguard.simulate`) scores each query against keys as the cache would hold them, statistics collection
(:mod:`kvguard.calibration.kv_statistics`) records K/V ranges and attention entropy, and the live monitor
(:mod:`kvguard.control.monitor`) watches the entropy of each decode query. They all plug in here:

- :func:`install` registers one attention function (and its mask function) under :data:`ATTN_NAME` with
  transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` and switches the model to it **once**. With
  no hook active it calls the model's original implementation with the original mask (so results are
  bit-identical to a model that was never installed), which is why it never has to be switched back.
- :func:`hooked` makes a hook active for the calls made inside the block, in this thread (a context
  variable): two sessions decoding on two threads through one model each see only their own hook.
- While a hook is active, the mask function builds transformers' eager (additive float) mask, which every hook
  reads: ``0`` where a query may attend, the dtype's minimum where not. Without a mask function of its own an
  attention function receives no causal mask at all.

- :func:`fused_reads` lets KVGuard cache layers defer their read: the layer's ``update`` returns only the new K/V
  and hands :func:`defer_read` a :class:`~kvguard.stored_read.StoredRead` of its stored past; the attention
  function, called next with those very key tensors (matched by identity, so a read can never reach another
  layer's attention), computes attention over both with :func:`kvguard.fused_attention.attend`, which reads the
  codes in C++ for a decode step and a bounded tile of dequantized history at a time for a longer chunk, never a
  copy of the whole history. Layers defer only while no hook is active that reads full K/V, and a deferred
  read that no attention call took is an error at the next one, not a
  silent attention over the new tokens alone.

A hook is called as ``hook(module, query, key, value, attention_mask, scaling=..., softcap=...)`` with
``query`` ``[B, H_q, T_q, D]``, ``key``/``value`` ``[B, H_kv, T_k, D]`` (after RoPE, as the cache returned them),
and returns the attention output ``[B, H_q, T_q, D]``. ``softcap`` is the model's attention logit soft-capping
(Gemma 2: ``scores = tanh(scores / softcap) * softcap`` before the mask), ``None`` for most models; every hook
applies it with :func:`softcapped`, and :func:`attend` is the plain attention a hook falls back to.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvguard import fused_attention

ATTN_NAME = "kvguard"


class AttentionHook(Protocol):
    def __call__(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, scaling: float, softcap: float | None) -> torch.Tensor:
        """The attention output ``[B, H_q, T_q, D]``."""


_HOOK: contextvars.ContextVar[AttentionHook | None] = contextvars.ContextVar("kvguard_attention_hook", default=None)
_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvguard_fused_reads", default=False)
_HOOK_TAKES_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("kvguard_hook_takes_reads", default=False)


@dataclass(frozen=True)
class _PendingRead:
    """The read a cache layer's update deferred to this thread's next attention call."""

    key: torch.Tensor  # the new keys the update returned: the attention call must receive these very tensors
    read: "StoredRead"


_PENDING: contextvars.ContextVar[_PendingRead | None] = contextvars.ContextVar("kvguard_pending_read", default=None)
_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvguard_packed_reads", default=False)
# The implementation each installed model had before, by ``id`` of its config (which every attention module
# shares; configs are unhashable), forgotten when the config is collected.
_ORIGINAL: dict[int, str] = {}
_INSTALL_LOCK = threading.Lock()


def expand_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Grouped-query attention: ``[B, H_kv, T, D] -> [B, H_kv * rep, T, D]`` (query head ``i`` reads KV head
    ``i // rep``)."""
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit soft-capping, ``tanh(scores / softcap) * softcap`` (``scores`` unchanged for ``None``);
    applied to the scaled scores before the mask, as Gemma 2's eager attention does."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *,
           scaling: float, softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """Plain grouped-query attention ``[B, H_q, T_q, D]`` of ``query`` over ``key``/``value`` ``[B, H_kv, T_k, D]``.

    ``mask``: additive float, or boolean (``True`` where a query may attend), broadcast to ``[B, H_q, T_q, T_k]``;
    ``is_causal`` (without a mask) as sdpa's. sdpa where the model does not soft-cap; otherwise sdpa cannot apply
    the cap, and the softmax of the capped scores is computed explicitly (in float32, as Gemma 2's eager
    attention does)."""
    rep = query.shape[1] // key.shape[1]
    k, v = expand_kv(key, rep), expand_kv(value, rep)  # [B, H_q, T_k, D]
    if softcap is None:
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, is_causal=is_causal)
    scores = softcapped((query @ k.transpose(-1, -2)) * scaling, softcap)  # [B, H_q, T_q, T_k]
    if is_causal:
        # sdpa's is_causal: query i sees keys 0..i (top-left aligned).
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return probs @ v


def install(model) -> None:
    """Route ``model``'s attention through the harness (idempotent, thread-safe). Without an active hook the
    model computes exactly what it computed before."""
    with _INSTALL_LOCK:
        config = model.config
        if config._attn_implementation == ATTN_NAME:
            return
        _ORIGINAL[id(config)] = config._attn_implementation or "sdpa"
        weakref.finalize(config, _ORIGINAL.pop, id(config), None)
        model.set_attn_implementation(ATTN_NAME)


@contextlib.contextmanager
def hooked(model, hook: AttentionHook, *, takes_reads: bool = False):
    """Within this block (and this thread), ``model``'s attention calls ``hook``. With ``takes_reads`` the hook
    also accepts deferred reads (see :func:`fused_reads`): it is then called with ``read=`` a
    :class:`~kvguard.stored_read.StoredRead` and only the new tokens as ``key`` / ``value``."""
    install(model)
    token = _HOOK.set(hook)
    reads = _HOOK_TAKES_READS.set(takes_reads)
    try:
        yield
    finally:
        _HOOK_TAKES_READS.reset(reads)
        _HOOK.reset(token)


def active_hook() -> AttentionHook | None:
    return _HOOK.get()


@contextlib.contextmanager
def _deferring(model, flag: contextvars.ContextVar):
    """``flag`` set within the block (and this thread); the read a layer deferred is dropped when it ends."""
    install(model)
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)
        _PENDING.set(None)


def fused_reads(model):
    """Within this block (and this thread), KVGuard cache layers hand their reads to the reads' attention
    (:func:`kvguard.fused_attention.attend`) instead of materializing their past, unless a hook that does not take
    reads is active (those read the full K/V)."""
    return _deferring(model, _FUSED)


def packed_reads(model):
    """Within this block (and this thread), ``model``'s forward runs over a packed row of several sequences
    (:mod:`kvguard.packed`): no mask is built over the row, and each layer's attention takes the
    :class:`~kvguard.packed.PackedRead` its cache deferred."""
    return _deferring(model, _PACKED)


def fused_reads_active() -> bool:
    """Whether a cache layer updated now may defer its read (inside :func:`fused_reads`, no hook active)."""
    return _FUSED.get() and (_HOOK.get() is None or _HOOK_TAKES_READS.get())


def defer_read(key: torch.Tensor, read) -> None:
    """Called by a cache layer's ``update`` that returned only the new ``key`` / value: the next attention call
    with that ``key`` attends over ``read`` (a :class:`~kvguard.stored_read.StoredRead`) followed by it."""
    if _PENDING.get() is not None:
        raise RuntimeError("a cache layer deferred its read but no attention call took it: the model's attention "
                           f"does not run through kvguard's harness (set_attn_implementation({ATTN_NAME!r}))")
    _PENDING.set(_PendingRead(key, read))


def _original(config) -> str:
    return _ORIGINAL.get(id(config), "sdpa")


def _original_attention(module, name: str):
    if name == "eager":
        # transformers keeps each model's eager attention in its modeling module, not in the registry.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    pending = _PENDING.get()
    if pending is not None:
        if pending.key is not key:
            raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')}: the keys attended to are not those the "
                               f"cache returned, so its deferred read cannot be matched")
        _PENDING.set(None)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        if not isinstance(pending.read, fused_attention.StoredRead):  # a packed row: each sequence on its own
            out = pending.read.attend(module, query, key, value, scaling=scaling, softcap=softcap)
            return out.transpose(1, 2).contiguous(), None
        hook = _HOOK.get()
        if hook is None:
            out = fused_attention.attend(query, pending.read, key, value, attention_mask, scaling=scaling, softcap=softcap)
        else:
            out = hook(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, read=pending.read)
        return out.transpose(1, 2).contiguous(), None
    hook = _HOOK.get()
    if hook is None:
        forward = _original_attention(module, _original(module.config))
        return forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                       softcap=softcap, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = hook(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)  # [B, H_q, T, D]
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, config=None, **kwargs):
    if _PACKED.get():
        return None  # a packed row's attention masks each sequence itself
    if _HOOK.get() is not None or config is None:
        return eager_mask(*args, config=config, **kwargs)
    return ALL_MASK_ATTENTION_FUNCTIONS[_original(config)](*args, config=config, **kwargs)


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
