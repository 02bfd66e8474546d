"""Fused CPU read of an int8 or int4 KV cache with its certificate: one C++ call per read.

Why a C++ extension (csrc/cpu_fused.cpp), built at first use with g++ into a cache directory:
decode is memory-bound, and the torch twin (fast.core.attention.attention_torch) dequantizes
the history into fp32, then makes separate passes for logits, softmax, witness bounds and sums
(each a full-size temporary). The kernel reads each int8 key code once (pass 1: logits) and each
value code and witness byte once (pass 2: weights, certificate sums, output), with only the
[rows, N] logits as scratch. torch.compile was slower than eager on this path (issue 11), and
the torch extension headers take minutes to compile on 2 cores; a plain C ABI (ctypes, raw
pointers and strides) builds in seconds with no torch headers, so CI builds it from a clean
clone. OpenMP threads come from the libgomp torch already loaded (same soname). The plain-torch
twin stays the readable reference (fast.core.attention.attention_rows) and the fallback.
With AVX2 + FMA (-march=native) the loops use intrinsics: pass 1 takes 8 key tokens at a time (8
accumulators per row, the 8 lane sums added by an hadd transpose) and pass 2 keeps the output in
registers (64 channels per row), the witness log codes decode in registers (the table is a power grid, checked per
call) and the certificate sums run in 8 lanes. For up to 8 rows per KV head (a decode read: the GQA group) the codes of
int8, int4, kivi2, pre-RoPE keys and fp8 are decoded in registers and used there (csrc: row_kind, dots8, out_rows: each
key row dotted with up to 4 query rows, each value row added into up to 3 rows' accumulators, no decoded copy written);
fp8 bytes decode by bit arithmetic where the kernel finds it gives every entry of the read's table (fp8_format, per
call), else by the table gather. All run the scalar code's operations in its order, so a -DKVCERT_SCALAR build gives
the same bits (tests/test_cpu_fused.py).

    out, cert = cpu_fused.attention_rows(q, k, v, rho, scale, bands=..., q_pos=...)  # the contract
    cpu_fused.available()                                                           # built and loadable?

Supported: keys and values both int8 QTensor (scheme "int8"), both int4 QTensor (scheme "int4": codes
packed two per byte, read in place, unpacked in registers) with any group count, or both float;
rho None (derived from the scales, fast.core.witness.witness_from_scales, for int8 and int4 alike),
fp32/fp16, or uint8 log codes. Through seg(k_asym=AsymKeys(..), v_asym=AsymValues(..)) (the cache's
FusedLayer, fast.integrations.hf_fused) also asymmetric codes: kivi2 (2-bit keys per channel over blocks of
32 tokens, 2-bit values per token group) and pre-RoPE keys (4 or 8 bits per channel block, rotated to their
positions at read) with int8 values, decoded in registers with the twin's fp32 operations (csrc: asym_row):
x~ = fl(code scale + zero), code scale exact (<= 8-bit code, 11-bit scale), then prerope._rotate's
fl(fl(x c) + fl(-y s)); the same bits as the twin's decode() read as fp32 rows (tests/test_cpu_fused.py), and the
logit bound e takes those rows' own max |k~| per channel. fp8 QTensors (round-to-nearest with per-token fp32
scales, and vLLM's round-toward-zero casts with a tensor scale: fp8_parts, Fp8Read) are decoded the same way (csrc:
fp8_row): x~ = fl(fl(fl(c pre) s) post), quant.dequantize's fp32 operations in its order, the logit bound from the
decoded rows' own max |k~|. Dithered int8 / int4 QTensors (dither_parts, Dither) decode as fl((code - u) scale), quant.dequantize's
bits, the dither u regenerated at read from the QTensors' counters (csrc: dither_row, dither_u: the Philox of
fast.core.quant._block_words, 8 blocks of channels per AVX2 pass); with _run(dither_F=F) the kernel also returns the
dither tier's sums (csrc: dither_sums): each token's radius s (F sqrt(sum_g sq_g d_g^2 / 12) + 3 2^-17 sum_g ab_g d_g)
(fast.core.dither.dither_radius with the step d_g constant on key scale group g; sq_g, ab_g the sums of q_i^2 and |q_i|
over the group; fp64 on nonnegative terms, <= 5 D + 10 roundings, times 1 + 2^-40, one ulp up, + 2^-1000 for the
range, to fp32 rounded up) in place of the witness bound c, through the same epilogue: the dither tier's estimate
(spec A2). Anything else (v_err) goes to the torch twin.

The certificate: the same forms, from the same fast.core.certify.forms_from_pmz, as the twin.
Re-derived here is only how Z, P = sum w expm1(c), M = sum w (1 - e^-c) are bounded: the kernel
does not evaluate expm1 per term; it returns fp64 sums Z = sum w, S1 = sum w c^, S2 = sum w c^2
(w the fp32 weights, c^ the fp32 witness bounds), and with cm >= max_j c_j:
  (P1) expm1(c) <= c + c^2 (1/2 + cm e^cm / 6)   (Taylor remainder sum_{k>=3} c^k/k! <= c^3 e^c / 6, c <= cm),
  (P2) expm1(c) <= c expm1(cm) / cm              (expm1(c)/c is nondecreasing),
  (M1) 1 - e^-c <= g(c) = c - c^2 (1/2 - cm/6)   (e^-c >= 1 - c + c^2/2 - c^3/6, c^3 <= cm c^2), and g is
       increasing on [0, cm] for every cm (g' >= 1 - c + c cm/3 > 0 since cm - cm^2/3 < 1), so an upper
       bound of c may be put in; (M2) 1 - e^-c <= c; (M3) sum w (1 - e^-c) <= sum w = Z.
So, with A1 >= sum w c and A2 >= sum w c^2 (upper bounds) and A2lo <= sum w c^2 (lower bound),
  P <= min(A1 + A2 (1/2 + cm e^cm / 6), A1 expm1(cm) / cm),
  M <= min(A1 - A2lo (1/2 - cm/6) [when 1/2 - cm/6 > 0], A1, Z (1 + 2 gamma_{N+1})),
all evaluated in fp64 and rounded outward (below). (M1 with an upper bound f c^ of c: g increasing.)
These bound the sums of the computed weights w over the exact witness bounds c; forms_from_pmz
then adds, unchanged, its margin for w against the exact e^{x - m} and for the logit rounding e.
The looseness against the twin's per-term expm1 is relative O(cm^2) (P1, M1): ~1e-3 at cm = 0.1.

Floating point (math.md T8, matching csrc/cpu_fused.cpp line by line).
- Logits: k~ = code x scale is exact in fp32 (8-bit code, or int4's nibble - 8 in [-7, 7], times an 11-bit
  fp16 scale: the twin's dequantize, bit for bit), so x = fl(fl(q . k~) s)
  with the D-term dot product in 8 fma lanes and a fixed tree: gamma_D (any order), one rounding for
  s: within gamma_{D+1} of s sum_i |q_i| |k~_i|, inside the twin's e = s (D + 4) u32 (1.01)
  sum_i |q_i| kmax_i (fast.core.certify.logit_rounding), which the kernel evaluates the same way in
  fp64 (last product one ulp up, plus T8e's absolute term (2.03 D s + 1) 2^-150 for subnormal products) with kmax_i = max(cmax (1 + 2^-23) x the largest fp16 scale of
  channel i over the codes, the largest |k_i| of the fp32 rows), cmax = 127 (int8) or 7 (int4, quant.CODE_MAX):
  the bound QTensor.max_abs uses. A packed int4 byte with a 0 nibble (code -8: no code quantize writes, and
  |k~| = 8 scale would break cmax = 7) decodes to NaN: the logit flag (keys) or the output flag (values) refuses it.
- Weights: w = kv_exp(fl(x - m)), m the max over the readable tokens of the row (one max for all
  chunks). kv_exp (Cody-Waite + degree-7 Taylor, fma) is checked EXHAUSTIVELY against fp64 exp on
  every fp32 input in [-104, 0] (exp_check(), run by tests/test_cpu_fused.py): relative error
  <= EXP32_EPS = 8 u32 where e^x >= 2^-126, absolute <= 2^-126 below (0 under -87.3365): the error
  model forms_from_pmz assumes for torch.exp. Measured here: 1.32 u32 (exp_check()).
- kappa_b >= s ||q_b|| in the kernel, as fast.core.certify.band_norms_up: squares exact in fp64, the
  W-term sum and the sqrt within gamma_{W+4} (u64), times 1 + 2 gamma_{W+4}, one ulp up; times s, one
  ulp up; at least 2^-60; cast to fp32 rounded up. AVX2 computes four bands per register with the same
  operations per lane (csrc: kappa_rows; kvcert_kappa is tested bit for bit against the scalar build and
  against the exact band norm, since the fp32 rounding up would hide a lost ulp from the stats).
- c^_j = fl(sum_b kappa_b rho_jb) by fma in band order, nonnegative terms, no underflow (kappa >= 2^-60,
  nonzero rho >= 2^-64 enforced; log codes are >= 2^-20): the exact sum of the fp32 arguments is
  <= c^ / (1 - u32)^NB <= f c^, f = 1 + 2 NB u32; so the exact witness bound
  c_j = s sum_b ||q_b|| rho_jb <= f c^_j, and cm = f max_j c^_j (rounded up) >= max_j c_j.
- Sums (fp64, any tree): w c^ one rounding, w c^ c^ two, N terms: sum w c^ <= S1 (1 + 2 gamma_{N+1}),
  sum w c^^2 in [S2 (1 - 2 gamma_{N+2}), S2 (1 + 2 gamma_{N+2})] (u64). A1 = f S1 (1 + 2 gamma_{N+1}),
  A2 = f^2 S2 (1 + 2 gamma_{N+2}), A2lo = f^2 S2 (1 - 2 gamma_{N+2}) (M1 at f c^ subtracts
  f^2 (1/2 - cm/6) sum w c^^2: a lower bound there). The fp64 evaluation: a handful of correctly
  rounded operations on nonnegative numbers and one subtraction (M1), whose subtrahend is at most
  max_cm (cm/2 - cm^2/6) = 0.375 of the minuend: each result is multiplied by 1 + 2^-40 and moved one
  ulp up (the subtrahend's coefficient rounded down), far above the <= 12 roundings of u64 involved.
- Z = sum w exactly as the twin forms it (fp32 terms, fp64 sum): forms_from_pmz's own margins apply.
- Output (not certified; T5 is separate): fp32 accumulation of w v~ per chunk, chunks summed in a fixed
  order, divided by fl32(Z): within ~1e-6 relative of the twin (tests: assert_close rtol 2e-5).
The epilogue (these sums -> P, M bounds -> forms_from_pmz at fp32 terms) runs in C++ (csrc: epilogue):
the numpy code's fp64 operations in the same order (_certificate_numpy is the readable statement and the
fallback; tests/test_cpu_fused.py checks they agree within one fp32 ulp, the room expm1's library leaves).
Rows with a large cm (forms_from_pmz refuses fp32 terms: max c_eff > CMAX32) are recomputed by
the twin. NaN/Inf in q, keys or scales: the kernel's logit flag -> ValueError; in values: its
output flag -> ValueError (attention_rows also runs the twin's input checks first).
"""

import ctypes
import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from fast.core import _checks
from fast.core.certify import CERT_KEYS, CMAX32, EXP32_EPS, EXP_EPS, T_CUT, TINY, U32, U64, _up, forms_from_pmz, gamma
from fast.core.native import (FLAGS, SANITIZE, SRC, _Args, _EpiConst, _lib, _Seg, available, build,  # noqa: F401
                              dither_noise, sanitized)
from fast.core.quant import QTensor
from fast.core.threads import read_threads
from fast.core.witness import log_table32, pack_witness, witness

CHUNK = 512      # at most this many tokens per work item (pass 1 and 2 split the cache into (b, kv head, chunk)
#                  items of equal size, a multiple of 8: see _chunk)
FUSED_SCHEMES = ("int8", "int4")  # QTensor codecs the kernel reads in place (keys and values of one scheme)
FP8_SCHEMES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_e5m2_rtz")  # fp8 QTensors it reads in place (fp8_parts)
DITHER_SCHEMES = ("int8_dither", "int4_dither")  # dithered QTensors it reads in place (dither_parts)
KAPPA_MIN = 2.0 ** -60
RHO_MIN = 2.0 ** -64


def exp_check(lo=-104.0, threads=None):
    """Exhaustive check of the kernel's exp on every fp32 x in [lo, 0]: (largest relative error in
    units of u32 = 2^-24 where e^x >= 2^-126, largest absolute error where e^x < 2^-126)."""
    ab = ctypes.c_double()
    rel = _lib().kvcert_exp_check(lo, ctypes.byref(ab), threads or torch.get_num_threads())
    return rel, ab.value


def lut_is_grid(lut):
    """True when the witness log table [256] fp32 has one of the power-grid forms the AVX2 path decodes in registers
    (csrc: lut_grid; 8 codes per octave, the coarse table, or 16, the fine one); else the kernel gathers from the table
    (same bits)."""
    lut = lut.to(torch.float32).contiguous()
    return bool(_lib().kvcert_lut_is_grid(lut.data_ptr()))


def exp_one(x):
    return _lib().kvcert_exp_one(float(x))


# ---- the certificate epilogue ----

def _sums_to_pmz(stats, NB, N):
    """[3, R, H] fp64 (Z, P up, M up) and cm [R, H] fp64 from the kernel stats [R, H, 4] (module doc)."""
    z, s1, s2, cmc = (stats[..., i] for i in range(4))
    f = 1 + 2 * NB * U32
    g1, g2 = 2 * gamma(N + 1), 2 * gamma(N + 2)
    up = 1 + 2.0 ** -40
    cm = _up(_up(cmc * f) * up)
    a1 = _up(s1 * f * (1 + g1) * up)
    a2 = _up(s2 * f * f * (1 + g2) * up)
    a2lo = np.nextafter(s2 * f * f * (1 - g2) / up, -np.inf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        em = np.expm1(np.minimum(cm, 700.0)) * (1 + 8 * U64)
        p1 = _up((a1 + a2 * (0.5 + cm * (em + 1) / 6)) * up)
        p2 = np.where(cm > 0, _up(a1 * _up(em / cm) * up), 0.0)
        p = np.minimum(p1, p2)
        coef = (0.5 - cm / 6) / up - 2.0 ** -50  # rounded down
        m1 = np.where(coef > 0, _up((a1 - a2lo * np.maximum(coef, 0.0)) * up), a1)
        m = np.minimum(np.minimum(m1, a1), _up(z * (1 + g1) * up))
    p = np.where(np.isfinite(p), p, np.inf)
    return np.stack([z, p, m]), cm


def _run(q, qpos, segs, s, bands, ngk, ngv, certify, lut=None, scalar=False, out=None, dither_F=None, value=None, hist=None):
    """Call the kernel. q [B, T, H, D] fp32 contiguous; qpos [B, T] int32; segs: two results of seg();
    bands [NB, W] int64 contiguous. Returns out [B, T, H, D] fp32 (written into `out` when given: fp32,
    contiguous, that shape), stats [B, T, H, 5] fp64 (Z, S1, S2, max c^, e). NaN/Inf: ValueError.
    dither_F (segment 0 dithered, certify): F >= sqrt(2 ln(2 n / d)) (fast.core.dither.radius_factor); then a third
    result, dstats [B, T, H, 5]: the same five numbers with each token's dither radius in place of c^ (csrc:
    dither_sums), for _certificate: the dither tier's estimate (fast.core.dither, spec A2).
    value (certify): the centre [B, Hkv, D] fp32 of the value witness's radii (None: 0); then a last result, the output
    bound's sums (csrc Args.vstats: segment 0's v_err, seg()): vstats [B, T, H, 3] fp64 (sum_j w_j e_j, max e_j,
    max r_j >= ||v~_j - centre||, over each row's tokens) and vmax [B, Hkv, D] fp32 (max |v~| per channel), for
    fast.core.attention.output_error_from_sums.
    hist (certify): an fp64 contiguous [B, T, H, 3 M] tensor (1 <= M <= HIST_K; box.HIST_M the default) the kernel
    fills with each row's histogram of c^ over the tokens it reads (csrc: hist_chunk, hist_emit; its occupied bins
    first: largest c^, sum of w, count; more than M occupied: neighbours merged until they fit; fast.core.box.hist_box
    turns it into the box form). hist_run: the same read in blocks of positions (bounded scratch)."""
    B, T, H, D, NB = _checked_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut)
    if dither_F is not None:
        if not (certify and segs[0]["c"].n and segs[0]["c"].dith):
            raise ValueError("dither_F: for a certified read whose segment 0 holds dithered codes")
        if isinstance(dither_F, bool) or not isinstance(dither_F, (int, float)) or not (math.isfinite(dither_F) and dither_F >= 1):
            raise ValueError(f"dither_F: a finite number >= 1 (radius_factor), got {dither_F!r}")
    W = bands.shape[1]
    if out is None:
        out = torch.empty(B, T, H, D, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out: fp32 contiguous {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    stats = torch.empty(B, T, H, 5, dtype=torch.float64)
    kmax, nan = _scratch(segs[0]["Hkv"] * B * 2 * D)
    a = _Args(B, T, H, segs[0]["Hkv"], D, NB, ngk, ngv, s, s, q.data_ptr(), qpos.data_ptr(), bands.data_ptr(), W,
              _band_margin(W), (D + 4) * U32 * 1.01, 0 if lut is None else lut.data_ptr())
    a.seg[0], a.seg[1] = segs[0]["c"], segs[1]["c"]
    a.out, a.stats, a.kmax, a.nanflag = out.data_ptr(), stats.data_ptr(), ctypes.addressof(kmax), ctypes.addressof(nan)
    a.certify, a.threads, a.chunk = int(certify), read_threads(), int(_chunk(segs[0]["c"].n + segs[1]["c"].n))
    dstats = None
    if dither_F is not None:
        dstats = torch.empty(B, T, H, 5, dtype=torch.float64)
        a.dF, a.dstats = float(dither_F), dstats.data_ptr()
    if hist is not None:
        from fast.core.box import HIST_K
        if not certify:
            raise ValueError("hist: the box form's histogram is for a certified read")
        shape = tuple(getattr(hist, "shape", ()))
        if not (isinstance(hist, torch.Tensor) and hist.dtype == torch.float64 and shape[:3] == (B, T, H) and len(shape) == 4
                and shape[3] % 3 == 0 and 3 <= shape[3] <= 3 * HIST_K and hist.is_contiguous() and hist.is_cpu):
            raise ValueError(f"hist: fp64 contiguous CPU {(B, T, H)} + (3 M,), 1 <= M <= {HIST_K}, got "
                             f"{getattr(hist, 'dtype', hist)} {shape}")
        a.hist, a.hist_m = hist.data_ptr(), shape[3] // 3
    vres = None
    if value is not None:
        if not certify:
            raise ValueError("value: the output bound's sums are for a certified read")
        Hkv = segs[0]["Hkv"]
        vstats = torch.empty(B, T, H, 3, dtype=torch.float64)
        vmax = torch.empty(B, Hkv, D, dtype=torch.float32)
        a.vstats, a.vmax, a.v_margin = vstats.data_ptr(), vmax.data_ptr(), _band_margin(D) * (1 + 2.0 ** -50)
        if isinstance(value, torch.Tensor):
            _check_block("value", value, (torch.float32,), (B, Hkv, D))
            if not value.is_contiguous() or not bool(torch.isfinite(value).all()):
                raise ValueError("value: a contiguous, finite fp32 [B, Hkv, D] centre")
            a.vctr = value.data_ptr()
        elif value != 0:
            raise ValueError("value: the centre, an fp32 [B, Hkv, D] tensor, or 0")
        vres = (vstats, vmax)
    _lib(scalar).kvcert_fused_run(ctypes.byref(a))
    nan_k, nan_v = nan[0], nan[1]
    if not math.isfinite(nan_k):
        raise ValueError("k or q: non-finite logits (NaN/Inf in q, the key cache or its scales, or logits overflow fp32)")
    if not math.isfinite(nan_v):
        raise ValueError("v: NaN/Inf in the value cache")
    res = (out, stats) if dstats is None else (out, stats, dstats)
    return res if vres is None else (*res, vres)


HIST_SCRATCH = 64 << 20  # bytes of the histogram's scratch one kernel call may take (csrc phist: 3 HIST_K fp64 per chunk, row)


def hist_run(q, qpos, segs, s, bands, ngk, ngv, lut=None, out=None, hist=None):
    """_run(certify=True, hist=hist) for one sequence (B = 1) in calls of at most hist_rows(...) positions each: the
    kernel keeps each row's histogram per chunk of keys while it reads (3 HIST_K doubles a (chunk, row): 8.5 KB, ~17
    bytes per row and key, 4x the logits), so a long prefill read in one call would take GBs; its rows are independent
    (each reads its own keys), so every row gets the bits of the read in one call. -> (out, stats) as _run."""
    B, T, H = q.shape[:3]
    Hkv, N = segs[0]["Hkv"], segs[0]["c"].n + segs[1]["c"].n
    tb = hist_rows(N, Hkv, H // Hkv)
    if B != 1 or T <= tb:
        return _run(q, qpos, segs, s, bands, ngk, ngv, True, lut, out=out, hist=hist)
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    stats = torch.empty(B, T, H, 5, dtype=torch.float64)
    for t0 in range(0, T, tb):
        t1 = min(T, t0 + tb)
        _, stats[:, t0:t1] = _run(q[:, t0:t1].contiguous(), qpos[:, t0:t1].contiguous(), segs, s, bands, ngk, ngv, True, lut,
                                  out=out[:, t0:t1], hist=None if hist is None else hist[:, t0:t1])
    return out, stats


def hist_rows(N, Hkv, G):
    """Query positions per call that keep the kernel's histogram scratch (Hkv x chunks x positions G rows x 3 HIST_K
    doubles) within HIST_SCRATCH for N keys (at least 1)."""
    from fast.core.box import HIST_K
    per = Hkv * int(-(-N // int(_chunk(N)))) * G * 3 * HIST_K * 8
    return max(1, HIST_SCRATCH // per)


_SCRATCH = threading.local()


def _scratch(n):
    """This thread's kernel scratch: kmax (n fp32, the per-channel key maxima) and the two NaN flags, kept across reads
    (the kernel writes both before reading them; a read from another thread has its own)."""
    kmax = getattr(_SCRATCH, "kmax", None)
    if kmax is None or len(kmax) < n:
        kmax = _SCRATCH.kmax = (ctypes.c_float * max(n, 1024))()
        _SCRATCH.nan = (ctypes.c_float * 2)()
    return kmax, _SCRATCH.nan


def _checked_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut):
    """_check_run, skipped when the same segment pair passed it with the same other objects (segment 1, bands at
    the same version, lut: kept referenced in segment 0's dict, so their ids cannot pass to others), the same
    shapes and arguments and q, qpos fp32 / int32 contiguous CPU tensors: a decode step's reads of one layer differ
    only in q's and qpos's contents and the segments' lengths (n >= 1 or 0 both times, so the checks that depend
    on them give the same answer). Each layer keeps its own segments, so each keeps its own entry."""
    if not (type(q) is torch.Tensor and type(qpos) is torch.Tensor and type(segs) in (list, tuple) and len(segs) == 2
            and type(segs[0]) is dict and type(segs[1]) is dict and "c" in segs[0] and "c" in segs[1]
            and type(s) is float and q.dtype is torch.float32 and qpos.dtype is torch.int32 and q.is_contiguous()
            and qpos.is_contiguous() and q.is_cpu and qpos.is_cpu and type(bands) is torch.Tensor
            and (lut is None or type(lut) is torch.Tensor)):
        return _check_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut)
    vb, vl = _checks.version(bands), 0 if lut is None else _checks.version(lut)
    if vb is None or vl is None:  # an inference tensor: its in-place writes cannot be seen, so check it all
        return _check_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut)
    key = (q.shape, qpos.shape, segs[0]["c"].n > 0, segs[1]["c"].n > 0, bool(segs[0]["c"].lens), vb, bands.shape, vl,
           None if lut is None else lut.shape, ngk, ngv, certify, s)
    plan = segs[0].get("_checked")
    if plan is not None and plan[0] is segs[1] and plan[1] is bands and plan[2] is lut and plan[3] == key:
        return plan[4]
    res = _check_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut)
    segs[0]["_checked"] = (segs[1], bands, lut, key, res)
    return res


def _check_run(q, qpos, segs, s, bands, ngk, ngv, certify, lut):
    """_run's inputs against each other (the segments are checked on their own by seg / paged_seg): every
    shape, count and index the kernel trusts. Returns B, T, H, D, NB."""
    if not (isinstance(q, torch.Tensor) and q.dtype == torch.float32 and q.dim() == 4 and q.is_contiguous()
            and q.is_cpu and min(q.shape) >= 1):
        raise ValueError(f"q: fp32 contiguous CPU [B, T, H, D], got {getattr(q, 'dtype', q)} {tuple(getattr(q, 'shape', ()))}")
    B, T, H, D = q.shape
    _check_head_dim(D)
    if len(segs) != 2 or any(not isinstance(sg, dict) or "c" not in sg for sg in segs):
        raise ValueError("segs: two results of seg() / paged_seg()")
    Hkv = segs[0]["Hkv"]
    if segs[1]["Hkv"] != Hkv or H % Hkv:
        raise ValueError(f"segs: KV heads {segs[0]['Hkv']}, {segs[1]['Hkv']} must agree and divide H = {H}")
    n0, n1 = segs[0]["c"].n, segs[1]["c"].n
    if n0 + n1 < 1:
        raise ValueError("segs: no tokens")
    for i, sg in enumerate(segs):
        if sg["c"].n and (sg["B"] != B or sg["D"] != D):
            raise ValueError(f"segment {i}: batch {sg['B']} and head size {sg['D']}, the query has {B} and {D}")
    if n1 and (segs[1]["c"].coded or segs[1]["c"].rho or segs[1]["c"].bs):
        raise ValueError("segment 1: exact fp32 rows only (read with c = 0; no codes, witness or block table)")
    if n1 and n0 and segs[0]["c"].lens:
        raise ValueError("segment 1: must be empty when segment 0 has per-sequence lengths (paged_seg(lens=...))")
    if (ngk, ngv) != (segs[0]["ng"] if n0 else (1, 1)):
        raise ValueError(f"ngk, ngv = {(ngk, ngv)}: segment 0 holds {segs[0]['ng'] if n0 else (1, 1)} scale groups")
    if not (isinstance(qpos, torch.Tensor) and qpos.dtype == torch.int32 and tuple(qpos.shape) == (B, T)
            and qpos.is_contiguous() and qpos.is_cpu):
        raise ValueError(f"qpos: int32 contiguous CPU {(B, T)}, got {getattr(qpos, 'dtype', qpos)} {tuple(getattr(qpos, 'shape', ()))}")
    if not (isinstance(bands, torch.Tensor) and bands.dtype == torch.int64 and bands.dim() == 2 and bands.is_contiguous()
            and bands.is_cpu and min(bands.shape) >= 1):
        raise ValueError("bands: int64 contiguous CPU [NB, W]")
    key = (bands.data_ptr(), _checks.version(bands), D)
    seen = _BANDS_OK.get(id(bands))
    if seen is None or seen[0] is not bands or seen[1] != key or key[1] is None:  # the index check once per bands tensor and version
        lo, hi = torch.aminmax(bands)
        if int(lo) < 0 or int(hi) >= D:
            raise ValueError(f"bands: coordinate indices must lie in [0, {D})")
        if len(_BANDS_OK) > 256:
            _BANDS_OK.clear()
        _BANDS_OK[id(bands)] = (bands, key)  # the tensor itself is kept: its id cannot pass to another
    NB = bands.shape[0]
    if certify and n0:
        if segs[0]["NB"] is None:
            raise ValueError("segment 0: certify needs its witness (rho None would be read as c = 0)")
        if segs[0]["NB"] != NB:
            raise ValueError(f"segment 0: witness of {segs[0]['NB']} bands, bands has {NB}")
        if segs[0]["c"].rho_u8 and not (isinstance(lut, torch.Tensor) and lut.dtype == torch.float32
                                        and tuple(lut.shape) == (256,) and lut.is_contiguous() and lut.is_cpu):
            raise ValueError("lut: the fp32 [256] contiguous log table (fast.core.witness._log_table) for uint8 witness codes")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
        raise ValueError(f"s: a finite real number > 0, got {s!r}")
    return B, T, H, D, NB


_BANDS_OK = {}  # id(bands) -> (bands, (data_ptr, version, D)) of a bands tensor whose indices were checked


def _chunk(N):
    """Tokens per work item: N split into ceil(N / CHUNK) chunks of equal size rounded up to a multiple of 8
    (the AVX2 blocks start at multiples of 8), so that threads get equal work (a 16-token last chunk
    beside 512-token ones left one of two threads idle a third of the time). Depends on N only: the
    result's bits do not depend on the thread count. N an int, or an int array (elementwise: paged_seg's lens)."""
    nch = np.maximum(1, -(-N // CHUNK))
    return np.maximum(8, (-(-N // nch) + 7) // 8 * 8)


_MARGIN = {}


def _band_margin(W):
    if W not in _MARGIN:
        _MARGIN[W] = 1 + 2 * gamma(W + 4)  # as fast.core.certify.band_norms_up
    return _MARGIN[W]


@functools.lru_cache(maxsize=256)
def _epi_const(NB, N, D):
    """The scalar constants of _sums_to_pmz and forms_from_pmz (fp32 terms), as those evaluate them."""
    u, eps = U32, EXP32_EPS
    return _EpiConst(1 + 2 * NB * U32, 2 * gamma(N + 1), 2 * gamma(N + 2), 1 + 2.0 ** -40, gamma(N), u, 2 * eps, 3 * u,
                     T_CUT[torch.float32], (D + 4) * U32, N * 8 * TINY[torch.float32] * math.exp(CMAX32), EXP_EPS, CMAX32, 2e-3,
                     N * TINY[torch.float32])


def _certificate(stats, NB, N, D):
    """The fp32 certificate dict [B, T, H] from the kernel stats [B, T, H, 5]
    (fast.core.certify.forms_from_pmz), or None when a row needs the twin's fp64 terms (a large witness, or a
    NaN sum: w = 0 times a c that overflowed fp32 at a token the row does not read). In C++
    (csrc: epilogue, the numpy code's operations in its order; tests/test_cpu_fused.py compares them),
    else _certificate_numpy."""
    try:
        lib = _lib()
    except (OSError, RuntimeError):
        return _certificate_numpy(stats, NB, N, D)
    B, T, H, _ = stats.shape
    st = stats.contiguous()
    out = torch.empty(len(CERT_KEYS), B * T * H, dtype=torch.float32)
    if not lib.kvcert_epilogue(st.data_ptr(), B * T * H, ctypes.byref(_epi_const(NB, N, D)), out.data_ptr()):
        return None
    return {key: val.view(B, T, H) for key, val in zip(CERT_KEYS, out.unbind(0))}


def _certificate_numpy(stats, NB, N, D):
    """_certificate in numpy: the readable statement of the epilogue (and the fallback)."""
    B, T, H, _ = stats.shape
    st = stats.numpy().reshape(B * T, H, 5)
    if np.isnan(st).any():  # 0 * inf in a sum (an unread token whose c overflowed fp32): the twin's fp64 terms
        return None
    e = st[..., 4]
    sums, cm = _sums_to_pmz(st[..., :4], NB, N)
    if float(cm.max()) + 2 * float(e.max()) >= CMAX32:
        return None
    cert = forms_from_pmz(torch.from_numpy(sums), torch.from_numpy(cm), e, N, D, torch.float32)
    if cert is None:
        return None
    return {key: val.view(B, T, H) for key, val in cert.items()}


# ---- segments ----

def _strides(t, name):
    """(base, b-stride, h-stride) in elements for t [B, Hkv, N, ...] with each (b, h) block contiguous."""
    shape, st = t.shape, t.stride()
    want = 1
    for i in range(t.dim() - 1, 1, -1):  # the [N, ...] block: row-major strides (size-1 dims are free)
        if shape[i] > 1 and st[i] != want:
            raise ValueError(f"{name}: each [N, ...] block must be contiguous")
        want *= shape[i]
    return t.data_ptr(), st[0] if shape[0] > 1 else 0, st[1] if shape[1] > 1 else 0


def _check_block(name, t, dtypes, shape, bcast=False):
    """t: a CPU tensor of one of dtypes with exactly `shape` (None: any size >= 1; bcast: size 1 allowed in the
    first two dims, read with stride 0) whose [N, ...] blocks are contiguous: what the kernel indexes blindly."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or t.device.type != "cpu":
        raise ValueError(f"{name}: a CPU tensor of {[str(d) for d in dtypes]}, got {t.dtype} on {t.device}")
    ok = t.dim() == len(shape) and all(
        (x == w if w is not None else x >= 1) or (bcast and i < 2 and x == 1) for i, (x, w) in enumerate(zip(t.shape, shape)))
    if not ok:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape} (None: any size >= 1)")
    return _strides(t, name)


def _check_head_dim(D):
    if D < 8 or D % 8 or D > 512:
        raise ValueError(f"head size D = {D}: the kernel needs a multiple of 8 in [8, 512]")


@dataclass(frozen=True)
class Dither:
    """The dither counters of a segment's subtractively dithered codes (int8_dither, int4_dither QTensors: their seed,
    layer and token_start; keys stream 0, values stream 1, batch row b and KV head h of the segment): the kernel
    regenerates u at read (csrc: dither_u) and decodes x~ = fl((code - u) scale), fast.core.quant.dequantize's bits."""
    seed: int
    layer: int
    token_start: int = 0


@functools.lru_cache(maxsize=1024)
def _dither_keys(seed, layer, B, Hkv):
    """uint32 words as int32 [B, Hkv, 2 streams, 2]: the Philox key of each (layer, row, head, stream), the first stage
    of fast.core.quant._block_words (csrc: dither_row reads them; read-only)."""
    from fast.core.quant import MASK, philox4x32_10
    b, h, st = torch.meshgrid(torch.arange(B), torch.arange(Hkv), torch.arange(2), indexing="ij")
    k0, k1, _, _ = philox4x32_10(layer, b, h, st, seed & MASK, seed >> 32)
    return torch.stack([k0, k1], -1).to(torch.int64).to(torch.int32).contiguous()


def _set_dither(c, keep, B, Hkv, n, D, dither):
    from fast.core.quant import check_dither_counters
    if not isinstance(dither, Dither):
        raise ValueError(f"dither: a cpu_fused.Dither, got {type(dither).__name__}")
    if not c.coded:
        raise ValueError("dither: dithered int8 or packed int4 codes with their fp16 scales")
    check_dither_counters(dither.seed, dither.layer, 0, B, Hkv, dither.token_start, n, D)
    keys = _dither_keys(dither.seed, dither.layer, B, Hkv)
    c.dith, c.dkey, c.dk_sb, c.dk_sh, c.dtok0 = 1, keys.data_ptr(), Hkv * 4, 4, dither.token_start
    keep["dkey"] = keys


def seg(Hkv, n, *, k=None, v=None, k_scales=None, v_scales=None, rho=None, valid=None, exact=None, pos=None,
        k_asym=None, v_asym=None, fp8=None, dither=None, v_err=None):
    """One kernel segment: keys/values int8 codes [B, Hkv, N, D], packed int4 codes (uint8 [B, Hkv, N, D / 2],
    fast.core.quant's layout: channel d in byte d // 2, low nibble = even channel, code = nibble - 8), each with
    fp16 scales [.., N, ng], ng dividing D (int16 views of them accepted), fp16 rows (no scales: a registered
    scheme's stored output, decoded exactly at read) or fp32 rows [B, Hkv, N, D]; rho [B, Hkv, N, NB] uint8 log codes or fp32 (None: c = 0,
    exact tokens); valid / exact uint8 or bool [B, Hkv, N] (size 1 or stride 0 broadcasts in B, Hkv); pos
    int32 [B, Hkv, N] (None: storage index). Every shape, dtype, stride and count the kernel trusts is
    checked here (ValueError); _run checks the segments against the query. Tensors are kept alive by the
    returned dict.
    Asymmetric codes (x~ = code * scale + zero, the twin's fp32 operations): k_asym = AsymKeys(...) (codes per
    channel over blocks of tokens: fast.core.schemes KiviKeys, fast.core.prerope PreRopeKeys, rotated at read), and
    v_asym = AsymValues(...) (per token groups: KiviValues); k / v and k_scales / v_scales are then taken from them.
    fp8 codes: fp8 = Fp8Read(...) with k / v the codes (float8 or their uint8 bytes [B, Hkv, N, D]) and k_scales / v_scales
    both fp32 [B, Hkv, N, 1] (one scale per token) or both None (Fp8Read.scale): fp8_parts(qt) builds them from a QTensor.
    Dithered int8 / int4 codes: dither = Dither(seed, layer, token_start) beside k / v and their scales (the QTensors'
    counters; dither_parts(qt) builds them); dithered 2-bit asymmetric codes (kivi2_dither): dither beside k_asym (2 bits,
    no rope) and v_asym, x~ = fl(fl((code - u) scale) + zero).
    v_err: fp32 [B, Hkv, N] >= ||v_j - v~_j|| (the value witness, math.md T5; 0 at tokens flagged exact), read by
    _run(value=...) for the output bound's sums."""
    keep = _seg(Hkv, n, k, v, k_scales, v_scales, rho, valid, exact, pos, k_asym, v_asym, fp8, dither)
    if v_err is not None and n:
        _check_block("v_err", v_err, (torch.float32,), (keep["B"], Hkv, n))
        _checks.nonneg_finite("v_err", v_err)
        _set(keep["c"], keep, "verr", "ve", v_err, (torch.float32,), (keep["B"], Hkv, n))
    return keep


def _seg(Hkv, n, k, v, k_scales, v_scales, rho, valid, exact, pos, k_asym, v_asym, fp8, dither):
    if isinstance(Hkv, bool) or not isinstance(Hkv, int) or Hkv < 1 or isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"seg: Hkv >= 1 and n >= 0 integers, got {Hkv!r}, {n!r}")
    c = _Seg()
    c.n = n
    keep = {"Hkv": Hkv, "c": c}
    if n == 0:
        return keep
    if dither is not None and (fp8 is not None or (k_asym is None) != (v_asym is None)
                               or (isinstance(k_asym, AsymKeys) and (k_asym.bits != 2 or k_asym.rope is not None))):
        raise ValueError("dither: symmetric int8 / int4 codes, or 2-bit asymmetric keys and values without rotation "
                         "(kivi2_dither); not fp8 codes")
    if fp8 is not None:
        return _fp8_seg(Hkv, n, c, keep, k, v, k_scales, v_scales, fp8, rho, valid, exact, pos)
    if k_asym is not None or v_asym is not None:
        keep = _asym_seg(Hkv, n, c, keep, k, v, k_scales, v_scales, k_asym, v_asym, rho, valid, exact, pos)
        if dither is not None:
            _set_dither(c, keep, keep["B"], Hkv, n, keep["D"], dither)
        return keep
    if k is None or v is None:
        raise ValueError("seg: keys and values are required for n > 0")
    B, W = (k.shape[0], k.shape[3]) if isinstance(k, torch.Tensor) and k.dim() == 4 else (0, 0)
    packed = isinstance(k, torch.Tensor) and k.dtype == torch.uint8  # int4: two codes per byte, [.., N, D / 2]
    D = 2 * W if packed else W
    for name, t in (("k", k), ("v", v)):
        _set(c, keep, name, name, t, (torch.int8, torch.uint8, torch.float32, torch.float16), (B, Hkv, n, W))
    _check_head_dim(D)
    if k.dtype != v.dtype:
        raise ValueError("k and v: both int8 codes, both packed int4 codes (uint8 [.., N, D / 2]), both fp16 rows or "
                         "both fp32 rows")
    half = k.dtype == torch.float16  # fp16 rows (a registered scheme's stored output): decoded exactly at read
    if dither is not None and k.dtype in (torch.float16, torch.float32):
        raise ValueError("dither: symmetric int8 / int4 codes (fp16 and fp32 rows carry no dither)")
    c.coded, c.int4, c.f16 = int(k.dtype != torch.float32), int(packed), int(half)
    ng = [1, 1]
    if c.coded and not half:
        for i, (name, t) in enumerate((("k_scales", k_scales), ("v_scales", v_scales))):
            if t is None:
                raise ValueError(f"{name}: integer codes need their fp16 scales")
            _check_block(name, t, (torch.float16, torch.int16), (B, Hkv, n, None))
            ng[i] = t.shape[-1]
            if D % ng[i]:
                raise ValueError(f"{name}: {ng[i]} groups do not divide the head size {D}")
        k_scales, v_scales = k_scales.view(torch.int16), v_scales.view(torch.int16)
    elif k_scales is not None or v_scales is not None:
        raise ValueError("k_scales / v_scales: only for integer codes (not fp16 or fp32 rows)")
    keep["B"], keep["D"], keep["ng"] = B, D, tuple(ng)
    for name, t in (("ks", k_scales), ("vs", v_scales)):
        if t is not None:
            _set(c, keep, name, name, t, (torch.int16,), (B, Hkv, n, None))
    if dither is not None:
        _set_dither(c, keep, B, Hkv, n, D, dither)
    return _witness_and_flags(c, keep, B, Hkv, n, rho, valid, exact, pos)


def _set(c, keep, name, field, t, dtypes, shape, bcast=False):
    """Check t (_check_block) and point the segment's pointer `name` and its b / h strides `field`_sb / _sh at it."""
    p, sb, sh = _check_block(name, t, dtypes, shape, bcast)
    setattr(c, name, p)
    setattr(c, f"{field}_sb", sb)
    setattr(c, f"{field}_sh", sh)
    keep[name] = t


def _witness_and_flags(c, keep, B, Hkv, n, rho, valid, exact, pos):
    checks = {"rho": ((torch.uint8, torch.float32), (B, Hkv, n, None), False, "r"),
              "valid": ((torch.uint8, torch.bool), (B, Hkv, n), True, "va"),
              "exact": ((torch.uint8, torch.bool), (B, Hkv, n), True, "ex"), "pos": ((torch.int32,), (B, Hkv, n), True, "p")}
    for name, t in (("rho", rho), ("valid", valid), ("exact", exact), ("pos", pos)):
        if t is not None:
            dtypes, shape, bcast, field = checks[name]
            _set(c, keep, name, field, t, dtypes, shape, bcast)
    if rho is not None:
        c.rho_u8 = int(rho.dtype == torch.uint8)
    keep["NB"] = None if rho is None else rho.shape[-1]
    return keep


@dataclass(frozen=True)
class Fp8Read:
    """How a segment's fp8 codes decode (csrc: fp8_row): x~ = fl(fl(fl(value(code) pre) s) post) in fp32, value(code)
    the byte read as `dtype` (exact), s the token's fp32 scale (seg's k_scales / v_scales) or `scale` without them:
    fast.core.quant.dequantize's operations in its order (fp8_parts)."""
    dtype: torch.dtype
    scale: float = 1.0
    pre: float = 1.0
    post: float = 1.0


_FP8_TABLES = {}


def _fp8_table(dtype):
    """fp32 [256]: the value of every byte read as `dtype` (NaN codes NaN)."""
    if dtype not in _FP8_TABLES:
        _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32).contiguous()
    return _FP8_TABLES[dtype]


def fp8_parts(k, v):
    """seg()'s fp8 arguments (k, v, k_scales, v_scales, fp8) for keys and values stored as fp8 QTensors of one
    scheme: round-to-nearest casts with their per-token fp32 scales (or none), or vLLM's round-toward-zero casts
    (uint8 bytes, one per-tensor scale each; e4m3 decodes as c 2^-120 s 2^120). The two streams' tensor scales
    must agree (one Fp8Read per segment)."""
    from fast.core.quant import FP8, RTZ
    if not (isinstance(k, QTensor) and isinstance(v, QTensor) and k.scheme == v.scheme and k.scheme in {**FP8, **RTZ}):
        raise ValueError("fp8_parts: keys and values must be fp8 QTensors of one scheme")
    if k.scheme in RTZ:
        if k.tensor_scale != v.tensor_scale:
            raise ValueError(f"fp8_parts: key and value tensor scales differ ({k.tensor_scale} vs {v.tensor_scale})")
        pre, post = (2.0 ** -120, 2.0 ** 120) if k.scheme == "fp8_e4m3_rtz" else (1.0, 1.0)
        return dict(k=k.codes, v=v.codes, k_scales=None, v_scales=None,
                    fp8=Fp8Read(RTZ[k.scheme][0], float(k.tensor_scale), pre, post))
    return dict(k=k.codes, v=v.codes, k_scales=k.scales, v_scales=v.scales, fp8=Fp8Read(FP8[k.scheme][0]))


def dither_parts(k, v):
    """seg()'s arguments (k, v, k_scales, v_scales, dither) for keys and values stored as dithered QTensors of one scheme
    (int8_dither, int4_dither) with one seed, layer and token_start, keys from stream 0 and values from stream 1 (the
    streams the kernel regenerates)."""
    if not (isinstance(k, QTensor) and isinstance(v, QTensor) and k.scheme == v.scheme and k.scheme in DITHER_SCHEMES):
        raise ValueError("dither_parts: keys and values must be dithered QTensors of one scheme (int8_dither, int4_dither)")
    if (k.seed, k.layer, k.token_start) != (v.seed, v.layer, v.token_start) or (k.stream, v.stream) != (0, 1):
        raise ValueError(f"dither_parts: keys (seed, layer, token_start, stream) {(k.seed, k.layer, k.token_start, k.stream)} and "
                         f"values {(v.seed, v.layer, v.token_start, v.stream)}: one seed, layer and start, streams 0 and 1")
    return dict(k=k.codes, v=v.codes, k_scales=k.scales, v_scales=v.scales, dither=Dither(int(k.seed), int(k.layer), int(k.token_start)))


def _check_fp8_read(f8):
    if not isinstance(f8, Fp8Read) or f8.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("fp8: an Fp8Read of torch.float8_e4m3fn or torch.float8_e5m2")
    for name, x in (("scale", f8.scale), ("pre", f8.pre), ("post", f8.post)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0) \
                or float(torch.tensor(x, dtype=torch.float32)) != x:
            raise ValueError(f"fp8.{name} = {x!r}: a positive number fp32 holds exactly")


def _fp8_seg(Hkv, n, c, keep, k, v, k_scales, v_scales, f8, rho, valid, exact, pos):
    _check_fp8_read(f8)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k, v)):
        raise ValueError("fp8: k and v must be code tensors [B, Hkv, N, D]")
    B, D = k.shape[0], k.shape[3]
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (f8.dtype, torch.uint8):
            raise ValueError(f"{name}: fp8 codes must be {f8.dtype} or their uint8 bytes, got {t.dtype}")
        _set(c, keep, name, name, t.view(torch.uint8), (torch.uint8,), (B, Hkv, n, D))
    _check_head_dim(D)
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales / v_scales: both fp32 [B, Hkv, N, 1] or both None")
    if k_scales is not None:
        _set(c, keep, "ks8", "ks", k_scales, (torch.float32,), (B, Hkv, n, 1))
        _set(c, keep, "vs8", "vs", v_scales, (torch.float32,), (B, Hkv, n, 1))
    table = _fp8_table(f8.dtype)
    keep["f8lut"] = table
    c.coded, c.fp8, c.f8lut = 1, 1, table.data_ptr()
    c.f8scale, c.f8pre, c.f8post = f8.scale, f8.pre, f8.post
    keep["B"], keep["D"], keep["ng"] = B, D, (1, 1)
    return _witness_and_flags(c, keep, B, Hkv, n, rho, valid, exact, pos)


@dataclass(frozen=True)
class AsymKeys:
    """Keys as asymmetric codes per channel over blocks of `block` tokens: codes uint8 [B, Hkv, N, D bits / 8]
    (channel d at bits (d bits) % 8 of byte d bits // 8: fast.core.schemes._pack2, fast.core.prerope._pack4),
    scales / zeros fp16 [B, Hkv, N / block, D]; k~ = fl(code scale + zero), then, with rope = (cos, sin, pos0)
    (fp32 [max_pos, D / 2]), rotated to position pos0 + j as fast.core.prerope._rotate."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    block: int
    rope: tuple = None


@dataclass(frozen=True)
class AsymValues:
    """Values as asymmetric codes per token in ng groups of channels: codes uint8 [B, Hkv, N, D bits / 8],
    scales / zeros fp16 [B, Hkv, N, ng] (fast.core.schemes KiviValues: bits 2)."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int


def _asym_seg(Hkv, n, c, keep, k, v, k_scales, v_scales, ka, va, rho, valid, exact, pos):
    """seg() with asymmetric keys (AsymKeys) and asymmetric (AsymValues) or int8 values."""
    if not isinstance(ka, AsymKeys) or (va is not None and not isinstance(va, AsymValues)):
        raise ValueError("k_asym: an AsymKeys (asymmetric values go with asymmetric keys), v_asym: an AsymValues or None")
    if k is not None or k_scales is not None or (va is not None and (v is not None or v_scales is not None)):
        raise ValueError("seg: give asymmetric keys (values) through k_asym (v_asym) only")
    if ka.bits not in (2, 4, 8) or (va is not None and va.bits != 2):
        raise ValueError(f"asymmetric codes: keys of 2, 4 or 8 bits, values of 2 bits, got {ka.bits}, {va and va.bits}")
    kc = ka.codes
    if not (isinstance(kc, torch.Tensor) and kc.dim() == 4 and kc.dtype == torch.uint8):
        raise ValueError(f"k_asym.codes: uint8 [B, Hkv, N, D bits / 8], got {getattr(kc, 'dtype', kc)}")
    B, D = kc.shape[0], kc.shape[3] * 8 // ka.bits
    _check_head_dim(D)
    blk = ka.block
    if isinstance(blk, bool) or not isinstance(blk, int) or blk < 1 or n % blk:
        raise ValueError(f"k_asym.block: a positive integer dividing the {n} tokens, got {blk!r}")
    _set(c, keep, "k", "k", kc, (torch.uint8,), (B, Hkv, n, D * ka.bits // 8))
    for name, field, t in (("ks", "ks", ka.scales), ("kz", "kz", ka.zeros)):
        _set(c, keep, name, field, t.view(torch.int16) if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t,
             (torch.int16,), (B, Hkv, n // blk, D))
    c.kasym, c.kblk = ka.bits, blk
    if ka.rope is not None:
        cos, sin, pos0 = ka.rope
        for name, t in (("cos", cos), ("sin", sin)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == D // 2
                    and t.is_contiguous() and t.device.type == "cpu"):
                raise ValueError(f"k_asym.rope {name}: fp32 contiguous CPU [max_pos, {D // 2}]")
        if cos.shape != sin.shape or isinstance(pos0, bool) or not isinstance(pos0, int) or pos0 < 0 or pos0 + n > cos.shape[0]:
            raise ValueError(f"k_asym.rope: positions {pos0!r} .. {pos0!r} + {n} must lie in the tables ({cos.shape[0]} rows)")
        c.rcos, c.rsin, c.rpos0 = cos.data_ptr(), sin.data_ptr(), pos0
        keep["rope"] = (cos, sin)
    ng = [1, 1]
    if va is not None:
        _set(c, keep, "v", "v", va.codes, (torch.uint8,), (B, Hkv, n, D * va.bits // 8))
        sc = va.scales
        ng[1] = sc.shape[-1] if isinstance(sc, torch.Tensor) and sc.dim() == 4 else 0
        if ng[1] < 1 or D % ng[1]:
            raise ValueError(f"v_asym.scales: fp16 [B, Hkv, N, ng], ng dividing D = {D}")
        for name, field, t in (("vs", "vs", va.scales), ("vz", "vz", va.zeros)):
            _set(c, keep, name, field, t.view(torch.int16) if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t,
                 (torch.int16,), (B, Hkv, n, ng[1]))
        c.vasym = va.bits
    else:  # int8 codes per token (prerope's values)
        if not isinstance(v, torch.Tensor) or v.dtype != torch.int8:
            raise ValueError("v: int8 codes [B, Hkv, N, D] beside asymmetric keys (or v_asym)")
        _set(c, keep, "v", "v", v, (torch.int8,), (B, Hkv, n, D))
        if v_scales is None:
            raise ValueError("v_scales: integer codes need their fp16 scales")
        _check_block("v_scales", v_scales, (torch.float16, torch.int16), (B, Hkv, n, None))
        ng[1] = v_scales.shape[-1]
        if D % ng[1]:
            raise ValueError(f"v_scales: {ng[1]} groups do not divide the head size {D}")
        _set(c, keep, "vs", "vs", v_scales.view(torch.int16), (torch.int16,), (B, Hkv, n, None))
    c.coded = 1
    keep["B"], keep["D"], keep["ng"] = B, D, tuple(ng)
    return _witness_and_flags(c, keep, B, Hkv, n, rho, valid, exact, pos)


_LENS = [None]  # paged_seg: the last lens checked (the tensor, its version, n, its values, its chunk sizes)


def paged_seg(n, *, table, k=None, v=None, rho=None, k_transposed=None, k_scales=None, v_scales=None, base=None, fp8=None,
              int4=False, reuse=None, lens=None):
    """A segment read in place from a paged cache: fp32 k [num_blocks, Hkv, D, bs] (k_transposed: vLLM's CPU
    layout) or [num_blocks, Hkv, bs, D], v [num_blocks, Hkv, bs, D]; or int8 codes k, v [num_blocks, Hkv, bs, D]
    with their fp16 (or int16-viewed) scales k_scales, v_scales [num_blocks, Hkv, bs, ng] (kvcert's packed vLLM
    cache: fast.integrations.vllm), or with int4=True packed int4 codes uint8 [num_blocks, Hkv, bs, D / 2] (quant's
    layout: low nibble = even channel) with such scales, or fp8 codes (fp8 = Fp8Read(...): k, v their uint8 bytes [num_blocks, Hkv, bs, D],
    k_scales, v_scales fp32 [num_blocks, Hkv, bs, 1] or both None); rho fp32 or uint8 log codes [num_blocks, Hkv, bs, NB] or None. Each
    (block, head) slab of each tensor holds its bs rows contiguously (rows of X elements at stride X); table int32
    [B, >= ceil(n / bs)] the blocks of each sequence (checked against num_blocks: the kernel trusts it).
    Tokens 0..n-1 of sequence b are its positions. The cache tensors' checks depend only on their dtypes,
    shapes and strides: memoized on those (and the data pointers), a serving loop pays them once per cache,
    the table check every call. base: paged_base(...)'s result in place of the cache tensors (a serving loop
    keeps it per cache tensor and skips even the memo's key). reuse: a dict an earlier paged_seg(base=...) call
    returned (a serving loop's, one per layer): when it was built on the same base it is updated and returned (so
    _run's checks, kept in it, are reused: they depend on the base, B and whether n > 0, not on n or the table).
    lens: int32 [B] (each in [1, n]), sequence b's own token count: it reads its tokens 0..lens[b] - 1 only (its blocks
    past that are never read, nor seen by the NaN flag or the logit bound), in _chunk(lens[b]) chunks, so sequences of
    different lengths share one _run (segment 1 empty), each bit for bit its own read; the table then needs
    ceil(lens[b] / bs) valid ids in row b."""
    if base is None:
        base = paged_base(k=k, v=v, rho=rho, k_transposed=k_transposed, k_scales=k_scales, v_scales=v_scales, fp8=fp8,
                          int4=int4)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"paged_seg: n must be an integer >= 0, got {n!r}")
    if n == 0:
        return {"Hkv": base["Hkv"], "c": _Seg()}
    need = -(-n // base["bs"])
    if (not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] < 1
            or table.shape[1] < need or table.stride(1) != 1 or table.device.type != "cpu"):
        raise ValueError(f"table: int32 [B, >= {need}] with unit stride on the CPU, got {getattr(table, 'dtype', table)} "
                         f"{tuple(getattr(table, 'shape', ()))}")
    ids = table.numpy()[:, :need]  # numpy's min / max: a few us, where torch's cost tens per read
    if lens is not None:
        if (not isinstance(lens, torch.Tensor) or lens.dtype != torch.int32 or tuple(lens.shape) != (table.shape[0],)
                or not lens.is_contiguous() or lens.device.type != "cpu"):
            raise ValueError(f"lens: int32 contiguous [{table.shape[0]}] on the CPU (one per table row), got "
                             f"{getattr(lens, 'dtype', lens)} {tuple(getattr(lens, 'shape', ()))}")
        seen, ver = _LENS[0], _checks.version(lens)
        if seen is not None and seen[0] is lens and seen[1] == ver and ver is not None and seen[2] == n:
            ln, chunks = seen[3], seen[4]  # the same lens at the same version (a step's layers): checked already
        else:
            ln = lens.numpy()
            if int(ln.min()) < 1 or int(ln.max()) > n:
                raise ValueError(f"lens: each sequence's token count must lie in [1, n = {n}]")
            chunks = torch.from_numpy(_chunk(ln.astype(np.int64)).astype(np.int32))  # each sequence's own chunks
            _LENS[0] = (lens, ver, n, ln, chunks)
    if int(ids.min()) < 0 or int(ids.max()) >= base["nb"]:
        if lens is not None:  # only each row's own blocks are read: check those
            ids = ids[np.arange(need)[None, :] < -(-ln[:, None] // base["bs"])]
        if int(ids.min()) < 0 or int(ids.max()) >= base["nb"]:
            raise ValueError(f"table: block ids must lie in [0, {base['nb']})")
    if type(reuse) is dict and reuse.get("_base") is base and reuse.get("B") == table.shape[0]:
        c = reuse["c"]
    else:
        c = _Seg.from_buffer_copy(base["c"])
        reuse = {**base, "c": c, "B": table.shape[0], "_base": base}
    c.n = n
    c.table, c.tb_sb = table.data_ptr(), table.stride(0)
    if lens is None:
        c.lens = c.lchunk = None
    else:  # each sequence's own chunk size, _chunk(lens[b]): its read is bit for bit its own, whatever shares the call
        c.lens, c.lchunk = lens.data_ptr(), chunks.data_ptr()
        reuse["lchunk"] = chunks
    reuse["table"], reuse["lens"] = table, lens
    return reuse


def paged_base(*, k, v, rho, k_transposed, k_scales=None, v_scales=None, fp8=None, int4=False):
    """paged_seg's checks of the cache tensors, once: a dict for paged_seg(base=...) that keeps them alive."""
    if fp8 is not None:
        return _paged_base_fp8(k, v, rho, k_transposed, k_scales, v_scales, fp8)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or min(v.shape) < 1:
        raise ValueError(f"v: [num_blocks, Hkv, bs, D], got {getattr(v, 'shape', v)}")
    nb, Hkv, bs = v.shape[0], v.shape[1], v.shape[2]
    D = v.shape[3] * (2 if int4 else 1)
    _check_head_dim(D)
    for name, t in (("k", k), ("rho", rho), ("k_scales", k_scales), ("v_scales", v_scales)):
        if (t is not None or name == "k") and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if k_scales is not None:
        k_scales = k_scales.view(torch.int16) if k_scales.dtype == torch.float16 else k_scales
    if v_scales is not None:
        v_scales = v_scales.view(torch.int16) if v_scales.dtype == torch.float16 else v_scales
    meta = lambda t: None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device.type)
    c = _paged_base(*(meta(t) for t in (k, v, rho, k_scales, v_scales)), bool(k_transposed), bool(int4))
    ng = (k_scales.shape[3], v_scales.shape[3]) if c.coded else (1, 1)
    return {"Hkv": Hkv, "c": c, "k": k, "v": v, "rho": rho, "ks": k_scales, "vs": v_scales, "nb": nb, "bs": bs,
            "D": D, "ng": ng, "NB": None if rho is None else rho.shape[3]}


def _paged_base_fp8(k, v, rho, k_transposed, k_scales, v_scales, f8):
    """paged_base for fp8 codes: the bytes k, v [num_blocks, Hkv, bs, D] (not transposed), the scales (fp32
    [num_blocks, Hkv, bs, 1], both or neither), the witness, each (block, head) slab's rows contiguous, and the
    decode (Fp8Read). Not memoized: a serving loop keeps the result per cache tensor (paged_seg(base=...))."""
    if k_transposed:
        raise ValueError("fp8 codes: k [num_blocks, Hkv, bs, D] (not transposed)")
    tensors = {"k": k, "v": v, "k_scales": k_scales, "v_scales": v_scales}
    for name, t in tensors.items():
        if (t is not None or name in ("k", "v")) and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    _check_fp8_read(f8)
    for name in ("k", "v"):
        if tensors[name].dtype not in (torch.uint8, f8.dtype):
            raise ValueError(f"{name}: fp8 codes must be {f8.dtype} or their uint8 bytes, got {tensors[name].dtype}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales / v_scales: both fp32 [num_blocks, Hkv, bs, 1] or both None")
    kb, vb = k.view(torch.uint8), v.view(torch.uint8)
    nb, Hkv, bs, D = v.shape if v.dim() == 4 else (0, 0, 0, 0)
    _check_head_dim(D)
    c = _Seg()
    for name, t, shape, dtypes, field in (("k", kb, (nb, Hkv, bs, D), (torch.uint8,), "k"),
                                          ("v", vb, (nb, Hkv, bs, D), (torch.uint8,), "v"),
                                          ("rho", rho, (nb, Hkv, bs, None), (torch.float32, torch.uint8), "r"),
                                          ("ks8", k_scales, (nb, Hkv, bs, 1), (torch.float32,), "ks"),
                                          ("vs8", v_scales, (nb, Hkv, bs, 1), (torch.float32,), "vs")):
        if t is None:
            continue
        if not (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device.type == "cpu" and t.dim() == 4
                and all(w is None or x == w for x, w in zip(t.shape, shape)) and t.shape[3] >= 1):
            raise ValueError(f"{name}: {[str(d) for d in dtypes]} {shape} on the CPU (None: any), got "
                             f"{getattr(t, 'dtype', t)} {tuple(getattr(t, 'shape', ()))}")
        if t.stride(3) != 1 or t.stride(2) != t.shape[3]:
            raise ValueError(f"{name}: each (block, head) slab must hold its rows contiguously")
        setattr(c, name, t.data_ptr())
        setattr(c, field + "_sb", t.stride(0))
        setattr(c, field + "_sh", t.stride(1))
    if rho is not None:
        c.rho_u8 = int(rho.dtype == torch.uint8)
    c.coded, c.fp8, c.f8lut = 1, 1, _fp8_table(f8.dtype).data_ptr()
    c.f8scale, c.f8pre, c.f8post = f8.scale, f8.pre, f8.post
    c.bs, c.k_t = bs, 0
    c.bs_log2 = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
    return {"Hkv": Hkv, "c": c, "k": kb, "v": vb, "rho": rho, "ks": k_scales, "vs": v_scales, "nb": nb, "bs": bs,
            "D": D, "ng": (1, 1), "NB": None if rho is None else rho.shape[3], "f8lut": _fp8_table(f8.dtype)}


@functools.lru_cache(maxsize=64)
def _paged_base(k, v, rho, ks, vs, k_transposed, int4=False):
    """The _Seg fields of a paged cache from (data_ptr, dtype, shape, stride, device) of k, v, rho, k_scales,
    v_scales (rho and the scales may be None), after paged_seg's checks; n and the table are the caller's.
    int4: k, v are packed int4 codes uint8 [num_blocks, Hkv, bs, D / 2]."""
    nb, Hkv, bs, W = v[2]
    D = 2 * W if int4 else W
    c = _Seg()
    coded = int4 or v[1] == torch.int8
    if coded and (k_transposed or ks is None or vs is None):
        raise ValueError(f"{'int4' if int4 else 'int8'} codes: k [num_blocks, Hkv, bs, W] (not transposed) with k_scales "
                         "and v_scales")
    if not coded and (ks is not None or vs is not None):
        raise ValueError("k_scales / v_scales: only with int8 codes")
    want_k = (nb, Hkv, D, bs) if k_transposed else (nb, Hkv, bs, W)
    rows = (torch.uint8,) if int4 else (torch.int8,) if coded else (torch.float32,)
    rows_what = "packed int4 codes (uint8)" if int4 else "int8 codes" if coded else "fp32"
    for name, t, shape, dtypes in (("k", k, want_k, rows), ("v", v, (nb, Hkv, bs, W), rows),
                                   ("rho", rho, (nb, Hkv, bs, None), (torch.float32, torch.uint8)),
                                   ("ks", ks, (nb, Hkv, bs, None), (torch.int16,)), ("vs", vs, (nb, Hkv, bs, None), (torch.int16,))):
        if t is None:
            continue
        ptr, dtype, tshape, st, dev = t
        if (dtype not in dtypes or dev != "cpu" or len(tshape) != 4 or tshape[3] < 1
                or any(w is not None and x != w for x, w in zip(tshape, shape))):
            what = {"k": rows_what, "v": rows_what, "rho": "fp32 or uint8", "ks": "fp16 scales", "vs": "fp16 scales"}[name]
            raise ValueError(f"{name}: {what} {shape} on the CPU (None: any), got {dtype} {tshape} on {dev}")
        if st[3] != 1 or st[2] != tshape[3]:
            raise ValueError(f"{name}: each (block, head) slab must hold its rows contiguously")
        if name in ("ks", "vs") and D % tshape[3]:
            raise ValueError(f"{name}: {tshape[3]} scale groups do not divide the head size {D}")
        field = {"k": "k", "v": "v", "rho": "r", "ks": "ks", "vs": "vs"}[name]
        setattr(c, name, ptr)
        setattr(c, field + "_sb", st[0])
        setattr(c, field + "_sh", st[1])
    if rho is not None:
        c.rho_u8 = int(rho[1] == torch.uint8)
    c.coded, c.int4 = int(coded), int(int4)
    c.bs, c.k_t = bs, int(k_transposed)
    c.bs_log2 = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
    return c


def paged_witness(key, kt, slots, rho, bands):
    """Write the band witness of exact keys key [n, Hkv, D] fp32 against the keys a paged cache stores for
    them (kt [num_blocks, Hkv, D, bs] fp32, each (block, head) slab contiguous: vLLM's CPU layout) into
    rho [num_blocks, Hkv, bs, NB] fp32 at slots [n] int64 (< 0: skipped): fast.core.witness.witness op for op
    in C++ (csrc: kvcert_paged_witness), nonzero values below RHO_MIN raised to it. NaN/Inf: ValueError."""
    ts = (("key", key, 3), ("kt", kt, 4), ("slots", slots, 1), ("rho", rho, 4), ("bands", bands, 2))
    for name, t, nd in ts:
        if not isinstance(t, torch.Tensor) or t.dim() != nd or t.device.type != "cpu":
            raise ValueError(f"paged_witness: {name} must be a {nd}-dim CPU tensor, got {getattr(t, 'shape', type(t).__name__)}")
    n, Hkv, D = key.shape
    nb, bs = kt.shape[0], kt.shape[3]
    NB, W = bands.shape
    if key.dtype != torch.float32 or kt.dtype != torch.float32 or rho.dtype != torch.float32:
        raise ValueError("paged_witness: fp32 keys, cache and witness")
    if tuple(kt.shape[1:3]) != (Hkv, D) or kt.stride(3) != 1 or kt.stride(2) != bs or bs < 1:
        raise ValueError(f"paged_witness: cache {tuple(kt.shape)} does not hold [.., {Hkv}, {D}, bs] slabs")
    if tuple(rho.shape) != (nb, Hkv, bs, NB) or not rho.is_contiguous() or D > 512:
        raise ValueError(f"paged_witness: witness {tuple(rho.shape)} != ({nb}, {Hkv}, {bs}, {NB})")
    if bands.dtype not in (torch.int64, torch.int32) or NB * W < 1:
        raise ValueError(f"paged_witness: bands must be integer [NB, W], got {bands.dtype} {tuple(bands.shape)}")
    lo, hi = torch.aminmax(bands)
    if int(lo) < 0 or int(hi) >= D:
        raise ValueError(f"paged_witness: band indices must lie in [0, {D}), got [{int(lo)}, {int(hi)}]")
    if slots.dtype not in (torch.int64, torch.int32) or slots.numel() != n or (n and int(slots.max()) >= nb * bs):
        raise ValueError(f"paged_witness: {slots.numel()} integer slots for {n} keys, or a slot beyond {nb * bs}")
    key, slots, bands = key.contiguous(), slots.to(torch.int64).contiguous(), bands.to(torch.int64).contiguous()
    bad = _lib().kvcert_paged_witness(key.data_ptr(), n, Hkv, D, kt.data_ptr(), kt.stride(0), kt.stride(1), bs,
                                      slots.data_ptr(), bands.data_ptr(), NB, W, _band_margin(W), RHO_MIN, rho.data_ptr())
    if bad < 0:
        raise ValueError("paged_witness: the kernel refused the bands or the head size")
    if bad:
        raise ValueError(f"paged_witness: {bad} key rows hold NaN/Inf (exact or stored): nothing certified for them")


def witness_codes(k, k_hat, bands, nonfinite="raise", fine=False):
    """fast.core.witness.pack_witness(witness(k, k_hat, bands), fine): the uint8 log codes [..., NB] of the band witness of
    keys k against k_hat ([..., D], same shape). fp32 CPU keys with the extension built: one C++ pass (csrc:
    kvcert_witness_codes), witness()'s operations with the W squares summed in band order (band_norms_up's error
    argument holds for any order, so the witness may differ from witness()'s by one fp32 ulp, and its code, rarely, by
    one step up or down: both are >= the exact band norm), then pack_witness's code; else witness() and pack_witness.
    A witness above the largest fp32: ValueError. NaN/Inf in a row of either: ValueError, or with nonfinite="top" that
    row's codes are 255 (the top code, a vacuous witness: for a caller storing a row whose decoded key is not finite,
    which every read refuses)."""
    for name, t in (("k", k), ("k_hat", k_hat)):
        if not (isinstance(t, torch.Tensor) and t.dim() >= 1):
            raise ValueError(f"witness_codes: {name} must be a tensor [..., D], got {type(t).__name__}")
    if k.shape != k_hat.shape:
        raise ValueError(f"witness_codes: k {tuple(k.shape)} and k_hat {tuple(k_hat.shape)} differ")
    if nonfinite not in ("raise", "top"):
        raise ValueError(f"witness_codes: nonfinite must be 'raise' or 'top', got {nonfinite!r}")
    D = k.shape[-1]
    if not (k.dtype == k_hat.dtype == torch.float32 and k.is_cpu and k_hat.is_cpu and available()):
        fin = (torch.isfinite(k).all(-1) & torch.isfinite(k_hat).all(-1))[..., None] if nonfinite == "top" else None
        if fin is not None:
            k, k_hat = k.masked_fill(~fin, 0.0), k_hat.masked_fill(~fin, 0.0)
        codes = pack_witness(witness(k.reshape(1, 1, -1, D), k_hat.reshape(1, 1, -1, D), bands), fine).view(*k.shape[:-1], -1)
        return codes if fin is None else codes.masked_fill(~fin, 255)
    bands = _checks.bands_tensor(bands, D).contiguous()
    NB, W = bands.shape
    if D > 512 or NB > 64:
        raise ValueError(f"witness_codes: head size {D} > 512 or {NB} bands > 64")
    n = k.numel() // D if D else 0
    out = torch.empty(*k.shape[:-1], NB, dtype=torch.uint8)
    k, k_hat = k.contiguous(), k_hat.contiguous()
    bad = _lib().kvcert_witness_codes(k.data_ptr(), k_hat.data_ptr(), n, D, bands.data_ptr(), NB, W, _band_margin(W),
                                      log_table32(fine).data_ptr(), out.data_ptr(), int(nonfinite == "top")) if n else 0
    if bad < 0:
        raise ValueError("witness_codes: the kernel refused the bands or the head size")
    if bad:
        raise ValueError(f"witness_codes: {bad} rows hold NaN/Inf or a witness above the largest fp32: nothing certified for them")
    return out


PAGE_BITS = {"int8": 8, "int4": 4, "fp8_e4m3": 0}  # csrc kvcert_page_write: bits (0: fp8 e4m3 codes)


def page_write(k, v, slots, page, codec, bands=None):
    """Quantize keys and values k, v [n, Hkv, D] (taken as fp32) into a packed page in one C++ pass (csrc:
    kvcert_page_write): each (token, KV head) row as fast.core.quant.quantize(row, codec, group_size=D) stores it, bit
    for bit (one fp16 scale per row, codes int8, or int4 two a byte with the even channel in the low nibble; fp8_e4m3:
    per_token_scale=True, one fp32 scale per row, the e4m3 bytes rounded to nearest even), and with bands [NB, W] the
    key's witness codes against the key the page now decodes to (witness_codes' operations, fine=True: the page's codes
    are the fine log table's, fast.core.witness.FINE_STEPS). page: a tensor
    [num_blocks, Hkv, bs, C] (any dtype) whose (block, head) slabs of bs C elements are contiguous, each slab laid out
    as fast.integrations.vllm.packed_views says: key codes [bs, Wc], value codes [bs, Wc] (Wc = D, or D / 2 for int4),
    key scales [bs] and value scales [bs] (fp16 bits; fp8: fp32), witness [bs, NB]. slots [n] (< 0: skipped): token i goes
    to block slots[i] // bs, offset slots[i] % bs. A row holding NaN/Inf is stored as zeros with a NaN scale (it
    decodes to NaN, which every read refuses) and, for a key, the top witness code. ValueError for bad arguments, a
    slot past the page, a row whose max |x| does not fit an fp16 scale, or a witness above the largest fp32."""
    if codec not in PAGE_BITS:
        raise ValueError(f"page_write: codec must be one of {tuple(PAGE_BITS)}, got {codec!r}")
    if not all(isinstance(t, torch.Tensor) for t in (k, v, slots, page)):
        raise ValueError("page_write: k, v, slots and page must be tensors")
    if k.dim() != 3 or k.shape != v.shape or slots.shape != (k.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_write: k, v [n, Hkv, D] alike and slots [n] int, got {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(slots.shape)} {slots.dtype}")
    n, Hkv, D = k.shape
    bits = PAGE_BITS[codec]
    if D > 512 or D % 2:
        raise ValueError(f"page_write: head size {D} must be even and <= 512")
    if not available():
        raise RuntimeError("page_write: the C++ extension is not built (cpu_fused.available() is False)")
    NB, W, bt = 0, 0, None
    if bands is not None:
        bt = _checks.bands_tensor(bands, D).contiguous()
        NB, W = bt.shape
        if NB > 64:
            raise ValueError(f"page_write: {NB} bands > 64")
    Wc, S = D // 2 if bits == 4 else D, 4 if bits == 0 else 2
    try:
        pg = page.view(torch.uint8) if page.dim() == 4 else None
    except RuntimeError:  # a dtype view needs the last dimension contiguous
        pg = None
    if pg is None or page.shape[1] != Hkv or not page.is_cpu or pg.stride(3) != 1 or pg.stride(2) != pg.shape[3]:
        raise ValueError(f"page_write: page must be a CPU tensor [num_blocks, {Hkv}, bs, C] with contiguous slabs")
    nb, _, bs, row = pg.shape
    if row < 2 * Wc + 2 * S + NB:
        raise ValueError(f"page_write: a slot holds {row} bytes, the packed {codec} page needs {2 * Wc + 2 * S + NB}")
    k, v = k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    got = _lib().kvcert_page_write(k.data_ptr(), v.data_ptr(), n, Hkv, D, slots.data_ptr(), nb, bs, pg.data_ptr(),
                                   pg.stride(0), pg.stride(1), bits, bt.data_ptr() if NB else None, NB, W,
                                   _band_margin(W) if NB else 1.0, log_table32(fine=True).data_ptr())
    if got == -1:
        raise ValueError(f"page_write: a slot lies past the page's {nb * bs} slots")
    if got < -1:
        i = -2 - got
        raise ValueError(f"page_write: token {i // Hkv}, KV head {i % Hkv}: its max |x| does not fit an fp16 scale "
                         "or its witness exceeds the largest fp32 (nothing certified for it)")


# ---- the attention_rows contract ----

def _supported(k, v, v_err):
    D = k.shape[-1]
    if v_err is not None or D % 8 or D > 512:
        return False
    if isinstance(k, QTensor) and isinstance(v, QTensor):
        return k.scheme == v.scheme and k.scheme in FUSED_SCHEMES + FP8_SCHEMES + DITHER_SCHEMES and k.codes.device.type == "cpu"
    if isinstance(k, QTensor) or isinstance(v, QTensor):
        return False
    return k.device.type == "cpu" and k.dtype == torch.float32 and v.dtype == torch.float32


def _check_qtensor(name, t):
    """A QTensor the kernel reads: int8 codes [B, Hkv, N, D] or int4 codes packed two per byte (uint8
    [B, Hkv, N, D / 2]), and fp16 scales [B, Hkv, N, ng], ng dividing D, on the CPU (a fp32 scale would be read
    as two fp16 halves, a group count off D leaves channels unset, scales for fewer tokens than codes are read
    past their end, int8 codes read as packed nibbles or the reverse give other keys). Float caches: nothing
    to check here. (A packed byte with a 0 nibble, no code quantize writes, is refused by the kernel: its
    logit / output flag.)"""
    if not isinstance(t, QTensor) or t.scheme in FP8_SCHEMES:  # fp8: seg checks codes and scales (fp8_parts)
        return
    c, sc = t.codes, t.scales
    dtype, W = (torch.uint8, "D / 2") if t.scheme in ("int4", "int4_dither") else (torch.int8, "D")
    if not (isinstance(c, torch.Tensor) and c.dtype == dtype and c.dim() == 4 and c.device.type == "cpu"):
        raise ValueError(f"{name}: {t.scheme} QTensor codes must be a {dtype} CPU tensor [B, Hkv, N, {W}], got "
                         f"{getattr(c, 'dtype', c)} {tuple(getattr(c, 'shape', ()))}")
    if not (isinstance(sc, torch.Tensor) and sc.dtype == torch.float16 and sc.dim() == 4 and sc.device.type == "cpu"):
        raise ValueError(f"{name}: {t.scheme} QTensor scales must be an fp16 CPU tensor [B, Hkv, N, ng], got "
                         f"{getattr(sc, 'dtype', sc)} {tuple(getattr(sc, 'shape', ()))}")
    D = t.shape[3]
    if tuple(sc.shape[:3]) != tuple(c.shape[:3]) or sc.shape[3] < 1 or D % sc.shape[3]:
        raise ValueError(f"{name}: scales {tuple(sc.shape)} do not fit codes {tuple(c.shape)} (one row of ng groups per "
                         f"token, ng dividing D = {D})")


def attention_rows(q, k, v, rho, scale, *, bands, q_pos, k_pos=None, valid=None, exact=None, certify=True, v_err=None):
    """fast.core.attention.attention_rows (same arguments, same result up to fp32 rounding of the
    output; certificate >= the exact formula, see module doc) through the fused kernel; inputs it
    does not cover, and rows with max c_eff > CMAX32, go to the torch twin."""
    from fast.core import attention as ref
    if not (_supported(k, v, v_err) and available()):
        return ref.attention_rows(q, k, v, rho, scale, bands=bands, q_pos=q_pos, k_pos=k_pos, valid=valid,
                                  exact=exact, certify=certify, v_err=v_err, backend="torch")
    _checks.tensor("q", q, ndim=4, dtypes=ref.IN_DTYPES)
    for name, t in (("k", k), ("v", v)):
        _check_qtensor(name, t)
    B, T, H, D = q.shape
    if T == 0:
        raise ValueError("q: no query rows (T = 0)")
    q_flat = q.permute(0, 2, 1, 3).reshape(B, H * T, D)
    s, bands, rho, valid, exact = ref._check_inputs(q_flat, k, v, rho, scale, bands, valid, exact)
    N = k.shape[2]
    ref._check_rows(q, q_pos, k_pos, valid, N)  # every row reads a key: else ValueError
    Hkv = k.shape[1]
    NB = bands.shape[0]
    lut = None
    if certify:
        if rho is None:  # derived from the codes, as the twin derives it (fast.core.attention._derived_rho)
            from fast.core.quant import QMAX
            from fast.core.witness import witness_from_scales, witness_from_step
            rho = witness_from_scales(k, bands) if k.scheme in QMAX else witness_from_step(k.step(), bands)
        if rho.dtype == torch.uint8:
            from fast.core.witness import _log_table
            lut = _log_table("cpu").to(torch.float32).contiguous()
        else:
            rho = rho.to(torch.float32)
            rho = torch.where((rho > 0) & (rho < RHO_MIN), torch.full_like(rho, RHO_MIN), rho).contiguous()
    else:
        rho = None
    big = 2 ** 31 - 1
    if k_pos is not None and (int(k_pos.min()) < -big or int(k_pos.max()) > big) or int(q_pos.min()) < -big or int(q_pos.max()) > big:
        raise ValueError("q_pos / k_pos: positions must fit int32")
    u8 = lambda t: None if t is None else t.to(torch.uint8).contiguous()
    va = None if valid is None else u8(valid).view(B, 1, N).expand(B, Hkv, N)
    pos = None if k_pos is None else k_pos.to(torch.int32).contiguous().view(B, 1, N).expand(B, Hkv, N)
    dither = None
    if isinstance(k, QTensor) and k.scheme in FP8_SCHEMES:
        parts = fp8_parts(k, v)
        kc, vc, ngk, ngv = parts["k"].contiguous(), parts["v"].contiguous(), 1, 1
        ks, vs = (None, None) if parts["k_scales"] is None else (parts["k_scales"].contiguous(), parts["v_scales"].contiguous())
    elif isinstance(k, QTensor):
        if k.scheme in DITHER_SCHEMES:
            dither = dither_parts(k, v)["dither"]
        kc, vc = k.codes.contiguous(), v.codes.contiguous()
        ks, vs = k.scales.contiguous(), v.scales.contiguous()  # fp16 (seg checks them)
        ngk, ngv = ks.shape[-1], vs.shape[-1]
    else:
        kc, vc, ks, vs, ngk, ngv = k.contiguous(), v.contiguous(), None, None, 1, 1
    f8 = parts["fp8"] if isinstance(k, QTensor) and k.scheme in FP8_SCHEMES else None
    s0 = seg(Hkv, N, k=kc, v=vc, k_scales=ks, v_scales=vs, rho=rho, valid=va, exact=u8(exact), pos=pos, fp8=f8,
             dither=dither)
    s1 = seg(Hkv, 0)
    qf = q.to(torch.float32).contiguous()
    out, stats = _run(qf, q_pos.to(torch.int32).contiguous(), [s0, s1], s, bands.cpu().contiguous(), ngk, ngv, certify, lut)
    if not certify:
        return out, None
    cert = _certificate(stats, NB, N, D)
    if cert is None:  # a row with a large witness: the twin's fp64 terms
        return ref.attention_rows(q, k, v, rho, scale, bands=bands, q_pos=q_pos, k_pos=k_pos, valid=valid,
                                  exact=exact, certify=True, backend="torch")
    return out, cert
