"""``kvguard models``: the embedded models and their attention layout."""

from __future__ import annotations

import argparse

from kvguard.cli.common import print_table


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the embedded models and their attention layout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard import models

    rows = []
    for name in models.EMBEDDED:
        try:
            arch = models.describe(name)
        except models.ModelNotFoundError as err:
            rows.append([name, "not installed", "-", "-", "-", "-", str(err).split("; ")[-1]])
            continue
        converted = "yes" if (models.converted_dir(name) / "config.json").is_file() else "no (first load converts)"
        window = f" (window {arch.sliding_window})" if arch.sliding_window else ""
        rows.append([name, arch.model_type, str(arch.num_layers), f"{arch.num_query_heads} / {arch.num_kv_heads}",
                     str(arch.head_dim), arch.layer_type_summary() + window, converted])
    print_table(["model", "type", "layers", "query / KV heads", "head_dim", "attention layers", "converted"], rows)
    print(f"\nconverted models live under {models.kvguard_home() / 'models'} (set KVGUARD_HOME to move them)")
    return 0
