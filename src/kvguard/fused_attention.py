"""Decode attention that reads the quantized cache's codes directly, without materializing the history.

For a decode step (at most :data:`MAX_QUERY` new tokens) a layer hands the attention harness
(:mod:`kvguard.attention`) a :class:`~kvguard.stored_read.StoredRead`: the segments of its stored past, as they
were before this step's tokens were appended, and :func:`attend` computes

    softmax(q . k / sqrt(D) + mask) @ v

over them segment by segment, in columns ``[ sinks | run 0 parts | ... | window | new tokens ]`` (the same
columns, hence the same mask, as the materialized tensor):

- **scores**: quantized parts by :func:`key_scores` in C++ (``fused_attention.cpp``: unpack one token's codes
  eight at a time, dequantize them as ``QuantizedTensor.dequantize`` does, dot them with every query row the
  KV head serves, grouped-query heads and query tokens together, four rows per pass), full-precision segments (sinks, window, FP16
  parts, the new tokens, overlay positions) by plain matmuls. Keys stored rotated (``k @ R``) are scored
  against the rotated query ``q @ R``: ``q . k = (q R) . (k R)``. Keys stored before RoPE
  (``CacheConfig.prerope_keys``) are turned in the kernel, key by key: rotated back, then turned by RoPE's row
  at their position (``StoredSegment.key_turn``).
- **softmax** over the whole row at once, after the mask transformers passed (boolean or additive; ``None``
  for an unpadded one-token step) and soft-capping, so the probabilities equal the reference's up to float
  summation order. The score row is ``H_q * T_q * N`` floats, tiny next to the ``2 * H_kv * N * D`` of K/V.
- **values**: quantized parts by :func:`value_accumulate` (the same unpack-dequantize loop, accumulating
  ``p * v`` per token block, blocks summed in a fixed order so the result does not depend on the thread
  count), the rest by matmuls; values stored rotated give ``(p @ v R) R^T``. Overlay positions (``write_fp``)
  are scored from the overlay, and their columns are zeroed in the probabilities the run parts read.

The common step, one new token without a mask, takes one kernel for the whole read, ``decode_attend``
(:func:`attend_steps`): scores, softmax and values in one pass per head over every segment where it lies (float16
rows, or codes dequantized in registers), for every sequence of a server's batch in one call.

The C++ kernels are compiled by the install (``make install`` runs ``python -m kvguard.fused_attention
--build``) with ``torch.utils.cpp_extension`` into :func:`build_dir` (the venv, or ``$KVGUARD_HOME/kernels``
outside one), for this machine's CPU (``-O3 -march=native``, OpenMP through ``at::parallel_for``). At run time
:func:`kernels` loads the built module; if it is missing, stale (the source changed since) or fails to load,
kvguard warns once and every read goes through :mod:`kvguard.chunk_attention` (a tile of dequantized history at
a time), as longer chunks always do.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

import torch

from kvguard import chunk_attention, scale_codes, score_bias
from kvguard.quantizer import Axis, QuantizedTensor
from kvguard.stored_read import StoredRead, StoredSegment

MAX_QUERY = 8  # query tokens per step read through the kernels; a longer chunk reads tiles (chunk_attention)
NAME = "kvguard_decode_attention"
SOURCE = Path(__file__).with_name("fused_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_LOADED: list = []  # [module or None] once loading was tried


# ------------------------------------------------------------------------------------------ the extension
def build_dir() -> Path:
    """Where the compiled kernels live: inside the venv, or ``$KVGUARD_HOME/kernels`` (default
    ``~/.cache/kvguard/kernels``) for an interpreter outside one."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "kvguard-kernels"
    home = os.environ.get("KVGUARD_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvguard")
    return Path(home).expanduser() / "kernels"


def _source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()


def build(verbose: bool = False):
    """Compile the kernels into :func:`build_dir` (needs a C++ compiler and ninja; offline) and return them."""
    from torch.utils.cpp_extension import load

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    module = load(name=NAME, sources=[str(SOURCE)], build_directory=str(folder), extra_cflags=_FLAGS,
                  extra_ldflags=["-fopenmp"], verbose=verbose)
    (folder / "source.sha256").write_text(_source_hash())
    _LOADED[:] = [module]
    return module


def _load_built():
    folder = build_dir()
    library, stamp = folder / f"{NAME}.so", folder / "source.sha256"
    if not library.exists() or not stamp.exists():
        raise FileNotFoundError(f"no built kernels in {folder}")
    if stamp.read_text().strip() != _source_hash():
        raise RuntimeError(f"the kernels in {folder} were built from another version of {SOURCE.name}")
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels():
    """The compiled kernels, or ``None`` (with one warning) when they are not built or do not load."""
    if not _LOADED:
        try:
            _LOADED.append(_load_built())
        except (OSError, RuntimeError, ImportError) as err:
            _LOADED.append(None)
            warnings.warn(f"kvguard's fused decode attention is unavailable ({err}); decoding dequantizes the cache "
                          f"at every step instead. Build it with: python -m kvguard.fused_attention --build",
                          RuntimeWarning, stacklevel=2)
    return _LOADED[0]


def available(device: torch.device | None = None) -> bool:
    """Whether the kernels are built and loaded and, given a ``device``, can read tensors there: they are C++ CPU
    code, so a cache on a GPU reads its history the materializing way (through the dequantizing torch ops)."""
    return (device is None or device.type == "cpu") and kernels() is not None


# ------------------------------------------------------------------------------------------ attention
_NO_TABLE = torch.empty(0, dtype=torch.float16)
_NO_TURN = torch.empty(0, dtype=torch.float32)


def _codes(x: QuantizedTensor, batch: int, heads: int) -> tuple:
    """The kernel arguments of a quantized part: codes, scale, zero, scale-code table, bits, tokens per scale
    row, channels per scale entry (see ``fused_attention.cpp``)."""
    spec, (tokens, dim) = x.spec, x.shape[-2:]
    codes = x.qdata.view(torch.uint8) if x.qdata.dtype == torch.int8 else x.qdata
    # One-byte scales go as their codes, with the table of their values: the kernel decodes them as it reads
    # (decoding them here, at every step, cost about a tenth of a SmolLM2 decode step at 4,096 tokens).
    table = scale_codes.BYTE_TABLE if spec.scale_bits == 8 else _NO_TABLE
    scale = x.scale
    zero = x.zero_point if x.zero_point is not None else torch.empty(0, dtype=scale.dtype)
    if spec.static:
        # One calibrated [1, h, 1, D] scale shared by every token: row 0 for all of them.
        return codes, scale.expand(batch, heads, 1, dim), zero, table, 8, max(tokens, 1), 1
    if spec.axis is Axis.CHANNEL:
        return codes, scale, zero, table, spec.precision.bits, spec.group_size, 1
    return codes, scale, zero, table, spec.precision.bits, 1, spec.group_size


def _score_segment(ops, scores: torch.Tensor, q: torch.Tensor, seg: StoredSegment, correct: bool = False) -> None:
    qs = q if seg.heads is None else q.index_select(1, seg.heads)
    if seg.key_signs is not None and seg.key_turn is None:
        qs = qs @ seg.rotation  # (q R) . (k R) = q . k
    if isinstance(seg.keys, QuantizedTensor):
        heads = seg.heads if seg.heads is not None else torch.empty(0, dtype=torch.long)
        # The kernel adds the softmax-bias correction (score_bias.correction) itself, in the keys' (rotated)
        # basis, once per scale row: as separate tensor ops it cost 7-9 % of a SmolLM2 decode step at 4,096 tokens.
        turn = (_NO_TURN, _NO_TURN) if seg.key_turn is None else seg.key_turn
        signs = _NO_TURN if seg.key_signs is None or seg.key_turn is None else seg.key_signs.contiguous()
        ops.key_scores(scores, seg.start, heads, qs.contiguous(), *_codes(seg.keys, q.shape[0], qs.shape[1]),
                       correct and score_bias.applies(seg.keys.spec), signs, *turn)
        return
    if seg.key_turn is not None:  # only quantized parts store keys before RoPE; plain keys would go unturned
        raise ValueError("keys stored before RoPE must come as codes (a QuantizedTensor) for the kernel to turn them")
    part = qs @ seg.keys.to(torch.float32).transpose(-1, -2)  # [B, h, R, T]
    if seg.heads is None:
        scores[..., seg.start:seg.start + seg.length] = part
    else:
        scores[:, seg.heads, :, seg.start:seg.start + seg.length] = part


def _read_segment(ops, probs: torch.Tensor, out: torch.Tensor, seg: StoredSegment) -> None:
    if isinstance(seg.values, QuantizedTensor):
        heads = seg.heads if seg.heads is not None else torch.empty(0, dtype=torch.long)
        h = out.shape[1] if seg.heads is None else seg.heads.numel()
        part = ops.value_accumulate(probs, seg.start, heads, *_codes(seg.values, out.shape[0], h), out.shape[-1])
    else:
        p = probs[..., seg.start:seg.start + seg.length]
        p = p if seg.heads is None else p.index_select(1, seg.heads)
        part = p @ seg.values.to(torch.float32)  # [B, h, R, D]
    if seg.value_signs is not None:
        part = part @ seg.rotation.transpose(-1, -2)  # (p @ v R) R^T = p @ v
    if seg.heads is None:
        out += part
    else:
        out.index_add_(1, seg.heads, part)


def _mask_(scores: torch.Tensor, attention_mask: torch.Tensor | None, rep: int, stored: int) -> None:
    """Apply transformers' mask (``[B, 1, T_q, >= N]``, boolean: True attends; or additive float) in place;
    without one, causality among several new tokens."""
    b, hkv, r, n = scores.shape
    tq = r // rep
    view = scores.view(b, hkv, rep, tq, n)
    if attention_mask is None:
        if tq > 1:
            future = torch.ones(tq, tq, dtype=torch.bool, device=scores.device).triu(1)
            view[..., stored:].masked_fill_(future, float("-inf"))
        return
    mask = attention_mask[..., :n].unsqueeze(2)  # [B, 1, 1, T_q, N]
    if mask.dtype == torch.bool:
        view.masked_fill_(~mask, float("-inf"))
    else:
        view.add_(mask.to(scores.dtype))


def attend(query: torch.Tensor, read: StoredRead, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, *, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``query`` (``[B, H_q, T_q, D]``) over ``read`` followed by the new ``key`` / ``value``
    (``[B, H_kv, T_q, D]``): ``[B, H_q, T_q, D]`` in the query's dtype.

    A decode step (at most :data:`MAX_QUERY` query tokens, on the CPU, kernels built) reads the codes in C++ (one
    new token without a mask, the common step, in one pass: :func:`attend_steps`); a longer chunk, or a step the
    kernels cannot take, reads the history a tile at a time (:mod:`kvguard.chunk_attention`), whose scores are
    not bias-corrected."""
    if direct(read, query, key, attention_mask, softcap):
        return _attend_direct(query, read, key, value, scaling)
    if query.shape[2] <= MAX_QUERY and available(query.device):
        return attend_with_probs(query, read, key, value, attention_mask, scaling=scaling, softcap=softcap)[0]
    if read.score_correction and any(seg.quantized for seg in read.segments):
        warnings.warn(UNCORRECTED, RuntimeWarning, stacklevel=2)
    return chunk_attention.attend(query, read, key, value, attention_mask, scaling=scaling, softcap=softcap)


_PLAIN_DTYPES = (torch.float16, torch.float32)  # the plain rows decode_attend reads


def direct(read: StoredRead, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None = None,
           softcap: float | None = None) -> bool:
    """Whether the kernels' one-pass ``decode_attend`` can take this step of ``query`` / ``key`` over ``read``: one
    new token, no mask, no soft cap, kernels built, on the CPU, no keys stored before RoPE, no softmax-bias
    correction, plain rows in float16 / float32 (any other step goes through :func:`attend_with_probs`)."""
    if query.shape[2] != 1 or attention_mask is not None or softcap is not None or read.score_correction:
        return False
    if query.device.type != "cpu" or kernels() is None:
        return False
    overlay = read.overlay_keys is not None and read.overlay_keys.dtype not in _PLAIN_DTYPES
    if key.dtype not in _PLAIN_DTYPES or overlay:
        return False
    return all(seg.key_turn is None and (seg.quantized or seg.keys.dtype in _PLAIN_DTYPES)
               and (isinstance(seg.values, QuantizedTensor) or seg.values.dtype in _PLAIN_DTYPES)
               for seg in read.segments)


def _attend_direct(query: torch.Tensor, read: StoredRead, key: torch.Tensor, value: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    return attend_steps([(query, read, key, value)], scaling=scaling)[0][0]


def attend_steps(steps: Sequence[tuple[torch.Tensor, StoredRead, torch.Tensor, torch.Tensor]], *, scaling: float,
                 probabilities: Sequence[bool] = ()) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One new token's attention for many sequences at once (a server's batch at one layer), each step
    ``(query [B, H_q, 1, D], read, key, value [B, H_kv, 1, D])`` with :func:`direct` true: per step its output
    ``[B, H_q, 1, D]`` and, where ``probabilities`` says so, the softmax ``[B, H_kv, rep, N]`` (float32; the
    stored columns then the new token's), which the run-time monitor reads; else ``None``.

    The kernels' ``decode_attend`` reads every stored segment where it lies (float16 rows, or codes dequantized in
    registers), scores, softmax and values in one pass per head, and every sequence in one parallel region. In a
    16-sequence SmolLM2 decode step at about 600 tokens, per sequence and layer: for an FP16 cache, copying the
    rows into one float32 buffer per side and two products took 141 us, a kernel call per sequence 56 us, one
    call for all of them 38 us; for INT4, the segment-by-segment read (:func:`attend_with_probs`, a dozen
    small torch ops around its two kernel calls) took 215 us, the one pass 53 us."""
    qs, columns, segments, overlays = [], [], [], []
    for query, read, key, value in steps:
        b, hq, _, d = query.shape
        hkv = key.shape[1]
        # Query head i reads KV head i // rep: [B, H_q, 1, D] -> [B, H_kv, rep, D].
        qs.append((query.to(torch.float32) * scaling).reshape(b, hkv, hq // hkv, d).contiguous())
        columns.append(read.length + 1)
        segments.append([_segment(seg, b, hkv) for seg in read.segments]
                        + [(read.length, 1, None, _rows(key), _rows(value), None, None)])
        overlays.append(None if read.overlay_columns is None else
                        (read.overlay_columns, _rows(read.overlay_keys), _rows(read.overlay_values)))
    wanted = [bool(w) for w in probabilities] + [False] * (len(steps) - len(probabilities))
    outs = kernels().decode_attend(qs, columns, segments, overlays, wanted)
    probs = iter(outs[len(steps):])
    return [(out.reshape(query.shape).to(query.dtype), next(probs) if want else None)
            for out, (query, *_), want in zip(outs, steps, wanted)]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _segment(seg: StoredSegment, batch: int, hkv: int) -> tuple:
    """``seg`` as ``decode_attend`` takes it: (start, length, heads, keys, values, key rotation, value rotation),
    a side as its rows or its codes (:func:`_codes`), a rotation as its ``[h, D, D]`` float32 matrices."""
    h = hkv if seg.heads is None else seg.heads.numel()
    rotation = None if seg.rotation is None else seg.rotation.to(torch.float32).contiguous()

    def side(x):
        return _codes(x, batch, h) if isinstance(x, QuantizedTensor) else _rows(x)

    heads = None if seg.heads is None else seg.heads.contiguous()
    return (seg.start, seg.length, heads, side(seg.keys), side(seg.values),
            rotation if seg.key_signs is not None else None, rotation if seg.value_signs is not None else None)


# Said once per place where a read applies no softmax-bias correction although the cache asks for it.
UNCORRECTED = ("score_correction is on, but this read dequantizes the stored keys (a chunk of more than "
                f"{MAX_QUERY} tokens, or a cache the fused CPU kernels cannot read): the softmax-bias correction "
                "applies only where they read the codes, so these scores are uncorrected")


def attend_with_probs(query: torch.Tensor, read: StoredRead, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, scaling: float,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend`, plus the attention probabilities ``[B, H_kv, rep * T_q, N]`` (float32; rows are
    (query head within the KV head's group, query token), columns the stored tokens then the new ones), which
    the run-time monitor reads its entropy from."""
    ops = kernels()
    if ops is None:
        raise RuntimeError("the fused decode attention is not built: python -m kvguard.fused_attention --build")
    b, hq, tq, d = query.shape
    hkv = key.shape[1]
    rep, n = hq // hkv, read.length + tq
    # Query head i reads KV head i // rep: [B, H_q, T_q, D] -> [B, H_kv, rep * T_q, D], rows (head, token).
    q = (query.to(torch.float32) * scaling).reshape(b, hkv, rep * tq, d).contiguous()
    scores = torch.empty(b, hkv, rep * tq, n, dtype=torch.float32, device=query.device)
    for seg in read.segments:
        _score_segment(ops, scores, q, seg, read.score_correction)
    scores[..., read.length:] = q @ key.to(torch.float32).transpose(-1, -2)
    overlay = read.overlay_columns
    if overlay is not None:
        scores[..., overlay] = q @ read.overlay_keys.to(torch.float32).transpose(-1, -2)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    _mask_(scores, attention_mask, rep, read.length)
    probs = torch.softmax(scores, dim=-1)  # [B, H_kv, R, N]
    out = probs[..., read.length:] @ value.to(torch.float32)  # [B, H_kv, R, D]
    stored = probs
    if overlay is not None:
        out += probs[..., overlay] @ read.overlay_values.to(torch.float32)
        stored = probs.clone()
        stored[..., overlay] = 0.0  # the overlay wins over the codes at these positions
    for seg in read.segments:
        _read_segment(ops, stored, out, seg)
    return out.view(b, hkv, rep, tq, d).reshape(b, hq, tq, d).to(query.dtype), probs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard.fused_attention",
                                     description="build kvguard's fused decode attention kernels")
    parser.add_argument("--build", action="store_true", help=f"compile {SOURCE.name} into the build folder")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    build(verbose=args.verbose)
    print(f"kvguard: fused decode attention built in {build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
