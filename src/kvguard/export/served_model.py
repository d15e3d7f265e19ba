"""The model folder vLLM serves an FP8 export from: the model's files, the scale file, the merged config.

vLLM reads the static scales only from the model folder: a ``kv_cache_scales.safetensors`` beside the
weights, listed in ``model.safetensors.index.json`` when the weights are sharded (vLLM reads only indexed
files), and a ``quantization_config`` whose ``kv_cache_scheme`` says to load them. :func:`build` assembles
that folder from a model folder and a ``kvguard export --format vllm`` directory (weights are hard-linked
where the file system allows, copied otherwise), written through a temporary sibling like every export.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvguard import atomic
from kvguard.export.export import CONFIG_NAME, MANIFEST_NAME, SCALES_NAME, ExportError

INDEX_NAME = "model.safetensors.index.json"
SERVED_NAME = "kvguard_served.json"  # marks a folder this module wrote (so it may be replaced)


@dataclass(frozen=True)
class ServedModel:
    """A served model folder: where it is, the export it carries, and whether its weights were indexed."""

    path: Path
    export: Path
    sharded: bool


def read_manifest(export_dir: str | os.PathLike) -> dict:
    """The manifest of a vLLM FP8 export; :class:`ExportError` for anything else."""
    export_dir = Path(export_dir)
    try:
        manifest = json.loads((export_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{export_dir} holds no kvguard export ({MANIFEST_NAME}: {err}); write one with "
                          f"`kvguard export --format vllm`") from None
    if manifest.get("format") != "vllm" or not (export_dir / SCALES_NAME).is_file():
        raise ExportError(f"{export_dir} is not a vLLM FP8 export (format {manifest.get('format')!r}, "
                          f"{SCALES_NAME} {'present' if (export_dir / SCALES_NAME).is_file() else 'missing'})")
    return manifest


def merged_config(config: dict, block: dict) -> dict:
    """``config.json`` with the export's ``quantization_config``: a model already quantized with
    compressed-tensors keeps its block and gains only the ``kv_cache_scheme``; any other method is refused
    (vLLM reads one quantization method per model)."""
    merged = dict(config)
    existing = config.get("quantization_config")
    if existing is None:
        merged["quantization_config"] = block
    elif existing.get("quant_method") == block["quant_method"]:
        merged["quantization_config"] = dict(existing, kv_cache_scheme=block["kv_cache_scheme"])
    else:
        raise ExportError(f"the model is quantized with {existing.get('quant_method')!r}; vLLM takes FP8 KV scales "
                          f"from a compressed-tensors quantization_config only")
    return merged


def merged_index(index: dict, scale_names: list[str]) -> dict:
    """``model.safetensors.index.json`` with the scale tensors mapped to the scale file."""
    weight_map = dict(index.get("weight_map", {}))
    taken = sorted(n for n in scale_names if weight_map.get(n, SCALES_NAME) != SCALES_NAME)
    if taken:
        raise ExportError(f"the model's weights already hold {taken[:2]} ... ({len(taken)} scale tensors); remove "
                          f"them or serve the model with its own scales")
    weight_map.update({name: SCALES_NAME for name in scale_names})
    return dict(index, weight_map=weight_map)


def check_model(model_config: dict, manifest: dict) -> None:
    """Refuse a model folder whose shape is not the exported model's (layers, KV heads, head size, type)."""
    want = manifest["model"]
    text = model_config.get("text_config", model_config)
    heads = text.get("num_key_value_heads", text.get("num_attention_heads"))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    got = {"model_type": model_config.get("model_type"), "num_layers": text.get("num_hidden_layers"),
           "num_kv_heads": heads, "head_dim": head_dim}
    wrong = {k: (v, want[k]) for k, v in got.items() if v != want[k]}
    if wrong:
        raise ExportError(f"the model folder is not the exported model {want['name']!r}: "
                          + ", ".join(f"{k} {v[0]} (export: {v[1]})" for k, v in wrong.items()))


def build(model_dir: str | os.PathLike, export_dir: str | os.PathLike, out: str | os.PathLike, *,
          force: bool = False) -> ServedModel:
    """Write ``out``: the files of ``model_dir``, the scale file of ``export_dir``, the merged config (and index).

    ``out`` may be missing, empty or a folder this function wrote; anything else only with ``force``."""
    from safetensors import safe_open

    model_dir, export_dir, out = Path(model_dir), Path(export_dir), Path(out)
    manifest = read_manifest(export_dir)
    config = json.loads((model_dir / "config.json").read_text())
    check_model(config, manifest)
    if out.exists() and any(out.iterdir()) and not (out / SERVED_NAME).is_file() and not force:
        raise ExportError(f"{out} is not empty and is no served model folder kvguard wrote; refusing to replace it "
                          f"(pass --force to replace it, deleting its files)")
    with safe_open(str(export_dir / SCALES_NAME), framework="pt") as f:
        scale_names = sorted(f.keys())
    block = json.loads((export_dir / CONFIG_NAME).read_text())["quantization_config"]
    sharded = (model_dir / INDEX_NAME).is_file()
    with atomic.directory(out) as tmp:
        for item in model_dir.iterdir():
            if item.is_file() and item.name not in ("config.json", INDEX_NAME, SCALES_NAME, SERVED_NAME):
                _link_or_copy(item, tmp / item.name)
        shutil.copyfile(export_dir / SCALES_NAME, tmp / SCALES_NAME)
        (tmp / "config.json").write_text(json.dumps(merged_config(config, block), indent=2) + "\n")
        if sharded:
            index = merged_index(json.loads((model_dir / INDEX_NAME).read_text()), scale_names)
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / SERVED_NAME).write_text(json.dumps({"model": str(model_dir.resolve()), "export": str(export_dir.resolve()),
                                                   "export_files": manifest["files"]}, indent=2) + "\n")
    return ServedModel(out, export_dir, sharded)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # weights are large and read-only here: share them
    except OSError:
        shutil.copy2(src, dst)
