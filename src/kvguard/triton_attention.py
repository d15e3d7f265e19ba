"""Decode attention over a layer's stored past (a :class:`~kvguard.stored_read.StoredRead`), reading its packed
codes in Triton.

:func:`decode_attention` computes what the model computes from ``read.materialize()`` (softmax attention of a
few query tokens over the stored past, plus optional new tokens), without dequantizing the cache into memory:

- **Quantized parts** (a run's heads sharing an integer precision) go through one Triton kernel each. A program
  takes one batch row, one KV head and one split of the part's tokens, holds all the query rows of that KV head
  (the ``rep`` query heads of a GQA group times the query tokens), walks its split in tiles of ``BLOCK_N`` tokens,
  unpacks and dequantizes each tile in registers, and keeps an online softmax (flash-decoding). It writes the
  split's normalized output and log-sum-exp; the splits are merged in torch.
- **Full-precision segments** (sinks, window, ``fp16`` heads of a run, overlay positions, new tokens) are plain
  torch attention, each giving an output and a log-sum-exp.
- Every segment covers some query heads and some key positions; outputs are merged by log-sum-exp. Overlay
  positions are masked out of the part that holds their codes (``-inf``) and attended from the overlay instead,
  which is what ``materialize`` does when the overlay wins.

Codes are read as :mod:`kvguard.packing` stores them: each token's row is a little-endian bit stream, code ``d``
at bits ``[d * bits, (d + 1) * bits)`` (INT3: eight codes in three bytes, a code may straddle two bytes), INT8 as
signed bytes. Dequantization is :mod:`kvguard.quantizer`'s, in float32: ``q * s + z`` (``q * s`` for INT8), with
``s`` / ``z`` the stored float16 values; keys have one scale per channel and group of ``group_size`` tokens
(``[B, h, T/G, D]``), values one per token and group of channels (``[B, h, T, D/G]``), calibrated INT8 one per
channel (``[1, h, 1, D]``). The kernels' reading is the same bit for bit (:func:`dequantize` exposes it for tests;
they are compiled without FP fusion, so no GPU contracts ``q * s + z`` into an FMA either). The attention equals
the reference up to float32 summation order (tiled dot products, online softmax, the log-sum-exp merges), and up
to rounding for rotated heads (the query is rotated, ``q R . k_r``, instead of every key rotated back, and the
output is rotated back once, ``(p v_r) R^T``).

Device: the tensors stay where the cache holds them. On CUDA the kernels run compiled; on CPU they run only in
Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before ``triton.language`` is first
imported (Triton decorates its library and these kernels then; ``torch._dynamo`` imports it, and transformers can
import that): set it before importing transformers. :func:`decode_attention` refuses CPU tensors otherwise.
Triton is optional: importing this module without it raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kvguard import rotation
from kvguard.quantizer import Axis, QuantizedTensor
from kvguard.stored_read import StoredRead, StoredSegment

TRITON_INSTALL_HINT = "pip install triton==3.9.0  (or `make install`, which installs requirements.txt)"

try:
    import triton
    import triton.language as tl
except ImportError as err:  # optional: only the Triton path needs it
    raise ImportError(f"kvguard.triton_attention needs Triton: {TRITON_INSTALL_HINT}") from err

# Read once, as triton.jit does when it decorates the kernels below: they are interpreted exactly when this is set.
INTERPRETED = bool(triton.knobs.runtime.interpret)


# ---------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _dequantize_tile(codes, scale, zero, t, d, t_ok, c_st, c_sd, s_st, s_sd,
                     BITS: tl.constexpr, GT: tl.constexpr, GD: tl.constexpr):
    """Tokens ``t`` ([N]) x channels ``d`` ([D]) of one (batch, head), float32 ``[N, D]``; rows not ``t_ok`` are 0.
    ``codes`` / ``scale`` / ``zero`` point at the (batch, head); scales are per ``GT`` tokens x ``GD`` channels."""
    ok = t_ok[:, None]
    if BITS == 8:
        q = tl.load(codes + t[:, None] * c_st + d[None, :] * c_sd, mask=ok, other=0).to(tl.float32)
    else:
        # The row is a little-endian bit stream: code d starts at bit d * BITS.
        row = codes + t[:, None] * c_st
        if BITS == 3:
            # Eight codes in three bytes: read the group's three bytes whole into a 24-bit word, no load masked by
            # channel. (The earlier reading, byte (3 d) // 8 plus the next byte only where the code spills, gave
            # wrong values for channels 6 and 7 of every 8 in the compiled dequantize kernel with Triton 3.6 on an
            # H200, though not in the attention kernel nor the interpreter; the cause was not established. This
            # reading passed every test compiled there.)
            first = ((d // 8) * 3)[None, :]
            word = tl.load(row + first * c_sd, mask=ok, other=0).to(tl.int32)
            word = word | (tl.load(row + (first + 1) * c_sd, mask=ok, other=0).to(tl.int32) << 8)
            word = word | (tl.load(row + (first + 2) * c_sd, mask=ok, other=0).to(tl.int32) << 16)
            shift = (d % 8) * 3
        else:  # INT4 / INT2: whole codes in each byte
            bit = d * BITS
            word = tl.load(row + (bit // 8)[None, :] * c_sd, mask=ok, other=0).to(tl.int32)
            shift = bit % 8
        q = ((word >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    s_off = (t[:, None] // GT) * s_st + (d[None, :] // GD) * s_sd
    s = tl.load(scale + s_off, mask=ok, other=0).to(tl.float32)
    if BITS == 8:  # symmetric
        return q * s
    z = tl.load(zero + s_off, mask=ok, other=0).to(tl.float32)
    return q * s + z


@triton.jit
def _dequantize_kernel(out, codes, scale, zero, c_sb, c_sh, c_st, c_sd, s_sb, s_sh, s_st, s_sd, tokens, heads,
                       D: tl.constexpr, BLOCK_N: tl.constexpr,
                       BITS: tl.constexpr, GT: tl.constexpr, GD: tl.constexpr):
    """One (batch x head, tile of tokens) of :func:`dequantize`; ``out`` is ``[B, h, T, D]`` float32."""
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    t_ok = t < tokens
    x = _dequantize_tile(codes + b * c_sb + h * c_sh, scale + b * s_sb + h * s_sh, zero + b * s_sb + h * s_sh,
                         t, d, t_ok, c_st, c_sd, s_st, s_sd, BITS, GT, GD)
    tl.store(out + (bh * tokens + t[:, None]) * D + d[None, :], x, mask=t_ok[:, None])


@triton.jit
def _part_attention_kernel(
    q, out, lse, bias,
    kc, ks, kz, kc_sb, kc_sh, kc_st, kc_sd, ks_sb, ks_sh, ks_st, ks_sd,
    vc, vs, vz, vc_sb, vc_sh, vc_st, vc_sd, vs_sb, vs_sh, vs_st, vs_sd,
    bias_sb, bias_sh, bias_sq, bias_st,
    heads, tokens, rep, q_len, split_tokens, n_splits, scaling, softcap,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr, K_GT: tl.constexpr, K_GD: tl.constexpr,
    V_BITS: tl.constexpr, V_GT: tl.constexpr, V_GD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr,
):
    """One (batch x KV head, split of tokens): softmax attention of the head's query rows over the split.

    ``q`` is ``[B, h, BLOCK_M, D]`` float32, row ``r * q_len + i`` = query head ``r`` of the group, token ``i``
    (rows past ``rep * q_len`` are padding). Writes ``out`` ``[B, h, n_splits, BLOCK_M, D]`` (normalized over the
    split) and ``lse`` ``[B, h, n_splits, BLOCK_M]`` (``-inf`` where the split has nothing to attend to).
    ``DOT``: the two products are ``tl.dot`` (which needs ``BLOCK_M >= 16``); otherwise broadcast multiply-sums
    over the ``BLOCK_M`` rows alone (a decode step's few).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b, h = bh // heads, bh % heads
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    row_ok = rows < rep * q_len
    query = tl.load(q + (bh * BLOCK_M + rows[:, None]) * D + d[None, :])
    k_codes, k_scale, k_zero = kc + b * kc_sb + h * kc_sh, ks + b * ks_sb + h * ks_sh, kz + b * ks_sb + h * ks_sh
    v_codes, v_scale, v_zero = vc + b * vc_sb + h * vc_sh, vs + b * vs_sb + h * vs_sh, vz + b * vs_sb + h * vs_sh
    # The mask row of query row (r, i) belongs to query head h * rep + r of the part, token i.
    bias_row = bias + b * bias_sb + (h * rep + rows // q_len) * bias_sh + (rows % q_len) * bias_sq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, tokens)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        k = _dequantize_tile(k_codes, k_scale, k_zero, t, d, t_ok, kc_st, kc_sd, ks_st, ks_sd, K_BITS, K_GT, K_GD)
        if DOT:
            s = tl.dot(query, tl.trans(k), input_precision="ieee") * scaling  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.sum(query[:, None, :] * k[None, :, :], 2) * scaling  # [BLOCK_M, BLOCK_N, D] summed over D
        if SOFTCAP:
            # softcap * tanh(s / softcap), tanh written with exp (no tanh in tl's core)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        if HAS_BIAS:
            s += tl.load(bias_row[:, None] + t[None, :] * bias_st, mask=row_ok[:, None] & t_ok[None, :], other=0.0)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing to attend to yet (all -inf) must not produce exp(-inf - -inf) = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _dequantize_tile(v_codes, v_scale, v_zero, t, d, t_ok, vc_st, vc_sd, vs_st, vs_sd, V_BITS, V_GT, V_GD)
        if DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)  # [BLOCK_M, BLOCK_N, D] over N
        m_i = m_new

    seen = l_i > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    m_final = tl.where(m_i == float("-inf"), 0.0, m_i)
    part_lse = tl.where(seen, m_final + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    slot = bh * n_splits + split
    tl.store(out + (slot * BLOCK_M + rows[:, None]) * D + d[None, :], o)
    tl.store(lse + slot * BLOCK_M + rows, part_lse)


@dataclass(frozen=True)
class Launch:
    """How the attention kernel is launched. ``benchmarks/triton_decode.py --sweep`` (in the history: commit 89134cf) timed the
    alternatives on a GPU; :data:`LAUNCH` is what runs.

    The defaults are the fastest of 36 configurations timed on an H200 for the INT4 part of a SmolLM2-shaped
    layer at 32k tokens (geometric mean over batch 1 and 64; ``benchmarks/DECISIONS.md``): 3.2x faster than the
    first ones (64 tokens, 4 warps, Triton's default stages, 2 programs per multiprocessor, ``tl.dot``) at batch
    64, as fast at batch 1.

    Attributes:
        block_n: tokens per tile.
        num_warps: warps per program.
        num_stages: Triton's software-pipelining stages (None: Triton's default, 3 on Hopper, which ran 1.8x
            slower than 1 at batch 64: the pipelined gathers take shared memory and occupancy).
        programs_per_sm: how many programs (splits of the tokens) to aim for per multiprocessor: a decode step has
            few batch x head programs, and each walks its tokens with little memory parallelism of its own.
        broadcast_limit: the products are broadcast multiply-sums over the query rows (to the next power of two)
            instead of ``tl.dot`` over rows padded to 16 when ``rows x block_n x head_dim`` is at most this: 4 x 32
            x 64 is the case measured faster (SmolLM2's 3 query heads per KV head, one token, 0.71-1.04x the time
            at batch 64). Larger products outgrow the registers (4 x 128 x 64 with 2 warps: 8.7-13.6x slower).
    """

    block_n: int = 32
    num_warps: int = 2
    num_stages: int | None = 1
    programs_per_sm: int = 32
    broadcast_limit: int = 4 * 32 * 64

    def options(self) -> dict:
        """The launch keywords Triton takes besides the kernel's own arguments."""
        extra = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return {"num_warps": self.num_warps, "enable_fp_fusion": False, **extra}


LAUNCH = Launch()


# ---------------------------------------------------------------------------------------------------- codes
@dataclass(frozen=True)
class _Codes:
    """One side of a quantized part as the kernels read it.

    Attributes:
        codes: ``[B, h, T, D * bits / 8]`` packed ``uint8`` (``[B, h, T, D]`` ``int8`` for INT8).
        scale: ``[B, h, T / tokens_per_scale, D / channels_per_scale]`` float16 (stride 0 along shared axes).
        zero: the zero points, same shape and strides as ``scale`` (``scale`` itself for INT8, never read).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    tokens_per_scale: int
    channels_per_scale: int

    @classmethod
    def of(cls, qt: QuantizedTensor) -> "_Codes":
        spec = qt.spec
        b, h, t, d = qt.shape
        stored = qt.scales()  # float16, decoded where stored in one byte
        if spec.static:  # calibrated INT8: one scale per channel, shared by every sequence and token
            scale, gt, gd = stored.expand(b, h, t, d), 1, 1
        elif spec.axis is Axis.CHANNEL:
            scale, gt, gd = stored, spec.group_size, 1
        else:
            scale, gt, gd = stored, 1, spec.group_size
        zero = scale if qt.zero_point is None else qt.zeros()
        if zero.stride() != scale.stride():  # the kernels index both with the scale's strides
            scale, zero = scale.contiguous(), zero.contiguous()
        return cls(qt.qdata, scale, zero, spec.precision.bits, gt, gd)

    def args(self) -> tuple:
        """Pointers and strides in the kernels' order: codes, scale, zero, codes' (b, h, t, d), scale's."""
        return (self.codes, self.scale, self.zero, *_strides(self.codes), *_strides(self.scale))


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 along size-1 axes, so the kernels can broadcast them."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "kvguard.triton_attention runs on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (torch._dynamo imports it, and transformers can import torch._dynamo), "
            "or put the cache on a CUDA device"
        )


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """``qt`` (``[B, h, T, D]``) decoded by the attention kernel's own reading of the codes, float32: equal bit for
    bit to ``qt.dequantize(torch.float32)``. For tests and debugging; :func:`decode_attention` never writes it."""
    _check_device(qt.qdata)
    side = _Codes.of(qt)
    b, h, t, d = qt.shape
    out = torch.empty(b, h, t, d, dtype=torch.float32, device=qt.qdata.device)
    block = 64
    _dequantize_kernel[(b * h, triton.cdiv(t, block))](out, *side.args(), t, h, D=d, BLOCK_N=block, BITS=side.bits,
                                                      GT=side.tokens_per_scale, GD=side.channels_per_scale,
                                                      enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class _Partial:
    """Attention over one segment of keys: ``out`` ``[B, H_q, T_q, D]`` normalized over the segment, ``lse``
    ``[B, H_q, T_q]`` its log-sum-exp (``-inf`` for query heads the segment does not cover)."""

    out: torch.Tensor
    lse: torch.Tensor


def _merge(out: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial softmaxes stacked along ``dim`` of ``lse`` (``out`` has one more trailing axis, D)."""
    m = lse.amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf: weights 0, not nan
    w = torch.exp(lse - m)
    total = w.sum(dim)
    merged = (w.unsqueeze(-1) * out).sum(dim) / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return merged, m.squeeze(dim) + torch.log(total)


def _dense(query, keys, values, bias, scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention over full-precision ``keys`` / ``values`` (``[B, h, n, D]``) for ``query``
    (``[B, h * rep, T_q, D]``, float32): output and log-sum-exp."""
    rep = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(rep, dim=1)  # [B, H_q, n, D]
    v = values.float().repeat_interleave(rep, dim=1)
    s = query @ k.transpose(-1, -2) * scaling  # [B, H_q, T_q, n]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - finite.unsqueeze(-1)) @ v, lse


class _Attention:
    """One call of :func:`decode_attention`: the query (float32), the mask, and the partial results so far."""

    def __init__(self, query: torch.Tensor, kv_heads: int, bias: torch.Tensor | None,
                 scaling: float, softcap: float | None, split_tokens: int | None):
        self.query, self.bias = query.float(), bias
        self.scaling, self.softcap, self.split_tokens = scaling, softcap, split_tokens
        self.rep = query.shape[1] // kv_heads
        self.partials: list[_Partial] = []

    def query_heads(self, kv_heads: torch.Tensor) -> torch.Tensor:
        """The query heads reading ``kv_heads`` (GQA: query head ``i`` reads KV head ``i // rep``)."""
        offsets = torch.arange(self.rep, device=kv_heads.device)
        return (kv_heads.unsqueeze(1) * self.rep + offsets).reshape(-1)

    def columns(self, cols, heads: torch.Tensor | None, excluded: torch.Tensor | None = None):
        """The mask for key columns ``cols`` (a slice, or positions) and query ``heads`` (None: all), with the
        ``excluded`` columns (relative to a slice ``cols``) at ``-inf``; None when nothing is masked."""
        bias = None if self.bias is None else self.bias[..., cols]
        if bias is not None and heads is not None and bias.shape[1] > 1:
            bias = bias.index_select(1, heads)
        if excluded is None or not excluded.numel():
            return bias
        if bias is None:
            bias = self.query.new_zeros(1, 1, self.query.shape[2], cols.stop - cols.start)
        bias = bias.clone()  # never write into the caller's mask
        bias[..., excluded] = float("-inf")
        return bias

    def add(self, out: torch.Tensor, lse: torch.Tensor, heads: torch.Tensor | None) -> None:
        """Record a segment's result for query ``heads`` (None: all of them)."""
        if heads is None:
            self.partials.append(_Partial(out, lse))
            return
        full_out = out.new_zeros(self.query.shape)
        full_lse = lse.new_full(self.query.shape[:-1], float("-inf"))
        full_out.index_copy_(1, heads, out)
        full_lse.index_copy_(1, heads, lse)
        self.partials.append(_Partial(full_out, full_lse))

    def dense(self, keys, values, cols, kv_heads: torch.Tensor | None = None, excluded=None) -> None:
        """A full-precision segment: ``keys`` / ``values`` ``[B, h, n, D]`` at key columns ``cols``."""
        if keys.shape[-2] == 0:
            return
        heads = None if kv_heads is None else self.query_heads(kv_heads)
        q = self.query if heads is None else self.query.index_select(1, heads)
        out, lse = _dense(q, keys, values, self.columns(cols, heads, excluded), self.scaling, self.softcap)
        self.add(out, lse, heads)

    def segment(self, seg: StoredSegment, excluded: torch.Tensor | None) -> None:
        """A stored segment: full-precision ones in torch, codes through the kernel (``excluded``: columns,
        relative to the segment, served from the overlay instead)."""
        cols = slice(seg.start, seg.stop)
        kv_heads = seg.heads
        if not seg.quantized:
            self.dense(seg.keys, seg.values, cols, kv_heads, excluded)
            return
        if kv_heads is None:
            kv_heads = torch.arange(seg.keys.shape[1], device=self.query.device)
        heads = self.query_heads(kv_heads)
        q = self.query.index_select(1, heads)  # [B, h * rep, T_q, D]
        if seg.key_signs is not None:
            q = rotation.rotate(q, seg.key_signs.repeat_interleave(self.rep, dim=0))  # q R . k_r = q . (k_r R^T)
        out, lse = self.kernel(q, seg, self.columns(cols, heads, excluded))
        if seg.value_signs is not None:
            out = rotation.unrotate(out, seg.value_signs.repeat_interleave(self.rep, dim=0))  # (sum p v_r) R^T
        self.add(out, lse, heads)

    def result(self) -> torch.Tensor:
        out = torch.stack([p.out for p in self.partials])  # [S, B, H_q, T_q, D]
        lse = torch.stack([p.lse for p in self.partials])
        return _merge(out, lse, 0)[0]

    def kernel(self, q: torch.Tensor, seg: StoredSegment, bias: torch.Tensor | None):
        """The quantized segment ``seg`` attended by ``q`` (``[B, h * rep, T_q, D]``): output and log-sum-exp."""
        keys, values = _Codes.of(seg.keys), _Codes.of(seg.values)
        b, hq, t_q, d = q.shape
        h, rows, tokens = hq // self.rep, self.rep * t_q, seg.keys.num_tokens
        block_n, block_m = LAUNCH.block_n, triton.next_power_of_2(rows)
        dot = block_m * block_n * d > LAUNCH.broadcast_limit
        if dot:
            block_m = max(16, block_m)  # tl.dot needs at least 16 rows
        split = self.split_size(tokens, b * h, block_n)
        n_splits = triton.cdiv(tokens, split)
        q_rows = q.new_zeros(b, h, block_m, d)
        q_rows[:, :, :rows] = q.reshape(b, h, rows, d)  # [B, h, rep * T_q, D]: row r * T_q + i
        out = q.new_empty(b, h, n_splits, block_m, d)
        lse = q.new_empty(b, h, n_splits, block_m)
        bias_args = (q, 0, 0, 0, 0) if bias is None else (bias, *_strides(bias))
        _part_attention_kernel[(b * h, n_splits)](
            q_rows, out, lse, bias_args[0], *keys.args(), *values.args(), *bias_args[1:],
            h, tokens, self.rep, t_q, split, n_splits, self.scaling, self.softcap or 1.0,
            D=d, BLOCK_M=block_m, BLOCK_N=block_n, K_BITS=keys.bits, K_GT=keys.tokens_per_scale,
            K_GD=keys.channels_per_scale, V_BITS=values.bits, V_GT=values.tokens_per_scale,
            V_GD=values.channels_per_scale, HAS_BIAS=bias is not None, SOFTCAP=self.softcap is not None, DOT=dot,
            **LAUNCH.options(),
        )
        out, lse = _merge(out, lse, 2)  # [B, h, BLOCK_M, D], [B, h, BLOCK_M]
        return out[:, :, :rows].reshape(b, hq, t_q, d), lse[:, :, :rows].reshape(b, hq, t_q)

    def split_size(self, tokens: int, programs: int, block_n: int) -> int:
        """Tokens per program: enough splits to fill the GPU (a decode step has few batch x head programs)."""
        if self.split_tokens is not None:
            return max(block_n, triton.cdiv(self.split_tokens, block_n) * block_n)
        if self.query.device.type == "cuda":
            target = LAUNCH.programs_per_sm * _multiprocessors(self.query.device)
            splits = max(1, target // max(programs, 1))
            return max(block_n, triton.cdiv(triton.cdiv(tokens, splits), block_n) * block_n)
        return max(block_n, triton.cdiv(tokens, block_n) * block_n)  # the interpreter: one program per head


# ---------------------------------------------------------------------------------------------------- entry point
def decode_attention(read: StoredRead, query: torch.Tensor, keys: torch.Tensor | None = None,
                     values: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                     scaling: float | None = None, softcap: float | None = None,
                     split_tokens: int | None = None) -> torch.Tensor:
    """Softmax attention of ``query`` over a layer's stored past ``read`` followed by ``keys`` / ``values``.

    Equals attention over ``torch.cat([read.materialize(...)[0], keys])`` (and values) to float32 summation order;
    see the module docstring. The quantized segments are read from their codes by a Triton kernel.

    Args:
        read: a layer's :meth:`~kvguard.cache_layer.KVGuardLayer.stored_read`, on the device the computation runs
            on: CUDA runs the kernels compiled; CPU only in Triton's interpreter (``TRITON_INTERPRET=1`` set before
            triton was first imported), otherwise ``RuntimeError``.
        query: ``[B, H_q, T_q, D]`` (after RoPE), ``H_q`` a multiple of the layer's KV heads, ``D`` a power of two
            >= 16. Meant for decoding: a few query tokens.
        keys, values: optional new tokens ``[B, H_kv, T_new, D]`` not stored in the layer, attended after it.
        attention_mask: additive float (or boolean, True = attend) ``[B, 1 or H_q, T_q, T_stored + T_new]``, as
            transformers builds it from the layer's ``get_mask_sizes``; None attends to every key.
        scaling: the score scale, default ``D ** -0.5``. softcap: Gemma 2-style ``tanh`` capping of the scores.
        split_tokens: tokens per kernel program (rounded up to its tile); default: enough splits to fill the GPU.

    Returns:
        ``[B, H_q, T_q, D]`` in ``query``'s dtype.
    """
    if any(seg.key_turn is not None for seg in read.segments):
        raise ValueError("this layer stores keys before RoPE (prerope_keys), which the Triton kernel cannot read: "
                         "attend over read.materialize() instead")
    _check_device(query)
    new = _check_inputs(read, query, keys, values)
    bias = _bias(attention_mask, query, read.length + new)
    attn = _Attention(query, read.num_heads, bias, query.shape[-1] ** -0.5 if scaling is None else scaling,
                      softcap, split_tokens)
    overlay = read.overlay_columns  # ascending
    for seg in read.segments:
        if seg.device != query.device:
            raise ValueError(f"query is on {query.device} but the layer holds its cache on {seg.device}")
        excluded = None
        if overlay is not None:
            excluded = overlay[(overlay >= seg.start) & (overlay < seg.stop)] - seg.start
        attn.segment(seg, excluded)
    if overlay is not None and overlay.numel():
        attn.dense(read.overlay_keys, read.overlay_values, overlay)
    if new:
        attn.dense(keys, values, slice(read.length, read.length + new))
    return attn.result().to(query.dtype)


def _check_inputs(read: StoredRead, query, keys, values) -> int:
    """Validate shapes; the number of new tokens."""
    b, h, d = read.batch, read.num_heads, read.head_dim
    if query.dim() != 4 or query.shape[0] != b or query.shape[-1] != d:
        raise ValueError(f"query must be [B={b}, H_q, T_q, D={d}], got {tuple(query.shape)}")
    if query.shape[1] % h:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of the layer's KV heads ({h})")
    if d < 16 or d & (d - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {d}")
    if (keys is None) != (values is None):
        raise ValueError("give both keys and values for the new tokens, or neither")
    if keys is None:
        return 0
    expected = (b, h, keys.shape[-2], d)
    if tuple(keys.shape) != expected or tuple(values.shape) != expected:
        raise ValueError(f"new keys and values must be {expected}, got {tuple(keys.shape)}, {tuple(values.shape)}")
    return keys.shape[-2]


def _bias(mask: torch.Tensor | None, query: torch.Tensor, key_len: int) -> torch.Tensor | None:
    """The mask as float32 additive scores ``[B or 1, 1 or H_q, T_q, key_len]``."""
    if mask is None:
        return None
    b, hq, t_q, _ = query.shape
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq) or mask.shape[2] != t_q \
            or mask.shape[3] != key_len:
        raise ValueError(f"attention_mask must be [{b} or 1, 1 or {hq}, {t_q}, {key_len}] (stored + new tokens), "
                         f"got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()
