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
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTN_NAME = "kvguard"


class AttentionHook(Protocol):
    def __call__(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, scaling: float, softcap: float | None) -> torch.Tensor:
        """The attention output ``[B, H_q, T_q, D]``."""


_HOOK: contextvars.ContextVar[AttentionHook | None] = contextvars.ContextVar("kvguard_attention_hook", default=None)
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
def hooked(model, hook: AttentionHook):
    """Within this block (and this thread), ``model``'s attention calls ``hook``."""
    install(model)
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def active_hook() -> AttentionHook | None:
    return _HOOK.get()


def _original(config) -> str:
    return _ORIGINAL.get(id(config), "sdpa")


def _original_attention(module, name: str):
    if name == "eager":
        # transformers keeps each model's eager attention in its modeling module, not in the registry.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    hook = _HOOK.get()
    if hook is None:
        forward = _original_attention(module, _original(module.config))
        return forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                       softcap=softcap, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = hook(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)  # [B, H_q, T, D]
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, config=None, **kwargs):
    if _HOOK.get() is not None or config is None:
        return eager_mask(*args, config=config, **kwargs)
    return ALL_MASK_ATTENTION_FUNCTIONS[_original(config)](*args, config=config, **kwargs)


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)
