"""``kvguard generate``: decode under the feedback loop, then show what the loop saw and did."""

from __future__ import annotations

import argparse
import time

from kvguard.cli.common import CommandError, add_device, add_model, device, writable_file
from kvguard.control.sampling import Sampler


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="decode with live entropy monitoring and compensation")
    add_model(p)
    add_device(p)
    p.add_argument("--profile", required=True, help="calibration profile of the model (from `kvguard calibrate`)")
    p.add_argument("--prompt", required=True, help="the prompt (sent as a user message when the model has a chat template)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=Sampler.temperature, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=Sampler.top_p, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=Sampler.seed, help="makes sampling reproducible (default: a fresh one)")
    p.add_argument("--events", help="write every alarm and action as one JSON line to this file")
    p.add_argument("--plan", default="profile",
                   help="plan new tokens start from: the profile's, or a static method such as int4 (default: %(default)s)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.set_defaults(func=run)


def prompt_ids(tok, prompt: str, raw: bool):
    """The prompt's token ids, as a user message under the chat template unless ``raw``."""
    if tok.chat_template and not raw:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    return tok(prompt, return_tensors="pt").input_ids[0]


def run(args: argparse.Namespace) -> int:
    from kvguard import models
    from kvguard.cli.common import load_profile
    from kvguard.evaluation import methods
    from kvguard.evaluation.method_spec import LIVE

    if args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise CommandError("--prompt is empty")
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    target = device(args)
    writable_file("--events", args.events)
    profile = load_profile(args.profile)
    method = methods.get(LIVE if args.plan == "profile" else f"{LIVE}:{args.plan}", profile)
    model, tok = models.load(args.model, device=target)
    profile.check_model(model)
    if args.events:
        open(args.events, "w").close()  # one run's events per file
    ids = prompt_ids(tok, args.prompt, args.raw)
    session = method.session(model, events_path=args.events)
    t0 = time.perf_counter()
    out = session.generate(ids, args.max_new_tokens, sampler=sampler, eos_token_id=tok.eos_token_id,
                           on_token=token_printer(tok))
    dt = time.perf_counter() - t0
    print(f"\n\n--- {len(out.tokens)} tokens in {dt:.1f} s ({len(out.tokens) / dt:.1f} tok/s), prompt {ids.numel()} "
          f"tokens, plan {args.plan} ---")
    print_summary(session.summary())
    if args.events:
        print(f"events: {len(session.events)} written to {args.events}")
    return 0


def token_printer(tok):
    """An ``on_token`` that prints the text as it grows."""
    generated: list[int] = []
    printed = ""

    def show(token: int) -> None:
        nonlocal printed
        generated.append(token)
        text = tok.decode(generated, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text

    return show


def print_summary(summary: dict) -> None:
    """Memory saved, alarms, compensation and the rollback level of a session's summary."""
    from kvguard.cache import MemoryUse

    a, acts = summary["alarms"], summary["actions"]
    memory = MemoryUse(*(summary["memory"][k] for k in ("hot_bytes", "overlay_bytes", "backing_ram_bytes",
                                                          "backing_disk_bytes", "fp16_bytes")))
    print(f"memory: {memory.describe()}: {100 * summary['memory_saved']:.1f} % saved, every tier in RAM counted "
          f"(held over the run: {summary['held_ram_ratio']:.3f} of FP16)")
    print(f"monitor: {summary['monitoring_steps']} steps, trigger rate {100 * summary['trigger_rate']:.1f} %; alarms: "
          f"{a['warning']} warning, {a['trigger']} trigger, {a['severe']} severe")
    print(f"compensation: {acts.get('light', 0)} light, {acts.get('heavy', 0)} heavy, "
          f"{summary['recomputed_positions']} positions recomputed ({summary['recompute_ms']:.0f} ms); precision "
          f"{acts.get('precision_up', 0)} up / {acts.get('precision_down', 0)} down")
    print(f"rollback: level {summary['level']} now, {summary['max_level']} at most"
          + ("; recalibration recommended" if summary["recalibration_recommended"] else ""))
