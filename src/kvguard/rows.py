"""Growable row buffers: how the store appends tokens without copying the history at every group.

A stored tensor (a part's codes, scales, zero points, or an FP16 part's keys) is a view of the first ``T`` rows
(axis -2) of a buffer with room for more, and a group leaving the window is written into the free rows behind
them (:func:`extend_rows`). A full buffer is replaced by one with room for ``max(MIN_ROOM, T / ROOM_DIVISOR)``
more rows: an appended row costs ``T / 256`` copied rows amortized up to 4,096 tokens and 16 beyond, instead of
``T``. The views handed out (a :class:`~kvguard.stored_read.StoredRead`) cover rows that are never written again:
appending leaves them as they were.

**Where the bytes come from.** On the CPU a buffer of at least :data:`MAPPED_BYTES` is its own anonymous memory
map (:func:`empty_rows`), not a block of the C heap. Two reasons, both measured on SmolLM2-135M (8 x 4,096 tokens):

- a map's untouched pages are not resident, so the free rows behind the stored ones cost address space, not
  RAM: the process holds the rows written, which is what ``nbytes`` counts;
- a map is returned to the kernel the moment its last view goes, so a replaced buffer leaves no hole. From the
  heap (glibc raises its mmap threshold to the size of the first large block freed, so later blocks of that
  size come from the heap), each replaced buffer left a hole slightly too small for the next one, and the
  process grew by hundreds of MiB more than the cache, by an amount that moved with ``MALLOC_ARENA_MAX`` and
  with the load on the machine.

Smaller buffers come from the C heap, where a replaced one leaves a hole of resident pages that the next, larger
buffer does not fit. With 256-token prefill chunks a buffer is often full when the prompt ends, so the first decode
steps replace most of them at once: 8 x 4,096 INT4 tokens held about 50 MiB more after them than before. So every
:data:`TRIM_BYTES` of replaced heap buffers the heap's free pages are handed back (:func:`kvguard.heap.release`,
about 3 ms).

On an accelerator the device allocator is used as is.
"""

from __future__ import annotations

import math
import mmap

import torch

from kvguard import heap

MIN_ROOM = 256
ROOM_DIVISOR = 16
MAPPED_BYTES = 1 << 20  # smaller buffers (scales of short runs, a few groups) come from torch's allocator
TRIM_BYTES = 8 << 20  # heap buffers replaced between two trims of the heap
_replaced = [0]  # heap bytes replaced since the last trim (one count per process: the heap is the process's)


def empty_rows(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` with ``like``'s dtype and device; on the CPU, from a memory map of its
    own when it is :data:`MAPPED_BYTES` or larger (see the module docstring)."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < MAPPED_BYTES:
        return like.new_empty(shape)
    # The tensor keeps the map alive; the map is unmapped when the last view of the tensor is gone.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(shape)


def extend_rows(room: dict, key: str, stored: torch.Tensor | None, new: torch.Tensor,
                min_room: int = MIN_ROOM) -> torch.Tensor:
    """``stored`` followed by ``new`` along axis -2, written into ``room[key]`` when ``stored`` is the view of
    its first rows that the last call returned (anything else, such as a batch reorder or a dropped front, gave
    new tensors) and it has the free rows; otherwise into a new buffer with room for a few percent more rows, and
    at least ``min_room`` (fewer where a row stands for several tokens: a key scale row per group of 32 tokens
    with 256 rows of room would be room for 8,192 tokens)."""
    n, m = (0 if stored is None else stored.shape[-2]), new.shape[-2]
    buffer = room.get(key)
    reusable = (buffer is not None and stored is not None and stored.data_ptr() == buffer.data_ptr()
                and stored.stride() == buffer.stride() and stored.shape[:-2] == buffer.shape[:-2]
                and n + m <= buffer.shape[-2])
    if not reusable:
        if buffer is not None:
            _replacing(buffer)
        rows = n + m + max(min_room, (n + m) // ROOM_DIVISOR)
        buffer = empty_rows(new, (*new.shape[:-2], rows, new.shape[-1]))
        if n:
            buffer[..., :n, :].copy_(stored)
        room[key] = buffer
    buffer[..., n:n + m, :].copy_(new)
    return buffer[..., :n + m, :]


def _replacing(buffer: torch.Tensor) -> None:
    """Count a replaced buffer that came from the C heap; trim the heap once :data:`TRIM_BYTES` of them were. (The
    buffer itself goes once the caller drops it: a later trim returns its pages.)"""
    nbytes = buffer.numel() * buffer.element_size()
    if buffer.device.type != "cpu" or nbytes >= MAPPED_BYTES:
        return  # a map of its own (unmapped when it goes) or the device's allocator: no hole is left
    _replaced[0] += nbytes
    if _replaced[0] >= TRIM_BYTES:
        _replaced[0] = 0
        heap.release()
