"""``kvguard export``: a profile's calibrated K/V ranges as the FP8 KV-cache scales vLLM and SGLang load.

The scales are :func:`kvguard.fp8.fp8_scales` of the profile (``clip * absmax / 448``), the same numbers the
``fp8`` / ``fp8:head`` / ``fp8:sglang`` evaluation methods quantize with. An export is one directory:

``--format vllm``
    - ``kv_cache_scales.safetensors``: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale``, float32, shape
      ``[]`` (``--granularity tensor``) or ``[num_kv_heads]`` (``head``), for every layer;
    - ``quantization_config.json``: ``{"quantization_config": {...}}``, a compressed-tensors config whose
      ``kv_cache_scheme`` (8-bit float, symmetric, static, strategy ``tensor`` or ``attn_head``) tells vLLM to
      load those scales; merged into the model's ``config.json``;
    - the plan's FP16-tier layers, for ``--kv-cache-dtype-skip-layers`` (in the manifest and the README).
``--format vllm --kv-cache-dtype int8_per_token_head | int4_per_token_head``
    - no scale file (vLLM computes those scales per token as it writes); the manifest and README carry the
      engine arguments, with the skip list calibration chose for a memory budget
      (:mod:`kvguard.export.skip_list`, measured by :mod:`kvguard.calibration.engine_skip`) when one was given.
``--format sglang``
    - ``kv_cache_scales.json``: the ``--quantization-param-path`` file, ``{"model_type": ..., "kv_cache":
      {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"<layer>": s}}}}`` (TP rank 0; one scale per layer
      shared by K and V, the larger of the two).

plus ``kvguard_export.json`` (manifest: source profile, model fingerprint, scales, file hashes) and
``README.md`` (how to launch the engine with it). The directory is written to a temporary sibling and swapped
into place, so a reader never sees half an export.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from kvguard import __version__, atomic
from kvguard.export.skip_list import EngineDtype
from kvguard.fp8 import FP8Scales, Granularity, describe, fp8_scales, parse_choice

MANIFEST_NAME = "kvguard_export.json"
README_NAME = "README.md"
SCALES_NAME = "kv_cache_scales.safetensors"
CONFIG_NAME = "quantization_config.json"
SGLANG_NAME = "kv_cache_scales.json"
KIND = "kvguard-export"
SCHEMA_VERSION = 1


class ExportFormat(str, Enum):
    """The serving engine an export is for."""

    VLLM = "vllm"
    SGLANG = "sglang"

    @classmethod
    def parse(cls, value: "ExportFormat | str") -> "ExportFormat":
        return parse_choice(cls, value, "format")


# vLLM's --kv-cache-dtype values an export plans for; only fp8 takes static scales from the model folder.
FP8 = EngineDtype.FP8.value
KV_CACHE_DTYPES = tuple(d.value for d in EngineDtype)


class ExportError(ValueError):
    """An export that cannot be written: bad arguments, or a directory it must not replace."""


@dataclass(frozen=True)
class ExportSpec:
    """What to export: the engine, the scale granularity (``head`` is vLLM only) and the engine's KV dtype."""

    format: ExportFormat
    granularity: Granularity = Granularity.TENSOR
    kv_cache_dtype: str = FP8

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", ExportFormat.parse(self.format))
        object.__setattr__(self, "granularity", Granularity.parse(self.granularity))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ExportError(f"--kv-cache-dtype has to be one of [{', '.join(KV_CACHE_DTYPES)}] but got "
                              f"{self.kv_cache_dtype!r}")
        if self.format is ExportFormat.SGLANG and self.kv_cache_dtype != FP8:
            raise ExportError(f"--kv-cache-dtype {self.kv_cache_dtype} is vLLM's; SGLang exports are fp8")
        if self.format is ExportFormat.SGLANG and self.granularity is not Granularity.TENSOR:
            raise ExportError("--granularity head is for vllm only: SGLang's --quantization-param-path holds one "
                              "scale per layer")

    @property
    def static_scales(self) -> bool:
        """Whether the engine takes scales from the export (FP8) or computes them as it writes."""
        return self.kv_cache_dtype == FP8

    @property
    def eval_method(self) -> str:
        """The ``kvguard eval`` method that quantizes exactly as this export's engine will."""
        if not self.static_scales:
            return f"vllm-{self.kv_cache_dtype}"
        if self.format is ExportFormat.SGLANG:
            return "fp8:sglang"
        return "fp8" if self.granularity is Granularity.TENSOR else "fp8:head"

    def scales(self, profile) -> FP8Scales:
        if self.format is ExportFormat.SGLANG:
            return fp8_scales(profile, Granularity.TENSOR, shared_kv=True, skip_fp16=False)
        return fp8_scales(profile, self.granularity)


def vllm_tensors(scales: FP8Scales) -> dict[str, torch.Tensor]:
    """The checkpoint tensors vLLM loads: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (float32)."""
    out = {}
    for i in range(scales.num_layers):
        out[f"model.layers.{i}.self_attn.k_scale"] = scales.key[i].clone()
        out[f"model.layers.{i}.self_attn.v_scale"] = scales.value[i].clone()
    return out


def vllm_quantization_config(granularity: Granularity) -> dict:
    """The ``quantization_config`` block for ``config.json``: compressed-tensors, nothing but the KV cache
    quantized (``config_groups`` empty: the weights stay as they are)."""
    strategy = "tensor" if granularity is Granularity.TENSOR else "attn_head"
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                            "dynamic": False},
    }


def sglang_params(scales: FP8Scales, model_type: str) -> dict:
    """SGLang's ``--quantization-param-path`` JSON (its ``QuantParamSchema``): per TP rank, per layer, the one
    scale K and V share. Only rank 0 is written: scales are per tensor, so every rank would get the same."""
    if not torch.equal(scales.key, scales.value) or scales.granularity is not Granularity.TENSOR:
        raise ExportError("SGLang scales must be per tensor and shared by K and V (fp8_scales(..., shared_kv=True))")
    per_layer = {str(i): float(s) for i, s in enumerate(scales.key.tolist())}
    return {"model_type": model_type, "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": per_layer}}}


def engine_args(spec: ExportSpec, skip_layers: tuple[int, ...], out: Path) -> list[str]:
    """The engine's command-line arguments that go with the files (after the model). For an FP8 export the
    merged config alone already selects vLLM's FP8 cache; the flag is kept so the command says what it does."""
    if spec.format is ExportFormat.SGLANG:
        return ["--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", str(out / SGLANG_NAME)]
    args = ["--kv-cache-dtype", spec.kv_cache_dtype]
    if skip_layers:
        args += ["--kv-cache-dtype-skip-layers", *map(str, skip_layers)]
    return args


def export(profile, spec: ExportSpec, out: str | os.PathLike, *, force: bool = False,
           skip_choice: dict | None = None) -> dict:
    """Write the export of ``profile`` for ``spec`` to ``out``; return its manifest.

    ``out`` may be missing, empty or a previous export; any other non-empty directory is refused unless
    ``force`` (it is then replaced, its files deleted). ``skip_choice``: the skip list calibration chose for
    ``spec.kv_cache_dtype`` under a memory budget (:meth:`kvguard.export.skip_list.SkipChoice.to_dict`);
    without it the plan's FP16 layers are skipped.
    """
    out = Path(out)
    _check_target(out, force)
    if skip_choice is not None and skip_choice["dtype"] != spec.kv_cache_dtype:
        raise ExportError(f"the skip list was chosen for {skip_choice['dtype']}, the export is {spec.kv_cache_dtype}")
    scales = spec.scales(profile)  # refuses 0 / NaN / Inf / 1.0 scales before anything is written
    if skip_choice is not None:
        if skip_choice["chosen"] is None:
            raise ExportError(f"no skip list of {spec.kv_cache_dtype} fits the memory budget {skip_choice['budget']}")
        scales = FP8Scales(scales.key, scales.value, scales.granularity, tuple(skip_choice["chosen"]))
    skip = () if spec.format is ExportFormat.SGLANG else scales.skip_layers
    model = profile.meta.model
    fp16_layers = [i for i, lp in enumerate(profile.plan.layers) if any(not p.is_quantized for p in lp.precision)]
    files: dict[str, bytes] = {}
    if not spec.static_scales:
        pass  # vLLM computes per-token-head scales as it writes: the arguments are the whole export
    elif spec.format is ExportFormat.VLLM:
        from safetensors.torch import save

        # One metadata key: safetensors writes a metadata map in no fixed order, and exports should be
        # byte-for-byte reproducible (the manifest's SHA-256s).
        files[SCALES_NAME] = save(vllm_tensors(scales), metadata={"format": "pt"})
        files[CONFIG_NAME] = _json({"quantization_config": vllm_quantization_config(spec.granularity)})
    else:
        files[SGLANG_NAME] = _json(sglang_params(scales, model.model_type))
    manifest = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "kvguard_version": __version__,
        "format": spec.format.value,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "granularity": spec.granularity.value,
        "eval_method": spec.eval_method,
        "profile": {"path": str(Path(profile.path).resolve()) if profile.path else None,
                    "tensors_sha256": profile.tensors_sha256},
        "model": {k: getattr(model, k) for k in ("name", "fingerprint", "model_type", "num_layers", "num_kv_heads", "head_dim")},
        "scale_formula": "scale = clip * absmax / 448 (x ~ fp8 * scale)",
        "skip_layers": list(skip),
        "skip_choice": skip_choice,
        "plan_fp16_layers": fp16_layers,
        "scales": {"key": _span(scales.key), "value": _span(scales.value)} if spec.static_scales else None,
        "engine_args": engine_args(spec, skip, out.resolve()),
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    files[MANIFEST_NAME] = _json(manifest)
    files[README_NAME] = readme(manifest, scales).encode()
    _write_dir(out, files)
    return manifest


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()) or force:
        return
    if not is_export(out):
        raise ExportError(f"{out} is not empty and holds no kvguard export ({MANIFEST_NAME}); refusing to replace "
                          f"it (pass --force to replace it, deleting its files)")


def is_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a kvguard export (its manifest)."""
    try:
        return json.loads((Path(directory) / MANIFEST_NAME).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def _write_dir(out: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into a temporary sibling of ``out`` and swap it into place (the old one removed)."""
    with atomic.directory(out) as tmp:
        for name, data in files.items():
            (tmp / name).write_bytes(data)


def _json(payload: dict) -> bytes:
    return (json.dumps(payload, indent=2) + "\n").encode()


def _span(t: torch.Tensor) -> dict:
    return {"min": float(t.min()), "max": float(t.max())}


def readme(manifest: dict, scales: FP8Scales) -> str:
    """The export's README: what the files are and the exact engine command."""
    model, fmt = manifest["model"], manifest["format"]
    args = " ".join(manifest["engine_args"])
    if manifest["kv_cache_dtype"] != FP8:
        return _token_head_readme(manifest, args)
    lines = [
        f"# kvguard export: FP8 KV-cache scales for {fmt}",
        "",
        f"- model: `{model['name']}` ({model['model_type']}, {model['num_layers']} layers, {model['num_kv_heads']} KV "
        f"heads), fingerprint `{model['fingerprint']}`",
        f"- source profile: `{manifest['profile']['path']}` (tensors sha256 `{manifest['profile']['tensors_sha256']}`)",
        f"- {describe(scales)}",
        f"- scales: `{manifest['scale_formula']}`, from the profile's calibrated absmax and its plan's clip ratios",
        f"- what the engine will do, measured on CPU: `kvguard eval --model {model['name']} --profile "
        f"{manifest['profile']['path']} --methods fp16,kvguard,{manifest['eval_method']}`",
        "",
        "| file | sha256 |",
        "|---|---|",
        *(f"| `{name}` | `{digest}` |" for name, digest in manifest["files"].items()),
        "",
    ]
    lines += _vllm_lines(manifest, args) if fmt == ExportFormat.VLLM.value else _sglang_lines(manifest, args)
    return "\n".join(lines) + "\n"


def _vllm_lines(manifest: dict, args: str) -> list[str]:
    lines = [
        f"`{SCALES_NAME}` holds `model.layers.{{i}}.self_attn.k_scale` / `v_scale` (float32, shape "
        f"{'`[]`' if manifest['granularity'] == 'tensor' else '`[num_kv_heads]`'}) for every layer; "
        f"`{CONFIG_NAME}` holds the `quantization_config` block for the model's `config.json`. "
        "`kvguard check-engine` builds the served folder (weights, scale file, merged config, sharded index) and, "
        "with `--engine-python`, loads it in vLLM and compares every layer's scales; by hand:",
        "",
        "```bash",
        "cp -r MODEL_DIR served-model",
        f"cp {SCALES_NAME} served-model/",
        "python - <<'PY'",
        "import json",
        "config = json.load(open('served-model/config.json'))",
        f"config.update(json.load(open('{CONFIG_NAME}')))",
        "json.dump(config, open('served-model/config.json', 'w'), indent=2)",
        "PY",
        f"vllm serve served-model {args}",
        "```",
        "",
        "The merged config alone switches vLLM's cache to FP8 (`--kv-cache-dtype fp8` is redundant). If the model "
        f"folder has `model.safetensors.index.json`, add the scale names to its `weight_map` (pointing to "
        f"`{SCALES_NAME}`): vLLM reads only indexed files, and a scale it does not find is 1.0, silently. A model "
        "that already has a compressed-tensors `quantization_config` keeps it: add only the `kv_cache_scheme` "
        "entry. Leave `--calculate-kv-scales` off, or vLLM replaces these scales with ones measured on the first "
        "batch. vLLM's CPU build runs an FP8 cache only on x86 with AVX-512 or AMX, with one scale per layer.",
    ]
    if manifest["skip_layers"]:
        source = ("calibration's choice for the memory budget" if manifest.get("skip_choice")
                  else "the plan's FP16 tier")
        lines += ["", f"Layers {', '.join(map(str, manifest['skip_layers']))} are {source}: "
                      "`--kv-cache-dtype-skip-layers` keeps them unquantized."]
    return lines


def _sglang_lines(manifest: dict, args: str) -> list[str]:
    lines = [
        f"`{SGLANG_NAME}` is SGLang's `--quantization-param-path` file: one scale per layer, shared by K and V "
        "(the larger of the two), for tensor-parallel rank 0:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path MODEL_DIR {args}",
        "```",
        "",
        "With tensor parallelism N, copy the `\"0\"` entry of `scaling_factor` to `\"1\"` ... `\"N-1\"` "
        "(per-tensor scales are the same on every rank).",
        "",
        "SGLang reads the file only for model classes that implement `load_kv_cache_scales` (the Llama family does).",
    ]
    if manifest["plan_fp16_layers"]:
        lines += ["", f"SGLang quantizes every layer: the plan's FP16 layers "
                      f"({', '.join(map(str, manifest['plan_fp16_layers']))}) are stored in FP8 too."]
    return lines


def _token_head_readme(manifest: dict, args: str) -> str:
    model, dtype, choice = manifest["model"], manifest["kv_cache_dtype"], manifest.get("skip_choice")
    lines = [
        f"# kvguard export: vLLM `--kv-cache-dtype {dtype}` for `{model['name']}`",
        "",
        f"vLLM computes these scales per token and KV head as it writes the cache: there is no file to load. "
        f"Serve the model's own folder:",
        "",
        "```bash",
        f"vllm serve MODEL_DIR {args}",
        "```",
        "",
        f"What the engine will do, measured on CPU: `kvguard eval --model {model['name']} --methods "
        f"fp16,{manifest['eval_method']}` (vLLM runs this dtype in its Triton attention backend only, i.e. on a GPU).",
    ]
    if choice is not None:
        lines += ["", f"The skip list is the one with the lowest held-out KL among the sensitivity ranking's "
                      f"prefixes within {choice['budget']} of the FP16 KV bytes:", "",
                  "| skipped layers | KV memory / FP16 | held-out KL | worst ppl +% |", "|---|---|---|---|"]
        lines += [f"| {','.join(map(str, c['skip'])) or 'none'} | {c['memory']:.3f} | {c['kl']:.5f} | "
                  f"{c['ppl_increase_pct']:+.2f} |" for c in choice["candidates"]]
    return "\n".join(lines) + "\n"
