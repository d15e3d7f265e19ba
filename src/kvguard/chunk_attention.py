"""Attention of a chunk of queries over a stored past, one bounded tile of history at a time.

A chunked prefill (a long prompt fed in pieces, a serving engine interleaving prefills with decode steps) used
to read a layer's history by materializing it: a fresh dequantized copy of every stored token, per layer, per
chunk, concatenated with the new tokens and expanded to the query heads. At 8 x 4,096 tokens on SmolLM2 that
transient was as large as FP16's whole cache, and how much of it the allocator kept moved the process's peak by
hundreds of MiB. Here the history is read through :meth:`StoredRead.tiles <kvguard.stored_read.StoredRead.tiles>`
instead: a tile of at most :data:`TILE_TOKENS` columns is dequantized (rotation undone, RoPE turned, overlay
applied), scored against every query row of its KV head, and folded into an online softmax (flash attention's
running max ``m``, normalizer ``l`` and output ``acc``); the next tile reuses the freed memory. The new tokens are
the last tile, under the causal mask transformers passed. Nothing held scales with the history but the tile.

Query rows are grouped per KV head as the fused decode attention groups them, ``[B, H_kv, rep * T_q, D]`` (query
head ``i`` reads KV head ``i // rep``), so grouped-query heads never expand K/V. The result equals attention over
the materialized past up to float32 summation order (each tile's softmax is rescaled into the running one).
"""

from __future__ import annotations

import torch

from kvguard.stored_read import StoredRead

# Columns per tile: at most TILE_TOKENS, fewer where a tile's scores (B x H_q x T_q x columns, float32) would pass
# TILE_BYTES. A few such tensors are alive at once (scores, probabilities, the masked copy), so 8 MiB keeps them
# below the model's own activations for the chunk, and 512 columns keep the matmuls, not the Python loop, setting
# the time (one sequence's 256-token chunk on SmolLM2: 1.5 MiB of scores a tile; eight sequences: 96 columns).
TILE_TOKENS = 512
TILE_BYTES = 8 * 2**20


def attend(query: torch.Tensor, read: StoredRead, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, *, scaling: float, softcap: float | None = None,
           tile_tokens: int | None = None) -> torch.Tensor:
    """Attention of ``query`` (``[B, H_q, T_q, D]``) over ``read`` followed by the new ``key`` / ``value``
    (``[B, H_kv, T_q, D]``): ``[B, H_q, T_q, D]`` in the query's dtype.

    ``attention_mask``: transformers' mask over the stored and new columns, ``[B, 1, T_q, >= N]``, boolean (True
    attends) or additive float; ``None`` is causal among the new tokens (and everything stored is visible)."""
    b, hq, tq, d = query.shape
    hkv = key.shape[1]
    rep = hq // hkv
    q = (query.to(torch.float32) * scaling).reshape(b, hkv, rep * tq, d)  # rows (query head in group, token)
    state = _Online(b, hkv, rep * tq, d, query.device)
    if tile_tokens is None:
        tile_tokens = min(TILE_TOKENS, TILE_BYTES // (4 * b * hq * tq))  # tiles() keeps at least one key group
    for start, k, v in read.tiles(tile_tokens, torch.float32):
        state.add(q, k, v, _tile_mask(attention_mask, start, k.shape[-2], rep, tq, read.length), softcap)
    new_mask = _tile_mask(attention_mask, read.length, tq, rep, tq, read.length)
    if attention_mask is None and tq > 1:
        causal = torch.ones(tq, tq, dtype=torch.bool, device=query.device).tril()
        new_mask = causal.repeat(rep, 1).view(1, 1, rep * tq, tq)  # rows (head, token)
    state.add(q, key.to(torch.float32), value.to(torch.float32), new_mask, softcap)
    return state.result().view(b, hkv, rep, tq, d).reshape(b, hq, tq, d).to(query.dtype)


def _tile_mask(mask: torch.Tensor | None, start: int, n: int, rep: int, tq: int, stored: int) -> torch.Tensor | None:
    """The mask's columns ``[start, start + n)`` for rows ``(head, token)``: ``[B, 1, rep * T_q, n]`` (boolean or
    additive float, as given), or ``None`` when the mask does not restrict them."""
    if mask is None:
        return None
    cols = mask[..., start:start + n]  # [B, 1, T_q, n]
    return cols.unsqueeze(2).expand(cols.shape[0], 1, rep, tq, n).reshape(cols.shape[0], 1, rep * tq, n)


class _Online:
    """Flash attention's running softmax over tiles of keys: max ``m`` and normalizer ``l`` ``[B, H, R, 1]``,
    unnormalized output ``acc`` ``[B, H, R, D]``."""

    def __init__(self, b: int, h: int, rows: int, d: int, device) -> None:
        self.m = torch.full((b, h, rows, 1), float("-inf"), device=device)
        self.l = torch.zeros(b, h, rows, 1, device=device)
        self.acc = torch.zeros(b, h, rows, d, device=device)

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            softcap: float | None) -> None:
        scores = q @ k.transpose(-1, -2)  # [B, H, R, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.to(scores.dtype)
        m = torch.maximum(self.m, scores.amax(-1, keepdim=True))
        # Rows with nothing visible yet keep m = -inf: shift them by 0 so that exp gives 0, not nan.
        shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(scores - shift)
        rescale = torch.exp(self.m - shift)
        self.l = self.l * rescale + p.sum(-1, keepdim=True)
        self.acc = self.acc * rescale + p @ v
        self.m = m

    def result(self) -> torch.Tensor:
        return self.acc / self.l
