"""Loading the C++ extension (csrc/cpu_fused.cpp): built once per source and flags with g++ into a
cache directory, loaded with ctypes (plain C ABI, no torch headers), and the small C entry points that
lower stages use without the fused read (the dither's Philox). fast.core.cpu_fused (the fused read)
builds on it; this module imports nothing from fast but the thread count, so that the codecs
(fast.core.quant) can call the extension without an import cycle.
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fast.core.threads import read_threads

SRC = Path(__file__).resolve().parent / "csrc" / "cpu_fused.cpp"
ABI = 13  # csrc: kvcert_fused_abi (bumped with every change of Seg / Args or of an entry point's arguments)
FLAGS = ["-O3", "-g", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fopenmp-simd", "-fPIC", "-shared", "-std=c++17"]


class _Seg(ctypes.Structure):
    _fields_ = [(n, t) for n, t in [
        ("k", ctypes.c_void_p), ("k_sb", ctypes.c_int64), ("k_sh", ctypes.c_int64),
        ("ks", ctypes.c_void_p), ("ks_sb", ctypes.c_int64), ("ks_sh", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_sb", ctypes.c_int64), ("v_sh", ctypes.c_int64),
        ("vs", ctypes.c_void_p), ("vs_sb", ctypes.c_int64), ("vs_sh", ctypes.c_int64),
        ("rho", ctypes.c_void_p), ("r_sb", ctypes.c_int64), ("r_sh", ctypes.c_int64),
        ("valid", ctypes.c_void_p), ("va_sb", ctypes.c_int64), ("va_sh", ctypes.c_int64),
        ("exact", ctypes.c_void_p), ("ex_sb", ctypes.c_int64), ("ex_sh", ctypes.c_int64),
        ("pos", ctypes.c_void_p), ("p_sb", ctypes.c_int64), ("p_sh", ctypes.c_int64),
        ("n", ctypes.c_int64), ("coded", ctypes.c_int), ("rho_u8", ctypes.c_int),
        ("table", ctypes.c_void_p), ("tb_sb", ctypes.c_int64), ("bs", ctypes.c_int64), ("k_t", ctypes.c_int),
        ("bs_log2", ctypes.c_int), ("int4", ctypes.c_int),
        ("kz", ctypes.c_void_p), ("kz_sb", ctypes.c_int64), ("kz_sh", ctypes.c_int64),
        ("vz", ctypes.c_void_p), ("vz_sb", ctypes.c_int64), ("vz_sh", ctypes.c_int64),
        ("kasym", ctypes.c_int), ("vasym", ctypes.c_int), ("kblk", ctypes.c_int64),
        ("rcos", ctypes.c_void_p), ("rsin", ctypes.c_void_p), ("rpos0", ctypes.c_int64),
        ("fp8", ctypes.c_int), ("f8lut", ctypes.c_void_p), ("ks8", ctypes.c_void_p), ("vs8", ctypes.c_void_p),
        ("f8scale", ctypes.c_float), ("f8pre", ctypes.c_float), ("f8post", ctypes.c_float),
        ("dith", ctypes.c_int), ("dkey", ctypes.c_void_p), ("dk_sb", ctypes.c_int64), ("dk_sh", ctypes.c_int64),
        ("dtok0", ctypes.c_int64), ("f16", ctypes.c_int), ("verr", ctypes.c_void_p), ("ve_sb", ctypes.c_int64),
        ("ve_sh", ctypes.c_int64), ("f8fmt", ctypes.c_int), ("lens", ctypes.c_void_p), ("lchunk", ctypes.c_void_p)]]


class _Args(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("T", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64),
                ("D", ctypes.c_int64), ("NB", ctypes.c_int64), ("ngk", ctypes.c_int64), ("ngv", ctypes.c_int64),
                ("s", ctypes.c_float), ("s64", ctypes.c_double), ("q", ctypes.c_void_p), ("qpos", ctypes.c_void_p), ("bands", ctypes.c_void_p),
                ("W", ctypes.c_int64), ("band_margin", ctypes.c_double), ("e_coef", ctypes.c_double), ("lut", ctypes.c_void_p), ("seg", _Seg * 2), ("out", ctypes.c_void_p), ("stats", ctypes.c_void_p),
                ("kmax", ctypes.c_void_p), ("nanflag", ctypes.c_void_p), ("certify", ctypes.c_int),
                ("threads", ctypes.c_int), ("chunk", ctypes.c_int64), ("dF", ctypes.c_double), ("dstats", ctypes.c_void_p),
                ("vstats", ctypes.c_void_p), ("vmax", ctypes.c_void_p), ("vctr", ctypes.c_void_p), ("v_margin", ctypes.c_double),
                ("hist", ctypes.c_void_p), ("hist_m", ctypes.c_int64)]


class _EpiConst(ctypes.Structure):
    _fields_ = [(n, ctypes.c_double) for n in ("f", "g1", "g2", "up_", "g_n", "u", "eps2", "u3", "t_cut", "den", "alpha",
                                                "exp_eps", "cap", "margin_max", "w_abs")]


_LIB = {}
_FAILED = {}  # (scalar, sanitized) -> the exception of a failed build or load, raised again without retrying


def _cache_dir():
    d = os.environ.get("KVCERT_BUILD_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvcert")
    return Path(d)


SANITIZE = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def sanitized():
    """KVCERT_SANITIZE=1: _lib loads the AddressSanitizer + UBSan build (tests/test_sanitize.py runs the kernel
    tests so, in a python started with libasan preloaded: python itself is not built with ASan)."""
    return os.environ.get("KVCERT_SANITIZE") == "1"


def build(verbose=False, scalar=False, sanitize=False):
    """Compile csrc/cpu_fused.cpp (once per source and flags) and return the .so path. scalar=True
    builds without the AVX2 paths (-DKVCERT_SCALAR): the same bits, used by the tests to check that.
    sanitize=True: with ASan + UBSan (SANITIZE; the flags are part of the cache key)."""
    src = SRC.read_bytes()
    flags = FLAGS + (["-DKVCERT_SCALAR"] if scalar else []) + (SANITIZE if sanitize else [])
    key = hashlib.sha256(src + " ".join(flags).encode() + sys.version.encode()).hexdigest()[:16]
    out = _cache_dir() / f"kvcert_fused_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [os.environ.get("CXX", "g++"), *flags, str(SRC), "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"cpu_fused: build failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders agree
    if verbose:
        print(f"built {out}")
    return out


def _lib(scalar=False):
    if scalar not in _LIB:
        failed = _FAILED.get((scalar, sanitized()))
        if failed is not None:  # the build or load failed before in this process: not tried again on every call
            raise failed
        try:
            lib = ctypes.CDLL(str(build(scalar=scalar, sanitize=sanitized())))
        except (OSError, RuntimeError) as e:
            _FAILED[(scalar, sanitized())] = e
            raise
        if lib.kvcert_fused_abi() != ABI:  # the _Seg / _Args layout above and the C++ structs must agree
            raise RuntimeError(f"cpu_fused: the extension's ABI {lib.kvcert_fused_abi()} is not this module's {ABI}")
        lib.kvcert_fused_run.argtypes = [ctypes.POINTER(_Args)]
        lib.kvcert_fused_run.restype = None
        lib.kvcert_exp_check.argtypes = [ctypes.c_float, ctypes.POINTER(ctypes.c_double), ctypes.c_int]
        lib.kvcert_exp_check.restype = ctypes.c_double
        lib.kvcert_exp_one.argtypes = [ctypes.c_float]
        lib.kvcert_exp_one.restype = ctypes.c_float
        lib.kvcert_paged_witness.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_float, ctypes.c_void_p]
        lib.kvcert_paged_witness.restype = ctypes.c_int64
        lib.kvcert_witness_codes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p,
                                             *[ctypes.c_int64] * 2, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int]
        lib.kvcert_witness_codes.restype = ctypes.c_int64
        lib.kvcert_page_write.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p,
                                          *[ctypes.c_int64] * 2, ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_int,
                                          ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_double, ctypes.c_void_p]
        lib.kvcert_page_write.restype = ctypes.c_int64
        lib.kvcert_epilogue.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_EpiConst), ctypes.c_void_p]
        lib.kvcert_epilogue.restype = ctypes.c_int
        lib.kvcert_lut_is_grid.argtypes = [ctypes.c_void_p]
        lib.kvcert_lut_is_grid.restype = ctypes.c_int
        lib.kvcert_fp8_format.argtypes = [ctypes.c_void_p]
        lib.kvcert_fp8_format.restype = ctypes.c_int
        lib.kvcert_dither_noise.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, *[ctypes.c_int64] * 5,
                                            ctypes.c_int, ctypes.c_void_p]
        lib.kvcert_dither_noise.restype = None
        lib.kvcert_box_bound.argtypes = [*[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                         *[ctypes.c_double] * 4, ctypes.c_int, *[ctypes.c_void_p] * 5]
        lib.kvcert_box_bound.restype = ctypes.c_int
        lib.kvcert_hist_bins.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 5, *[ctypes.c_double] * 5,
                                         ctypes.c_int, *[ctypes.c_void_p] * 4]
        lib.kvcert_hist_bins.restype = None
        lib.kvcert_hist_k.argtypes = []
        lib.kvcert_hist_k.restype = ctypes.c_int64
        _LIB[scalar] = lib
    return _LIB[scalar]


def available():
    """True when the extension builds (g++ with OpenMP) and loads here."""
    try:
        _lib()
        return True
    except (OSError, RuntimeError):
        return False


def dither_noise(seed, layer, Hkv, token_start, N, D, *, rows=1, stream=0):
    """fast.core.quant.dither_noise's u [rows, Hkv, N, D] fp32, bit for bit, computed in C++
    (kvcert_dither_noise); the counters must already be checked (quant.check_dither_counters)."""
    out = torch.empty(rows, Hkv, N, D, dtype=torch.float32)
    if out.numel():
        _lib().kvcert_dither_noise(int(seed), int(stream), int(layer), rows, Hkv, int(token_start), N, D,
                                   read_threads(), out.data_ptr())
    return out
