"""K/V activation statistics and the attention-entropy baseline, recorded over calibration batches.

FP forward passes through the model's decoder (no LM head), a few rows of a batch at a time, with an observing
attention hook (:mod:`kvguard.attention`, so no modeling code is forked): it computes the model's attention
(soft-capped where the model caps its logits, as Gemma 2) and records, per layer / KV head / channel, the ``max``,
``min``, ``mean``, ``std`` and ``absmax`` of the keys (after RoPE, as the cache stores them) and values, plus the
entropy of every attention row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvguard import attention
from kvguard.architecture import Architecture
from kvguard.entropy import EntropyAccumulator, EntropyBaseline, attention_entropy

STATS = ("max", "min", "mean", "std", "absmax")
KINDS = ("key", "value")


@dataclass(frozen=True)
class KVStatistics:
    """Per-batch K/V statistics.

    Attributes:
        history: ``"key.max"`` ... ``"value.absmax"`` -> ``[batches, layers, KV heads, head_dim]``.
        tokens: ``[batches]`` tokens (batch rows x length) behind each batch's statistics.
    """

    history: dict[str, torch.Tensor]
    tokens: torch.Tensor

    @property
    def num_batches(self) -> int:
        return int(self.tokens.numel())

    def aggregate(self) -> dict[str, torch.Tensor]:
        """The statistics over all batches, ``[layers, KV heads, head_dim]`` each (pooled mean and std)."""
        w = self.tokens.to(torch.float64).view(-1, 1, 1, 1)
        out = {}
        for kind in KINDS:
            h = {s: self.history[f"{kind}.{s}"].to(torch.float64) for s in STATS}
            mean = (h["mean"] * w).sum(0) / w.sum()
            second = ((h["std"] ** 2 + h["mean"] ** 2) * w).sum(0) / w.sum()
            out[f"{kind}.max"] = h["max"].amax(0).float()
            out[f"{kind}.min"] = h["min"].amin(0).float()
            out[f"{kind}.absmax"] = h["absmax"].amax(0).float()
            out[f"{kind}.mean"] = mean.float()
            out[f"{kind}.std"] = (second - mean ** 2).clamp_min(0).sqrt().float()
        return out

    def tensors(self, prefix: str = "stats.") -> dict[str, torch.Tensor]:
        """The per-batch history as float16 (5,000 samples make hundreds of batches) and the aggregates,
        computed before that rounding, as float32."""
        out = {f"{prefix}batch.{k}": v.to(torch.float16).contiguous() for k, v in self.history.items()}
        out[f"{prefix}batch.tokens"] = self.tokens.contiguous()
        out.update({f"{prefix}{k}": v.contiguous() for k, v in self.aggregate().items()})
        return out

    @staticmethod
    def aggregate_from(tensors: dict[str, torch.Tensor], prefix: str = "stats.") -> dict[str, torch.Tensor]:
        """The float32 aggregates saved by :meth:`tensors`."""
        return {f"{k}.{s}": tensors[f"{prefix}{k}.{s}"] for k in KINDS for s in STATS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "stats.") -> "KVStatistics":
        history = {f"{k}.{s}": tensors[f"{prefix}batch.{k}.{s}"] for k in KINDS for s in STATS}
        return cls(history, tensors[f"{prefix}batch.tokens"])

    @classmethod
    def concat(cls, parts: list["KVStatistics"]) -> "KVStatistics":
        """The histories of ``parts`` one after another (exact: batches are only stacked, in order)."""
        if not parts:
            raise ValueError("no statistics to concatenate")
        history = {k: torch.cat([p.history[k] for p in parts]) for k in parts[0].history}
        return cls(history, torch.cat([p.tokens for p in parts]))


@dataclass(frozen=True)
class BatchStatistics:
    """What one calibration batch contributes: its row of K/V statistics and its attention-entropy sums.

    The unit of work of statistics collection, in one process or spread over workers
    (:mod:`kvguard.calibration.distributed`); :func:`merge` puts batches back together."""

    statistics: KVStatistics  # num_batches == 1
    entropy: EntropyAccumulator


class _Recorder:
    """Keeps what each layer's attention saw during one batch (possibly over several forward passes, see
    :func:`collect_batch`) and turns it into the batch's statistics at :meth:`end_batch`."""

    def __init__(self, arch: Architecture, num_query_heads: int) -> None:
        self.arch = arch
        self.entropy = EntropyAccumulator(arch.num_layers, num_query_heads)
        self.batches: list[dict[str, torch.Tensor]] = []
        self.tokens: list[int] = []
        self.current: dict[str, torch.Tensor] = {}
        # Per layer: the keys, values and attention entropies of each pass of the batch, in row order.
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.n_keys: dict[int, torch.Tensor] = {}

    def start_batch(self) -> None:
        self.seen, self.n_keys = {}, {}

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor, entropy: torch.Tensor,
                n_keys: torch.Tensor) -> None:
        """One pass's ``key`` / ``value`` ``[B, H_kv, T, D]`` and attention ``entropy`` ``[B, H_q, rows]`` of
        queries that saw ``n_keys`` ``[rows]`` keys (the same for every row of a batch)."""
        self.seen.setdefault(layer, []).append((key.detach(), value.detach(), entropy.detach()))
        self.n_keys[layer] = n_keys

    def _statistics(self, layer: int) -> None:
        passes = self.seen[layer]
        for kind, i in (("key", 0), ("value", 1)):
            x = torch.cat([p[i] for p in passes]).float()  # [B, H_kv, T, D], the whole batch
            self.current[f"{kind}.max"][layer] = x.amax((0, 2)).cpu()
            self.current[f"{kind}.min"][layer] = x.amin((0, 2)).cpu()
            self.current[f"{kind}.mean"][layer] = x.mean((0, 2)).cpu()
            self.current[f"{kind}.std"][layer] = x.std((0, 2), unbiased=False).cpu()
            self.current[f"{kind}.absmax"][layer] = x.abs().amax((0, 2)).cpu()
        self.entropy.add(layer, torch.cat([p[2] for p in passes]), self.n_keys[layer])

    def end_batch(self, tokens: int) -> None:
        missing = [layer for layer in range(self.arch.num_layers) if layer not in self.seen]
        if missing:
            raise RuntimeError(f"a forward pass did not reach every attention layer (missing layer {missing[0]})")
        shape = (self.arch.num_layers, self.arch.num_kv_heads, self.arch.head_dim)
        self.current = {f"{k}.{s}": torch.empty(shape) for k in KINDS for s in STATS}
        for layer in range(self.arch.num_layers):
            self._statistics(layer)
        self.batches.append(self.current)
        self.tokens.append(tokens)
        self.seen, self.n_keys = {}, {}

    def statistics(self) -> KVStatistics:
        history = {k: torch.stack([b[k] for b in self.batches]) for k in self.batches[0]}
        return KVStatistics(history, torch.tensor(self.tokens, dtype=torch.int64))


def entropy_rows(t: int) -> torch.Tensor:
    """Query positions whose attention entropy is recorded: the first 16, then every 8th. Entropy needs a
    full softmax row per query, so a subsample keeps statistics collection near the cost of a plain forward
    pass while every length bin still gets thousands of queries over a calibration set."""
    return torch.unique(torch.cat([torch.arange(min(t, 16)), torch.arange(16, t, 8)]))


class _RecordingHook:
    """The model's attention (sdpa) that also records K/V statistics and attention entropy."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __call__(self, module, query, key, value, attention_mask, *, scaling, softcap):
        t = query.shape[2]
        mask = None if attention_mask is None else attention_mask[..., : key.shape[2]]
        out = attention.attend(query, key, value, mask, scaling=scaling, softcap=softcap, is_causal=mask is None)

        rows = entropy_rows(t).to(query.device)
        k = attention.expand_kv(key, query.shape[1] // key.shape[1])  # [B, Hq, T, D]
        scores = (query[:, :, rows].float() @ k.float().transpose(-1, -2)) * scaling  # [B, Hq, rows, T]
        scores = attention.softcapped(scores, softcap)
        if mask is not None:
            row_mask = mask[:, :, rows].float()
            n_keys = (row_mask[0, 0] > torch.finfo(torch.float32).min / 2).sum(-1)  # [rows]; same for every batch row
        else:
            row_mask = torch.where(torch.arange(t, device=query.device)[None, :] <= rows[:, None], 0.0, float("-inf"))
            n_keys = rows + 1
        probs = torch.softmax(scores + row_mask, dim=-1)
        self.recorder.observe(module.layer_idx, key, value, attention_entropy(probs), n_keys)
        return out


def batches_by_length(samples: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Group 1-D token samples into ``[B, T]`` batches of similar length (each cut to its shortest sample),
    so no padding distorts the statistics."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ordered = sorted(samples, key=lambda s: (-s.numel(), s.tolist()[:8]))
    out = []
    for i in range(0, len(ordered), batch_size):
        group = ordered[i:i + batch_size]
        n = min(s.numel() for s in group)
        out.append(torch.stack([s[:n] for s in group]))
    return out


# Rows per forward pass. A batch's statistics are those of all its rows at once, but a pass over 4 rows keeps
# the activations (4 x 512 tokens) in cache where 16 rows do not: on 2 cores a 16 x 512 batch took 13.4 s in
# passes of 4 rows against 18.1 s in one on Gemma 3, 20.6 s against 31.7 s on SmolLM2 (1 or 2 rows were within
# the noise of 4). No row's keys and values depend on another row.
ROWS_PER_PASS = 4


@torch.no_grad()
def collect_batch(model, ids: torch.Tensor, rows_per_pass: int = ROWS_PER_PASS) -> BatchStatistics:
    """Run one ``[B, T]`` batch through ``model``'s decoder with the FP cache semantics, ``rows_per_pass`` rows
    at a time, and record its statistics (over all ``B`` rows)."""
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    arch = Architecture.from_config(model.config)
    recorder = _Recorder(arch, arch.num_query_heads)
    with attention.hooked(model, _RecordingHook(recorder)):
        recorder.start_batch()
        for rows in ids.split(rows_per_pass):  # [<= rows_per_pass, T] each
            model.base_model(input_ids=rows.to(model.device), use_cache=False)
        recorder.end_batch(ids.numel())
    return BatchStatistics(recorder.statistics(), recorder.entropy)


def merge(batches: Iterable[BatchStatistics]) -> tuple[KVStatistics, EntropyBaseline]:
    """The per-batch K/V statistics and the attention-entropy baseline of ``batches``, given in batch order.

    Exact wherever each batch was collected: the history is stacked in order, and the entropy sums are folded
    one batch at a time from zero, the same additions in the same order."""
    parts, total = [], None
    for batch in batches:
        parts.append(batch.statistics)
        if total is None:
            total = EntropyAccumulator(*batch.entropy.norm_sum.shape)
        total.merge(batch.entropy)
    if total is None:
        raise ValueError("no calibration batches to collect statistics from")
    return KVStatistics.concat(parts), total.finish()


def collect(model, batches: list[torch.Tensor], *, progress: bool = True) -> tuple[KVStatistics, EntropyBaseline]:
    """Run every ``[B, T]`` batch through ``model``'s decoder with the FP cache semantics and return the
    per-batch K/V statistics and the attention-entropy baseline."""
    if not batches:
        raise ValueError("no calibration batches to collect statistics from")
    bar = tqdm(batches, desc="statistics", unit="batch", disable=not progress)
    return merge(collect_batch(model, ids) for ids in bar)
