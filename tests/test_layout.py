"""The house rules that a grep could check, checked: layering, function length, module names."""

import ast
import sys
from pathlib import Path

import kvguard

ROOT = Path(kvguard.__file__).parent
CORE = ("precision", "packing", "quantizer", "config", "plan", "cache_layer", "cache", "fp8", "per_token_head",
        "simulate", "entropy", "profile", "models", "assets", "architecture", "attention", "atomic", "rotation",
        "fused_attention", "triton_attention", "device", "backing", "score_bias", "scale_codes", "rope", "metrics",
        "scoring", "risk")
STAGES = ("calibration", "control", "evaluation", "serving", "peers", "export")
MAX_FUNCTION_LINES = 80


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree) -> set[str]:
    out = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_root_shows_the_core_and_the_four_stages():
    names = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    assert names == set(CORE)
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} == {*STAGES, "cli", "data"}


def test_nothing_at_run_time_imports_calibration():
    offenders = []
    for path, tree in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("calibration", "cli"):
            continue
        bad = sorted(m for m in _imports(tree) if m == "kvguard.calibration" or m.startswith("kvguard.calibration."))
        offenders += [f"{rel}: {m}" for m in bad]
    assert offenders == []


def test_architecture_lives_in_the_core_and_the_profile_needs_no_calibration():
    trees = dict((p.relative_to(ROOT).as_posix(), t) for p, t in _modules())
    assert not any(isinstance(n, ast.ClassDef) and n.name == "Architecture" for n in ast.walk(trees["models.py"]))
    assert not any(m.startswith("kvguard.calibration") for m in _imports(trees["profile.py"]))


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


# ``profile`` is also the standard library's profiler; the layout names the core's profile module so, and the
# package only ever imports it as ``kvguard.profile``.
NAMED_BY_THE_LAYOUT = {"profile"}


def test_no_module_shadows_the_standard_library():
    shadows = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
               if p.stem in sys.stdlib_module_names and p.stem not in NAMED_BY_THE_LAYOUT]
    assert shadows == []


def test_public_api_is_re_exported():
    for name in ("KVGuardCache", "CacheConfig", "Precision", "Plan", "Profile", "LiveSession", "load"):
        assert getattr(kvguard, name) is not None
