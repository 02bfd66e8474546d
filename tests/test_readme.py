"""README.md's Python snippets run verbatim: every ```python block is written to a file of its own
and run as a script (a fresh interpreter, the repository on the path, the real shipped SmolLM2
where the snippet loads it; the vLLM snippet starts a real CPU engine, ~40 s)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
TIMEOUT = 240  # seconds per snippet; the vLLM one takes ~40 s here, the transformers one ~10 s


def python_blocks(text):
    """[(line of the opening fence, code)] of every ```python block in text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_python_blocks_finds_every_fence():
    """property: the extractor sees each ```python block whole (so the tests below are not vacuous)
    and no other fence; README has at least the transformers and the vLLM snippet."""
    text = "x\n```python\na = 1\n\nb = 2\n```\n```\nshell\n```\n```python\nc = 3\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n\nb = 2\n"), (10, "c = 3\n")]
    readme = (ROOT / "README.md").read_text()
    blocks = python_blocks(readme)
    assert len(blocks) == readme.count("```python") >= 2
    assert any("load_smollm2" in code for _, code in blocks) and any("vllm" in code for _, code in blocks)


def _params():
    out = []
    for line, code in python_blocks((ROOT / "README.md").read_text()):
        marks = [pytest.mark.model] + ([pytest.mark.vllm] if "vllm" in code else [])
        out.append(pytest.param(line, code, marks=marks, id=f"README.md:{line}"))
    return out


@pytest.mark.parametrize("line,code", _params())
def test_readme_snippet_runs(tmp_path, line, code):
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"README.md line {line}: the snippet failed (rc {r.returncode}):\n{code}\n{r.stderr[-4000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    # each snippet prints its answer and its certificate summary: the run did what the README says
    assert "records" in r.stdout or "reads" in r.stdout, r.stdout[-2000:]
