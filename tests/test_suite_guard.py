"""The suite's own guard (conftest.py): a run that skips a test fails, so CI can never go
green by skipping proofs, model or vLLM tests."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_skipped_test_fails_the_run(tmp_path):
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_one.py").write_text("import pytest\n\ndef test_skips():\n    pytest.skip('no')\n\ndef test_ok():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "skipped or xfailed" in r.stdout
    (tmp_path / "test_one.py").write_text("def test_ok():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:]
