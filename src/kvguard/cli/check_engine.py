"""``kvguard check-engine``: build the served model folder of a vLLM export and read its scales back from vLLM."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("check-engine", help="load a vLLM export in vLLM and compare its scales, layer by layer")
    p.add_argument("export", metavar="DIR", help="a `kvguard export --format vllm` directory")
    add_check_arguments(p)
    p.set_defaults(func=run)


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``check-engine`` and ``export --check`` share."""
    p.add_argument("--model-dir", help="the model's Hugging Face folder (default: the exported model, for an "
                                       "embedded one its converted folder)")
    p.add_argument("--served-out", help="where to write the served model folder (default: DIR/served-model)")
    p.add_argument("--engine-python", help="python of the venv vLLM is installed in (`make engines`: "
                                           ".venv-engines/bin/python); without it only the folder is built")


def run(args: argparse.Namespace) -> int:
    check(Path(args.export), args.model_dir, args.served_out, args.engine_python)
    return 0


def check(export_dir: Path, model_dir: str | None, served_out: str | None, engine_python: str | None) -> None:
    """Build the served folder; with ``engine_python``, load it in vLLM and print the per-layer table."""
    from kvguard import models
    from kvguard.cli.common import CommandError
    from kvguard.export import engine_check, served_model

    manifest = served_model.read_manifest(export_dir)
    model_dir = model_dir or str(models.resolve(manifest["model"]["name"]))
    served = served_model.build(model_dir, export_dir, served_out or export_dir / "served-model")
    print(f"served model folder: {served.path} (weights from {model_dir}{', sharded index extended' if served.sharded else ''})")
    print(f"serve it with: vllm serve {served.path} (its config alone selects the FP8 cache; "
          f"--kv-cache-dtype fp8 is redundant)")
    if engine_python is None:
        print("engine not checked: pass --engine-python .venv-engines/bin/python (`make engines`) to load it in vLLM")
        return
    try:
        report = engine_check.run_vllm(served.path, engine_python)
    except engine_check.EngineUnavailable as err:
        raise CommandError(str(err)) from None
    result = engine_check.compare(engine_check.exported_scales(export_dir, manifest["granularity"]), report)
    print(f"vLLM {report.version}: KV-cache dtype {report.cache_dtype}, {len(report.layers)} attention layers read back")
    print(result.table())
    if report.error:
        print(f"note: vLLM loaded the scales, then refused to run: {report.error}")
    status = engine_check.sglang_status(engine_python)
    print(f"SGLang: {status or 'importable (its exports are checked with --format sglang)'}")
    if not result.ok:
        raise CommandError("the engine does not hold the exported scales: " + "; ".join(result.problems))
    print(f"all {len(result.layers)} layers hold exactly the exported k_scale / v_scale")
