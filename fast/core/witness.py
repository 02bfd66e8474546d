"""Band witness (math.md T4): per-token band norms of the key error, rounded UP.

Floating point (math.md T8, assumption A5). Inputs are fp32/fp16/bf16; everything runs
in fp64 and is rounded up to fp32 at the end. fp64 is chosen for soundness, not speed:
a square of an fp32 number is exact in fp64 (48 <= 53 bits) and can neither underflow
nor overflow there, so the only errors are relative ones with the Higham bounds below.
"""

import torch

from fast.core import _checks
from fast.core.floats import U64, band_norms_up, gamma, up32, up64

IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The uint8 log code: code 0 is exactly 0, code i in [1, 254] is 2^((i - LOG_ZERO) / LOG_STEPS)
# rounded up to fp32: 8 codes per octave (at most 9% above the true value), from ~1e-6 to ~3.4e3.
# Code 255 is reserved: the largest finite fp32 (>= any finite fp32 witness), so a witness above code 254
# is stored soundly rounded up (its bound is vacuous) instead of failing in the middle of a request.
TOP_CODE = 255
LOG_STEPS = 8
LOG_ZERO = 160
# The fine table (fine=True; vLLM's packed pages): 16 codes per octave (at most 4.4% above the true value) over a
# narrower range, ~4.9e-4 to ~28 (code 1 = 2^-11, code 254 = 2^(77/16)): a key witness on SmolLM2 lies in
# [1e-3, 4] for int8, int4 and fp8 e4m3 per-token scales. Below code 1 a witness is stored as code 1 (rounded up,
# sound); above code 254 as the top code (vacuous, sound: a faulty quantizer's keys, which the gate repairs).
FINE_STEPS = 16
FINE_ZERO = 177


def _use_triton(backend, x):
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def witness(k, k_hat, bands, *, backend="auto"):
    """rho [B, Hkv, N, NB] fp32 >= the exact band norms ||(k - k_hat)_b|| (T4 witness).

    k, k_hat: [B, Hkv, N, D] fp32/fp16/bf16 (k_hat: what the compressed cache returns).
    backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton".
    """
    _checks.tensor("k", k, ndim=4, dtypes=IN_DTYPES)
    _checks.tensor("k_hat", k_hat, ndim=4, dtypes=IN_DTYPES)
    if k.shape != k_hat.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != k_hat shape {tuple(k_hat.shape)}")
    bands = _checks.bands_tensor(bands, k.shape[-1]).to(k.device)
    _checks.finite("k", k)
    _checks.finite("k_hat", k_hat)
    if _use_triton(backend, k):
        from fast.core import triton_kernels
        return triton_kernels.witness(k, k_hat, bands)
    r = k.to(torch.float64) - k_hat.to(torch.float64)
    return up32(band_norms_up(r, bands))


def witness_from_step(delta, bands):
    """Zero-memory derived witness (T4, last paragraph): |r_i| <= delta_i / 2 for a uniform
    quantizer without clipping, so rho_b = ||delta_b|| / 2. delta: [..., D] (QTensor.step(),
    which already includes the codec's own rounding). Returns [..., NB] fp32, rounded up.
    """
    _checks.tensor("delta", delta, dtypes=IN_DTYPES)
    bands = _checks.bands_tensor(bands, delta.shape[-1]).to(delta.device)
    _checks.nonneg_finite("delta", delta)
    return up32(band_norms_up(delta.to(torch.float64) * 0.5, bands))


def witness_from_scales(qt, bands):
    """The zero-memory witness of an integer-coded QTensor (int8, int8_dither, int4), from its
    scales alone: O(N NB) per read instead of O(N D). Equal to witness_from_step(qt.step()):
    with delta_g = scale_g (1 + 2^-10) constant on each group g,
    rho_b^2 = sum_g n_{g,b} (delta_g / 2)^2, n_{g,b} = #coordinates of band b in group g (exact counts).
    Error (fp64): delta^2 exact (11-bit scale times 11-bit margin: 22 bits, squared 44), the
    (D/G)-term sum gamma_{D/G}, sqrt: margin 2 gamma_{D/G + 4}. Returns [B, Hkv, N, NB] fp32, rounded up.
    """
    from fast.core.quant import QMAX, STEP_MARGIN
    if qt.scheme not in QMAX:
        raise ValueError(f"witness_from_scales: {qt.scheme} has no per-group uniform step (use witness_from_step)")
    D = qt.shape[-1]
    bands = _checks.bands_tensor(bands, D).to(qt.scales.device)
    ngroups = qt.scales.shape[-1]
    group_of = torch.arange(D, device=bands.device) // (D // ngroups)
    counts = torch.zeros(ngroups, bands.shape[0], dtype=torch.float64, device=bands.device)
    for b in range(bands.shape[0]):
        counts[:, b] = torch.bincount(group_of[bands[b]], minlength=ngroups).to(torch.float64)
    half = qt.scales.to(torch.float64) * (STEP_MARGIN * 0.5)  # exact
    norms = torch.sqrt(torch.matmul(half * half, counts))
    return up32(up64(norms * (1 + 2 * gamma(ngroups + 4))))


def _log_table(device, fine=False):
    steps, zero = (FINE_STEPS, FINE_ZERO) if fine else (LOG_STEPS, LOG_ZERO)
    i = torch.arange(256, dtype=torch.float64)
    table = up32(torch.exp2((i - zero) / steps) * (1 + 8 * U64))  # exp2: <= 2 ulp, 8 u64 covers it
    table[0] = 0.0
    table[TOP_CODE] = torch.finfo(torch.float32).max
    return table.to(device)


_TABLES = {}


def _table(device, fine=False):
    """_log_table(device, fine), built once per device, for pack / unpack (never written: they only read it)."""
    key = (str(device), bool(fine))
    if key not in _TABLES:
        with torch.inference_mode(False):  # a normal tensor even when first built inside inference mode (vLLM's
            _TABLES[key] = _log_table(device, fine)  # worker): its version counter lets the fused read keep its checks
    return _TABLES[key]


_LUT32 = {}


def log_table32(fine=False):
    """The log table as fp32 [256] contiguous on the CPU, built once: the fused C++ read decodes uint8 witness codes
    with it (the transformers cache and the vLLM plugin pass the same tensor; vLLM's packed pages the fine one)."""
    fine = bool(fine)
    if fine not in _LUT32:
        with torch.inference_mode(False):
            _LUT32[fine] = _table("cpu", fine).to(torch.float32).contiguous()
    return _LUT32[fine]


def max_packable(fine=False):
    """The largest witness a regular code holds (code 254: ~3.4e3, fine ~28); above it: the reserved top code."""
    return float(_log_table("cpu", fine)[TOP_CODE - 1])


def pack_witness(rho, fine=False):
    """uint8 log codes with unpack_witness(code, fine) >= rho elementwise (1 byte per band).

    rho > max_packable(fine) -> the reserved top code (the largest fp32: a vacuous, sound bound).
    NaN, Inf or a negative rho -> ValueError (the witness computation failed: nothing is >= it).
    fine: the fine table (16 codes per octave, narrower range; vLLM's packed pages).
    """
    _checks.tensor("rho", rho, dtypes=IN_DTYPES)
    _checks.nonneg_finite("rho", rho)
    table = _table(rho.device, fine)
    r = rho.to(torch.float32)
    return torch.searchsorted(table, r.contiguous(), right=False).to(torch.uint8)  # first table[i] >= r


def unpack_witness(codes, fine=False):
    """fp32 witness from uint8 log codes (>= the packed rho; fine: codes of the fine table)."""
    _checks.tensor("codes", codes, dtypes=(torch.uint8,))
    return _table(codes.device, fine)[codes.long()]


def _check_scale(scale):
    s = _checks.positive_scale("scale", scale)
    if not (2.0 ** -60 <= s <= 2.0 ** 60):
        raise ValueError(f"scale = {s} outside [2^-60, 2^60]: fp64 products could underflow")
    return s


def logit_error_bound(q, rho, bands, scale, *, backend="auto"):
    """c [B, H, N] fp32 >= scale * sum_b ||q_b|| rho_{j,b} (T4c), GQA: head h reads KV head h // (H // Hkv).

    q: [B, H, D] fp32/fp16/bf16; rho: [B, Hkv, N, NB] fp32/fp16 witness (>= 0).
    Error (fp64): the band norms of q are upper bounds (band_norms_up); the NB-term
    dot product with rho is within gamma_NB, the product with scale within u64: the
    margin 2 gamma_{NB+2} covers both; no underflow since every factor is >= 2^-149 * 2^-60.
    """
    _checks.tensor("q", q, ndim=3, dtypes=IN_DTYPES)
    _checks.tensor("rho", rho, ndim=4, dtypes=(torch.float32, torch.float16))
    s = _check_scale(scale)
    B, H, D = q.shape
    Bk, Hkv, N, NB = rho.shape
    _checks.same("q batch", B, "rho batch", Bk)
    G = _checks.gqa(H, Hkv)
    bands = _checks.bands_tensor(bands, D).to(q.device)
    _checks.same("rho bands", NB, "bands", bands.shape[0])
    _checks.finite("q", q)
    _checks.nonneg_finite("rho", rho)
    if _use_triton(backend, q):
        from fast.core import triton_kernels
        return triton_kernels.logit_error_bound(q, rho, bands, s)
    return up32(logit_error_bound64(q, rho, bands, s))


def logit_error_bound64(q, rho, bands, s):
    """Unchecked fp64 core of logit_error_bound: [B, H, N] fp64 upper bounds."""
    B, H, D = q.shape
    Hkv, N, NB = rho.shape[1:]
    qn = band_norms_up(q.to(torch.float64), bands).view(B, Hkv, H // Hkv, NB)
    c = torch.matmul(qn, rho.to(torch.float64).transpose(-1, -2)) * s  # [B, Hkv, G, N]
    return up64(c * (1 + 2 * gamma(NB + 2))).reshape(B, H, N)

