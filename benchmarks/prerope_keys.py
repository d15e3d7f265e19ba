"""Would quantizing keys before RoPE (as KVQuant does) move the calibrated frontier? Each ``kvguard@<bytes>`` plan of
a profile, on and off at its own bytes.

    .venv/bin/python benchmarks/prerope_keys.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512 \\
        --methods kvguard@0.258544921875,kvguard@0.20683593749999998,kvguard@0.15468563503689237 \\
        --corpus prose,code,dialog --tokens 2048 --json benchmarks/results/smollm2-135m-prerope-keys.json
    .venv/bin/python benchmarks/prerope_keys.py --model smollm2-135m --profile benchmarks/profiles/smollm2-135m-512 \\
        --tokens 1024 --key-error 64      # only the keys' squared error before / after RoPE, calibration text

The cache stores keys after RoPE, as every engine does, and groups them per channel over ``group_size`` tokens
(KIVI's layout). RoPE turns each pair of channels by an angle that grows with the position, so within a group a
high-frequency pair's two channels trade values back and forth and each channel's range spans both. KVQuant
quantizes keys before RoPE instead and applies RoPE to what it reads back. ``+prerope`` does that to every key head
below 8 bits: it undoes RoPE on the stored keys (an exact rotation per pair, up to float rounding), quantizes them as
the plan stores them (the plan's Hadamard rotation of that layer's keys, scales, ranges), and rotates what it reads
back to its position again. Values have no RoPE and are stored as the plan stores them; INT8 heads keep their
calibrated post-RoPE scales. The bytes are the plan's own. A plan's softmax-bias correction (``+sb``) still estimates
the keys' rounding noise from their post-RoPE groups. It runs through the exact chunk-1 simulation (its store of each
head, ``simulate._quantized_copy``, swapped within :func:`prerope`) on the ``eval`` split (``--split calib``: the
calibration split). ``--variants chosen`` picks the layers on calibration text (:func:`choose_layers`).

The cache and the search have since learnt it for whole plans (``CacheConfig.prerope_keys``, ``kvguard/rope.py``; the
eval modifier ``+prerope``), without the softmax-bias correction, whose noise model is post-RoPE. This script keeps
what they do not: layers chosen one by one, and a ``+sb`` plan with its keys turned (the correction then estimated
from the post-RoPE groups, which no cache reads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

import torch
from lowbit import logits_row, print_table  # run as a script: benchmarks/ is on sys.path

from kvguard.rope import Rope, rerope, unrope


@contextlib.contextmanager
def prerope(cos: list[torch.Tensor], sin: list[torch.Tensor], layers: set[int] | None = None):
    """Within this block the simulation stores every key head below 8 bits before RoPE (in ``layers`` only, when
    given): ``cos`` / ``sin`` are per layer ``[T, D]``, the model's own rotary embedding at positions ``0..T-1``."""
    from kvguard import simulate
    from kvguard.quantizer import Axis

    kept = simulate._quantized_copy

    def copy(x, precisions, start, end, axis, cache, clip, absmax=None, rot=None, codec=None, layer=0, rope=None):
        args = (precisions, start, end, axis, cache, clip, absmax, rot, codec, layer)
        low = [p.is_quantized and p.bits < 8 for p in precisions]
        if axis is not Axis.CHANNEL or (layers is not None and layer not in layers) or not any(low):
            return kept(x, *args, rope)  # values have no RoPE
        c, s = cos[layer][:x.shape[2]], sin[layer][:x.shape[2]]  # [T, D]
        read = rerope(kept(unrope(x, c, s), *args), c, s)  # [B, H, T, D], stored turned back to position 0
        if all(low):
            return read
        # INT8 and FP16 heads keep their post-RoPE store (INT8: its calibrated post-RoPE scales).
        return torch.where(torch.tensor(low, device=x.device).view(1, -1, 1, 1), read, kept(x, *args))

    simulate._quantized_copy = copy
    try:
        yield
    finally:
        simulate._quantized_copy = kept


def rope_tables(model, t: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the model's ``cos`` / ``sin`` ``[T, D]`` at positions ``0..t-1`` (Gemma 3: its sliding and full
    layers' own bases; :class:`kvguard.rope.Rope`, equal to the model's rotary embedding bit for bit)."""
    rope = Rope.from_config(model.config)
    tables = [rope.tables(i, 0, t) for i in range(len(rope.bases))]
    return [c for c, _ in tables], [s for _, s in tables]


@torch.no_grad()
def key_error(model, tok, group: int, tokens: int) -> None:
    """Print, per width and with / without the Hadamard rotation, the squared error of every layer's keys stored
    before RoPE over that stored after it, with float16 and with one-byte scales (``--key-error``: calibration text
    of each corpus, groups of ``group`` tokens, no clipping)."""
    from kvguard import attention, data, rotation
    from kvguard.quantizer import Axis, QuantSpec, quantize

    cos, sin = rope_tables(model, tokens)
    keys: dict[int, list[torch.Tensor]] = {}

    def hook(module, query, key, value, mask, *, scaling, softcap):
        keys.setdefault(module.layer_idx, []).append(key.float())
        return attention.attend(query, key, value, mask, scaling=scaling, softcap=softcap)

    for corpus in ("prose", "code", "dialog"):
        with attention.hooked(model, hook):
            model(input_ids=data.token_stream(corpus, "calib", tok, tokens)[None], use_cache=False)
    for bits in ("int3", "int2"):
        for rotated in (False, True):
            err = {}
            for layer, seen in keys.items():
                for k in seen:
                    t = k.shape[2] // group * group
                    post = k[:, :, :t]  # [1, H, T, D]
                    pre = unrope(post, cos[layer][:t], sin[layer][:t])
                    signs = rotation.signs(k.shape[-1], k.shape[1], layer, k.device) if rotated else None
                    for where, x in (("post", post), ("pre", pre)):
                        x = rotation.rotate(x, signs) if rotated else x
                        for scale_bits in (16, 8):
                            spec = QuantSpec(bits, Axis.CHANNEL, group, 1.0, False, scale_bits, scale_bits == 8)
                            e = float((quantize(x, spec).dequantize(torch.float32) - x).square().sum())
                            err[where, scale_bits] = err.get((where, scale_bits), 0.0) + e
            print(f"{bits}, {'rotated' if rotated else 'not rotated'}: key squared error before / after RoPE "
                  f"{err['pre', 16] / err['post', 16]:.3f} (float16 scales), {err['pre', 8] / err['post', 8]:.3f} "
                  f"(one-byte scales, searched ranges)")


def choose_layers(model, tok, plan, scales, cos, sin, tokens: int) -> set[int]:
    """The layers whose keys ``plan`` should store before RoPE, chosen on **calibration** text (``tokens`` of each
    corpus's ``calib`` split): each layer with a key head below 8 bits is tried alone, and kept where the plan's KL
    falls (as calibration chooses the rotation per layer)."""
    from kvguard import data
    from kvguard.calibration.heldout import HeldOut

    heldout = HeldOut(model, {c: data.token_stream(c, "calib", tok, tokens) for c in ("prose", "code", "dialog")})
    base = heldout.score(plan, scales).kl
    chosen, moves = set(), []
    for i, lp in enumerate(plan.layers):
        if not any(p.is_quantized and p.bits < 8 for p in lp.precision):
            continue
        with prerope(cos, sin, {i}):
            kl = heldout.score(plan, scales).kl
        moves.append(f"{i}:{math.log(kl / base):+.3f}")
        if kl < base:
            chosen.add(i)
    print(f"ln KL ratio per layer alone (calibration text): {' '.join(moves)}; chosen {sorted(chosen)}", flush=True)
    return chosen


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.architecture import Architecture
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.profile import Profile
    from kvguard.scoring import score_simulated
    from kvguard.simulate import simulate_logits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", required=True)
    p.add_argument("--methods", help="kvguard@<bytes>,...: each is scored off and +prerope")
    p.add_argument("--candidates", help="';'-separated names from the profile's search log, scored like --methods")
    p.add_argument("--corpus", default="prose,code,dialog")
    p.add_argument("--split", default="eval", choices=("eval", "calib"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json", default=None)
    p.add_argument("--variants", default="off,all", help="off, all (every layer), chosen (see --choose-tokens)")
    p.add_argument("--choose-tokens", type=int, default=512,
                   help="calibration tokens per corpus the layers of the 'chosen' variant are picked on")
    p.add_argument("--key-error", type=int, metavar="GROUP", default=None,
                   help="only print the keys' squared error before / after RoPE, in groups of GROUP tokens")
    args = p.parse_args(argv)
    model, tok = models.load(args.model)
    if args.key_error:
        key_error(model, tok, args.key_error, args.tokens)
        return 0
    if not (args.methods or args.candidates):
        p.error("--methods or --candidates is required (unless --key-error)")
    profile = Profile.load(args.profile, model)
    arch = Architecture.from_config(model.config)
    scales = profile.static_scales()
    cos, sin = rope_tables(model, args.tokens)
    plans = {name: methods.get(name, profile).plan(arch) for name in (args.methods or "").split(",") if name}
    log = {c.name: c.plan for c in profile.meta.search_log}
    for name in (args.candidates or "").split(";"):
        if name and name not in log:
            p.error(f"{name!r} is not in the profile's search log")
        if name:
            plans[name] = log[name]
    variants = args.variants.split(",")
    chosen = {name: choose_layers(model, tok, plan, scales, cos, sin, args.choose_tokens)
              for name, plan in plans.items()} if "chosen" in variants else {}
    rows = []
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, args.split, tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        reference = torch.log_softmax(fp.logits, dim=-1)
        for name, plan in plans.items():
            blocks = {"off": ("", contextlib.nullcontext), "all": ("+prerope", lambda: prerope(cos, sin)),
                      "chosen": ("+prerope-chosen", lambda: prerope(cos, sin, chosen[name]))}
            for suffix, block in (blocks[v] for v in variants):
                with block():
                    logits = simulate_logits(model, ids[:-1], plan, scales)
                stored, fp16 = plan.kv_bytes(model.config, ids.numel() - 1, scales)
                rows.append(logits_row(corpus, name + suffix, ids, logits, reference, fp.nll, stored, fp16))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "split": args.split, "tokens": args.tokens, "rows": rows,
                       "chosen_layers": {k: sorted(v) for k, v in chosen.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
