"""The layout is part of the design (README, Layout): a certificate core that imports neither
transformers nor vLLM, thin integrations over it, policies and tools on top, and no import
cycle anywhere in `fast` (lazy imports inside functions count: they are cycles too).
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "fast"
LAYERS = {"core": 0, "integrations": 1, "policies": 1, "tools": 2}


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path):
    """Every `fast...` module imported anywhere in the file (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("fast"):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fast"))
    return out


def graph():
    mods = {module_name(p): p for p in FAST.rglob("*.py")}
    edges = {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}
    return mods, edges


def test_no_import_cycles():
    """Property: the import graph of fast (package __init__ files excluded) is acyclic."""
    mods, edges = graph()
    inits = {m for m, p in mods.items() if p.name == "__init__.py"}
    edges = {m: e - inits for m, e in edges.items() if m not in inits}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in edges.get(m, ()):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, n]))
            if n not in state:
                visit(n, stack + [m])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])


def test_core_imports_no_upper_layer():
    """Property: fast.core never imports integrations, policies or tools."""
    mods, edges = graph()
    for m, e in edges.items():
        if m.startswith("fast.core"):
            upper = [n for n in e if n.split(".")[1:2] and n.split(".")[1] in ("integrations", "policies", "tools")]
            assert not upper, f"{m} imports {upper}"


REPO_ONLY = ("benchmarks", "spec", "reference", "conformance", "tests")  # top-level dirs the wheel does not ship


def test_fast_imports_no_repository_only_package():
    """Property: no module of fast imports benchmarks, spec, reference, conformance or tests (anywhere in
    the file, lazy imports included): an installed kvcert has none of them."""
    bad = []
    for path in sorted(FAST.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{module_name(path)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in REPO_ONLY]
    assert not bad, "\n".join(bad)


def test_core_imports_neither_transformers_nor_vllm():
    """Property: importing the whole core (and `import fast`) loads neither transformers nor vllm."""
    core = sorted(module_name(p) for p in (FAST / "core").glob("*.py"))
    code = "import sys, importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in core + ["fast"]) + (
        "bad = [m for m in ('transformers', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_wheel_ships_the_library_only(tmp_path):
    """The wheel built from pyproject holds every module of fast and the fused CPU read's source
    (fast/core/csrc/cpu_fused.cpp, built at first use: without it an installed kvcert has no fused
    read), and nothing outside fast/ but its metadata (no top-level spec, reference or benchmarks)."""
    import shutil
    import zipfile
    tree = tmp_path / "src"  # a copy: setuptools builds in the tree, and a stale build/ there would hide a miss
    for name in ("fast", "spec", "reference", "benchmarks"):  # all of them: the wheel must leave three out
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("kvcert-*.whl"))).namelist()
    outside = [n for n in names if n.split("/")[0] != "fast" and not n.split("/")[0].endswith(".dist-info")]
    assert not outside, f"the wheel ships more than fast/: {outside}"
    want = [str(p.relative_to(ROOT).as_posix()) for p in FAST.rglob("*.py")]
    want += [f"fast/core/csrc/{f.name}" for f in (FAST / "core" / "csrc").glob("*.cpp")]
    missing = [n for n in want if n not in names]
    assert not missing, f"the wheel lacks {missing}"


CORE_STAGES = [("base", {"_checks", "floats", "threads", "native", "rope"}), ("forms", {"certify", "box"}),
               ("codecs", {"quant", "schemes", "prerope"}), ("kernels", {"triton_kernels"}),
               ("witnesses", {"witness", "subspace", "dither", "evict", "pagebox"}),
               ("reads", {"attention", "cpu_fused", "sparse"})]


def test_core_is_laid_out_by_stage():
    """Property: every module of fast.core sits in one stage of fast/core/__init__.py's list, and imports
    (anywhere in the file) only from its own stage or earlier ones: no codec or witness reaches into a read."""
    mods, edges = graph()
    stage = {f"fast.core.{m}": i for i, (_, names) in enumerate(CORE_STAGES) for m in names}
    core = {m for m, p in mods.items() if m.startswith("fast.core.")}
    assert core == set(stage), f"unplaced: {sorted(core - set(stage))}, gone: {sorted(set(stage) - core)}"
    for m in sorted(core):
        later = [n for n in edges[m] if n in stage and stage[n] > stage[m]]
        assert not later, f"{m} ({CORE_STAGES[stage[m]][0]}) imports a later stage: {later}"
    doc = (FAST / "core" / "__init__.py").read_text()
    for name, names in CORE_STAGES:
        assert all(n in doc for n in names) and name in doc, name
