"""What several test modules build: a small real calibration's settings, and typed profile metadata."""

from __future__ import annotations

import collections
import subprocess
import threading

from kvguard.config import MonitorConfig, Objective
from kvguard.plan import Plan
from kvguard.profile import Candidate, DataManifest, DomainData, ModelInfo, PlanScore, ProfileMeta, Settings

ZERO_FINGERPRINT = "sha256:" + "0" * 64


# A small real calibration of SmolLM2 (seconds, not minutes). Latency is in the score with the default weight:
# its model is counted from shapes, so the same settings give the same plan on any machine, loaded or not.
def small_config(out, **kw):
    from kvguard.calibration.settings import CalibrationConfig

    settings = dict(samples=8, domains=("prose", "code"), max_tokens=64, batch_size=4, heldout_tokens=512,
                    context=512, head_layers=1, latency_context=128, low_bit=False,
                    objective=Objective(memory_budget=0.40, max_ppl_increase=2.0))
    settings.update(kw)
    return CalibrationConfig("smollm2-135m", out, **settings)


def eval_row(method: str, corpus: str, mode: str, kv_bytes: int, kv_bytes_ratio: float, ppl: float,
             ppl_delta_pct: float | None, kl: float, top1_agree: float, tok_s: float, **more):
    """A ``kvguard eval`` row (:class:`kvguard.evaluation.harness.Row`) from its leading numbers, in table order."""
    from kvguard.evaluation.harness import Row

    return Row(method, corpus, mode, kv_bytes=kv_bytes, kv_bytes_ratio=kv_bytes_ratio, ppl=ppl,
               ppl_delta_pct=ppl_delta_pct, kl=kl, top1_agree=top1_agree, tok_s=tok_s, **more)


def candidate(name: str, plan: Plan, *, level: int = 1, memory: float = 0.4, kl: float = 1e-3,
              ppl: float = 0.1, feasible: bool = True) -> Candidate:
    return Candidate(name, level, plan, memory, 1.0, PlanScore(kl, {"prose": ppl}, 0.99), memory + ppl, feasible)


def profile_meta(plan: Plan, *, name: str = "tiny", fingerprint: str = ZERO_FINGERPRINT, model_type: str = "llama",
                 head_dim: int = 4, layer_types: tuple[str, ...] | None = None, search_log: tuple[Candidate, ...] = (),
                 pareto_front: tuple[str, ...] | None = None, chosen: Candidate | None = None,
                 objective: Objective | None = None, monitor: MonitorConfig | None = None,
                 record: dict | None = None) -> ProfileMeta:
    """Valid metadata for ``plan`` (the search log defaults to the plan alone, chosen and on the frontier)."""
    n = len(plan.layers)
    chosen = chosen or candidate("chosen", plan)
    log = search_log or (chosen,)
    data = DataManifest({"prose": DomainData(4, 256, 2, 1, 256)}, 4, 256, 64)
    return ProfileMeta(
        model=ModelInfo(name, fingerprint, model_type, n, len(plan.layers[0].precision), head_dim,
                        layer_types or ("full_attention",) * n),
        plan=plan, monitor=monitor or MonitorConfig(), risk_classifier=None, objective=objective or Objective(),
        settings=Settings(0, 4, 512, 512, 1, 128), data=data, chosen=chosen, constraints_met=chosen.feasible,
        search_log=log, pareto_front=pareto_front if pareto_front is not None else tuple(c.name for c in log),
        kvguard_version="test", record=record or {})


def tiny_llama(seed: int = 0, **overrides):
    """A small random Llama (2 layers, 4 query / 2 KV heads, head_dim 16) for fast unit tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
    settings.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def kvguard_env(**extra) -> dict:
    """The environment for a ``python -m kvguard`` subprocess that runs the kvguard this process imports (its
    source folder first on ``PYTHONPATH``), not whichever one the interpreter has installed."""
    import os
    from pathlib import Path

    import kvguard

    src = str(Path(kvguard.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def tiny_profile(path, *, tensors: dict | None = None, **meta_kw):
    """A valid 2-layer, 2-KV-head profile saved at ``path`` (``tensors`` replaces the default tensor file)."""
    import torch

    from kvguard.entropy import EntropyBaseline
    from kvguard.plan import LayerPlan
    from kvguard.profile import Profile

    plan = Plan((LayerPlan(("int4", "int8")), LayerPlan(("int2", "fp16"), key_clip=0.9)))
    g = torch.Generator().manual_seed(0)
    default = {"calibrated.key.absmax": torch.rand(2, 2, 4, generator=g) + 0.1,
               "calibrated.value.absmax": torch.rand(2, 2, 4, generator=g) + 0.1,
               **EntropyBaseline(*(torch.rand(2, 4, 3, generator=g) for _ in range(3)), torch.rand(2, 4, generator=g)).tensors()}
    return Profile(profile_meta(plan, **meta_kw), default if tensors is None else tensors).save(path)


def edit_profile(path, edit, *, reseal: bool = True) -> None:
    """Apply ``edit(raw)`` to a saved profile's ``profile.json``; ``reseal`` recomputes its manifest hash (so
    the edit is seen by the block checks, not only by the hash)."""
    import json
    from pathlib import Path

    from kvguard.profile import JSON_NAME, manifest_sha256

    file = Path(path) / JSON_NAME
    raw = json.loads(file.read_text())
    edit(raw)
    if reseal:
        raw["manifest_sha256"] = manifest_sha256(raw)
    file.write_text(json.dumps(raw))


def chromium_or_skip() -> str:
    """The headless browser of the page checks (Debian's ``chromium``, which ``make`` installs where apt works)."""
    import shutil

    import pytest

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium; `make` does it where apt is usable)")
    return path


def render_page(url: str, *, screenshot=None, wait_ms: int = 4000, size: str = "1200,1800") -> tuple[str, list[str]]:
    """``(rendered DOM, console messages)`` of ``url`` in headless Chromium after ``wait_ms`` of (virtual) time;
    with ``screenshot``, also a PNG of the page there."""
    import re
    import subprocess

    browser = chromium_or_skip()
    base = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}", "--enable-logging=stderr", "--v=0"]
    done = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [m.group(1) for m in re.finditer(r":CONSOLE[^\]]*\] (.*)", done.stderr)]
    if screenshot is not None:
        shot = subprocess.run(base + [f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=120)
        assert shot.returncode == 0, shot.stderr[-2000:]
    return done.stdout, console


def screenshot_dir(tmp_path):
    """Where page checks put their screenshots: ``$KVGUARD_SCREENSHOTS`` (`benchmarks/run.sh pages` sets
    benchmarks/results) or the test's temporary folder."""
    import os
    from pathlib import Path

    return Path(os.environ.get("KVGUARD_SCREENSHOTS") or tmp_path)


class Drained:
    """A child's piped output read on a thread as it comes, the last lines kept: a pipe nobody reads fills up and
    the child blocks on its next write (a server logging every event of its loop stalled that way)."""

    def __init__(self, proc: subprocess.Popen, keep: int = 400) -> None:
        self.lines: collections.deque = collections.deque(maxlen=keep)
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append(line.decode(errors="replace"))

    def tail(self) -> str:
        return "".join(self.lines)[-3000:]
