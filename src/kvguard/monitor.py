"""The run-time monitor: attention entropy and quantization-error evidence, token by token, cheaply.

While a sequence decodes, an attention function registered with transformers' ``AttentionInterface``
(``"kvguard_live"``; no modeling code is forked) computes each monitored layer's attention explicitly for the
one new query and records

- its entropy (mean over query heads) against the profile's length-aware baseline: ``drop = 1 - H / H_base``;
- the attention-weighted relative quantization error of the keys and values it read (the cache records each
  position's error when it quantizes it, see ``KVGuardLayer.error_evidence``);
- the attention mass every stored position receives (what selective recomputation ranks by).

:class:`TokenMonitor` keeps the last ``window_tokens`` tokens of that evidence; every ``refresh_tokens`` tokens
the session (:mod:`kvguard.live`) reads the window means and decides. The same function also runs the
recomputation forward pass (new tokens at old positions, against the cache, without storing them).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvguard.entropy import EntropyBaseline, SequenceReference, baseline_ratio

ATTN_NAME = "kvguard_live"


@dataclass(frozen=True)
class MonitorConfig:
    """Thresholds of the feedback loop (SPEC part 2 defaults; a profile stores them, any can be overridden).

    Attributes:
        window_tokens, refresh_tokens: window mean over the last 32 tokens, refreshed every 8 (one
            *monitoring step*).
        baseline_tokens: time constant of the sequence's own entropy level the drop is measured against
            (:class:`~kvguard.entropy.SequenceReference`).
        warn_drop: window-mean entropy drop that warns and triggers light compensation (recompute the alarming
            layer's KV at the selected positions). A layer's warning or trigger acts once per episode: it
            re-arms when the layer's window drop is back under half of ``warn_drop``.
        trigger_drop, trigger_consecutive: that many consecutive tokens this far below baseline trigger
            light compensation too.
        light_drop: drop from which compensation is light (== ``warn_drop`` by default).
        heavy_drop, heavy_layers: a severe alarm: heavy compensation over the ``heavy_layers`` layers up to
            the alarming one, and one step up the rollback ladder.
        recompute_fraction: ``[base, max]`` share of a layer's quantized positions recomputed per action, and
            the most its full-precision overlay may hold (the ladder doubles both).
        max_trigger_rate, trigger_rate_steps: above this share of acting steps over the last
            ``trigger_rate_steps`` steps, a "recalibration recommended" event.
        promote_risk, promote_layer_risk, promote_steps, demote_risk, demote_steps: dynamic precision
            hysteresis on the risk classifier's output: ``promote_steps`` steps in a row at or above
            ``promote_risk`` (or, while some layer is there, at or above ``promote_layer_risk``) promote a
            layer one tier for new tokens; ``demote_steps`` steps at or below ``demote_risk`` demote it
            one tier, never below the plan; at most ``max_promotion_tiers`` tiers above the plan (promoting
            changes only new tokens, while the risk also reflects the old ones: without a cap a layer would
            climb to FP16 on the strength of tokens promotion cannot fix). A promotion also recomputes the
            layer's top positions.
        cooldown_steps: steps without a severe alarm before the ladder steps down from level 1; doubles with
            every level.
        layers: the monitored layers (``None``: all).
    """

    window_tokens: int = 32
    refresh_tokens: int = 8
    baseline_tokens: int = 64
    warn_drop: float = 0.20
    trigger_drop: float = 0.25
    trigger_consecutive: int = 3
    light_drop: float = 0.20
    heavy_drop: float = 0.35
    heavy_layers: int = 4
    recompute_fraction: tuple[float, float] = (0.02, 0.05)
    max_trigger_rate: float = 0.05
    trigger_rate_steps: int = 256
    promote_risk: float = 0.9
    promote_layer_risk: float = 0.5
    promote_steps: int = 2
    demote_risk: float = 0.2
    demote_steps: int = 32
    max_promotion_tiers: int = 1
    cooldown_steps: int = 4
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute_fraction", tuple(float(x) for x in self.recompute_fraction))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        for name in ("window_tokens", "refresh_tokens", "baseline_tokens", "trigger_consecutive", "heavy_layers", "trigger_rate_steps",
                     "promote_steps", "demote_steps", "max_promotion_tiers", "cooldown_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"monitor setting {name} must be >= 1, got {getattr(self, name)}")
        for name in ("warn_drop", "trigger_drop", "light_drop", "heavy_drop", "max_trigger_rate", "promote_risk", "promote_layer_risk",
                     "demote_risk"):
            if not 0.0 < float(getattr(self, name)) <= 1.0:
                raise ValueError(f"monitor setting {name} must be in (0, 1], got {getattr(self, name)}")
        lo, hi = self.recompute_fraction if len(self.recompute_fraction) == 2 else (None, None)
        if lo is None or not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"recompute_fraction must be [base, max] with 0 < base <= max <= 1, got {self.recompute_fraction}")
        if self.demote_risk > self.promote_risk:
            raise ValueError("demote_risk must not exceed promote_risk (hysteresis)")

    @classmethod
    def from_dict(cls, data: dict, **overrides) -> "MonitorConfig":
        """From a profile's ``monitor`` block (keys this kvguard does not know are ignored, so older and newer
        profiles load) plus ``overrides`` (unknown names are an error)."""
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown monitor settings {sorted(unknown)}; valid: {sorted(names)}")
        merged = {k: v for k, v in data.items() if k in names}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**merged)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["recompute_fraction"] = list(self.recompute_fraction)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


class TokenMonitor:
    """Per-token evidence of one sequence: the last ``window`` tokens' drop and weighted error per layer, the
    run of consecutive low-entropy tokens per layer, and the attention mass every position received."""

    def __init__(self, baseline: EntropyBaseline, config: MonitorConfig, num_layers: int, *,
                 sliding_window: int | None, sliding_layers: tuple[int, ...] = ()) -> None:
        if baseline.mean.shape[0] != num_layers:
            raise ValueError(f"entropy baseline has {baseline.mean.shape[0]} layers, the model has {num_layers}")
        self.baseline = baseline
        self.config = config
        self.num_layers = num_layers
        self.sliding_window = sliding_window
        self.sliding = set(sliding_layers)
        monitored = range(num_layers) if config.layers is None else config.layers
        bad = [l for l in monitored if not 0 <= l < num_layers]
        if bad:
            raise ValueError(f"monitored layers {bad} out of range [0, {num_layers})")
        self.monitored = torch.zeros(num_layers, dtype=torch.bool)
        self.monitored[list(monitored)] = True
        self.reset()

    def reset(self) -> None:
        w, n = self.config.window_tokens, self.num_layers
        self.drops = torch.zeros(w, n)
        self.werrs = torch.zeros(w, n, 2)
        self.entropies = torch.zeros(w, n)
        self.filled = 0
        self.consecutive = torch.zeros(n, dtype=torch.long)
        self.nonfinite = torch.zeros((), dtype=torch.bool)
        self.mass: list[torch.Tensor | None] = [None] * n
        self.tokens = 0
        self.reference = SequenceReference(n, self.config.baseline_tokens)
        self._entropy: dict[int, torch.Tensor] = {}
        self._werr: dict[int, torch.Tensor] = {}
        self._n_keys: dict[int, int] = {}

    # ---------------------------------------------------------------- called by the attention function
    def observe(self, layer: int, probs: torch.Tensor, first: int, error: torch.Tensor | None) -> None:
        """``probs`` ``[B, H_kv, rep, T]`` of the new query over the keys at absolute positions ``first..``;
        ``error`` ``[H_kv, T, 2]`` their relative K/V quantization error."""
        t = probs.shape[-1]
        self._entropy[layer] = torch.special.entr(probs).sum(-1).mean()
        received = probs.sum((0, 1, 2))  # [T]
        mass = self.mass[layer]
        if mass is None or mass.shape[0] < first + t:
            grown = torch.zeros(max(first + t, 2 * (0 if mass is None else mass.shape[0]), 256), device=probs.device)
            if mass is not None:
                grown[:mass.shape[0]] = mass
            self.mass[layer] = mass = grown
        mass[first:first + t] += received
        if error is not None:
            self._werr[layer] = (probs @ error.unsqueeze(0)).mean((0, 1, 2))  # [2]
        n = t if layer not in self.sliding or self.sliding_window is None else min(t, self.sliding_window)
        self._n_keys[layer] = n

    # ---------------------------------------------------------------- called by the session
    def end_token(self) -> None:
        """Close the current token: turn what the layers recorded into its drop and error per layer."""
        if not self._entropy:
            return
        n = self.num_layers
        entropy = torch.zeros(n)
        werr = torch.zeros(n, 2)
        n_keys = torch.full((n,), 2, dtype=torch.long)
        layers = list(self._entropy)
        entropy[layers] = torch.stack([self._entropy[l] for l in layers]).float().cpu()
        if self._werr:
            wl = list(self._werr)
            werr[wl] = torch.stack([self._werr[l] for l in wl]).float().cpu()
        n_keys[layers] = torch.tensor([self._n_keys[l] for l in layers])
        seen = torch.zeros(n, dtype=torch.bool)
        seen[layers] = True
        ratio = torch.where(seen, baseline_ratio(entropy, self.baseline.expected_mean(n_keys)), torch.ones(()))
        drop = self.reference.drop(ratio)
        self.nonfinite |= ~torch.isfinite(drop).all() | ~torch.isfinite(werr).all()
        drop = torch.nan_to_num(drop, nan=1.0, posinf=1.0, neginf=1.0)  # unreadable attention counts as lost
        werr = torch.nan_to_num(werr, nan=1.0, posinf=1.0, neginf=1.0)
        slot = self.tokens % self.config.window_tokens
        self.drops[slot], self.werrs[slot], self.entropies[slot] = drop, werr, entropy
        self.filled = min(self.filled + 1, self.config.window_tokens)
        self.consecutive = torch.where(drop >= self.config.trigger_drop, self.consecutive + 1, torch.zeros_like(self.consecutive))
        self.tokens += 1
        self._entropy, self._werr, self._n_keys = {}, {}, {}

    def window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window means over the tokens seen (at most ``window_tokens``): drop ``[L]``, weighted K/V error
        ``[L, 2]``, entropy ``[L]``."""
        k = max(self.filled, 1)
        if self.filled < self.config.window_tokens:
            idx = torch.arange(self.tokens - k, self.tokens) % self.config.window_tokens
            return self.drops[idx].mean(0), self.werrs[idx].mean(0), self.entropies[idx].mean(0)
        return self.drops.mean(0), self.werrs.mean(0), self.entropies.mean(0)

    def features(self) -> torch.Tensor:
        """``[L, 4]`` window means of :data:`kvguard.signals.FEATURES` (drop, |drop|, K error, V error)."""
        k = max(self.filled, 1)
        idx = torch.arange(self.tokens - k, self.tokens) % self.config.window_tokens
        d = self.drops[idx]
        return torch.cat([d.mean(0)[:, None], d.abs().mean(0)[:, None], self.werrs[idx].mean(0)], dim=1)

    def attention_mass(self, layer: int, end: int) -> torch.Tensor:
        mass = self.mass[layer]
        if mass is None:
            return torch.zeros(end)
        if mass.shape[0] < end:
            mass = torch.cat([mass, mass.new_zeros(end - mass.shape[0])])
        return mass[:end]


# ------------------------------------------------------------------------------------------- the attention
@dataclass
class _Recompute:
    positions: torch.Tensor  # [P] absolute, ascending
    offsets: dict[int, int]  # layer -> absolute position of its first stored token
    sliding_window: int | None
    sliding: set[int]


@dataclass
class _Live:
    monitor: TokenMonitor
    cache: object  # the session's KVGuardCache
    recompute: _Recompute | None = None


_ACTIVE: contextvars.ContextVar[_Live | None] = contextvars.ContextVar("kvguard_live", default=None)


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """sdpa, except for the monitored layers' one-token decode queries (explicit softmax, recorded) and the
    recomputation pass (each re-fed token sees the stored keys before its own position)."""
    live = _ACTIVE.get()
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    rep = hq // hkv
    scaling = d ** -0.5 if scaling is None else scaling
    layer = module.layer_idx
    if live is not None and live.recompute is not None:
        return _recompute_attention(live.recompute, layer, query, key, value, scaling, softcap, rep)
    if live is None or t != 1 or not bool(live.monitor.monitored[layer]):
        if softcap is not None:
            raise NotImplementedError("kvguard's live attention does not support attention logit soft-capping")
        mask = None if attention_mask is None else attention_mask[..., : key.shape[2]]
        out = F.scaled_dot_product_attention(query, _expand(key, rep), _expand(value, rep), attn_mask=mask,
                                             scale=scaling, is_causal=mask is None and t > 1)
        return out.transpose(1, 2).contiguous(), None
    n = key.shape[2]
    cache_layer = live.cache.layers[layer]
    scores = (query.view(b, hkv, rep, d).float() * scaling) @ key.float().transpose(-1, -2)  # [B, Hkv, rep, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and (b > 1 or cache_layer.is_sliding):  # one unpadded full layer: all zeros
        scores = scores + attention_mask[..., :n].float().view(attention_mask.shape[0], 1, 1, n)
    probs = torch.softmax(scores, dim=-1)
    out = (probs.to(value.dtype) @ value).view(b, hq, 1, d)
    first = cache_layer.length - n  # absolute position of the first key (stored past, then the new token)
    error = None
    if cache_layer.track_error:
        buffer = cache_layer.error_evidence()
        if not cache_layer.stored_last_update:
            error = buffer[:, first:first + n]  # zeros from the window on
        else:
            # This token pushed a group out of the window: the read still saw it at full precision.
            end = max(first, cache_layer.read_fp_from)
            error = torch.cat([buffer[:, first:end], buffer.new_zeros(buffer.shape[0], first + n - end, 2)], dim=1)
    live.monitor.observe(layer, probs, first, error)
    return out.transpose(1, 2).contiguous(), None


def _recompute_attention(spec: _Recompute, layer, query, key, value, scaling, softcap, rep):
    p = query.shape[2]
    stored = key.shape[2] - p
    first = spec.offsets[layer]
    pos = spec.positions.to(query.device)
    absolute = torch.arange(first, first + stored, device=query.device)
    allowed = absolute[None, :] < pos[:, None]  # [P, stored]: keys strictly before each re-fed token
    if layer in spec.sliding and spec.sliding_window is not None:
        allowed &= absolute[None, :] > pos[:, None] - spec.sliding_window
    mask = torch.cat([allowed, torch.eye(p, dtype=torch.bool, device=query.device)], dim=1)
    if softcap is not None:
        raise NotImplementedError("kvguard's live attention does not support attention logit soft-capping")
    out = F.scaled_dot_product_attention(query, _expand(key, rep), _expand(value, rep), attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, eager_mask)


@contextlib.contextmanager
def live_attention(model, monitor: TokenMonitor, cache, recompute: _Recompute | None = None):
    """Within this block, ``model`` attends through the monitor (see module docstring)."""
    previous = model.config._attn_implementation
    token = _ACTIVE.set(_Live(monitor, cache, recompute))
    if previous != ATTN_NAME:  # a server sets it once for good: sessions on other threads keep running through it
        model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        if previous != ATTN_NAME:
            model.set_attn_implementation(previous)
        _ACTIVE.reset(token)


class _ViewLayer(CacheLayerMixin):
    """Reads a cache layer's stored past and returns it with the new tokens, storing nothing; keeps the new
    tokens' K/V (the recomputed full-precision values)."""

    is_compileable = False

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer
        self.is_sliding = layer.is_sliding
        self.is_initialized = True
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - never uninitialised
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.captured = (key_states, value_states)
        past_k, past_v = self.layer.materialize(key_states.dtype)
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.layer.get_max_length()


class RecomputeView(Cache):
    """A read-only view of a KVGuardCache for the recomputation pass."""

    def __init__(self, cache) -> None:
        super().__init__(layers=[_ViewLayer(layer) for layer in cache.layers])

    def captured(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.layers[layer].captured
        if got is None:
            raise RuntimeError(f"the recomputation pass did not reach layer {layer}")
        return got


def recompute_spec(cache, positions: torch.Tensor, sliding_window: int | None) -> _Recompute:
    return _Recompute(positions, {i: layer.offset for i, layer in enumerate(cache.layers)}, sliding_window,
                      {i for i, layer in enumerate(cache.layers) if layer.is_sliding})


def ceil_fraction(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` (at least 1 when ``n > 0``)."""
    return 0 if n <= 0 else max(1, math.ceil(fraction * n - 1e-9))
