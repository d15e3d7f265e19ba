"""``kvguard run``: the mission end to end on the embedded default model, in four steps.

1. **Calibrate.** A quick calibration (a few hundred samples instead of the recommended 5,000) of the model:
   K/V statistics, sensitivity per layer and head, the three-level search, the run-time monitor. The profile is
   cached under ``<cache>/profiles/`` by a digest of its settings and reused by later runs.
2. **Plan and frontier.** The chosen plan (per-layer tiers), the Pareto frontier of the search, and a table of
   the plan and its frontier points against FP16 and the peers (kvguard's uniform tiers, the KIVI recipe,
   transformers' quantized caches) on held-out text: the evaluation split, which calibration never reads.
3. **Live loop.** A reply generated under the feedback loop over the most aggressive frontier plan
   (``kvguard-live:kvguard@<bytes>``), and a timeline of what the loop did: alarms, recomputations, precision
   changes, rollback level.
4. **Report.** The HTML report of the profile (sensitivity heat map, frontier, per-layer tiers) with the loop's
   timeline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvguard.cli.common import add_device, add_model, csv, default, device, print_table

PEERS = "int8,int4,kivi-4,kivi-2,hf-quanto-4,hf-hqq-4"
PROMPT = "Summarize this article in two sentences.\n\n"


@dataclass(frozen=True)
class RunConfig:
    """What ``kvguard run`` does (the command line's defaults are these).

    Attributes:
        model: embedded model name or local model folder.
        cache: where profiles, the loop's events and the report go; ``None``: ``$KVGUARD_HOME/run``.
        samples, max_tokens, heldout_tokens, head_layers, domains: the quick calibration's settings.
        tokens: held-out evaluation tokens scored for the table.
        peers: the methods the plan is compared with (besides FP16).
        frontier_points: the most frontier plans shown in the table.
        max_new_tokens: tokens the live-loop reply may generate.
        recalibrate: calibrate again even when a cached profile exists.
        device: where the model runs in every step (``cpu``, ``cuda``, ``auto``; :mod:`kvguard.device`).
    """

    model: str
    cache: Path | None = None
    samples: int = 128
    max_tokens: int = 256
    heldout_tokens: int = 768
    head_layers: int = 2
    domains: tuple[str, ...] = ("prose", "dialog", "code")
    tokens: int = 512
    peers: tuple[str, ...] = tuple(PEERS.split(","))
    frontier_points: int = 4
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
    p.add_argument("--recalibrate", action="store_true", help="step 1: calibrate again, ignoring a cached profile")
    p.add_argument("--tokens", type=int, default=default(C, "tokens"),
                   help="step 2: held-out evaluation tokens scored per method (default: %(default)s)")
    p.add_argument("--peers", default=PEERS, help="step 2: methods compared with the plan (default: %(default)s)")
    p.add_argument("--frontier-points", type=int, default=default(C, "frontier_points"),
                   help="step 2: most frontier plans in the table (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=default(C, "max_new_tokens"),
                   help="step 3: tokens of the live-loop reply (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The four steps: calibrate (or reuse), plan and frontier against the peers, the live loop, the report."""
    from kvguard import models

    cfg = RunConfig(args.model, Path(args.cache) if args.cache else None, args.samples, args.max_tokens,
                    args.heldout_tokens, args.head_layers, tuple(csv(args.domains)), args.tokens,
                    tuple(csv(args.peers)), args.frontier_points, args.max_new_tokens, args.recalibrate, device(args))
    cache = cfg.cache or models.kvguard_home() / "run"
    t0 = time.perf_counter()
    models.resolve(cfg.model)  # an unknown model fails here, before any work; the first use converts the GGUF
    profile, profile_dir = calibrate_step(cfg, cache)
    model, tok = models.load(cfg.model, device=cfg.device)
    profile.check_model(model)
    frontier_step(cfg, profile, model, tok)
    events = cache / "events.jsonl"
    live_step(cfg, profile, model, tok, events)
    page = report_step(profile, cache / "report", events)
    print(f"\nkvguard run: done in {time.perf_counter() - t0:.0f} s. Next: kvguard serve --profile {profile_dir}")
    return 0


def _heading(step: int, text: str) -> None:
    print(f"\n=== {step}/4  {text}", flush=True)


def profile_dir(cfg: RunConfig, cache: Path):
    """``(calibration config, profile folder)``: the folder is named by the digest of the settings."""
    from kvguard.calibration.settings import CalibrationConfig

    calib = CalibrationConfig(cfg.model, cache / "profiles", cfg.samples, cfg.domains, cfg.max_tokens,
                              heldout_tokens=cfg.heldout_tokens, head_layers=cfg.head_layers, device=cfg.device,
                              ranking_tokens=0)  # quick: the held-out slice alone ranks the candidates
    out = cache / "profiles" / f"{Path(cfg.model).name}-{cfg.samples}-{calib.key()}"  # the key leaves out ``out``
    return replace(calib, out=out), out


def calibrate_step(cfg: RunConfig, cache: Path):
    """Step 1: the cached quick profile, or a new one; ``(profile, folder)``."""
    import contextlib

    from kvguard.calibration.pipeline import calibrate
    from kvguard.calibration.settings import RECOMMENDED_SAMPLES
    from kvguard.profile import Profile, ProfileError

    calib, out = profile_dir(cfg, cache)
    _heading(1, f"calibrate {cfg.model}: {cfg.samples} samples from {', '.join(cfg.domains)}")
    profile = None
    if out.is_dir() and not cfg.recalibrate:
        with contextlib.suppress(ProfileError):
            profile = Profile.load(out)
            print(f"reusing the cached profile {out} (--recalibrate to make it again)")
    if profile is None:
        log = cache / "calibrate.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        with open(log, "w") as stream:
            profile = calibrate(calib, log=lambda m: print(m, file=stream, flush=True))
        print(f"calibrated in {time.perf_counter() - t:.0f} s; profile {out}, log {log}")
    print(f"this is a quick calibration; for a production profile run the full {RECOMMENDED_SAMPLES:,}-sample one:\n"
          f"  kvguard calibrate --model {cfg.model} --samples {RECOMMENDED_SAMPLES} --out profiles/{cfg.model}")
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


def frontier_step(cfg: RunConfig, profile, model, tok) -> None:
    """Step 2: the chosen plan, the frontier, and the table on held-out text."""
    from kvguard import data
    from kvguard.config import penalty
    from kvguard.evaluation import harness

    meta = profile.meta
    chosen = meta.chosen
    _heading(2, f"plan and frontier; scored on {cfg.tokens} held-out tokens against FP16 and the peers")
    print(f"chosen plan {chosen.name!r}: {chosen.memory:.3f} of FP16 bytes, expected perplexity "
          f"{penalty(chosen.quality.kl):+.2f} % (held-out calibration text). Tiers per layer "
          "(a/b/c: per KV head; cX: keys clipped to X; rk / rv: keys / values rotated; [v:...]: the values' tiers where "
          "they are stored below the keys'):")
    print("\n".join(plan_lines(profile.plan)))
    front = meta.frontier()
    print(f"Pareto frontier of the search ({len(front)} of {len(meta.search_log)} candidates; bytes / FP16, "
          "expected perplexity change from KL):")
    print("  " + "  ".join(f"{c.memory:.3f}:{penalty(c.quality.kl):+.2f}%" + ("*" if c.name == chosen.name else "")
                           for c in front) + "   (* chosen)")
    shown = _spread(front, cfg.frontier_points)
    names = ["kvguard"] + [f"kvguard@{c.memory!r}" for c in shown] + [p for p in cfg.peers if p != "fp16"]
    ids = data.token_stream("prose", "eval", tok, cfg.tokens)
    rows = harness.evaluate_stream(model, ids, "prose", names, profile=profile)
    labels = {f"kvguard@{c.memory!r}": f"frontier {c.memory:.3f}" for c in shown}
    print_table(["method", "bytes / FP16", "ppl change", "KL", "top-1"],
                [[labels.get(r.method, "kvguard (chosen)" if r.method == "kvguard" else r.method),
                  *_cells(r)] for r in rows])


def _cells(row) -> list[str]:
    if row.error:
        return ["unsupported", "", "", ""]
    return [f"{row.kv_bytes_ratio:.3f}", f"{row.ppl_delta_pct:+.2f} %", f"{row.kl:.4f}", f"{row.top1_agree:.3f}"]


def _spread(points: list, n: int) -> list:
    """At most ``n`` of ``points``, evenly spaced, the first and last included."""
    if len(points) <= n:
        return list(points)
    if n <= 1:
        return list(points[:n])
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


def live_step(cfg: RunConfig, profile, model, tok, events: Path) -> None:
    """Step 3: a reply under the live loop over the most aggressive frontier plan, and its timeline."""
    import json

    from kvguard import data
    from kvguard.cli.generate import print_summary, prompt_ids, token_printer
    from kvguard.control.events import describe
    from kvguard.evaluation import methods
    from kvguard.evaluation.method_spec import LIVE

    aggressive = min(profile.meta.frontier(), key=lambda c: c.memory)
    name = f"{LIVE}:kvguard@{aggressive.memory!r}"
    doc = data.documents("prose", "eval", limit=1, max_chars=1500)[0]
    ids = prompt_ids(tok, PROMPT + doc.text, raw=False)
    _heading(3, f"the live loop over the most aggressive frontier plan ({aggressive.memory:.3f} of FP16): "
                f"kvguard-live:kvguard@{aggressive.memory:.3f}")
    print(f"prompt: summarize held-out article {doc.doc_id!r} ({ids.numel()} tokens); reply:", flush=True)
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text("")  # one run's events per file
    session = methods.get(name, profile).session(model, events_path=events)
    t = time.perf_counter()
    out = session.generate(ids, cfg.max_new_tokens, eos_token_id=tok.eos_token_id, on_token=token_printer(tok))
    dt = time.perf_counter() - t
    print(f"\n--- {len(out.tokens)} tokens in {dt:.1f} s; what the loop did:")
    records = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    for record in records[:TIMELINE_LINES]:
        print("  " + describe(record))
    if len(records) > TIMELINE_LINES:
        print(f"  ... and {len(records) - TIMELINE_LINES} more events in {events}")
    if not records:
        print("  no alarm: the entropy of every monitored layer stayed at its calibrated baseline")
    print_summary(session.summary())


TIMELINE_LINES = 12


def report_step(profile, out: Path, events: Path) -> Path:
    """Step 4: the HTML report with the loop's timeline."""
    from kvguard.calibration import report

    _heading(4, "the report")
    page = report.write(profile, out, events=events)
    print(f"report (sensitivity heat map, frontier, per-layer tiers, the loop's timeline): {page}")
    return page
