"""The run-time monitor: attention entropy and quantization-error evidence, token by token, cheaply.

While a sequence decodes, an attention hook (:mod:`kvguard.attention`; no modeling code is forked) computes each
observed layer's attention explicitly for the one new query (through the fused decode attention,
:mod:`kvguard.fused_attention`, which reads the quantized codes directly and returns the probabilities, when it
is built; otherwise over the materialized cache) and records

- its entropy (mean over query heads) against the profile's length-aware baseline: ``drop = 1 - H / H_base``;
- the attention-weighted relative quantization error of the keys and values it read (the cache records each
  position's error when it quantizes it, see ``KVGuardLayer.error_evidence``);
- the attention mass every stored position receives (what selective recomputation ranks by).

:class:`TokenMonitor` keeps the last ``window_tokens`` tokens of that evidence; every ``refresh_tokens`` tokens
the session (:mod:`kvguard.control.session`) reads the window means and the policy
(:mod:`kvguard.control.policy`) decides.

On a GPU the per-token evidence stays on the model's device: a token costs no device-to-host copy and no wait
for the GPU here. The host reads the device once per monitoring step (:meth:`TokenMonitor.window`,
:meth:`TokenMonitor.features`: the policy is plain Python over a few dozen numbers). What crosses per token is
host-to-device only (the baseline entropy for the token's key counts, computed on the host from integers it
already knows); the monitored-layer mask stays on the host, where the hook reads it without touching the device.
"""

from __future__ import annotations

import contextlib

import torch

from kvguard import attention, fused_attention
from kvguard.config import MonitorConfig
from kvguard.entropy import EntropyBaseline, SequenceReference, baseline_ratio


class TokenMonitor:
    """Per-token evidence of one sequence: the last ``window`` tokens' drop and weighted error per layer, the
    run of consecutive low-entropy tokens per layer, and the attention mass every position received."""

    def __init__(self, baseline: EntropyBaseline, config: MonitorConfig, num_layers: int, *,
                 sliding_window: int | None, sliding_layers: tuple[int, ...] = (),
                 device: torch.device | str = "cpu", observe_all: bool = False) -> None:
        if baseline.mean.shape[0] != num_layers:
            raise ValueError(f"entropy baseline has {baseline.mean.shape[0]} layers, the model has {num_layers}")
        self.baseline = baseline
        self.config = config
        self.num_layers = num_layers
        self.sliding_window = sliding_window
        self.sliding = set(sliding_layers)
        self.device = torch.device(device)  # where the per-token evidence lives: the model's
        monitored = range(num_layers) if config.layers is None else config.layers
        bad = [l for l in monitored if not 0 <= l < num_layers]
        if bad:
            raise ValueError(f"monitored layers {bad} out of range [0, {num_layers})")
        self.monitored = torch.zeros(num_layers, dtype=torch.bool)
        self.monitored[list(monitored)] = True
        # The layers whose evidence is recorded: the monitored ones (their entropy alarms count), or every layer
        # when the risk classifier and the position selection need evidence from all of them (``observe_all``).
        self.observed = torch.ones(num_layers, dtype=torch.bool) if observe_all else self.monitored.clone()
        self.reset()

    def reset(self) -> None:
        w, n, d = self.config.window_tokens, self.num_layers, self.device
        self.drops = torch.zeros(w, n, device=d)
        self.werrs = torch.zeros(w, n, 2, device=d)
        self.entropies = torch.zeros(w, n, device=d)
        self.filled = 0
        self.consecutive = torch.zeros(n, dtype=torch.long, device=d)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=d)
        self.mass: list[torch.Tensor | None] = [None] * n
        self.tokens = 0
        self.reference = SequenceReference(n, self.config.baseline_tokens)
        self.reference.level = self.reference.level.to(d)
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
        n, d = self.num_layers, self.device
        entropy = torch.zeros(n, device=d)
        werr = torch.zeros(n, 2, device=d)
        n_keys = torch.full((n,), 2, dtype=torch.long)  # host: the counts are host integers already
        layers = list(self._entropy)
        entropy[layers] = torch.stack([self._entropy[l] for l in layers]).float().to(d)
        if self._werr:
            wl = list(self._werr)
            werr[wl] = torch.stack([self._werr[l] for l in wl]).float().to(d)
        n_keys[layers] = torch.tensor([self._n_keys[l] for l in layers])
        seen = torch.zeros(n, dtype=torch.bool)
        seen[layers] = True
        expected = self.baseline.expected_mean(n_keys).to(d)  # host -> device: no wait for the GPU
        ratio = torch.where(seen.to(d), baseline_ratio(entropy, expected), torch.ones((), device=d))
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

    def _recent(self) -> torch.Tensor:
        k = max(self.filled, 1)
        return torch.arange(self.tokens - k, self.tokens, device=self.device) % self.config.window_tokens

    def window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window means over the tokens seen (at most ``window_tokens``), on the host: drop ``[L]``, weighted
        K/V error ``[L, 2]``, entropy ``[L]`` (a monitoring step's one read of the device)."""
        if self.filled < self.config.window_tokens:
            idx = self._recent()
            means = self.drops[idx].mean(0), self.werrs[idx].mean(0), self.entropies[idx].mean(0)
        else:
            means = self.drops.mean(0), self.werrs.mean(0), self.entropies.mean(0)
        return tuple(m.cpu() for m in means)

    def features(self) -> torch.Tensor:
        """``[L, 4]`` window means of :data:`kvguard.calibration.signals.FEATURES` (drop, |drop|, K error, V error),
        on the host."""
        idx = self._recent()
        d = self.drops[idx]
        return torch.cat([d.mean(0)[:, None], d.abs().mean(0)[:, None], self.werrs[idx].mean(0)], dim=1).cpu()

    def attention_mass(self, layer: int, end: int) -> torch.Tensor:
        mass = self.mass[layer]
        if mass is None:
            return torch.zeros(end)
        if mass.shape[0] < end:
            mass = torch.cat([mass, mass.new_zeros(end - mass.shape[0])])
        return mass[:end]


# ------------------------------------------------------------------------------------------- the attention
class _LiveHook:
    """sdpa, except for the observed layers' one-token decode queries: explicit softmax, recorded."""

    def __init__(self, monitor: TokenMonitor, cache) -> None:
        self.monitor, self.cache = monitor, cache

    def observes(self, module, tokens: int) -> bool:
        """Whether a step of ``tokens`` query tokens at ``module``'s layer is watched (one-token decode queries)."""
        return tokens == 1 and bool(self.monitor.observed[module.layer_idx])

    def record(self, module, probs: torch.Tensor) -> None:
        """A watched step's ``[B, H_kv, rep, N]`` probabilities, attended elsewhere (a packed forward's one kernel
        call for every sequence: :func:`kvguard.packed.attend`)."""
        self._observe(module.layer_idx, probs)

    def __call__(self, module, query, key, value, attention_mask, *, scaling, softcap, read=None):
        b, hq, t, d = query.shape
        hkv = key.shape[1]
        rep = hq // hkv
        layer = module.layer_idx
        observed = self.observes(module, t)
        if read is not None:  # a deferred read of the stored past
            if fused_attention.direct(read, query, key, attention_mask, softcap):
                # The kernels' one pass, which gives the probabilities too (as a packed forward reads it).
                (out, probs), = fused_attention.attend_steps([(query, read, key, value)], scaling=scaling,
                                                             probabilities=[observed])
                if observed:
                    self._observe(layer, probs)
                return out
            if t <= fused_attention.MAX_QUERY and fused_attention.available(query.device):
                # The fused kernels attend, and give the probabilities too.
                out, probs = fused_attention.attend_with_probs(query, read, key, value, attention_mask,
                                                               scaling=scaling, softcap=softcap)
                if observed:
                    self._observe(layer, probs.view(b, hkv, rep, -1))
                return out
            if not observed:
                return fused_attention.attend(query, read, key, value, attention_mask, scaling=scaling, softcap=softcap)
            past_k, past_v = read.materialize(key.dtype, key.device)  # one token to watch, and no kernels
            key, value = torch.cat([past_k, key], dim=-2), torch.cat([past_v, value], dim=-2)
        if not observed:
            mask = None if attention_mask is None else attention_mask[..., : key.shape[2]]
            return attention.attend(query, key, value, mask, scaling=scaling, softcap=softcap,
                                    is_causal=mask is None and t > 1)
        n = key.shape[2]
        cache_layer = self.cache.layers[layer]
        scores = (query.view(b, hkv, rep, d).float() * scaling) @ key.float().transpose(-1, -2)  # [B, Hkv, rep, T]
        scores = attention.softcapped(scores, softcap)
        if attention_mask is not None and (b > 1 or cache_layer.is_sliding):  # one unpadded full layer: all zeros
            scores = scores + attention_mask[..., :n].float().view(attention_mask.shape[0], 1, 1, n)
        probs = torch.softmax(scores, dim=-1)
        out = (probs.to(value.dtype) @ value).view(b, hq, 1, d)
        self._observe(layer, probs)
        return out

    def _observe(self, layer: int, probs: torch.Tensor) -> None:
        """Record a one-token query's ``[B, H_kv, rep, N]`` probabilities over the stored past and itself."""
        n = probs.shape[-1]
        cache_layer = self.cache.layers[layer]
        first = cache_layer.length - n  # absolute position of the first key (stored past, then the new token)
        self.monitor.observe(layer, probs, first, _read_error(cache_layer, first, n))


def _read_error(cache_layer, first: int, n: int) -> torch.Tensor | None:
    """The relative K/V error ``[H_kv, n, 2]`` of the ``n`` keys a query read from absolute position ``first``."""
    if not cache_layer.track_error:
        return None
    buffer = cache_layer.error_evidence()
    if not cache_layer.stored_last_update:
        return buffer[:, first:first + n]  # zeros from the window on
    # This token pushed a group out of the window: the read still saw it at full precision.
    end = max(first, cache_layer.read_fp_from)
    return torch.cat([buffer[:, first:end], buffer.new_zeros(buffer.shape[0], first + n - end, 2)], dim=1)


def live_hook(monitor: TokenMonitor, cache):
    """The monitor's attention for one sequence's slice of a packed forward (:class:`kvguard.packed.Piece`)."""
    return _LiveHook(monitor, cache)


@contextlib.contextmanager
def live_attention(model, monitor: TokenMonitor, cache):
    """Within this block (and this thread), ``model`` attends through the monitor (see module docstring); decode
    steps read the cache through the fused decode attention when it is built (:mod:`kvguard.fused_attention`),
    which also returns the probabilities the monitor records."""
    with attention.fused_reads(model), attention.hooked(model, _LiveHook(monitor, cache), takes_reads=True):
        yield
