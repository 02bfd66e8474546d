"""The query-subspace witness (issue 20; spec T4d, T4e; proofs/Subspace.v): a signed interval for
every token's logit shift, tighter than the band witness wherever the queries of a KV head lie
close to a few directions.

Per (batch row, KV head) a basis U [m, D] (fp32 rows) is fixed once, from the head's own earlier
queries (query_basis: the top m right singular vectors of the last QWIN query rows of its G query
heads). Per token j, with r_j = k_j - k~_j the key error (exact key minus what is served), the cache
stores at write time (encode):
    a_j     [m]        ~ U r_j, stored as int8 codes times one fp16 scale per token (a = code * scale, exact
                       in fp32: 8-bit code, 11-bit scale); any values are sound: the identity below holds for every a
    tau_j   fp32 >= ||U r'_j||,        r'_j = r_j - U^T a_j (exactly, in real arithmetic)
    sigma_j [NB] fp32 >= ||(r'_j)_b||  per RoPE band b
At read time, for a query q, any p [m] (here p = fl(U q)) and q' = q - U^T p (exactly):
    q . r_j = (U q) . a_j + p . (U r'_j) + q' . r'_j                        (Subspace.v)
so with mu_j ~ (U q) . a_j within em_j, pn >= ||p||, qn_b >= ||q'_b||:
    |s q . r_j - s mu_j| <= s (em_j + pn tau_j + sum_b qn_b sigma_{j,b})   (T4e)
No assumption on U (orthonormal or not), a or p: only the rounding of what is computed from them is
bounded, below. The witness is sound for any query, chosen adaptively or not, like the band witness;
U only decides how tight it is. Where U q carries most of q, q' is small and the unknown part of the
error, q' . r', shrinks with it: the interval is then centred on the part of the shift that is known.

Floating point (spec A13; argued here, next to each step). Inputs are fp32 (q, U, keys), fp16 (a)
or fp32 upper bounds (tau, sigma); everything runs in fp64, u = 2^-53, gamma_n = n u / (1 - n u).
- encode: r = fl(k - k~) within u |r| of the exact difference (fp32 operands). U r and U^T a are
  D- and m-term sums of products: within gamma_{n+1} of the sum of |products| (Higham 3.5); the
  products U a are exact (24 + 19 bits). r' = fl(r - U^T a): one more u |r'|. The coordinate error
  err_i >= |r'_i - fl(r'_i)| is formed from those terms with factors of 2 to spare. Then
  ||r'_b|| <= ||fl(r')_b|| + ||err_b|| (triangle inequality), each norm by band_norms_up;
  ||U r'|| <= ||fl(U fl(r'))|| + ||the sum's error|| + ||U||_F ||err|| (||U||_2 <= ||U||_F).
- shift_bounds: p = fl(U q) (a choice: any p is sound); em_j = sum_k |a_jk| (|U q - p|_k + gamma_m |p_k|)
  covers the centre's error (|(U q)_k - p_k| <= gamma_{D+1} sum_i |U_ki q_i|, then the m products
  p_k a_jk and their sum); q' = fl(q - fl(U^T p)) within gamma_{m+1} sum_k |U_ki p_k| + u |q'_i|;
  the sums of nonnegative terms (em, pn tau + sum_b qn_b sigma_b) carry 2 gamma_{n+4} and one ulp up;
  the centre s mu one rounding, the ends one ulp outward.
Every bound is also checked against exact keys and against the 60-digit reference
(conformance/test_subspace.py, conformance/test_fast_subspace.py).
"""

import torch

from fast.core import _checks
from fast.core.floats import U64, band_norms_up, down64, gamma, up32, up64

QWIN = 128         # query rows (the last QWIN positions of the first read) that fix a KV head's basis
QMAX = 127         # the coefficients' int8 codes


def _norm_up(x64):
    """[...] fp64 >= ||x|| over the last axis (band_norms_up with one band of every coordinate)."""
    D = x64.shape[-1]
    return band_norms_up(x64, torch.arange(D, device=x64.device)[None])[..., 0]


def query_basis(q, Hkv, m):
    """U [B, Hkv, m, D] fp32: per KV head, the top m right singular vectors of its query rows.

    q: [B, H, T, D] query rows (post-RoPE, as the attention reads them; the last QWIN rows are used),
    H = Hkv G. Rows of U beyond the rank of the rows are zero. Any U is sound (T4e holds for every
    U); this one makes the witness tight for queries near the span of the earlier ones."""
    _checks.tensor("q", q, ndim=4)
    _checks.positive_int("m", m)
    B, H, T, D = q.shape
    G = _checks.gqa(H, Hkv)
    if m > D:
        raise ValueError(f"m = {m} > head size D = {D}")
    _checks.nonempty("q", q, 2)
    _checks.finite("q", q)
    rows = q[:, :, -QWIN:].to(torch.float64).reshape(B, Hkv, G * min(T, QWIN), D)
    _, _, vh = torch.linalg.svd(rows, full_matrices=False)  # vh: [B, Hkv, min(G T, D), D]
    U = torch.zeros(B, Hkv, m, D, dtype=torch.float32, device=q.device)
    k = min(m, vh.shape[2])
    U[:, :, :k] = vh[:, :, :k].to(torch.float32)
    return U


def _check_basis(U, B, Hkv, D):
    _checks.tensor("U", U, ndim=4, dtypes=(torch.float32,))
    if U.shape[0] != B or U.shape[1] != Hkv or U.shape[3] != D:
        raise ValueError(f"U: shape {tuple(U.shape)}, expected [{B}, {Hkv}, m, {D}]")
    _checks.finite("U", U)
    return U.shape[2]


def coefficients(codes, scale):
    """a [B, Hkv, N, m] fp32 = codes * scale, exact (int8 codes [.., m], fp16 scale [..] per token)."""
    return codes.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)


def _quantize_coefficients(ur):
    """(codes int8, scale fp16) for the fp64 coefficients ur [.., m]: scale >= max |ur| / QMAX (fp16 rounded up,
    at least the least fp16 subnormal, at most 65504: codes are clamped, which is sound, every a is)."""
    amax = ur.abs().amax(-1)
    sc = (amax / QMAX).clamp(min=2.0 ** -24, max=65504.0)
    scale = sc.to(torch.float16)
    scale = torch.where(scale.to(torch.float64) < sc, torch.nextafter(scale, torch.tensor(65504.0, dtype=torch.float16)), scale)
    codes = torch.round(ur / scale.to(torch.float64).unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def encode(k, k_hat, U, bands):
    """(codes [B, Hkv, N, m] int8, scale [B, Hkv, N] fp16, tau [B, Hkv, N] fp32, sigma [B, Hkv, N, NB] fp32): the
    stored witness of keys k (exact) served as k_hat, for the basis U [B, Hkv, m, D] fp32 (module doc; spec T4e):
    a = coefficients(codes, scale) ~ U r, tau >= ||U r'||, sigma_b >= ||r'_b|| for r' = (k - k_hat) - U^T a
    exactly, rounded up."""
    from fast.core.witness import IN_DTYPES
    _checks.tensor("k", k, ndim=4, dtypes=IN_DTYPES)
    _checks.tensor("k_hat", k_hat, ndim=4, dtypes=IN_DTYPES)
    if k.shape != k_hat.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != k_hat shape {tuple(k_hat.shape)}")
    B, Hkv, N, D = k.shape
    m = _check_basis(U, B, Hkv, D)
    bands = _checks.bands_tensor(bands, D).to(k.device)
    _checks.finite("k", k)
    _checks.finite("k_hat", k_hat)
    U64_ = U.to(torch.float64)
    r = k.to(torch.float64) - k_hat.to(torch.float64)                       # within u |r|
    codes, scale = _quantize_coefficients(torch.matmul(r, U64_.transpose(-1, -2)))  # any a is sound
    a64 = coefficients(codes, scale).to(torch.float64)
    uta = torch.matmul(a64, U64_)                                             # U^T a: [B, Hkv, N, D]
    rp = r - uta                                                              # r' as computed
    abs_uta = torch.matmul(a64.abs(), U64_.abs())
    err = 2 * U64 * r.abs() + 2 * gamma(m + 2) * abs_uta + 2 * U64 * rp.abs()  # >= |r'_exact - fl(r')|
    sigma = up64(band_norms_up(rp, bands) + band_norms_up(err, bands))
    t = torch.matmul(rp, U64_.transpose(-1, -2))                             # U fl(r'): [B, Hkv, N, m]
    et = 2 * gamma(D + 2) * torch.matmul(rp.abs(), U64_.abs().transpose(-1, -2))
    frob = _norm_up(U64_.reshape(B, Hkv, m * D))[:, :, None]                 # >= ||U||_F >= ||U||_2
    tau = up64((_norm_up(t) + _norm_up(et) + up64(frob * _norm_up(err))) * (1 + 2 * gamma(6)))
    return codes, scale, up32(tau), up32(sigma)


def shift_bounds(q, U, a, tau, sigma, bands, s, return_p=False):
    """(lo, hi) [B, H, N] fp64 with lo_j <= s q . (k_j - k~_j) <= hi_j for every token whose stored
    witness (a, tau, sigma) is that of its key error for the basis U (module doc; spec T4e).

    q: [B, H, D] fp32/fp16/bf16 (H = Hkv G: query head h reads KV head h // G); U: [B, Hkv, m, D] fp32;
    a: [B, Hkv, N, m] fp16/fp32; tau: [B, Hkv, N] fp32 >= 0; sigma: [B, Hkv, N, NB] fp32 >= 0 (the
    largest fp32 stands for "unknown": the interval is then vacuous, not wrong). return_p=True also
    returns p = fl(U q) [B, H, m] fp64, the p of the theorem (for the differential test)."""
    from fast.core.witness import IN_DTYPES, _check_scale
    _checks.tensor("q", q, ndim=3, dtypes=IN_DTYPES)
    B, H, D = q.shape
    _checks.tensor("a", a, ndim=4, dtypes=(torch.float16, torch.float32))
    Hkv, N = a.shape[1], a.shape[2]
    m = _check_basis(U, B, Hkv, D)
    G = _checks.gqa(H, Hkv)
    if tuple(a.shape) != (B, Hkv, N, m):
        raise ValueError(f"a: shape {tuple(a.shape)}, expected {(B, Hkv, N, m)}")
    _checks.tensor("tau", tau, ndim=3, dtypes=(torch.float32,))
    _checks.tensor("sigma", sigma, ndim=4, dtypes=(torch.float32,))
    bands = _checks.bands_tensor(bands, D).to(q.device)
    NB = bands.shape[0]
    if tuple(tau.shape) != (B, Hkv, N) or tuple(sigma.shape) != (B, Hkv, N, NB):
        raise ValueError(f"tau / sigma: shapes {tuple(tau.shape)} / {tuple(sigma.shape)}, expected {(B, Hkv, N)} / {(B, Hkv, N, NB)}")
    s = _check_scale(s)
    _checks.finite("q", q)
    _checks.finite("a", a)
    _checks.nonneg_finite("tau", tau)
    _checks.nonneg_finite("sigma", sigma)
    q64 = q.to(torch.float64).view(B, Hkv, G, D)
    U64_ = U.to(torch.float64)
    p = torch.matmul(q64, U64_.transpose(-1, -2))                            # [B, Hkv, G, m]
    ep = 2 * gamma(D + 2) * torch.matmul(q64.abs(), U64_.abs().transpose(-1, -2))  # >= |U q - p|
    a64 = a.to(torch.float64)
    mu = torch.matmul(p, a64.transpose(-1, -2))                              # [B, Hkv, G, N]
    em = up64(torch.matmul(ep + gamma(m + 1) * p.abs(), a64.abs().transpose(-1, -2)) * (1 + 2 * gamma(m + 4)))
    qp = q64 - torch.matmul(p, U64_)                                         # q' as computed: [B, Hkv, G, D]
    eq = 2 * gamma(m + 2) * torch.matmul(p.abs(), U64_.abs()) + 2 * U64 * qp.abs()
    qn = up64(band_norms_up(qp, bands) + band_norms_up(eq, bands))          # [B, Hkv, G, NB] >= ||q'_b||
    pn = _norm_up(p)                                                         # [B, Hkv, G] >= ||p||
    rad = pn[..., None] * tau.to(torch.float64)[:, :, None] + torch.matmul(qn, sigma.to(torch.float64).transpose(-1, -2))
    rad = up64((em + rad) * (1 + 2 * gamma(NB + 6)))
    smu = mu * s
    w = up64(up64(rad * s) * (1 + 2 * U64) + 2 * U64 * smu.abs())          # + the rounding of s mu
    lo, hi = down64(smu - w).reshape(B, H, N), up64(smu + w).reshape(B, H, N)
    if return_p:
        return lo, hi, p.reshape(B, H, m)
    return lo, hi
