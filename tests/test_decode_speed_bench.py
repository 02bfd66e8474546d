"""benchmarks/decode_speed.py times the cache README's first example builds (fast.CertifiedCache,
read with the attention fast.enable_meter sets), not another class or attention name."""

import ast
from pathlib import Path

from test_readme import python_blocks

import fast
from benchmarks import decode_speed

ROOT = Path(__file__).resolve().parent.parent


def called(tree):
    """Dotted names of every call in tree ("fast.CertifiedCache", "model.generate", ...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                out.append(".".join([f.id] + parts[::-1]))
    return out


def test_benchmark_builds_the_readme_cache():
    """Property: the only cache class README's first example constructs is the only one the benchmark
    constructs, and the benchmark never names FusedCertifiedCache."""
    _, code = python_blocks((ROOT / "README.md").read_text())[0]
    readme = {c for c in called(ast.parse(code)) if c.endswith("Cache")}
    assert readme == {"fast.CertifiedCache"}, readme
    src = (ROOT / "benchmarks" / "decode_speed.py").read_text()
    bench = {c for c in called(ast.parse(src)) if c.endswith("CertifiedCache")}
    assert bench == readme, bench
    assert "FusedCertifiedCache" not in src


def test_benchmark_reads_with_the_readme_attention():
    """Property: ATTENTION is the name fast.enable_meter (README's first example) gives the model,
    and no variant is labelled "(meter)" (every certified row goes through the same meter)."""
    _, code = python_blocks((ROOT / "README.md").read_text())[0]
    assert "fast.enable_meter" in called(ast.parse(code))

    class Model:
        def set_attn_implementation(self, name):
            self.attn = name

    assert fast.enable_meter(Model()).attn == decode_speed.ATTENTION
    assert not [n for n in decode_speed.CACHES if "(meter)" in n]
    assert set(decode_speed.MEMORY_VARIANTS) <= {"uncompressed", *decode_speed.CACHES}
