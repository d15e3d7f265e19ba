"""``kvguard export``: a profile's calibrated ranges as the FP8 KV-cache scales vLLM or SGLang loads."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvguard.cli.common import CommandError, writable_dir


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="calibrated FP8 KV-cache scales for vLLM / SGLang")
    p.add_argument("--profile", required=True, help="calibration profile (from `kvguard calibrate`)")
    p.add_argument("--format", required=True, choices=["vllm", "sglang"], help="serving engine")
    p.add_argument("--out", required=True, help="directory to write (a previous export there is replaced)")
    p.add_argument("--granularity", default="tensor", choices=["tensor", "head"],
                   help="one scale per layer (tensor) or per layer and KV head (head, vllm only) (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace --out even if it holds other files (they are deleted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.cli.common import load_profile
    from kvguard.fp8 import describe
    from kvguard.serving import export

    spec = export.ExportSpec(args.format, args.granularity)
    if _same_or_inside(args.out, args.profile) or _same_or_inside(args.profile, args.out):
        raise CommandError(f"--out {args.out} and --profile {args.profile} overlap: the export would replace the "
                           f"profile it reads; choose another --out")
    writable_dir("--out", args.out)
    profile = load_profile(args.profile)
    manifest = export.export(profile, spec, args.out, force=args.force)
    model = manifest["model"]
    print(f"{spec.format.value} export of {model['name']} (fingerprint {model['fingerprint'][:19]}...) written to "
          f"{args.out}: {', '.join(manifest['files'])}")
    print(describe(spec.scales(profile)))
    if spec.format is export.ExportFormat.SGLANG and manifest["plan_fp16_layers"]:
        print(f"note: SGLang quantizes every layer; the plan's FP16 layers {manifest['plan_fp16_layers']} are FP8 there")
    print(f"engine arguments: {' '.join(manifest['engine_args'])} (see {os.path.join(args.out, export.README_NAME)})")
    print(f"what it will do, on CPU: kvguard eval --model {model['name']} --profile {args.profile} "
          f"--methods fp16,kvguard,{spec.eval_method}")
    return 0


def _same_or_inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (links resolved)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents
