"""The fused C++ read (fast/core/csrc/cpu_fused.cpp) under AddressSanitizer + UBSan (issue 19).

cpu_fused.build(sanitize=True) compiles the kernel with cpu_fused.SANITIZE (ASan, UBSan, float-cast-overflow,
no recovery); KVCERT_SANITIZE=1 makes cpu_fused load that build. Python is not built with ASan, so the kernel
tests run in a subprocess started with libasan preloaded (leak detection off: python keeps its objects to the
end by design). Any sanitizer report aborts that run: the test fails with the report. A canary first checks
that the sanitizer is really on (an out-of-bounds read through the raw C ABI must be caught), so a run that
silently loaded the plain build cannot pass. `make sanitize` runs this file alone.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the kernel tests: every kernel path (codes / fp32 rows, paged, witness, epilogue, scalar and AVX2 builds),
# the bad-input checks, the transformers integration and the box certificate (kvcert_box_bound); the exhaustive
# exp check runs the same kv_exp over 10^9 inputs (minutes under the sanitizers): its error path is
# test_exp_error_path_is_defined; the box twin's speed test times nothing useful there
KERNEL_TESTS = ["tests/test_cpu_fused.py", "tests/test_cpu_fused_dither.py", "tests/test_hf_fused.py", "tests/test_box_cpp.py"]
DESELECT = "not test_exp_exhaustive and not test_cpp_is_faster_than_torch"


def _env():
    cxx = os.environ.get("CXX", "g++")
    asan = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(asan) and os.path.exists(asan), f"{cxx} has no libasan.so ({asan!r}): install the compiler's ASan runtime"
    return dict(os.environ, KVCERT_SANITIZE="1", LD_PRELOAD=asan, ASAN_OPTIONS="halt_on_error=1:detect_leaks=0",
                UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT))


def _run(args, timeout):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


CANARY = """
import ctypes, torch
from fast.core import cpu_fused
lib = cpu_fused._lib()
lib.kvcert_kappa.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                             ctypes.c_double, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p]
q = torch.ones(8)  # the call below reads 64 floats of it
bands = torch.arange(64).view(8, 8).contiguous()
k64, k32 = torch.empty(8, dtype=torch.float64), torch.empty(8)
lib.kvcert_kappa(q.data_ptr(), 1, 64, bands.data_ptr(), 8, 8, 1.0, 1.0, k64.data_ptr(), k32.data_ptr())
print("not caught")
"""


def test_sanitizer_is_on():
    r = _run(["-c", CANARY], timeout=600)
    assert r.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]


def test_kernel_tests_clean_under_sanitizers():
    """The kernel tests pass on the ASan + UBSan build, with no sanitizer report (each one aborts the run)."""
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", "-k", DESELECT, *KERNEL_TESTS], timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    for mark in ("runtime error:", "AddressSanitizer", "UndefinedBehaviorSanitizer"):
        assert mark not in out, out[-6000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
