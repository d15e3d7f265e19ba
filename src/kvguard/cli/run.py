"""``kvguard run``: the mission end to end on the embedded default model, in four steps.

1. **Calibrate.** A *quick* calibration of the model (a few dozen samples instead of the recommended 5,000, and a
   smaller search: a quick look, not a profile to serve): K/V statistics, sensitivity per layer and head, the
   search, the run-time monitor. Its memory budget is just under uniform ``int4``'s bytes, so the plan it chooses
   has to beat ``int4`` on bytes. The profile is cached under ``<cache>/profiles/`` by a digest of its settings and
   reused by later runs; the command for the full calibration is printed.
2. **Plan and frontier.** The chosen plan (per-layer tiers), the Pareto frontier of the search, and a table on
   2,048 held-out tokens (the evaluation split, which calibration never reads): FP16, ``int4``, the frontier plan
   nearest ``int4``'s bytes next to it, the chosen plan, a few more frontier plans and the peers, each with the
   bytes it holds, its perplexity change, and its KL from FP16 (the mean and the tail). Then whether the chosen plan
   beats ``int4`` on both bytes and KL, or why not.
3. **Live loop.** A reply generated under the feedback loop over a low-bit frontier plan (``kvguard-live:
   kvguard@<bytes>``, the one nearest 0.6 of ``int4``'s bytes), a timeline of what the loop did (alarms,
   recomputations, precision changes, rollback level), the bytes it held with every tier counted, and the same
   reply scored against FP16 for the loop and for the static frontier plan that holds about the same bytes.
4. **Report.** The HTML report of the profile (sensitivity heat map, frontier, per-layer tiers) with the loop's
   timeline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvguard.cli.common import CommandError, add_device, add_model, csv, default, device, print_table

PEERS = "int4,kivi-4"
PROMPT = "Summarize this article in two sentences.\n\n"
# Step 3 runs the loop over the frontier plan nearest this fraction of uniform int4's bytes: low enough that the
# loop has something to watch, high enough that the reply is still worth reading.
LIVE_SHARE = 0.6


@dataclass(frozen=True)
class RunConfig:
    """What ``kvguard run`` does (the command line's defaults are these).

    Attributes:
        model: embedded model name or local model folder.
        cache: where profiles, the loop's events and the report go; ``None``: ``$KVGUARD_HOME/run``.
        samples, max_tokens, heldout_tokens, head_layers, domains: the quick calibration's settings.
        memory_budget: the most KV bytes the chosen plan may hold, over FP16's at the calibration context; ``None``:
            just under uniform ``int4``'s (:func:`int4_budget`).
        tokens: held-out evaluation tokens scored for the table.
        peers: the methods the plans are compared with (besides FP16).
        frontier_points: the most frontier plans shown in the table besides the chosen one, the one nearest
            ``int4``'s bytes and step 3's.
        max_new_tokens: tokens the live-loop reply may generate.
        recalibrate: calibrate again even when a cached profile exists.
        device: where the model runs in every step (``cpu``, ``cuda``, ``auto``; :mod:`kvguard.device`).
    """

    model: str
    cache: Path | None = None
    samples: int = 64
    max_tokens: int = 256
    heldout_tokens: int = 768
    head_layers: int = 2
    domains: tuple[str, ...] = ("prose", "dialog", "code")
    memory_budget: float | None = None
    tokens: int = 2048
    peers: tuple[str, ...] = tuple(PEERS.split(","))
    frontier_points: int = 1
    max_new_tokens: int = 64
    recalibrate: bool = False
    device: str = "cpu"


def add_parser(sub) -> None:
    C = RunConfig
    p = sub.add_parser("run", help="the mission end to end: calibrate, plan and frontier against the peers, the "
                                   "live loop, the report", description=__doc__.split("\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model(p)
    add_device(p)
    p.add_argument("--cache", help="folder for profiles, events and the report (default: $KVGUARD_HOME/run)")
    p.add_argument("--samples", type=int, default=default(C, "samples"),
                   help="step 1: calibration samples; `kvguard calibrate` takes 5,000 (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=default(C, "max_tokens"),
                   help="step 1: tokens per calibration sample (default: %(default)s)")
    p.add_argument("--heldout-tokens", type=int, default=default(C, "heldout_tokens"),
                   help="step 1: held-out calibration tokens scoring the candidates (default: %(default)s)")
    p.add_argument("--head-layers", type=int, default=default(C, "head_layers"),
                   help="step 1: most sensitive layers also measured per KV head (default: %(default)s)")
    p.add_argument("--domains", default=",".join(default(C, "domains")),
                   help="step 1: calibration domains (default: %(default)s)")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="step 1: the most KV bytes the chosen plan may hold, as a fraction of FP16's at 2,048 tokens "
                        "(default: just under uniform int4's)")
    p.add_argument("--recalibrate", action="store_true", help="step 1: calibrate again, ignoring a cached profile")
    p.add_argument("--tokens", type=int, default=default(C, "tokens"),
                   help="step 2: held-out evaluation tokens scored per method (default: %(default)s)")
    p.add_argument("--peers", default=PEERS,
                   help="step 2: methods compared with the plans, `kvguard eval --list-methods` names them; "
                        "hf-quanto-4 (transformers' QuantizedCache) decodes token by token, about 2 minutes more "
                        "(default: %(default)s)")
    p.add_argument("--frontier-points", type=int, default=default(C, "frontier_points"),
                   help="step 2: more frontier plans in the table (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=default(C, "max_new_tokens"),
                   help="step 3: tokens of the live-loop reply (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The four steps: calibrate (or reuse), plan and frontier against the peers, the live loop, the report."""
    from kvguard import models

    if args.memory_budget is not None and not 0 < args.memory_budget <= 1.5:
        raise CommandError(f"--memory-budget is a fraction of FP16's bytes in (0, 1.5], got {args.memory_budget}")
    cfg = RunConfig(args.model, Path(args.cache) if args.cache else None, args.samples, args.max_tokens,
                    args.heldout_tokens, args.head_layers, tuple(csv(args.domains)), args.memory_budget, args.tokens,
                    tuple(csv(args.peers)), args.frontier_points, args.max_new_tokens, args.recalibrate, device(args))
    cache = cfg.cache or models.kvguard_home() / "run"
    t0 = time.perf_counter()
    models.resolve(cfg.model)  # an unknown model fails here, before any work; the first use converts the GGUF
    profile, profile_dir = calibrate_step(cfg, cache)
    model, tok = models.load(cfg.model, device=cfg.device)
    profile.check_model(model)
    rows = frontier_step(cfg, profile, model, tok)
    events = cache / "events.jsonl"
    live_step(cfg, profile, model, tok, events, rows)
    report_step(profile, cache / "report", events)
    print(f"\nkvguard run: done in {time.perf_counter() - t0:.0f} s. Next: kvguard serve --profile {profile_dir}")
    return 0


def _heading(step: int, text: str) -> None:
    print(f"\n=== {step}/4  {text}", flush=True)


def int4_budget(model: str, context: int) -> float:
    """Just under the bytes of uniform ``int4`` (the ``int4`` method: the default layout) at ``context`` tokens, over
    FP16's: the budget under which the chosen plan has to beat ``int4`` on bytes. Shapes only: no model run."""
    from transformers import AutoConfig

    from kvguard import models
    from kvguard.architecture import Architecture
    from kvguard.plan import Plan
    from kvguard.precision import Precision

    config = AutoConfig.from_pretrained(models.resolve(model))
    stored, fp16 = Plan.uniform(Architecture.from_config(config), Precision.INT4).kv_bytes(config, context)
    return stored / fp16 - 1e-6


def profile_dir(cfg: RunConfig, cache: Path):
    """``(calibration config, profile folder)``: the folder is named by the digest of the settings."""
    from kvguard.calibration.settings import CalibrationConfig, Search
    from kvguard.config import Objective

    context = default(CalibrationConfig, "context")
    budget = cfg.memory_budget if cfg.memory_budget is not None else int4_budget(cfg.model, context)
    calib = CalibrationConfig(cfg.model, cache / "profiles", cfg.samples, cfg.domains, cfg.max_tokens,
                              heldout_tokens=cfg.heldout_tokens, head_layers=cfg.head_layers, device=cfg.device,
                              ranking_tokens=0,  # quick: the held-out slice alone ranks the candidates
                              search=Search.QUICK, objective=Objective(memory_budget=round(budget, 6)))
    # The key leaves out ``out``.
    out = cache / "profiles" / f"{Path(cfg.model).name}-quick-{cfg.samples}-{calib.key()}"
    return replace(calib, out=out), out


def full_command(model: str) -> str:
    """The full calibration, as the quick step prints it."""
    from kvguard.calibration.settings import RECOMMENDED_SAMPLES

    return f"kvguard calibrate --model {model} --samples {RECOMMENDED_SAMPLES} --out profiles/{Path(model).name}"


def calibrate_step(cfg: RunConfig, cache: Path):
    """Step 1: the cached quick profile, or a new one; ``(profile, folder)``."""
    import contextlib

    from kvguard.calibration.pipeline import calibrate
    from kvguard.calibration.settings import RECOMMENDED_SAMPLES
    from kvguard.profile import Profile, ProfileError

    calib, out = profile_dir(cfg, cache)
    _heading(1, f"quick calibration of {cfg.model}: {cfg.samples} samples from {', '.join(cfg.domains)}, the quick "
                "search")
    print(f"memory budget {calib.objective.memory_budget:.3f} of FP16's bytes at {calib.context:,} tokens"
          + (" (just under uniform int4's)" if cfg.memory_budget is None else ""))
    profile = None
    if out.is_dir() and not cfg.recalibrate:
        with contextlib.suppress(ProfileError):
            profile = Profile.load(out)
            print(f"reusing the cached quick profile {out} (--recalibrate to make it again)")
    if profile is None:
        log = cache / "calibrate.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        with open(log, "w") as stream:
            profile = calibrate(calib, log=lambda m: print(m, file=stream, flush=True))
        print(f"calibrated in {time.perf_counter() - t:.0f} s; quick profile {out}, log {log}")
    print(f"this is a QUICK profile ({cfg.samples} samples, {cfg.heldout_tokens} held-out tokens, the quick search), "
          f"for a look, not to serve; the production profile is the full {RECOMMENDED_SAMPLES:,}-sample calibration "
          f"(about 30-60 minutes on 2 cores):\n  {full_command(cfg.model)}")
    return profile, out


def plan_lines(plan) -> list[str]:
    """The plan's per-layer tiers, one line per distinct tier spec: ``int4  layers 0-16, 19``."""
    from kvguard.control.events import layer_ranges

    by_spec: dict[str, list[int]] = {}
    for token in plan.summary().split():
        layer, spec = token.split(":", 1)
        by_spec.setdefault(spec, []).append(int(layer))
    width = max(len(s) for s in by_spec)
    return [f"  {spec:<{width}}  layer{'s' if len(ls) > 1 else ''} {layer_ranges(ls)}" for spec, ls in by_spec.items()]


def b4(profile) -> float:
    """Uniform ``int4``'s bytes over FP16's at the calibration context (level 1's all-INT4 plan in the default
    layout)."""
    from kvguard.calibration.search import int4_bytes

    return int4_bytes(list(profile.meta.search_log))


def live_candidate(profile):
    """Step 3's plan: the frontier plan nearest :data:`LIVE_SHARE` of ``int4``'s bytes."""
    return min(profile.meta.frontier(), key=lambda c: abs(c.memory - LIVE_SHARE * b4(profile)))


def shown_plans(cfg: RunConfig, profile) -> list[tuple[str, str]]:
    """``(method name, label)`` of the kvguard rows of step 2, largest first: the frontier plan nearest ``int4``'s
    bytes (shown next to ``int4``), the chosen plan, ``frontier_points`` more frontier plans below ``int4``'s bytes,
    and step 3's plan."""
    meta = profile.meta
    front, chosen, int4 = meta.frontier(), meta.chosen, b4(profile)
    near = min(front, key=lambda c: abs(c.memory - int4))
    live = live_candidate(profile)
    below = [c for c in front if c.memory < int4 and c.name not in (near.name, chosen.name, live.name)]
    picked = {c.name: c for c in [near, chosen, live, *_spread(below, cfg.frontier_points)]}
    labels = []
    for c in sorted(picked.values(), key=lambda c: -c.memory):
        tags = [t for t, yes in (("chosen", c.name == chosen.name), ("nearest int4's bytes", c.name == near.name),
                                 ("step 3's plan", c.name == live.name)) if yes]
        name = "kvguard" if c.name == chosen.name else f"kvguard@{c.memory!r}"
        labels.append((name, f"kvguard@{c.memory:.3f}" + (f" ({', '.join(tags)})" if tags else "")))
    return labels


def frontier_step(cfg: RunConfig, profile, model, tok) -> dict:
    """Step 2: the chosen plan, the frontier, and the table on held-out text; the rows by method name."""
    from kvguard import data
    from kvguard.config import penalty
    from kvguard.evaluation import harness

    meta = profile.meta
    chosen, int4 = meta.chosen, b4(profile)
    _heading(2, f"plan and frontier; {cfg.tokens:,} held-out tokens against FP16, int4 and the peers")
    print(f"chosen plan {chosen.name!r}: {chosen.memory:.3f} of FP16's bytes at {meta.settings.context:,} tokens "
          f"(int4: {int4:.3f}), expected perplexity {penalty(chosen.quality.kl):+.2f} % (held-out calibration text). "
          "Tiers per layer (a/b/c: per KV head; cX: keys clipped to X; rk / rv: keys / values rotated; [v:...]: the "
          "values' tiers where they are stored below the keys'):")
    print("\n".join(plan_lines(profile.plan)))
    front = meta.frontier()
    print(f"Pareto frontier of the search ({len(front)} of {len(meta.search_log)} candidates; bytes / FP16 : "
          "expected perplexity change from the held-out KL):")
    print("  " + "  ".join(f"{c.memory:.3f}:{penalty(c.quality.kl):+.2f}%" + ("*" if c.name == chosen.name else "")
                           for c in front) + "   (* chosen)")
    plans = shown_plans(cfg, profile)
    peers = [p for p in cfg.peers if p not in ("fp16", "int4")]
    names = ["int4", *(n for n, _ in plans), *peers]
    labels = dict(plans)
    ids = data.token_stream("prose", "eval", tok, cfg.tokens)
    print(f"scoring {len(names) + 1} methods on {ids.numel():,} tokens of held-out prose (the evaluation split) ...",
          flush=True)
    rows = harness.evaluate_stream(model, ids, "prose", names, profile=profile, progress=False)
    print_table(["method", "bytes held / FP16", "ppl change", "KL mean", "KL p99", "KL p99.9", "KL max", "top-1"],
                [[labels.get(r.method, r.method), *_cells(r)] for r in rows])
    print("bytes held: every tier in RAM at the end of the text; KL: KL(FP16 || method) per token, nats; p99 / p99.9 / "
          "max: its tail over the tokens")
    by_name = {r.method: r for r in rows}
    print("\n".join(verdict(cfg, profile, by_name["kvguard"], by_name["int4"], rows, labels)))
    return by_name


def _cells(row) -> list[str]:
    if row.error:
        return ["unsupported", "", "", "", "", "", ""]
    return [f"{row.ram_bytes_ratio:.3f}", f"{row.ppl_delta_pct:+.2f} %", f"{row.kl:.5f}", f"{row.kl_p99:.4f}",
            f"{row.kl_p999:.4f}", f"{row.kl_max:.3f}", f"{row.top1_agree:.3f}"]


def _beats(row, int4) -> bool:
    return row.error is None and row.ram_bytes_ratio < int4.ram_bytes_ratio and row.kl < int4.kl


def _change(value: float, base: float, less: str, more: str) -> str:
    """``value`` against ``base`` in words: "2.0 % fewer", "9.2 % higher" (a signed "-9.2 % lower" reads wrong)."""
    if not base:
        return "no base to compare"
    pct = 100 * (value / base - 1)
    return f"{abs(pct):.1f} % {less if pct < 0 else more}"


def verdict(cfg: RunConfig, profile, chosen, int4, rows: list, labels: dict) -> list[str]:
    """Whether the chosen plan beats ``int4`` on both bytes and KL on these tokens, in figures; if not, why not."""
    meta = profile.meta
    figures = (f"{chosen.ram_bytes_ratio:.3f} of FP16's bytes against int4's {int4.ram_bytes_ratio:.3f} "
               f"({_change(chosen.ram_bytes_ratio, int4.ram_bytes_ratio, 'fewer', 'more')}), mean KL {chosen.kl:.5f} "
               f"against {int4.kl:.5f} ({_change(chosen.kl, int4.kl, 'lower', 'higher')}), p99.9 "
               f"{chosen.kl_p999:.4f} against {int4.kl_p999:.4f}")
    if _beats(chosen, int4):
        return [f"the chosen plan beats int4 on both bytes and KL: {figures}."]
    lines = [f"the chosen plan does NOT beat int4 on both bytes and KL here: {figures}."]
    if chosen.ram_bytes_ratio >= int4.ram_bytes_ratio:
        if not meta.constraints_met:
            lines.append("  why: no candidate met the memory budget and the perplexity limit together, so calibration "
                         "kept the lowest score (see its log).")
        else:
            lines.append(f"  why: the memory budget ({meta.objective.memory_budget}) is not below int4's bytes.")
    if chosen.kl >= int4.kl:
        held = {c.name: c.quality.kl for c in meta.search_log}
        int4_held = held.get("L1 all-int4 window-64")
        lines.append(f"  why: the quick calibration ranked its candidates on {meta.settings.heldout_tokens} held-out "
                     f"tokens of calibration text, where the chosen plan measured KL {meta.chosen.quality.kl:.5f}"
                     + (f" against int4's {int4_held:.5f}" if int4_held is not None else "")
                     + f"; on these {cfg.tokens:,} tokens the order differs. The full calibration ranks on twice the "
                     "held-out text and re-ranks the closest candidates on 3,072 tokens more.")
    better = [r for r in rows if r.method not in ("kvguard", "int4") and r.method.startswith("kvguard@")
              and _beats(r, int4)]
    if better:
        r = min(better, key=lambda r: r.kl)
        lines.append(f"  on the frontier, {labels.get(r.method, r.method)} does: {r.ram_bytes_ratio:.3f} of FP16's "
                     f"bytes, mean KL {r.kl:.5f}.")
    return lines


def _spread(points: list, n: int) -> list:
    """At most ``n`` of ``points``, evenly spaced, the first and last included."""
    if len(points) <= n:
        return list(points)
    if n <= 1:
        return list(points[:n])
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


class _Recorded:
    """A decoder (:class:`kvguard.control.decoding.Decoder`) that keeps the next-token logits it hands out."""

    def __init__(self, decoder) -> None:
        self.decoder, self.logits = decoder, []

    def prefill(self, ids):
        return self._keep(self.decoder.prefill(ids))

    def step(self, token: int):
        return self._keep(self.decoder.step(token))

    def _keep(self, logits):
        self.logits.append(logits.float().cpu())
        return logits


def teacher_forced(decoder, prompt, reply: list[int]):
    """``[len(reply), vocab]``: ``decoder``'s predictions of each reply token, fed the prompt and the reply before it
    (the decode path the reply was generated on, without drawing)."""
    import torch

    logits = [decoder.prefill(prompt)] + [decoder.step(t) for t in reply[:-1]]
    return torch.stack([x.float().cpu() for x in logits])


def live_step(cfg: RunConfig, profile, model, tok, events: Path, rows: dict) -> None:
    """Step 3: a reply under the live loop over step 3's plan, its timeline, the bytes it held, and the reply scored
    against FP16 for the loop and for the static frontier plan at about the same bytes."""
    import json

    import torch

    from kvguard import data
    from kvguard.architecture import Architecture
    from kvguard.cli.generate import print_summary, prompt_ids, token_printer
    from kvguard.control import decoding
    from kvguard.control.events import describe
    from kvguard.control.session import LiveSession
    from kvguard.evaluation import methods
    from kvguard.evaluation.method_spec import LIVE
    from kvguard.metrics import TokenMetrics
    from kvguard.plan import Plan

    live = live_candidate(profile)
    name = f"{LIVE}:kvguard@{live.memory!r}"
    doc = data.documents("prose", "eval", limit=1, max_chars=1500)[0]
    ids = prompt_ids(tok, PROMPT + doc.text, raw=False)
    _heading(3, f"the live loop over kvguard@{live.memory:.3f} (the frontier plan nearest {LIVE_SHARE} of int4's "
                f"bytes): {LIVE}:kvguard@{live.memory:.3f}")
    print(f"prompt: summarize held-out article {doc.doc_id!r} ({ids.numel()} tokens); reply:", flush=True)
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text("")  # one run's events per file
    session = methods.get(name, profile).session(model, events_path=events)
    recorded = _Recorded(session)
    t = time.perf_counter()
    out = decoding.generate(recorded, ids, cfg.max_new_tokens, eos_token_id=tok.eos_token_id,
                            on_token=token_printer(tok))
    dt = time.perf_counter() - t
    print(f"\n--- {len(out.tokens)} tokens in {dt:.1f} s; what the loop did:")
    records = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    for record in records[:TIMELINE_LINES]:
        print("  " + describe(record))
    if len(records) > TIMELINE_LINES:
        print(f"  ... and {len(records) - TIMELINE_LINES} more events in {events}")
    if not records:
        print("  no alarm: the entropy of every monitored layer stayed at its calibrated baseline")
    summary = session.summary()
    print_summary(summary)

    # The same reply, teacher-forced through FP16 and through the static plan holding about the loop's bytes.
    arch = Architecture.from_config(model.config)
    static = min(profile.meta.frontier(), key=lambda c: abs(_held_at(c.plan, model.config, session.length)
                                                            - summary["held_ram_ratio"]))

    def static_session(plan):
        return LiveSession.from_profile(model, profile, plan=plan, monitor=False)

    reference = torch.log_softmax(teacher_forced(static_session(Plan.uniform(arch, "fp16")), ids, out.tokens), -1)
    plain = static_session(static.plan)
    scored = {"loop": torch.stack(recorded.logits[:len(out.tokens)]),
              "static": teacher_forced(plain, ids, out.tokens)}
    kl = {}
    for key, logits in scored.items():
        m = TokenMetrics()
        m.add(logits, torch.tensor(out.tokens), reference)
        kl[key] = m
    print(f"the same {len(out.tokens)}-token reply, teacher-forced, KL from FP16 (mean / max over the reply):")
    print(f"  the live loop, {summary['held_ram_ratio']:.3f} of FP16 held over the run (every tier in RAM): "
          f"{kl['loop'].kl:.5f} / {kl['loop'].kl_max:.4f}")
    static_row = rows.get("kvguard" if static.name == profile.meta.chosen.name else f"kvguard@{static.memory!r}")
    print(f"  static kvguard@{static.memory:.3f}, the frontier plan nearest those bytes, "
          f"{plain.held_ratios()[0]:.3f} of FP16 held: {kl['static'].kl:.5f} / {kl['static'].kl_max:.4f}"
          + (f" (step 2's table: KL {static_row.kl:.5f} on {cfg.tokens:,} tokens)" if static_row is not None else ""))


def _held_at(plan, model_config, tokens: int) -> float:
    stored, fp16 = plan.kv_bytes(model_config, tokens)
    return stored / fp16


TIMELINE_LINES = 12


def report_step(profile, out: Path, events: Path) -> Path:
    """Step 4: the HTML report with the loop's timeline."""
    from kvguard.calibration import report

    _heading(4, "the report")
    page = report.write(profile, out, events=events)
    print(f"report (sensitivity heat map, frontier, per-layer tiers, the loop's timeline): {page}")
    return page
