"""The backing tier: the full-precision originals of quantized tokens, kept in a bounded, slower store.

When a layer quantizes a group of tokens (:meth:`Store.append <kvguard.store.Store.append>`), it hands the group's
K/V, exactly as its full-precision window held them (``CacheConfig.fp_dtype``, float16 by default), to the cache's
:class:`BackingStore`, and :meth:`BackingStore.restore` gives them back bit for bit, so the feedback loop can put a
token's original K/V into the overlay instead of recomputing an approximation of it against the already-quantized
past (:mod:`kvguard.control.recompute`).

**One level down from the hot cache.** A byte resident in RAM is a byte used, whatever tier it is in: on a CPU the
hot cache already lives in RAM, so originals kept "in host memory" would cost more than an FP16 cache alone. Where
the originals go is :class:`Tier`:

- ``disk`` (the default for a CPU cache): one file under ``BackingConfig.directory`` (default
  ``$KVGUARD_HOME/backing``), written and read with ordinary ``pwrite`` / ``preadv`` calls into the tensors, so
  its pages live in the kernel's page cache, which the kernel reclaims, not in the process's resident set. The file
  is unlinked as soon as it is created: it goes when the store is collected, or with the process, whatever
  happens to it. A directory that is missing or not writable is a clear error when the cache is built; a full
  one (``ENOSPC``) stops the tier keeping new groups, with one warning, and the loop recomputes the positions it
  does not hold instead of failing.
- ``host``: tensors in host memory (pinned when the hot cache is on an accelerator, where host memory is the
  slower tier and a copy back is one transfer).

The store is bounded either way. ``BackingConfig.max_bytes`` caps the bytes it holds over all layers of one cache,
and it evicts **oldest first**: the group of the lowest absolute position goes first, over all layers (the lowest
layer first among equal positions), so every layer keeps the same most recent positions. Not the order of storing: a
forward pass stores all of layer 0's groups before layer 1's, and first-stored-first-evicted would empty the lower
layers on a long prompt. Whole groups are the unit (``group_size`` tokens of one layer, as they were quantized); a
group larger than the whole cap is not kept. Positions evicted, never quantized, or dropped by a sliding layer are
reported *missing* and fall back to recomputation.

Layout: a layer's entry is a list of chunks in ascending position order, each ``[B, H_kv, group_size, D]`` keys and
values plus its first absolute position (in memory, or a slot of the file: keys then values, bytes as stored).
Every layer of one cache shares one store (and so one cap); its bytes are not the hot cache's
(``KVGuardCache.nbytes`` leaves them out; ``backing_bytes`` reports them, ``ram_bytes`` / ``disk_bytes`` say where).
"""

from __future__ import annotations

import bisect
import errno
import os
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable

import torch


class Tier(str, Enum):
    """Where the originals are kept (see the module docstring)."""

    AUTO = "auto"  # disk for a CPU cache, pinned host memory for a cache on an accelerator
    DISK = "disk"
    HOST = "host"


def default_directory() -> Path:
    """``$KVGUARD_HOME/backing`` (default ``~/.cache/kvguard/backing``)."""
    from kvguard.models import kvguard_home

    return kvguard_home() / "backing"


@dataclass(frozen=True)
class BackingConfig:
    """Whether a cache keeps the full-precision originals of the tokens it quantizes, where, and how many bytes.

    Attributes:
        enabled: off by default: the store costs a copy per quantized group, and RAM on the ``host`` tier.
        max_bytes: cap over all layers of one cache (keys and values); oldest groups are evicted first.
            256 MiB holds SmolLM2-135M's 30 layers for about 11,600 tokens at float16 (22.5 KiB per token).
        tier: where the originals go (:class:`Tier`); ``auto``: on disk for a CPU cache, pinned host memory for a
            cache on an accelerator.
        directory: the folder of the ``disk`` tier's file (``None``: :func:`default_directory`, created if
            missing); it must exist and be writable.
    """

    enabled: bool = False
    max_bytes: int = 256 * 2**20
    tier: Tier = Tier.AUTO
    directory: str | None = None

    def __post_init__(self) -> None:
        if int(self.max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0 (a byte count), got {self.max_bytes}")
        try:
            object.__setattr__(self, "tier", Tier(self.tier))
        except ValueError:
            raise ValueError(f"tier has to be one of {[t.value for t in Tier]} but got {self.tier!r}") from None


@dataclass(frozen=True)
class Restored:
    """What :meth:`BackingStore.restore` found for one layer.

    Attributes:
        positions: ``[R]`` the absolute positions held, ascending.
        keys, values: ``[B, H_kv, R, D]`` their original K/V, on the device asked for.
        missing: ``[M]`` the positions asked for that the store does not hold, ascending.
    """

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    missing: torch.Tensor


@dataclass
class _Chunk:
    """One group's originals: in memory (``keys`` / ``values``), or at ``slot`` of the disk tier's file."""

    first: int  # absolute position of its first token
    shape: tuple[int, ...]  # [B, H_kv, n, D] of keys (and of values)
    dtype: torch.dtype
    keys: torch.Tensor | None = None  # host memory
    values: torch.Tensor | None = None
    slot: int | None = None  # byte offset in the file

    @property
    def length(self) -> int:
        return self.shape[-2]

    @property
    def nbytes(self) -> int:
        return 2 * _numel(self.shape) * _itemsize(self.dtype)


@dataclass
class _LayerEntry:
    chunks: list[_Chunk] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)  # chunks[i].first, for bisect


class _File:
    """The disk tier's one file: slots of ``nbytes`` bytes, reused once freed (every chunk of a cache has the same
    size, but a batch reorder can change it), written and read with positional calls, never mapped."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise FileNotFoundError(f"the backing tier's directory {str(directory)!r} does not exist: create it, or "
                                    "choose another with BackingConfig(directory=...)")
        try:
            handle = tempfile.TemporaryFile(dir=directory, prefix="kvguard-backing-")  # unlinked at once
        except OSError as err:
            raise PermissionError(f"the backing tier cannot write in {str(directory)!r} ({err.strerror}): choose a "
                                  "writable directory with BackingConfig(directory=...)") from None
        self.directory = directory
        self.fd = os.dup(handle.fileno())
        handle.close()
        self._close = weakref.finalize(self, os.close, self.fd)
        self.size = 0  # bytes the file spans
        self._free: dict[int, list[int]] = {}  # slot size -> free offsets

    def write(self, tensors: tuple[torch.Tensor, ...]) -> int:
        """Write the tensors' bytes one after another into a free slot; its offset. ``OSError`` if the disk is full."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        free = self._free.get(nbytes)
        offset = free.pop() if free else self.size
        views = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors]
        written = os.pwritev(self.fd, views, offset)
        if written != nbytes:
            raise OSError(errno.ENOSPC, f"short write ({written} of {nbytes} bytes)")
        self.size = max(self.size, offset + nbytes)
        return offset

    def read(self, offset: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """Fill the tensors (contiguous, on the CPU) with the bytes at ``offset``."""
        views = [memoryview(t.view(torch.uint8).reshape(-1).numpy()) for t in tensors]
        nbytes = sum(len(v) for v in views)
        if os.preadv(self.fd, views, offset) != nbytes:
            raise OSError(errno.EIO, f"short read at {offset} of the backing file")

    def release(self, offset: int, nbytes: int) -> None:
        self._free.setdefault(nbytes, []).append(offset)


class BackingStore:
    """The originals of one cache's quantized tokens, per layer, under one byte cap (see the module doc)."""

    def __init__(self, config: BackingConfig, *, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._layers: dict[int, _LayerEntry] = {}
        self._bytes = 0
        self.evicted_tokens = 0  # (layer, position) pairs evicted by the cap since creation
        self.dropped_tokens = 0  # (layer, position) pairs not kept because the disk was full
        self.failure: str | None = None  # why the disk tier stopped keeping groups (a full disk)
        self._file: _File | None = None
        if config.tier is not Tier.HOST:
            directory = Path(config.directory).expanduser() if config.directory else default_directory()
            if config.directory is None:
                directory.mkdir(parents=True, exist_ok=True)
            self._file = _File(directory)  # checked now: a bad directory is an error when the cache is built

    def _on_disk(self, source: torch.Tensor) -> bool:
        """Whether originals of a cache on ``source``'s device go to the file."""
        tier = self.config.tier
        return tier is Tier.DISK or (tier is Tier.AUTO and source.device.type == "cpu")

    # ---------------------------------------------------------------- writing
    def put(self, layer: int, first: int, keys: torch.Tensor, values: torch.Tensor, group_size: int) -> None:
        """Keep ``keys`` / ``values`` (``[B, H_kv, n, D]``, positions ``first .. first + n - 1`` of ``layer``) in
        chunks of ``group_size`` tokens, evicting the oldest chunks over the cap."""
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"put expects keys and values of one [B, H_kv, n, D] shape, got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}")
        entry = self._layers.setdefault(layer, _LayerEntry())
        if entry.chunks and first < entry.chunks[-1].first + entry.chunks[-1].length:
            raise ValueError(f"layer {layer}: positions must be stored in ascending order; got {first} after "
                             f"{entry.chunks[-1].first + entry.chunks[-1].length - 1}")
        on_disk = self._on_disk(keys)
        for start in range(0, keys.shape[-2], group_size):
            k, v = keys[..., start:start + group_size, :], values[..., start:start + group_size, :]
            chunk = _Chunk(first + start, tuple(k.shape), k.dtype)
            if chunk.nbytes > self.config.max_bytes:
                continue
            if on_disk:
                if not self._write(chunk, k, v):
                    continue
            else:
                chunk.keys, chunk.values = self._host_copy(k), self._host_copy(v)
            entry.chunks.append(chunk)
            entry.firsts.append(chunk.first)
            self._bytes += chunk.nbytes
            self._evict()

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        # Copies (not views): a view would keep the whole block alive after its neighbours are evicted. From an
        # accelerator into pinned memory, so that a restore is one transfer back.
        pin = t.device.type != "cpu" and self.device.type == "cpu" and torch.cuda.is_available()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device, pin_memory=pin)
        return out.copy_(t)

    def _write(self, chunk: _Chunk, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write a chunk to the file; ``False`` (and the tier stops keeping groups) when the disk is full."""
        if self.failure is not None:
            self.dropped_tokens += chunk.length
            return False
        try:
            chunk.slot = self._file.write((k.cpu(), v.cpu()))
            return True
        except OSError as err:
            self.failure = (f"the backing tier's disk is full or failing in {str(self._file.directory)!r} "
                            f"({err.strerror or err}): originals are no longer kept, and positions it does not hold "
                            f"are recomputed")
            warnings.warn(self.failure, RuntimeWarning, stacklevel=3)
            self.dropped_tokens += chunk.length
            return False

    def _load(self, chunk: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's keys and values on the CPU (read back from the file when it is there)."""
        if chunk.slot is None:
            return chunk.keys, chunk.values
        k, v = torch.empty(chunk.shape, dtype=chunk.dtype), torch.empty(chunk.shape, dtype=chunk.dtype)
        self._file.read(chunk.slot, (k, v))
        return k, v

    def _evict(self) -> None:
        while self._bytes > self.config.max_bytes:
            # A layer's chunks ascend, so its first is its oldest.
            layer = min((l for l, e in self._layers.items() if e.chunks), key=lambda l: (self._layers[l].chunks[0].first, l))
            self.evicted_tokens += self._pop_front(layer)

    def _forget(self, chunk: _Chunk) -> None:
        self._bytes -= chunk.nbytes
        if chunk.slot is not None:
            self._file.release(chunk.slot, chunk.nbytes)

    def _pop_front(self, layer: int) -> int:
        """Drop ``layer``'s oldest chunk; returns its token count."""
        entry = self._layers[layer]
        chunk = entry.chunks.pop(0)
        entry.firsts.pop(0)
        self._forget(chunk)
        return chunk.length

    def drop_before(self, layer: int, position: int) -> None:
        """Forget ``layer``'s chunks that end before ``position`` (a sliding layer no longer holds them)."""
        entry = self._layers.get(layer)
        while entry is not None and entry.chunks and entry.chunks[0].first + entry.chunks[0].length <= position:
            self._pop_front(layer)

    def clear(self, layer: int | None = None) -> None:
        """Forget one layer's originals (its cache layer was reset), or everything."""
        for l in [layer] if layer is not None else list(self._layers):
            entry = self._layers.pop(l, None)
            for chunk in [] if entry is None else entry.chunks:
                self._forget(chunk)

    def map_batch(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch reorder / selection ``fn`` (on dimension 0) to ``layer``'s originals, as the cache
        layer applies it to its own tensors, so the store stays aligned with the batch."""
        entry = self._layers.get(layer)
        if entry is None:
            return
        kept = []
        for chunk in entry.chunks:
            k, v = self._load(chunk)
            self._forget(chunk)
            k, v = fn(k), fn(v)
            moved = _Chunk(chunk.first, tuple(k.shape), k.dtype)
            if chunk.slot is not None:
                if not self._write(moved, k, v):
                    continue
            else:
                moved.keys, moved.values = k, v
            self._bytes += moved.nbytes
            kept.append(moved)
        entry.chunks, entry.firsts = kept, [c.first for c in kept]
        self._evict()

    # ---------------------------------------------------------------- reading
    def positions(self, layer: int) -> torch.Tensor:
        """``[N]`` the absolute positions held for ``layer``, ascending."""
        entry = self._layers.get(layer)
        if entry is None or not entry.chunks:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(c.first, c.first + c.length) for c in entry.chunks])

    def restore(self, layer: int, positions, device: torch.device | str | None = None) -> Restored:
        """The originals of ``layer`` at absolute ``positions`` (``[P]``, unique), bit for bit, moved to
        ``device``; positions not held come back in ``Restored.missing``."""
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1).cpu().unique()  # sorted
        device = torch.device(device) if device is not None else self.device
        entry = self._layers.get(layer) or _LayerEntry()
        found, ks, vs, missing = [], [], [], []
        loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # chunk index -> its K/V, read once
        for p in pos.tolist():
            i = bisect.bisect_right(entry.firsts, p) - 1
            if i >= 0 and p < entry.chunks[i].first + entry.chunks[i].length:
                chunk = entry.chunks[i]
                if i not in loaded:
                    loaded[i] = self._load(chunk)
                k, v = loaded[i]
                found.append(p)
                ks.append(k[..., p - chunk.first, :])
                vs.append(v[..., p - chunk.first, :])
            else:
                missing.append(p)
        if not found:
            empty = torch.zeros(0, device=device)  # nothing held: no batch or head shape to give
            return Restored(_long(found), empty, empty, _long(missing))
        keys = torch.stack(ks, dim=-2).to(device)  # [B, H_kv, R, D]
        values = torch.stack(vs, dim=-2).to(device)
        return Restored(_long(found), keys, values, _long(missing))

    def nbytes(self, layer: int | None = None) -> int:
        """Bytes of the originals held, for one layer or the whole store (RAM and disk)."""
        if layer is None:
            return self._bytes
        entry = self._layers.get(layer)
        return 0 if entry is None else sum(c.nbytes for c in entry.chunks)

    def disk_nbytes(self) -> int:
        """Bytes of the originals held in the file."""
        return sum(c.nbytes for e in self._layers.values() for c in e.chunks if c.slot is not None)

    def ram_nbytes(self) -> int:
        """Bytes of the originals held in memory (host RAM; on the CPU, the same RAM as the hot cache)."""
        return self._bytes - self.disk_nbytes()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
