"""What the fixed-plan benchmarks (``side_widths.py``, ``scale_bytes.py``) share: their command line, the
model's low-bit layout, and each corpus's FP16 reference.

Each of them scores uniform plans by the exact chunk-1 simulation against the model's FP16 cache on one stream
per corpus, and writes its rows as JSON with the model, split, length and layout they were measured on.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stream:
    """One corpus's token stream and what the FP16 cache predicts on it."""

    corpus: str
    ids: torch.Tensor  # [T]
    reference: torch.Tensor  # [T - 1, vocab], FP16's log-probabilities
    nll: float  # FP16's mean negative log-likelihood


def parser(doc: str, model: str, tokens: int) -> argparse.ArgumentParser:
    """The shared options: ``--model``, ``--split``, ``--corpus``, ``--tokens``, ``--json``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=model)
    p.add_argument("--split", default="calib", choices=("calib", "eval"))
    p.add_argument("--corpus", default="prose,code")
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--json", default=None)
    return p


def setup(args: argparse.Namespace):
    """``(model, tokenizer, architecture, low-bit layout name)``; prints what is measured."""
    from kvguard import models
    from kvguard.architecture import Architecture
    from kvguard.calibration.search import low_bit_layout

    model, tok = models.load(args.model)
    layout_name = low_bit_layout(model.config, args.tokens)
    print(f"{args.model}: layout {layout_name}, {args.split} split, {args.tokens} tokens", flush=True)
    return model, tok, Architecture.from_config(model.config), layout_name


def streams(model, tok, arch, args: argparse.Namespace) -> Iterator[Stream]:
    """Each corpus of ``--corpus`` on ``--split``, with FP16's predictions."""
    from kvguard import data
    from kvguard.plan import Plan
    from kvguard.scoring import score_simulated

    for corpus in args.corpus.split(","):
        ids = data.token_stream(corpus, args.split, tok, args.tokens)
        fp = score_simulated(model, ids, Plan.uniform(arch, "fp16"), keep_logits=True)
        yield Stream(corpus, ids, torch.log_softmax(fp.logits, dim=-1), fp.nll)


def score(model, stream: Stream, plan, codec=None) -> dict:
    """KL, perplexity change and top-1 agreement of ``plan`` against FP16 on ``stream``."""
    from kvguard.scoring import score_logits
    from kvguard.simulate import simulate_logits

    s = score_logits(stream.ids, [simulate_logits(model, stream.ids[:-1], plan, codec=codec)],
                     reference=stream.reference)
    return {"kl": s.kl, "ppl_delta_pct": 100.0 * (math.exp(s.nll - stream.nll) - 1.0), "top1_agree": s.top1_agree}


def write_json(args: argparse.Namespace, layout_name: str, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "split": args.split, "tokens": args.tokens, "layout": layout_name,
                       "rows": rows}, f, indent=1)
