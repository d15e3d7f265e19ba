"""``kvguard eval``: methods side by side on the same tokens (perplexity, pass-key retrieval, long-range recall,
decode speed)."""

from __future__ import annotations

import argparse
import os

from kvguard.cli.common import CommandError, add_device, add_model, csv, device, finite, positive, writable_file

# The first 4 and the last 64 tokens stay in full precision and tokens are quantized in groups of 32: below
# about 100 tokens nothing is quantized and every method scores exactly like fp16; 128 leaves at least one group.
MIN_TOKENS = 128
DEFAULT_METHODS = "fp16,int8,int4,int2,kivi-4,kivi-2,hf-quanto-4,hf-quanto-2,hf-hqq-4"


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="quality, memory and speed through the cache, side by side with peers")
    add_model(p)
    add_device(p)
    p.add_argument("--profile", help="calibration profile (for the kvguard / kvguard-live / fp8 methods)")
    from kvguard.evaluation import recall
    from kvguard.peers import llamacpp

    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods (default: %(default)s); llama.cpp's own KV types, run in llama.cpp on "
                        f"an embedded model's GGUF, deltas against {llamacpp.REFERENCE}: {', '.join(llamacpp.SPECS)}")
    p.add_argument("--task", default="ppl", choices=["ppl", "passkey", "recall", "speed", "capacity"],
                   help="what to measure; capacity: the largest batch x context each method fits in --memory-budget "
                        "(default: %(default)s)")
    p.add_argument("--corpus", default="prose", help="comma-separated eval corpora: prose, code, dialog, long (default: %(default)s)")
    p.add_argument("--text-file", help="evaluate this UTF-8 text file instead of a corpus")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per text (default: %(default)s)")
    p.add_argument("--windows", type=int, default=1,
                   help="score this many consecutive --tokens windows per corpus and combine them (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=1, help="tokens per forward pass; 1 = true decoding (default: %(default)s)")
    p.add_argument("--simulate", default="auto", choices=["auto", "on", "off"],
                   help="score static methods by the exact parallel simulation of chunk-1 decoding (default: %(default)s)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--lengths", default="1024,2048,4096", help="passkey: prompt lengths (default: %(default)s)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="passkey: needle depths (default: %(default)s)")
    p.add_argument("--trials", type=int, default=3,
                   help="passkey: prompts per length and depth; recall: prompts per distance (default: %(default)s)")
    p.add_argument("--distances", default="512,1024,2048,4096",
                   help="recall: filler tokens between the word list and its repeat (default: %(default)s)")
    p.add_argument("--words", type=int, default=recall.DEFAULT_WORDS,
                   help="recall: words in the list, one token each; the first of the repeat is not scored "
                        "(default: %(default)s)")
    p.add_argument("--contexts", default="1024,4096",
                   help="speed: context lengths; capacity: the contexts the largest batch is given at "
                        "(default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="speed: decode steps timed (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="speed: blocks of --new-tokens steps timed one after another per method; the fastest "
                        "block counts, the slower ones are the machine's noise (default: %(default)s)")
    p.add_argument("--passes", type=int, default=1,
                   help="speed: times the whole list of methods runs, in turn, each method in a fresh process "
                        "per pass; each method's fastest block over all passes counts (default: %(default)s)")
    p.add_argument("--memory-budget", type=float, default=4.0,
                   help="capacity: process memory budget in GiB (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="capacity: batch of the peak-RSS run (default: %(default)s)")
    p.add_argument("--context", type=int, default=4096,
                   help="capacity: context of the peak-RSS run (default: %(default)s)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="capacity: skip the real runs that check the prediction: --batch x --context per method, and "
                        "the largest batch predicted for the --check-largest methods (minutes to an hour each)")
    p.add_argument("--check-largest", default="fp16,int4",
                   help="capacity: methods whose largest predicted batch at --context is run to check it, or 'none' "
                        "(default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.cli.common import load_profile
    from kvguard.evaluation import methods

    names = _check_args(args)
    args.device = device(args)
    profile = load_profile(args.profile) if args.profile else None
    for name in names:
        methods.get(name, profile)  # unknown names and missing profiles fail before any model is loaded
    if args.task == "speed":
        return _speed(args, names)
    if args.task == "capacity":
        return _capacity(args, names)
    from kvguard import models

    # The text first (seconds, with the tokenizer alone): a file or corpus too short fails before the weights load.
    streams = _streams(args, models.load_tokenizer(args.model)) if args.task == "ppl" else None
    if streams:
        _check_context(args.model, max(w.numel() for ws in streams.values() for w in ws))
    model, tok = models.load(args.model, device=args.device)
    if profile is not None:
        profile.check_model(model)
    if args.task == "passkey":
        return _passkey(args, model, tok, names, profile)
    if args.task == "recall":
        return _recall(args, model, tok, names, profile)
    return _perplexity(args, model, streams, names, profile)


def _check_args(args: argparse.Namespace) -> list[str]:
    """Every check that needs no model, so that bad input fails in a second, not after loading one; the
    method names."""
    from kvguard import data
    from kvguard.evaluation import methods
    from kvguard.peers import llamacpp

    names = csv(args.methods)
    if not names:
        raise CommandError(f"--methods is empty; give at least one, e.g. --methods fp16,int4 (default: {DEFAULT_METHODS})")
    if args.profile and "kvguard" not in names:
        names.append("kvguard")
    in_llamacpp = [n for n in names if methods.reference_of(n) == llamacpp.REFERENCE]
    if in_llamacpp and args.task not in ("ppl", "speed"):
        raise CommandError(f"--methods {in_llamacpp[0]}: the llama.cpp methods run in --task ppl and speed only "
                           f"(llama.cpp keeps its own cache; kvguard's {args.task} task measures a transformers cache)")
    for flag in ("tokens", "windows", "chunk", "trials", "new_tokens", "batch", "context"):
        positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.task == "recall":
        _check_recall(args)
    if args.task == "ppl" and args.tokens < MIN_TOKENS:
        raise CommandError(f"--tokens {args.tokens} is too few: at least {MIN_TOKENS} tokens are needed (with fewer, the "
                           f"cache keeps them all in full precision and every method scores like fp16)")
    corpora = csv(args.corpus)
    bad = [c for c in corpora if c not in data.CORPORA]
    if bad or not corpora:
        raise CommandError(f"--corpus: unknown corpus {', '.join(bad) or repr(args.corpus)}; valid corpora: "
                           f"{', '.join(data.CORPORA)}")
    if args.text_file:
        try:
            data.read_text_file(args.text_file)
        except (OSError, ValueError) as err:
            raise CommandError(f"--text-file: {err}") from None
    writable_file("--json", args.json)
    return names


def _speed(args, names: list[str]) -> int:
    from kvguard.evaluation import harness, speed

    for flag, value in (("--rounds", args.rounds), ("--passes", args.passes)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    rows = speed.run(args.model, names, csv(args.contexts, int), args.new_tokens, profile_path=args.profile,
                     device=args.device, rounds=args.rounds, passes=args.passes)
    print(speed.markdown_table(rows))
    if args.json:
        harness.write_json(args.json, {"model": args.model, "task": "speed", "new_tokens": args.new_tokens,
                                       "rounds": args.rounds, "passes": args.passes, "results": rows})
    return 0


def _capacity(args, names: list[str]) -> int:
    from kvguard.evaluation import capacity, harness

    finite("--memory-budget", args.memory_budget, low=0.01)
    rows = capacity.run(args.model, names, budget_gib=args.memory_budget, contexts=tuple(csv(args.contexts, int)),
                        batch=args.batch, context=args.context, check=args.check,
                        largest=() if args.check_largest == "none" else tuple(csv(args.check_largest, str)),
                        profile_path=args.profile, device=args.device)
    print(capacity.markdown_table(rows, args.memory_budget))
    if args.json:
        harness.write_json(args.json, {"model": args.model, "task": "capacity", "memory_budget_gib": args.memory_budget,
                                       "device": args.device, "results": rows})
    return 0


def _passkey(args, model, tok, names: list[str], profile) -> int:
    from kvguard.evaluation import harness, methods, passkey

    results = []
    for name in ["fp16"] + [n for n in names if n != "fp16"]:
        results += passkey.run(model, tok, methods.get(name, profile), csv(args.lengths, int), csv(args.depths, float),
                               args.trials)
    print("| method | length | depth | accuracy | trials |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.method} | {r.length} | {r.depth} | {r.accuracy:.2f} | {r.trials} |")
    if args.json:
        harness.write_json(args.json, {"model": args.model, "task": "passkey",
                                       "results": [dict(vars(r), accuracy=r.accuracy) for r in results]})
    return 0


def _check_context(model: str, tokens: int) -> None:
    """Refuse texts longer than the model's positions (from its config, before the weights load): past them the
    model's numbers mean nothing, and a method's row would only measure that."""
    from transformers import AutoConfig

    from kvguard import models

    context = getattr(AutoConfig.from_pretrained(models.resolve(model)), "max_position_embeddings", None)
    if context is not None and tokens > context:
        raise CommandError(f"--tokens {tokens} is longer than {model}'s context ({context} positions); use at most "
                           f"{context}, or a model with a longer context")


def _check_recall(args: argparse.Namespace) -> None:
    from kvguard.evaluation import recall

    distances = csv(args.distances, int)
    if not distances or min(distances) < 1:
        raise CommandError(f"--distances must be positive token counts, e.g. 512,1024,2048, got {args.distances!r}")
    if not 2 <= args.words <= recall.POOL_SIZE:
        raise CommandError(f"--words must be in [2, {recall.POOL_SIZE}] (the first word of the repeat is not scored), "
                           f"got {args.words}")


def _recall(args, model, tok, names: list[str], profile) -> int:
    from kvguard.evaluation import harness, methods, recall

    results = []
    for name in ["fp16"] + [n for n in names if n != "fp16"]:
        results += recall.run(model, tok, methods.get(name, profile), csv(args.distances, int), args.trials,
                              words=args.words)
    print(recall.markdown_table(results))
    if args.json:
        harness.write_json(args.json, {"model": args.model, "task": "recall", "words": args.words,
                                       "results": [r.to_json() for r in results]})
    return 0


def _streams(args, tok) -> dict[str, list]:
    """Per corpus (or the text file), the token windows to score."""
    from kvguard import data

    if args.text_file:
        ids = data.load_text_file(args.text_file, tok, args.tokens)
        if ids.numel() < MIN_TOKENS:
            raise CommandError(f"--text-file {args.text_file} has {ids.numel()} tokens; at least {MIN_TOKENS} are "
                               f"needed (with fewer, the cache keeps them all in full precision)")
        return {os.path.basename(args.text_file): [ids]}
    return {c: _windows(data.token_stream(c, "eval", tok, args.tokens * args.windows), args.tokens, tok)
            for c in csv(args.corpus)}


def _perplexity(args, model, streams: dict[str, list], names: list[str], profile) -> int:
    from kvguard import models
    from kvguard.evaluation import harness, methods
    from kvguard.peers import llamacpp

    # The llama.cpp methods run on the GGUF the embedded model was converted from; a local folder has none (their
    # rows say so). Asked for only when needed: Gemma 3's GGUF is assembled from its chunk packages once.
    wants_gguf = any(methods.reference_of(n) == llamacpp.REFERENCE for n in names)
    gguf = models.gguf_path(args.model) if wants_gguf and args.model in models.EMBEDDED else None
    rows = []
    for corpus, windows in streams.items():
        per_window = [harness.evaluate_stream(model, ids, corpus, names, chunk=args.chunk, simulate=args.simulate,
                                              profile=profile, gguf=gguf) for ids in windows]
        rows += per_window[0] if len(per_window) == 1 else harness.combine_windows(per_window)
    print(harness.markdown_table(rows))
    if args.json:
        tokens = max(w.numel() for ws in streams.values() for w in ws)
        payload = harness.rows_payload(args.model, tokens, args.chunk, rows)
        payload["windows"] = args.windows
        harness.write_json(args.json, payload)
    return 0


def _windows(stream, tokens: int, tok) -> list:
    """Consecutive ``tokens``-long windows of ``stream``; every window starts with BOS when the model wants
    one (the stream has it only at its start)."""
    from kvguard import data

    windows = [stream[i:i + tokens].clone() for i in range(0, stream.numel(), tokens)]
    if data.wants_bos(tok) and tok.bos_token_id is not None:
        for w in windows[1:]:
            w[0] = tok.bos_token_id
    return windows
