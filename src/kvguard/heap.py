"""The C heap's settings for a process that holds a KV cache on the CPU.

glibc's ``malloc`` serves a large block from its own memory map and returns it to the kernel when it is freed, but
only above a threshold that it *raises* to the size of the largest mapped block freed so far (up to 32 MiB). A
chunked prefill frees blocks of a size that grows with the history at every chunk (the attention's scores, a
layer's read of the stored keys), so after the first few the threshold sits above them and they come from the
heap, where each freed block leaves a hole slightly too small for the next one. On SmolLM2-135M, two sequences of
2,048 tokens through an FP16 cache (93 MiB stored) grew the process by 150 MiB more than the cache holds; with the
threshold fixed at 512 KiB (and the heap trimmed past 4 MiB free at its top) by 50 MiB, the model's own
activations for one chunk, and the same with ``MALLOC_ARENA_MAX`` set or not (``benchmarks/README.md``, "Memory and
capacity"). What it costs: a large block's pages are faulted in afresh each time, in kernel time: an FP16 cache's chunked
prefill at 4,096 tokens ran at 155 tokens/s against 278, its decode at 12.3 against 14.3 (its reads of the
history are larger than the threshold; the quantized tiers' fused reads are not).

:func:`settle` fixes both once per process (:func:`kvguard.models.load` calls it), unless the environment already
sets them (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), and does nothing where the C library is not
glibc.

:func:`release` hands the heap's free pages back to the kernel (``malloc_trim``): a server calls it when its batch
empties, since blocks freed in the middle of an arena stay resident until then, whatever the trim threshold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

MMAP_THRESHOLD = 512 << 10
TRIM_THRESHOLD = 4 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def _libc():
    """glibc, or ``None`` where the C library is another (whose allocator has its own rules)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def settle() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module docstring); whether they were set here."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # the user's settings stand
    libc = _libc()
    if libc is None:
        return False
    mmap_set = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return mmap_set and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release() -> bool:
    """Return every free page of the C heap to the kernel (glibc's ``malloc_trim(0)``, all arenas); whether it
    could (False where the C library is not glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
