"""``kvguard export``: a profile's calibrated ranges as the FP8 KV-cache scales vLLM or SGLang loads, or the
engine arguments of vLLM's per-token-head dtypes; with ``--memory-budget``, the layers to skip chosen by
calibration; with ``--check``, proof that the scales reached vLLM."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvguard.cli.check_engine import add_check_arguments
from kvguard.cli.common import CommandError, add_device, device, writable_dir
from kvguard.export.export import KV_CACHE_DTYPES


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="calibrated FP8 KV-cache scales for vLLM / SGLang, engine arguments, checks")
    p.add_argument("--profile", required=True, help="calibration profile (from `kvguard calibrate`)")
    p.add_argument("--format", required=True, choices=["vllm", "sglang"], help="serving engine")
    p.add_argument("--out", required=True, help="directory to write (a previous export there is replaced)")
    p.add_argument("--granularity", default="tensor", choices=["tensor", "head"],
                   help="one scale per layer (tensor) or per layer and KV head (head, vllm only) (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=KV_CACHE_DTYPES,
                   help="vLLM's KV dtype to plan for; the per-token-head ones need no scales (default: %(default)s)")
    p.add_argument("--memory-budget", type=float,
                   help="choose --kv-cache-dtype-skip-layers for this KV memory (fraction of FP16) on the profile's "
                        "held-out text (loads the model); default: skip the plan's FP16 layers")
    p.add_argument("--max-skip", type=int, help="with --memory-budget: skip at most this many layers")
    add_device(p)  # with --memory-budget, the model runs
    p.add_argument("--check", action="store_true",
                   help="build the served model folder and, with --engine-python, load it in vLLM and compare scales")
    add_check_arguments(p)
    p.add_argument("--force", action="store_true", help="replace --out even if it holds other files (they are deleted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.cli.common import load_profile
    from kvguard.export import export
    from kvguard.fp8 import describe

    spec = export.ExportSpec(args.format, args.granularity, args.kv_cache_dtype)
    if args.check and not (spec.format is export.ExportFormat.VLLM and spec.static_scales):
        raise CommandError("--check loads FP8 scales in vLLM: it needs --format vllm --kv-cache-dtype fp8")
    if _same_or_inside(args.out, args.profile) or _same_or_inside(args.profile, args.out):
        raise CommandError(f"--out {args.out} and --profile {args.profile} overlap: the export would replace the "
                           f"profile it reads; choose another --out")
    writable_dir("--out", args.out)
    target = device(args)
    profile = load_profile(args.profile)
    choice = None if args.memory_budget is None else _choose_skip(profile, spec, args, target)
    manifest = export.export(profile, spec, args.out, force=args.force, skip_choice=choice)
    model = manifest["model"]
    print(f"{spec.format.value} export of {model['name']} (fingerprint {model['fingerprint'][:19]}...) written to "
          f"{args.out}: {', '.join(manifest['files']) or 'engine arguments only'}")
    if spec.static_scales:
        print(describe(spec.scales(profile)))
    if spec.format is export.ExportFormat.SGLANG and manifest["plan_fp16_layers"]:
        print(f"note: SGLang quantizes every layer; the plan's FP16 layers {manifest['plan_fp16_layers']} are FP8 there")
    print(f"engine arguments: {' '.join(manifest['engine_args'])} (see {os.path.join(args.out, export.README_NAME)})")
    print(f"what it will do, on CPU: kvguard eval --model {model['name']} --profile {args.profile} "
          f"--methods fp16,kvguard,{spec.eval_method}")
    if args.check:
        from kvguard.cli.check_engine import check

        check(Path(args.out), args.model_dir, args.served_out, args.engine_python)
    return 0


def _same_or_inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (links resolved)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def _choose_skip(profile, spec, args, target: str) -> dict:
    """Calibration's skip list for the engine dtype under ``--memory-budget`` (prints the candidates)."""
    from kvguard import models
    from kvguard.calibration.engine_skip import choose_for_profile

    model, tokenizer = models.load(profile.model_name, device=target)
    choice = choose_for_profile(profile, model, tokenizer, spec.kv_cache_dtype, args.memory_budget,
                                max_skip=args.max_skip)
    print(choice.table())
    return choice.to_dict()
