"""Ablation: one-byte scales and the softmax-bias correction read inside the fused kernels, or by torch ops.

The fused decode kernels decode one-byte scale / zero codes as they read them and add the softmax-bias
correction once per scale row (``kvguard/fused_attention.cpp``). Before, every decode step decoded each part's
one-byte scales into float16 tensors (``QuantizedTensor.scales()`` / ``zeros()``) and added the correction with
separate tensor ops (``score_bias.correction``). This script decodes the same greedy tokens both ways, each plan's
two decoders one step after the other in one process (as ``fused_decode.py``), and prints the median step times.
Both read the same numbers (``tests/test_fused_attention.py``: the decoded scales bit for bit, the correction to
float rounding).

    python benchmarks/fused_scales.py --context 4096 --steps 32 --profile benchmarks/profiles/smollm2-135m-512 \\
        --precisions fp16,int2,kvguard@0.15468563503689237,kvguard@0.20615590413411458,kvguard@0.25714331732855905
"""

from __future__ import annotations

import contextlib

import torch

from kvguard import fused_attention, score_bias
from kvguard.control.decoding import CacheDecoder
from kvguard.quantizer import QuantizedTensor

from fused_decode import _filled, interleaved, parser, prefilled, print_medians  # a sibling script


def _torch_codes(x: QuantizedTensor, batch: int, heads: int) -> tuple:
    """The kernel arguments with the scales decoded by torch ops (float16 scale and zero, no table)."""
    args = list(_KERNEL_CODES(x, batch, heads))
    if x.spec.scale_bits == 8:
        args[1:4] = [x.scales(), x.zeros(), fused_attention._NO_TABLE]
    return tuple(args)


def _torch_score_segment(ops, scores, q, seg, correct: bool = False) -> None:
    """``_score_segment`` with the correction added by ``score_bias.correction`` after the kernel's scores."""
    if not isinstance(seg.keys, QuantizedTensor):
        return _KERNEL_SCORE(ops, scores, q, seg, False)
    qs = q if seg.heads is None else q.index_select(1, seg.heads)
    if seg.key_rotation is not None:
        qs = qs @ seg.key_rotation
    heads = seg.heads if seg.heads is not None else torch.empty(0, dtype=torch.long)
    ops.key_scores(scores, seg.start, heads, qs.contiguous(), *_torch_codes(seg.keys, q.shape[0], qs.shape[1]), False,
                   *(torch.empty(0),) * 3)  # no turn: keys stored after RoPE
    if correct and score_bias.applies(seg.keys.spec):
        bias = score_bias.correction(qs, seg.keys)  # [B, h, R, T]
        if seg.heads is None:
            scores[..., seg.start:seg.start + seg.length] += bias
        else:
            scores[:, seg.heads, :, seg.start:seg.start + seg.length] += bias


_KERNEL_CODES, _KERNEL_SCORE = fused_attention._codes, fused_attention._score_segment


@contextlib.contextmanager
def torch_reads():
    """Within this block the fused read decodes scales and corrects scores with torch ops, as before."""
    fused_attention._codes, fused_attention._score_segment = _torch_codes, _torch_score_segment
    try:
        yield
    finally:
        fused_attention._codes, fused_attention._score_segment = _KERNEL_CODES, _KERNEL_SCORE


class _TorchDecoder:
    """A decoder whose steps run inside :func:`torch_reads`."""

    def __init__(self, decoder: CacheDecoder) -> None:
        self.decoder = decoder

    def step(self, token: int) -> torch.Tensor:
        with torch_reads():
            return self.decoder.step(token)


@torch.no_grad()
def main() -> None:
    args = parser(__doc__.splitlines()[0], steps=32, precisions="fp16,int2").parse_args()
    model, profile, prompt_cache, first = prefilled(args)
    decoders = {}
    for precision in args.precisions.split(","):
        def decoder() -> CacheDecoder:
            return CacheDecoder(model, _filled(model, prompt_cache, precision, profile), fused=True)

        decoders[f"{precision} kernel"], decoders[f"{precision} torch"] = decoder(), _TorchDecoder(decoder())
    seconds = interleaved(decoders, {name: first for name in decoders}, args.steps)
    print_medians(seconds, f"{args.precisions.split(',')[0]} kernel", f"context {args.context}")


if __name__ == "__main__":
    main()
