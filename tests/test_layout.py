"""The house rules that a grep could check, checked: layering, function length, module names.

The layering, as the imports must show it (lazy imports inside functions count too):

- the core (the flat modules and ``data/``) imports no stage: stages build on the core, never the reverse
  (``__init__`` and ``__main__`` are the front door, exempt);
- nothing but ``calibration/`` itself and the CLI imports ``calibration/``: run time, evaluation, serving, peers
  and export only load what calibration wrote;
- nothing but ``evaluation/`` itself and the CLI imports ``evaluation/``: calibration scores with the core's
  ``scoring`` and ``metrics``, peers are measured by evaluation and do not call back into it.
"""

import ast
import re
import sys
from pathlib import Path

import kvguard

ROOT = Path(kvguard.__file__).parent
CORE = ("precision", "packing", "quantizer", "config", "plan", "cache_layer", "cache", "fp8", "per_token_head",
        "simulate", "entropy", "profile", "models", "assets", "architecture", "attention", "atomic", "rotation",
        "fused_attention", "triton_attention", "device", "backing", "score_bias", "scale_codes", "rope", "metrics",
        "scoring", "risk", "store", "stored_read", "overlay", "rows", "chunk_attention", "packed", "heap",
        "gguf_parts", "logprob_file")
CORE_PACKAGES = ("data",)
STAGES = ("calibration", "control", "evaluation", "serving", "peers", "export")
FRONT_DOOR = ("__init__.py", "__main__.py")  # like cli/, may import anything: the public re-exports, `python -m`
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


def _part(path: Path) -> str:
    """The part of the package a file belongs to: a stage, ``cli``, a core package, ``core`` (a flat module) or
    ``front`` (the root's ``__init__`` / ``__main__``)."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else ("front" if rel.name in FRONT_DOOR else "core")


def _offenders(modules, importers, imported: str) -> list[str]:
    """``file: module`` for every import of ``kvguard.<imported>`` by a file whose part is in ``importers``."""
    out = []
    for path, tree in modules:
        if _part(path) not in importers:
            continue
        bad = sorted(m for m in _imports(tree) if m == f"kvguard.{imported}" or m.startswith(f"kvguard.{imported}."))
        out += [f"{path.relative_to(ROOT)}: {m}" for m in bad]
    return out


def test_the_root_shows_the_core_and_the_stages():
    names = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    assert names == set(CORE)
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == {*STAGES, *CORE_PACKAGES, "cli"}


def test_no_core_module_imports_a_stage():
    modules = list(_modules())
    offenders = [o for stage in (*STAGES, "cli") for o in _offenders(modules, ("core", *CORE_PACKAGES), stage)]
    assert not offenders, "the core imports a stage:\n" + "\n".join(offenders)


def test_the_stored_format_has_one_reader_seam():
    """Every reader of the stored K/V (the kernels, the chunked read, the simulation) takes a StoredRead; only the
    layer and the simulation build stores, and nothing anywhere (benchmarks and tests included) reaches into the
    store's or the layer's private layout state."""
    readers = ("fused_attention.py", "chunk_attention.py", "triton_attention.py", "stored_read.py")
    for name in readers:
        imported = _imports(ast.parse((ROOT / name).read_text()))
        assert not {m for m in imported if m == "kvguard.store" or m.startswith(("kvguard.store.", "kvguard.cache_layer"))}, name
    builders = {p.relative_to(ROOT).as_posix() for p, t in _modules()
                if any(m == "kvguard.store" or m.startswith("kvguard.store.") for m in _imports(t))}
    assert builders <= {"cache_layer.py", "simulate.py", "plan.py"}, builders
    private = re.compile(r"\._runs\b|\b_Part(Layout)?\b|\._(sinks|win)_[kv]\b|\._overlay_(pos|k|v)\b|\._store\(|"
                         r"\._layout\(|\b_quantized_copy\b|\._encode_into\(|\._win_scale\b|\._rope_rows\b")
    repo = ROOT.parent.parent
    offenders = [f"{path.relative_to(repo)}: {m.group(0)}" for folder in ("src", "tests", "benchmarks")
                 for path in sorted((repo / folder).rglob("*.py")) if path.name not in ("test_layout.py", "store.py")
                 for m in private.finditer(path.read_text())]
    assert offenders == []


def test_nothing_at_run_time_imports_calibration():
    others = ("core", *CORE_PACKAGES, *(s for s in STAGES if s != "calibration"))
    offenders = _offenders(list(_modules()), others, "calibration")
    assert not offenders, "only calibration/ and cli/ may import calibration:\n" + "\n".join(offenders)


def test_no_stage_but_evaluation_imports_evaluation():
    others = ("core", *CORE_PACKAGES, *(s for s in STAGES if s != "evaluation"))
    offenders = _offenders(list(_modules()), others, "evaluation")
    assert not offenders, "only evaluation/ and cli/ may import evaluation:\n" + "\n".join(offenders)


def test_the_checks_see_lazy_and_package_imports():
    """The checker itself: a lazy import in a function, and ``from kvguard import <stage>``, are both caught."""
    lazy = ast.parse("def f():\n    from kvguard.control.session import LiveSession\n")
    package = ast.parse("from kvguard import evaluation\n")
    modules = [(ROOT / "profile.py", lazy), (ROOT / "calibration" / "search.py", package)]
    assert _offenders(modules, ("core",), "control") == ["profile.py: kvguard.control.session",
                                                        "profile.py: kvguard.control.session.LiveSession"]
    assert _offenders(modules, ("calibration",), "evaluation") == ["calibration/search.py: kvguard.evaluation"]
    assert _offenders(modules, ("serving",), "evaluation") == []


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


def _kvguard_names(tree) -> set[str]:
    """The local names a script binds to kvguard modules or to what it imported from them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "kvguard"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvguard":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    """``a`` of ``a.b.c``: the name an attribute chain starts from (None for a call's result and the like)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_uses(tree) -> list[str]:
    """What a script takes from kvguard that is not public API, or patches in it: an imported name starting with
    ``_``, an attribute starting with ``_`` of a kvguard name, an assignment to a kvguard name's attribute."""
    bound = _kvguard_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvguard":
            out += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
            out += [f"from {node.module} import ..." for part in node.module.split(".") if part.startswith("_")]
        elif isinstance(node, ast.Attribute) and _root(node) in bound:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(ast.unparse(node))
            if isinstance(node.ctx, ast.Store):
                out.append(f"{ast.unparse(node)} = ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in bound:
            out.append(f"setattr({node.args[0].id}, ...)")
    return out


def test_benchmarks_use_the_public_api():
    """Benchmarks measure kvguard as a user runs it: no private name of kvguard imported or reached into, and no
    kvguard module patched (an experiment that needs to is history: benchmarks/DECISIONS.md)."""
    repo = ROOT.parent.parent
    scripts = sorted((repo / "benchmarks").glob("*.py"))
    assert scripts, "no benchmark scripts found"
    offenders = [f"{path.name}: {use}" for path in scripts for use in _private_uses(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_private_use_check_sees_imports_attributes_and_patches():
    tree = ast.parse("from kvguard.quantizer import _grid\nfrom kvguard import simulate as s\n"
                     "import kvguard.fused_attention\ns._quantized_copy(1)\ns.simulate_logits = None\n"
                     "setattr(s, 'x', 1)\nkvguard.fused_attention._codes\nself._stop = 1\n")
    assert sorted(_private_uses(tree)) == sorted(["from kvguard.quantizer import _grid", "s._quantized_copy",
                                                  "s.simulate_logits = ...", "setattr(s, ...)",
                                                  "kvguard.fused_attention._codes"])
