"""The peer transformers users reach for: its own ``QuantizedCache`` on the ``quanto`` and ``hqq`` backends.

    cache = quantized_cache.make_cache("hf-quanto-4", model)
    model(input_ids=ids, cache=cache)
    quantized_cache.cache_nbytes(cache) / quantized_cache.fp16_nbytes(cache)    # measured bytes vs FP16

Every peer is built with transformers' defaults except ``nbits``: ``axis_key=0``, ``axis_value=0``,
``q_group_size=64``, ``residual_length=128``. What those defaults mean in transformers 5.24:

* The first ``update`` of a layer (the prefill) is quantized whole at once, whatever its length; the
  full-precision residual starts empty. Later tokens collect in the residual (model dtype) and, when
  ``residual + new >= residual_length``, the whole history is dequantized, joined with the residual and
  quantized again from scratch (history is re-quantized at every flush, every 128 tokens).
* quanto (``optimum-quanto``, ``MaxOptimizer``: per-group min/max, affine with scale and shift) with
  ``axis=0`` groups the flattened ``[batch, kv_heads, tokens, head_dim]`` states into contiguous runs of 64
  values: with a head_dim of 64 that is one group per (batch, head, token) over the head dimension, i.e.
  per-token for keys as well as values (not KIVI's per-channel keys). Codes are bit-packed in uint8;
  scale and shift are in the model dtype.
* hqq (``hqq.core.quantize.Quantizer``, HQQ's optimized zero-point, ``optimize=True``) with ``axis=0``
  reshapes the flattened states to ``[64, numel / 64]`` and groups along dim 0: each group takes every
  ``numel / 64``-th value, so which values share a scale depends on the sequence length. Codes are
  bit-packed in uint8; scale and zero are in the model dtype.

Re-quantization at a flush leaves quanto's history all but unchanged (its groups are per token), while hqq's
groups are regrouped by the new length, so a flush moves values quantized before (by ~1 on keys of
magnitude ~20 in SmolLM2-135M).

No backend is imported until a cache is built.
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass

import torch

from kvguard.peers import PeerUnsupported

QUANTO_PACKAGE = "optimum-quanto==0.2.7"
HQQ_PACKAGE = "hqq==0.2.8.post1"

# transformers' QuantizedLayer defaults (transformers 5.24), left unset so that transformers applies them.
RESIDUAL_LENGTH = 128
Q_GROUP_SIZE = 64
AXIS_KEY = 0
AXIS_VALUE = 0


@dataclass(frozen=True)
class PeerSpec:
    """One peer cache.

    Attributes:
        name: the name used in reports (``hf-quanto-4``...).
        backend: the ``QuantizedCache`` backend (``"quanto"`` or ``"hqq"``).
        nbits: bits per quantized value.
        description: one line with the settings used.
    """

    name: str
    backend: str
    nbits: int
    description: str


_DEFAULTS = (f"residual_length={RESIDUAL_LENGTH} tokens in the model dtype, q_group_size={Q_GROUP_SIZE}, "
             f"axis_key={AXIS_KEY}, axis_value={AXIS_VALUE} (transformers defaults); prefill quantized at once, "
             f"history re-quantized at every residual flush")

PEERS: dict[str, PeerSpec] = {
    p.name: p
    for p in (
        PeerSpec("hf-quanto-4", "quanto", 4,
                 "transformers QuantizedCache, optimum-quanto qint4 (MaxOptimizer min/max affine, contiguous "
                 f"64-value groups: per token and head when head_dim=64), {_DEFAULTS}"),
        PeerSpec("hf-quanto-2", "quanto", 2,
                 "transformers QuantizedCache, optimum-quanto qint2 (MaxOptimizer min/max affine, contiguous "
                 f"64-value groups: per token and head when head_dim=64), {_DEFAULTS}"),
        PeerSpec("hf-hqq-4", "hqq", 4,
                 "transformers QuantizedCache, HQQ 4-bit (optimized zero-point, groups of 64 strided values "
                 f"along axis 0 of the flattened states), {_DEFAULTS}"),
    )
}

_BACKEND_MODULES = {"quanto": ("optimum.quanto", QUANTO_PACKAGE), "hqq": ("hqq", HQQ_PACKAGE)}


def _spec(name: str) -> PeerSpec:
    try:
        return PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; valid names: {', '.join(sorted(PEERS))}") from None


def _has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def make_cache(name: str, model):
    """A fresh transformers ``QuantizedCache`` for ``model`` (a model or its config) with peer ``name``'s
    backend and bits, everything else at transformers' defaults.

    Raises:
        ValueError: ``name`` is not a peer (the message lists the valid names).
        PeerUnsupported: the backend package is missing (the message says what to pip install), or
            transformers refuses the model (e.g. models with sliding-window layers such as Gemma 3).
    """
    spec = _spec(name)
    module, package = _BACKEND_MODULES[spec.backend]
    if not _has_module(module):
        raise PeerUnsupported(f"peer {spec.name!r} needs the {spec.backend} backend ({module}), which is not "
                              f"installed: pip install 'kvguard[peers]' (or: pip install {package})")
    config = getattr(model, "config", model)
    from transformers import QuantizedCache

    try:
        return QuantizedCache(spec.backend, config, nbits=spec.nbits)
    except Exception as e:  # transformers raises ValueError / ImportError; report them all the same way
        model_type = getattr(config, "model_type", type(config).__name__)
        raise PeerUnsupported(f"peer {spec.name!r} cannot run on {model_type!r}: transformers' QuantizedCache "
                              f"refused it: {e}") from e


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           torch.nn.Module, torch.dtype, torch.device, str, bytes, int, float, complex, bool)


def _storage_key_and_size(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
        return ("storage", storage.data_ptr(), storage.nbytes()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        size = t.numel() * t.element_size()
        return ("tensor", id(t), size), size


def cache_nbytes(cache) -> int:
    """Measured bytes of every tensor ``cache`` holds now: quantized codes and their scales/shifts/zeros,
    the full-precision residual keys/values, anything else stored. Found by walking the cache's objects
    (tensors, containers, instance attributes, tensor subclasses through ``__tensor_flatten__``); each
    storage counts once, whole, even when only viewed in part. Model weights are never reached
    (``torch.nn.Module`` is not entered)."""
    seen_objects: set[int] = set()
    seen_storages: set[tuple] = set()
    total = 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, _OPAQUE) or id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            flatten = getattr(obj, "__tensor_flatten__", None)
            if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                inner_names, _ = flatten()
                stack.extend(getattr(obj, n) for n in inner_names)
                continue
            key, size = _storage_key_and_size(obj)
            if key not in seen_storages:
                seen_storages.add(key)
                total += size
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


def _bhd(layer, which: str) -> tuple[int, int, int]:
    """(batch, kv_heads, head_dim) of a layer's keys or values, from the residual or the quantized states."""
    residual = getattr(layer, which, None)
    if isinstance(residual, torch.Tensor) and residual.dim() == 4 and residual.shape[-2] > 0:
        return residual.shape[0], residual.shape[1], residual.shape[3]
    quantized = getattr(layer, "_quantized_" + which, None)
    shape = None
    if isinstance(quantized, torch.Tensor):
        shape = quantized.shape
    elif isinstance(quantized, tuple) and quantized:
        if len(quantized) > 1 and isinstance(quantized[1], dict) and "shape" in quantized[1]:
            shape = quantized[1]["shape"]  # hqq: (W_q, meta)
        elif isinstance(quantized[0], torch.Tensor):
            shape = quantized[0].shape  # fp8: (codes, scale)
    if shape is None or len(shape) != 4:
        raise ValueError(f"cannot tell the shape of the {which} of a {type(layer).__name__}")
    return shape[0], shape[1], shape[3]


def fp16_nbytes(cache) -> int:
    """Bytes an FP16 cache holding the same tokens would take: 2 bytes x batch x kv_heads x tokens x
    (key head_dim + value head_dim), summed over layers."""
    total = 0
    for layer in cache.layers:
        tokens = layer.get_seq_length()
        if tokens == 0:
            continue
        for which in ("keys", "values"):
            batch, heads, head_dim = _bhd(layer, which)
            total += 2 * batch * heads * tokens * head_dim
    return total
