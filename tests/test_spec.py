"""spec/theorems.toml resolves in every direction: proofs, reference, fast, tests, README."""

import ast
import importlib
import re
from pathlib import Path

import pytest

import spec
from spec import readme

ROOT = Path(__file__).resolve().parent.parent
THEOREMS, ASSUMPTIONS = spec.load()
COQ_DECL = re.compile(r"^\s*(Theorem|Lemma|Corollary|Proposition|Fact|Remark)\s+([A-Za-z0-9_']+)", re.M)


def coq_decls(path):
    """{name: keyword} for every declaration in one .v file."""
    return {m.group(2): m.group(1) for m in COQ_DECL.finditer(path.read_text())}


def resolve_python(dotted):
    """'pkg.module:name' or 'pkg.module:Class.method' -> the object."""
    module, _, name = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_ids_are_unique_and_ordered():
    ids = [r["id"] for r in THEOREMS]
    assert ids == sorted(ids), ids


@pytest.mark.parametrize("row", THEOREMS, ids=lambda r: r["id"])
def test_row_proof_names_are_main_theorems(row):
    path = ROOT / row["proof"]
    assert path.is_file(), f"{row['id']}: {row['proof']} does not exist"
    decls = coq_decls(path)
    for name in row["coq"]:
        assert decls.get(name) == "Theorem", f"{row['id']}: {name} is not a Theorem in {row['proof']} (found {decls.get(name)})"


def test_every_main_theorem_has_a_row():
    named = {(Path(r["proof"]).name, n) for r in THEOREMS for n in r["coq"]}
    for path in sorted((ROOT / "proofs").glob("*.v")):
        for name, kind in coq_decls(path).items():
            if kind == "Theorem":
                assert (path.name, name) in named, f"{path.name}: Theorem {name} has no row in spec (make it a Lemma or add a row)"


@pytest.mark.parametrize("row", THEOREMS, ids=lambda r: r["id"])
def test_row_python_names_resolve(row):
    assert callable(resolve_python(row["reference"])), row["reference"]
    if row["fast"]:
        assert callable(resolve_python(row["fast"])), row["fast"]


def test_functions(path):
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{f.name}" for f in cls.body if isinstance(f, ast.FunctionDef)}
    return names


test_functions.__test__ = False  # a helper, not a test


@pytest.mark.parametrize("row", THEOREMS, ids=lambda r: r["id"])
def test_row_tests_exist(row):
    assert row["tests"], f"{row['id']}: no tests"
    for node in row["tests"]:
        file, _, name = node.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{row['id']}: {file} does not exist"
        assert name in test_functions(path), f"{row['id']}: {node} is not a test function"


@pytest.mark.parametrize("row", [r for r in THEOREMS if r["fast"]], ids=lambda r: r["id"])
def test_row_with_fast_function_has_a_differential_test(row):
    """A fast mirror is only trusted with a fast-vs-reference test (conformance/test_fast_*)."""
    assert any(t.startswith("conformance/test_fast_") for t in row["tests"]), f"{row['id']}: no differential test"


def test_every_reference_module_is_in_spec():
    used = {r["reference"].split(":")[0] for r in THEOREMS}
    for path in sorted((ROOT / "reference").glob("*.py")):
        if path.name.startswith("_"):
            continue
        assert f"reference.{path.stem}" in used, f"reference/{path.name} is named by no spec row"


def test_readme_is_generated_from_spec_and_results():
    text = (ROOT / "README.md").read_text()
    assert readme.render(text) == text, "README.md is stale: run `make readme`"


def test_every_chain_step_resolves():
    """spec/chains.toml (README, From theorem to number): every function imports, every id exists,
    and every assumption of spec/ appears in some chain (nothing trusted is left out of the story)."""
    import tomllib
    chains = tomllib.loads((ROOT / "spec" / "chains.toml").read_text())["quantity"]
    known = {r["id"] for r in THEOREMS} | {a["id"] for a in ASSUMPTIONS}
    used = set()
    for q in chains:
        assert q["step"], q["name"]
        for st in q["step"]:
            assert callable(resolve_python(st["function"])), st["function"]
            assert set(st["rests_on"]) <= known, (st["function"], set(st["rests_on"]) - known)
            used |= set(st["rests_on"])
    assert {a["id"] for a in ASSUMPTIONS} <= used, {a["id"] for a in ASSUMPTIONS} - used
