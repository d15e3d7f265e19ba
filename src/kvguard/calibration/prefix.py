"""Prefix reuse: a trial that changes a plan from layer ``i`` on starts at layer ``i``.

Most sensitivity trials differ from one of two plans (all-FP16 or all-base) in a single layer. Every layer
before it computes exactly what it computes under that plan, so a pass recorded once under the plan (the
input each decoder layer received) lets the trial skip those layers: the decoder's layers before ``i`` hand
on the recorded input of layer ``i`` instead of computing it. The trial's logits are the ones a full pass
gives, bit for bit (the same kernels on the same inputs); on average half of a trial's layers are skipped.

The layers are skipped by shadowing their ``forward`` for the block, so no modeling code is forked: the model
still embeds the tokens, builds its masks and position embeddings, and runs its norm and output head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvguard.plan import Plan, StaticScales
from kvguard.precision import Precision


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers, in order (``model.model.layers`` for Llama- and Gemma-style models)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layer list to resume from")
    return layers


@contextlib.contextmanager
def recording(model) -> Iterator[list[torch.Tensor]]:
    """Within this block, each decoder layer's input hidden states (``[B, T, hidden]``) are appended, in layer
    order, to the list this yields."""
    seen: list[torch.Tensor] = []

    def keep(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append(hidden.detach().clone())

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def resumed(model, layer: int, hidden: torch.Tensor):
    """Within this block, the decoder layers before ``layer`` compute nothing: each returns ``hidden``, the input
    ``layer`` received in a recorded pass (so ``layer`` receives it too)."""
    skipped = list(decoder_layers(model))[:layer]

    def hand_on(*args, **kwargs) -> torch.Tensor:
        return hidden

    for module in skipped:
        module.forward = hand_on  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for module in skipped:
            del module.forward


def shared_layers(plan: Plan, recorded: Plan, scales: StaticScales | None) -> int:
    """How many leading layers ``plan`` computes exactly as ``recorded`` did (a pass recorded without static
    scales): the layers must be equal, the cache layout too, and with ``scales`` none of them may hold a
    static-INT8 head (the only heads ``scales`` change)."""
    if plan.cache != recorded.cache:
        return 0
    n = 0
    for mine, theirs in zip(plan.layers, recorded.layers):
        if mine != theirs or (scales is not None and Precision.INT8 in mine.precision):
            break
        n += 1
    return n
