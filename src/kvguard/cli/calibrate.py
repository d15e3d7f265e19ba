"""``kvguard calibrate``: statistics, sensitivity, hierarchical search, monitor, profile."""

from __future__ import annotations

import argparse

from kvguard.cli.common import CommandError, add_device, add_model, csv, default, device, finite, writable_dir
from kvguard.config import Objective


def add_parser(sub) -> None:
    from kvguard.calibration.settings import CalibrationConfig as C

    p = sub.add_parser("calibrate", help="model-specific calibration: statistics, sensitivity, mixed-precision plan, profile")
    add_model(p)
    add_device(p)
    p.add_argument("--out", required=True, help="profile directory to write")
    p.add_argument("--samples", type=int, default=default(C, "samples"),
                   help="calibration samples, mixed over the domains (default: %(default)s)")
    p.add_argument("--domains", default=",".join(default(C, "domains")), help="calibration domains (default: %(default)s)")
    o = Objective()
    p.add_argument("--alpha", type=float, default=o.alpha, help="score weight of memory (bytes / FP16) (default: %(default)s)")
    p.add_argument("--beta", type=float, default=o.beta,
                   help="score weight of latency (decode time / FP16) (default: %(default)s)")
    p.add_argument("--gamma", type=float, default=o.gamma,
                   help="score weight of the perplexity penalty: the increase in %% the held-out KL predicts "
                        "(default: %(default)s)")
    p.add_argument("--max-ppl-increase", type=float, default=o.max_ppl_increase,
                   help="largest perplexity increase in %% on held-out calibration text, worst domain (default: %(default)s)")
    p.add_argument("--memory-budget", type=float, default=o.memory_budget,
                   help="largest KV bytes as a fraction of FP16 at --context tokens; 0 for none (default: %(default)s)")
    p.add_argument("--context", type=int, default=default(C, "context"),
                   help="context length the memory is measured at (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=default(C, "max_tokens"),
                   help="tokens per calibration sample (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=default(C, "batch_size"),
                   help="samples per statistics batch (default: %(default)s)")
    p.add_argument("--heldout-tokens", type=int, default=default(C, "heldout_tokens"),
                   help="held-out calibration tokens (split over the domains) that score candidates (default: %(default)s)")
    p.add_argument("--ranking-tokens", type=int, default=default(C, "ranking_tokens"),
                   help="calibration tokens (split over the domains, past the samples' documents) that re-score the "
                        "closest low-bit candidates at 0.75 and 0.60 x the all-INT4 bytes; 0: off (default: %(default)s)")
    p.add_argument("--head-layers", type=int, default=default(C, "head_layers"),
                   help="most sensitive layers also measured per KV head (default: %(default)s)")
    p.add_argument("--seed", type=int, default=default(C, "seed"), help="random seed (default: %(default)s)")
    p.add_argument("--no-low-bit", dest="low_bit", action="store_false",
                   help="search INT8 / INT4 / INT2 only: no INT3, no rotation, no low-bit frontier (about half the "
                        "sensitivity stage's time)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished stage")
    p.add_argument("--monitor-only", action="store_true",
                   help="recalibrate only the run-time monitor of the existing profile at --out (plan and statistics kept)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run statistics, sensitivity and search on Ray (same profile, bit for bit): alone, a private "
                        "Ray on this machine; or a cluster address (auto, HOST:6379, ray://HOST:10001). Needs "
                        "pip install 'kvguard[ray]'")
    p.add_argument("--ray-workers", type=int, metavar="N",
                   help="Ray workers, each loading the model once (default: the cluster's CPUs / --ray-threads)")
    p.add_argument("--ray-threads", type=int, default=1, metavar="T",
                   help="torch threads (and Ray CPUs) per Ray worker (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.calibration.distributed import RayConfig
    from kvguard.calibration.pipeline import CalibrationConfig, calibrate, refit_monitor

    writable_dir("--out", args.out)
    target = device(args)
    if args.monitor_only:
        refit_monitor(args.out, device=target)
        return 0
    objective = _objective(args)
    cfg = CalibrationConfig(args.model, args.out, args.samples, tuple(csv(args.domains)), args.max_tokens,
                            args.batch_size, args.heldout_tokens, args.context, args.head_layers,
                            seed=args.seed, low_bit=args.low_bit, ranking_tokens=args.ranking_tokens,
                            objective=objective, device=target)
    if args.ray is None and (args.ray_workers is not None or args.ray_threads != 1):
        raise CommandError("--ray-workers and --ray-threads need --ray")
    ray = None if args.ray is None else RayConfig(args.ray, args.ray_workers, args.ray_threads)
    calibrate(cfg, resume=args.resume, ray=ray)
    return 0


def _objective(args: argparse.Namespace) -> Objective:
    """The objective flags, each checked by name (``--memory-budget 0`` is the documented "no budget")."""
    for flag in ("alpha", "beta", "gamma", "max_ppl_increase", "memory_budget"):
        finite("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.memory_budget > 1.5:
        raise CommandError(f"--memory-budget is a fraction of the FP16 KV bytes in (0, 1.5] (0 for none), got "
                           f"{args.memory_budget}")
    return Objective(args.alpha, args.beta, args.gamma, args.max_ppl_increase,
                     None if args.memory_budget == 0 else args.memory_budget)
