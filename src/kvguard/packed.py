"""One model forward for many sequences: their new tokens packed in one row, attention per sequence over its own
store.

A server decoding several requests wants every sequence to advance in the same forward pass: the projections and
the MLP then read the weights once for all of them. The sequences differ in length (and one may be prefilling a
chunk of its prompt while the others decode one token), and each has its own cache, so padding them into a batch
would waste both compute and memory. Instead their new tokens are **packed** along the token axis of a single
batch row, ``[1, T]`` with ``T = n_1 + ... + n_S`` (vLLM's layout), each token carrying its own sequence's
position (``position_ids``), so RoPE turns it as a lone forward would.

Attention is the one place where sequences must not mix. :class:`PackedCache` is the ``Cache`` the model sees: at
every layer its ``update`` splits the packed K/V by sequence, appends each slice to that sequence's own cache layer
(which quantizes it in its own format), and defers one :class:`PackedRead` to the attention harness
(:mod:`kvguard.attention`): per sequence, the :class:`~kvguard.stored_read.StoredRead` of its past and the columns
of its new tokens. The harness's attention then attends each sequence's queries over its own past and new tokens
(:func:`attend`: the fused kernels for a decode step, tiles for a chunk), with the causal mask among its new tokens
and, on sliding-window layers, its own window. No mask over the packed row is ever built: while a packed forward
runs, the harness's mask function gives none.

A sequence may carry a hook (a :class:`~kvguard.control.monitor` probe of the feedback loop) that attends its
slice itself and records what it saw; the others attend through :func:`kvguard.fused_attention.attend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvguard import attention, fused_attention
from kvguard.stored_read import StoredRead


@dataclass(frozen=True)
class Piece:
    """One sequence's share of a packed forward.

    Attributes:
        cache: its :class:`~kvguard.cache.KVGuardCache` (one batch row).
        ids: its new tokens ``[n]``, which follow what the cache holds.
        hook: attends this sequence's slice itself, ``hook(module, query, key, value, mask, scaling=, softcap=,
            read=)`` (the feedback loop's monitor); ``None``: :func:`kvguard.fused_attention.attend`.
    """

    cache: object
    ids: torch.Tensor
    hook: object | None = None


@dataclass(frozen=True)
class _Slice:
    read: StoredRead | None  # the sequence's stored past at this layer (None: nothing stored yet)
    start: int  # its new tokens' columns in the packed row: [start, start + length)
    length: int
    position: int  # absolute position of its first new token
    offset: int  # absolute position of the read's column 0 (a sliding layer drops its oldest tokens)
    hook: object | None


@dataclass(frozen=True)
class PackedRead:
    """What one layer's attention reads in a packed forward: one :class:`_Slice` per sequence."""

    slices: tuple[_Slice, ...]

    def attend(self, module, query, key, value, *, scaling: float, softcap: float | None) -> torch.Tensor:
        return attend(module, query, key, value, self, scaling=scaling, softcap=softcap)


@dataclass(frozen=True)
class _Row:
    """The sequences of one packed row: their pieces, new-token counts and first positions."""

    pieces: tuple[Piece, ...]
    lengths: tuple[int, ...]
    positions: tuple[int, ...]

    @classmethod
    def of(cls, pieces: Sequence[Piece]) -> "_Row":
        pieces = tuple(pieces)
        return cls(pieces, tuple(int(p.ids.numel()) for p in pieces), tuple(p.cache.get_seq_length() for p in pieces))


class _PackedLayer(CacheLayerMixin):
    """Layer ``layer_idx`` of every sequence's cache, seen as one layer of the packed row.

    It holds the row, not the :class:`PackedCache` that holds it: a layer pointing back at its cache is a reference
    cycle, which CPython frees only at a full collection, and a server's full collections are rare, so every
    sequence's cache the row touched (the finished ones' included) would stay in memory for minutes."""

    is_compileable = False
    is_croppable = False

    def __init__(self, row: _Row, layer_idx: int, sliding: bool) -> None:
        super().__init__()
        self.row, self.layer_idx, self.is_sliding = row, layer_idx, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append each sequence's slice of ``[1, H_kv, T, D]`` to its own layer; defer the packed read."""
        slices, start, row = [], 0, self.row
        for piece, n, position in zip(row.pieces, row.lengths, row.positions):
            layer = piece.cache.layers[self.layer_idx]
            k, v = key_states[:, :, start:start + n], value_states[:, :, start:start + n]
            read = layer.read_and_append(k, v)
            offset = layer.offset if read is None else position - read.length
            slices.append(_Slice(read, start, n, position, offset, piece.hook))
            start += n
        attention.defer_read(key_states, PackedRead(tuple(slices)))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # no mask is built over a packed row (the harness's mask function gives none)

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The ``Cache`` a packed forward runs with: its layers hand every sequence's slice to that sequence's cache."""

    def __init__(self, pieces: Sequence[Piece], sliding_layers: Sequence[bool]) -> None:
        self.row = _Row.of(pieces)
        super().__init__(layers=[_PackedLayer(self.row, i, s) for i, s in enumerate(sliding_layers)])


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, read: PackedRead, *,
           scaling: float, softcap: float | None) -> torch.Tensor:
    """Attention of a packed row, ``query`` ``[1, H_q, T, D]`` and new ``key`` / ``value`` ``[1, H_kv, T, D]``:
    each sequence's queries over its own stored past and its own new tokens. ``[1, H_q, T, D]``."""
    out = torch.empty_like(query)
    window = getattr(module, "sliding_window", None)
    # Every sequence decoding one token in one kernel call: per sequence, the call and its threads' wake-up cost
    # more than its products. A sequence whose loop watches this layer gets the probabilities too.
    together = [s for s in read.slices
                if s.read is not None and not window and (s.hook is None or hasattr(s.hook, "record"))
                and fused_attention.direct(s.read, query[:, :, s.start:s.start + s.length], key, None, softcap)]
    cols = [slice(s.start, s.start + 1) for s in together]
    steps = [(query[:, :, c], s.read, key[:, :, c], value[:, :, c]) for s, c in zip(together, cols)]
    watched = [s.hook is not None and s.hook.observes(module, 1) for s in together]
    results = fused_attention.attend_steps(steps, scaling=scaling, probabilities=watched) if steps else []
    for s, c, (o, probs) in zip(together, cols, results):
        out[:, :, c] = o
        if probs is not None:
            s.hook.record(module, probs)
    done = {id(s) for s in together}
    for s in read.slices:
        if id(s) in done:
            continue
        cols = slice(s.start, s.start + s.length)
        q, k, v = query[:, :, cols], key[:, :, cols], value[:, :, cols]
        stored = 0 if s.read is None else s.read.length
        mask = _sliding_mask(s, stored, window, query.device) if window else None
        if s.hook is not None:
            out[:, :, cols] = s.hook(module, q, k, v, mask, scaling=scaling, softcap=softcap, read=s.read)
        elif s.read is None:
            out[:, :, cols] = attention.attend(q, k, v, mask, scaling=scaling, softcap=softcap, is_causal=mask is None)
        else:
            out[:, :, cols] = fused_attention.attend(q, s.read, k, v, mask, scaling=scaling, softcap=softcap)
    return out


def _sliding_mask(s: _Slice, stored: int, window: int, device) -> torch.Tensor:
    """``[1, 1, n, stored + n]`` boolean: query ``i`` (absolute position ``position + i``) sees the stored and new
    keys at most ``window - 1`` positions back, and none ahead (transformers' sliding-window causal mask)."""
    keys = torch.cat([torch.arange(stored, device=device) + s.offset,
                      torch.arange(s.length, device=device) + s.position])
    queries = torch.arange(s.length, device=device) + s.position
    visible = (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
    return visible.view(1, 1, s.length, -1)


@torch.no_grad()
def forward(model, pieces: Sequence[Piece]) -> torch.Tensor:
    """One forward of ``model`` over every piece's new tokens; the next-token logits after each piece's last token,
    ``[len(pieces), vocab]`` (float32). Every piece's cache holds its new tokens afterwards."""
    from kvguard.architecture import Architecture

    if not pieces:
        raise ValueError("a packed forward needs at least one sequence")
    arch = Architecture.from_config(model.config)
    cache = PackedCache(pieces, [arch.is_sliding(l) for l in range(arch.num_layers)])
    device = model.device
    ids = torch.cat([p.ids.reshape(-1) for p in pieces]).view(1, -1).to(device)
    row = cache.row
    positions = torch.cat([torch.arange(n) + start for n, start in zip(row.lengths, row.positions)])
    last = torch.tensor(row.lengths).cumsum(0) - 1  # each piece's last token in the row
    with attention.packed_reads(model):
        out = model(input_ids=ids, position_ids=positions.view(1, -1).to(device), cache=cache, use_cache=True,
                    logits_to_keep=last.to(device))
    return out.logits[0].float()
