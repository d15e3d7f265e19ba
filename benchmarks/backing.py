"""Restore, recompute, re-encode? The live loop over a static plan, with and without the backing tier.

    .venv/bin/python benchmarks/backing.py --model smollm2-135m --profile P [--base kvguard@0.22]
        [--corpus prose,code,dialog] [--tokens 2048] [--cap-mib 256] [--variants recompute,restore,reencode]
        [--split eval] [--set NAME=VALUE ...] [--json F]

Scores, side by side on the same tokens of each corpus (the evaluation split; ``--split calib``: calibration
text): ``fp16`` (the reference), ``<base>`` (no loop), and the loop ``kvguard-live:<base>`` in up to three
variants, the ablation of what the backing tier (:mod:`kvguard.backing`) adds:

- ``recompute``: no backing tier; compensation recomputes against the quantized past, a promotion changes the
  tier of new tokens only;
- ``restore``: a backing tier of ``--cap-mib`` MiB; compensation restores the original K/V where it holds them;
  promotions still change new tokens only (``reencode_history=False``);
- ``reencode``: the same tier, and a promotion also stores the layer's history again at its new tier from the
  originals, within the memory budget (the default loop).

``kl_gap_recovered`` is the share of the base plan's KL (and ``ppl_gap_recovered`` of its perplexity excess
over ``fp16``) the loop takes back; ``fp_share`` the (layer, position) pairs held at full precision by
restoring or recomputing; ``reencoded_share`` the (layer, position) pairs whose history was stored again;
``saving_kept`` the share of the base plan's memory saving the hot cache keeps. Thresholds come from the
profile; nothing is tuned here. ``--set NAME=VALUE`` (repeatable) overrides one of the loop's monitor settings
(:class:`~kvguard.config.MonitorConfig`) for every variant, to try a policy change; try it on ``--split calib``
text first, so that the evaluation split is not what picks it. ``kl_by_quarter`` (JSON) is each quarter of the
stream's mean KL, which shows whether the loop's remaining gap is early (before it acts) or late.
"""

from __future__ import annotations

import argparse
import json
import sys

VARIANTS = ("recompute", "restore", "reencode")
COLUMNS = ["corpus", "method", "ppl", "kl", "top1_agree", "kl_gap_recovered", "ppl_gap_recovered", "fp_share",
           "reencoded_share", "kv_bytes_ratio", "saving_kept", "backing_mib", "trigger_rate", "tok_s"]


def main(argv: list[str] | None = None) -> int:
    from kvguard import data, models
    from kvguard.profile import Profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--base", default="kvguard@0.22", help="the static method the loop runs over")
    parser.add_argument("--corpus", default="prose,code,dialog")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--cap-mib", type=float, default=256.0, help="the backing tier's byte cap, in MiB")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    parser.add_argument("--split", default="eval", choices=("eval", "calib"), help="the text split to score on")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a monitor setting for the loop, e.g. demotion=risk (repeatable)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        overrides = monitor_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")

    model, tok = models.load(args.model)
    profile = Profile.load(args.profile, model)
    print(f"{args.model}, {args.tokens} {args.split}-split tokens per corpus, loop over {args.base}, profile "
          f"{args.profile}" + "".join(f", {s}" for s in args.set), flush=True)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, args.split, tok, args.tokens)
        for row in corpus_rows(model, profile, ids, args.base, variants, args.cap_mib, overrides):
            row["corpus"] = corpus
            rows.append(row)
            print("| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "base": args.base, "tokens": args.tokens, "split": args.split,
                       "cap_mib": args.cap_mib, "monitor_overrides": overrides, "rows": rows}, f, indent=1)
    return 0


def monitor_overrides(settings: list[str]) -> dict:
    """``["NAME=VALUE", ...]`` -> monitor setting overrides (values parsed as JSON: numbers, booleans, lists; a value
    that is not JSON, such as ``demotion=risk``, is taken as a word), checked by :class:`MonitorConfig` itself so
    that a wrong name or value fails before the model loads."""
    from kvguard.config import MonitorConfig

    out = {}
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants NAME=VALUE; got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out[name] = tuple(parsed) if isinstance(parsed, list) else parsed
    MonitorConfig.from_dict({}, **out)
    return out


def _kl_by_quarter(logits: "torch.Tensor", reference: "torch.Tensor", ids: "torch.Tensor") -> list[float]:
    """The mean KL of each quarter of a stream's ``[T - 1, vocab]`` predictions against ``reference``."""
    from kvguard.metrics import TokenMetrics

    n = logits.shape[0]
    step = -(-n // 4)
    out = []
    for i in range(0, n, step):
        m = TokenMetrics()
        m.add(logits[i:i + step], ids[1 + i:1 + i + step], reference[i:i + step])
        out.append(m.kl)
    return out


def corpus_rows(model, profile, ids, base_name: str, variants: list[str], cap_mib: float,
                overrides: dict | None = None) -> list[dict]:
    """The reference, the base plan and each loop variant on one token stream."""
    import torch

    from kvguard.architecture import Architecture
    from kvguard.backing import BackingConfig
    from kvguard.evaluation import methods
    from kvguard.plan import Plan
    from kvguard.scoring import score_live, score_simulated

    arch = Architecture.from_config(model.config)
    fp16 = score_simulated(model, ids, Plan.uniform(arch, "fp16", profile.plan.cache), keep_logits=True)
    reference = torch.log_softmax(fp16.logits, dim=-1)
    base = methods.get(base_name, profile)
    plan = base.plan(arch)
    static = score_simulated(model, ids, plan, reference=reference, scales=base.scales, keep_logits=True)
    stored, full = plan.kv_bytes(model.config, ids.numel() - 1, base.scales)
    rows = [{"method": "fp16", "ppl": fp16.perplexity, "kl": 0.0, "top1_agree": 1.0},
            {"method": base_name, "ppl": static.perplexity, "kl": static.kl, "top1_agree": static.top1_agree,
             "kv_bytes_ratio": stored / full, "saving_kept": 1.0,
             "kl_by_quarter": _kl_by_quarter(static.logits, reference, ids)}]
    live = methods.get(f"kvguard-live:{base_name}", profile)
    backing = BackingConfig(enabled=True, max_bytes=int(cap_mib * 2**20))
    settings = {"recompute": ({"backing": None}, {}),
                "restore": ({"backing": backing}, {"reencode_history": False}),
                "reencode": ({"backing": backing}, {})}
    for variant in variants:
        kwargs, variant_overrides = settings[variant]
        name = f"kvguard-live:{base_name} ({variant})"
        session = live.session(model, sequence_id=name, monitor_overrides={**(overrides or {}), **variant_overrides},
                               **kwargs)
        score = score_live(session, ids, reference=reference, keep_logits=True, desc=name)
        s = session.summary()
        pairs = s["tokens"] * arch.num_layers
        ratio = s["kv_bytes"] / s["kv_bytes_fp16"]
        rows.append({"method": name, "ppl": score.perplexity, "kl": score.kl, "top1_agree": score.top1_agree,
                     "tok_s": (score.tokens - 1) / score.seconds, "trigger_rate": s["trigger_rate"],
                     "restored_positions": s["restored_positions"], "recomputed_positions": s["recomputed_positions"],
                     "reencoded_positions": s["reencoded_positions"], "fp_share": s["recompute_fraction"],
                     "reencoded_share": s["reencoded_positions"] / pairs, "kv_bytes_ratio": ratio,
                     "saving_kept": (1 - ratio) / (1 - stored / full), "backing_mib": s["backing_bytes"] / 2**20,
                     "max_level": s["max_level"], "actions": s["actions"], "precisions": s["precisions"],
                     "kl_by_quarter": _kl_by_quarter(score.logits, reference, ids)})
    for row in rows:
        row["kl_gap_recovered"] = 1 - row["kl"] / static.kl if static.kl else None
        excess = static.perplexity - fp16.perplexity
        row["ppl_gap_recovered"] = 1 - (row["ppl"] - fp16.perplexity) / excess if excess > 0 else None
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5f}" if abs(value) < 1 else f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
