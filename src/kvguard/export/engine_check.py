"""Proof that an export reached the engine: the scales each attention layer holds after loading, per layer.

An engine that finds no scale for a layer runs it with 1.0 and no warning, so a file name, a tensor name or a
config block that the engine does not read is invisible until the answers degrade. :func:`run_vllm` loads a
served model folder (:mod:`kvguard.served_model <kvguard.export.served_model>`) in vLLM, in a subprocess with
the python of the venv vLLM lives in (``make engines``: vLLM cannot share kvguard's venv), and
:func:`compare` sets what every attention layer holds beside what the export wrote. A layer the engine did not
report, a scale of 1.0 in the engine, or a value that differs is an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvguard.fp8 import FP8Scales

PROBE = Path(__file__).with_name("vllm_probe.py")
PROBE_PREFIX = "KVGUARD_PROBE "
DEFAULT_TIMEOUT_S = 900


class EngineUnavailable(ValueError):
    """The engine cannot be run from here (no such python, or the engine is not importable with it)."""


@dataclass(frozen=True)
class EngineReport:
    """What a probe read from an engine after loading a model folder.

    Attributes:
        engine, version: e.g. ``vllm``, ``0.32.0``.
        layers: layer index -> ``(k_scale, v_scale)``, each the flat list of values the layer holds.
        cache_dtype: the KV-cache dtype the engine configured (``fp8`` when the scheme was read).
        error: the engine's refusal after loading (e.g. no FP8 cache on this CPU), else ``None``.
        score: teacher-forced ``{"tokens", "nll", "ppl"}`` when the engine ran and tokens were given.
        cpu: what the engine's machine offers (``avx512``, ``amx``, ``cuda``).
    """

    engine: str
    version: str | None
    layers: dict[int, tuple[list[float], list[float]]]
    cache_dtype: str | None = None
    error: str | None = None
    score: dict | None = None
    cpu: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> "EngineReport":
        layers = {int(i): (list(v["k_scale"]), list(v["v_scale"])) for i, v in d.get("layers", {}).items()}
        return cls(d["engine"], d.get("version"), layers, d.get("cache_dtype"), d.get("error"), d.get("score"),
                   d.get("cpu") or {})


@dataclass(frozen=True)
class LayerCheck:
    """One attention layer: the exported scales and the engine's (``None``: the engine reported no such layer)."""

    layer: int
    exported_k: list[float]
    exported_v: list[float]
    engine_k: list[float] | None
    engine_v: list[float] | None

    @property
    def problem(self) -> str | None:
        if self.engine_k is None:
            return "missing in the engine"
        if 1.0 in self.engine_k or 1.0 in self.engine_v:
            return "scale 1.0 in the engine (the scale file was not read)"
        if self.engine_k != self.exported_k or self.engine_v != self.exported_v:
            return "differs from the export"
        return None

    @property
    def match(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class CheckResult:
    """The per-layer comparison; ``ok`` when every layer holds exactly the exported scales."""

    report: EngineReport
    layers: tuple[LayerCheck, ...]

    @property
    def problems(self) -> list[str]:
        return [f"layer {c.layer}: {c.problem}" for c in self.layers if c.problem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        """Markdown: layer, exported k / v, engine k / v, match."""
        lines = ["| layer | exported k_scale | engine k_scale | exported v_scale | engine v_scale | match |",
                 "|---|---|---|---|---|---|"]
        for c in self.layers:
            lines.append(f"| {c.layer} | {_values(c.exported_k)} | {_values(c.engine_k)} | {_values(c.exported_v)} | "
                         f"{_values(c.engine_v)} | {'yes' if c.match else 'NO: ' + c.problem} |")
        return "\n".join(lines)


def _values(v: list[float] | None) -> str:
    return "-" if v is None else " / ".join(f"{x:.6g}" for x in v)


def exported_scales(export_dir: str | os.PathLike, granularity: str) -> FP8Scales:
    """The scales as the export's ``kv_cache_scales.safetensors`` holds them (what the engine is given)."""
    from safetensors.torch import load_file

    from kvguard.export.export import SCALES_NAME

    tensors = load_file(str(Path(export_dir) / SCALES_NAME))
    n = len(tensors) // 2
    try:
        key = torch.stack([tensors[f"model.layers.{i}.self_attn.k_scale"] for i in range(n)])
        value = torch.stack([tensors[f"model.layers.{i}.self_attn.v_scale"] for i in range(n)])
    except KeyError as err:
        raise ValueError(f"{export_dir}/{SCALES_NAME} lacks the tensor {err}; re-export it") from None
    return FP8Scales(key, value, granularity)


def compare(scales: FP8Scales, report: EngineReport) -> CheckResult:
    """Every layer of ``scales`` beside the engine's. Values are compared as float32, exactly: the engine loads
    float32 tensors, so any difference means it did not load (or transformed) the exported file."""
    rows = []
    for i in range(scales.num_layers):
        exp_k = _float32_list(scales.key[i])
        exp_v = _float32_list(scales.value[i])
        got = report.layers.get(i)
        eng_k, eng_v = (None, None) if got is None else (_float32_list(torch.tensor(got[0])),
                                                          _float32_list(torch.tensor(got[1])))
        rows.append(LayerCheck(i, exp_k, exp_v, eng_k, eng_v))
    extra = sorted(set(report.layers) - set(range(scales.num_layers)))
    if extra:
        raise ValueError(f"the engine has attention layers {extra} the export does not know: wrong model folder?")
    return CheckResult(report, tuple(rows))


def _float32_list(t: torch.Tensor) -> list[float]:
    return t.to(torch.float32).reshape(-1).tolist()


def parse_probe_output(stdout: str) -> EngineReport:
    """The report in a probe's output (its last ``KVGUARD_PROBE {json}`` line)."""
    lines = [line for line in stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    if not lines:
        raise EngineUnavailable("the engine probe printed no report; its output ends with:\n"
                                + "\n".join(stdout.splitlines()[-15:]))
    return EngineReport.from_json(json.loads(lines[-1][len(PROBE_PREFIX):]))


def run_vllm(served_dir: str | os.PathLike, engine_python: str | os.PathLike, *, tokens: list[int] | None = None,
             timeout: float = DEFAULT_TIMEOUT_S) -> EngineReport:
    """Load ``served_dir`` in vLLM with ``engine_python`` (a venv's ``bin/python``) and read back its scales.

    ``tokens``: also score them teacher-forced in the engine (only where it runs the FP8 cache)."""
    python = Path(engine_python)
    if not python.is_file():
        raise EngineUnavailable(f"--engine-python {python} does not exist; create the engine venv with `make engines` "
                                f"(then pass .venv-engines/bin/python)")
    check = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        raise EngineUnavailable(f"vLLM is not importable with {python}: {check.stderr.strip().splitlines()[-1:]}; "
                                f"install it there (`make engines`)")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="kvguard-probe-") as tmp:
        cmd = [str(python), str(PROBE), str(served_dir)]
        if tokens is not None:
            token_file = Path(tmp) / "tokens.json"
            token_file.write_text(json.dumps(list(map(int, tokens))))
            cmd += ["--tokens", str(token_file)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return parse_probe_output(done.stdout + done.stderr)


def sglang_status(engine_python: str | os.PathLike) -> str | None:
    """``None`` when SGLang is importable with ``engine_python``; otherwise why it cannot be checked."""
    done = subprocess.run([str(engine_python), "-c", "import sglang"], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return f"SGLang is not importable with {engine_python} (pip install sglang there to check SGLang exports)"
