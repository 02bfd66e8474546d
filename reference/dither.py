"""Dithered quantization, probabilistic tier (math.md T6), exact at 60 digits.

Caveat (spec assumption A2): these radii hold for queries that do not depend on the
dither. Autoregressive decoding feeds outputs back, so this tier is stated for
non-adaptive queries; the deterministic tier (reference.band) has no such caveat.
"""
from fractions import Fraction

from mpmath import exp, log, mpf, sqrt, workdps

DPS = 60


def _one_sigma(q, delta, scale):
    """s * sqrt(sum_i q_i^2 delta_i^2 / 12) for one token."""
    if len(delta) != len(q):
        raise ValueError(f"deltas: {len(delta)} steps for a query of length {len(q)}")
    total = mpf(0)
    for qi, di in zip(q, delta):
        if mpf(di) < 0:
            raise ValueError(f"deltas: negative step {di}")
        total += mpf(qi) ** 2 * mpf(di) ** 2 / 12
    return mpf(scale) * sqrt(total)


@workdps(DPS)
def dither_sigma(q, deltas, scale):
    """sigma_j = s * sqrt(sum_i q_i^2 delta_{j,i}^2 / 12) (spec T6a, T6b, T6c).

    The dithered error of channel i is uniform on delta_{j,i} * [-1/2, 1/2), sub-Gaussian
    with variance proxy delta^2/12 (T6a-b); eps_j = s <q, r_j> has proxy sigma_j^2 (T6c).
    deltas is one token's steps (D numbers: returns one mpf) or a list of per-token steps
    (returns a list). scale must be >= 0.
    """
    if not mpf(scale) >= 0:
        raise ValueError(f"scale must be >= 0 (got {scale})")
    if len(deltas) > 0 and isinstance(deltas[0], (list, tuple)):
        return [_one_sigma(q, d, scale) for d in deltas]
    return _one_sigma(q, deltas, scale)


@workdps(DPS)
def dither_radius(q, deltas, scale, n, d):
    """c_j = sigma_j * sqrt(2 ln(2n/d)): with n tokens in the read, P(some |eps_j| > c_j) <= d
    (spec T6d: n * 2 exp(-c^2 / (2 sigma^2)) = d). Same shapes as dither_sigma.

    ValueError unless 0 < d < 1 and n >= 1.
    """
    if not 0 < mpf(d) < 1:
        raise ValueError(f"d must lie in (0, 1) (got {d})")
    if int(n) != n or n < 1:
        raise ValueError(f"n must be an integer >= 1 (got {n})")
    factor = sqrt(2 * log(2 * mpf(n) / mpf(d)))
    sigma = dither_sigma(q, deltas, scale)
    if isinstance(sigma, list):
        return [s * factor for s in sigma]
    return sigma * factor


@workdps(DPS)
def budget_local(delta_req, L, H, t):
    """d_{l,h,t} = delta_req / (L H t (t+1)): the local budget of one read at step t
    (spec T6e: sum over l, h and t = 1, 2, ... stays <= delta_req, no horizon needed).

    ValueError unless 0 < delta_req < 1, L >= 1, H >= 1 and t >= 1 (integers).
    """
    if not 0 < mpf(delta_req) < 1:
        raise ValueError(f"delta_req must lie in (0, 1) (got {delta_req})")
    for name, v in (("L", L), ("H", H), ("t", t)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {v})")
    return mpf(delta_req) / (mpf(L) * H * t * (t + 1))


# ---- The dither on the code's 16-bit grid (proofs/DitherGrid.v) ----------------------------

GRID_N = 2 ** 16  # fast/core/quant.py: u = (2 i + 1 - 2^16) / 2^17 for a 16-bit hash output i


def grid_u(i, N=GRID_N):
    """u_i = (2 i + 1 - N) / (2 N), exact (DitherGrid.v grid_u)."""
    return Fraction(2 * i + 1 - N, 2 * N)


def _round_half_even(z):
    """The integer nearest to the Fraction z, ties to even (torch.round)."""
    f = z.numerator // z.denominator
    frac = z - f
    if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and f % 2 == 1):
        f += 1
    return f


def _fl32(z):
    """The dyadic Fraction z rounded to binary32, ties to even, gradual underflow (the same
    rounding as reference.floats.round_nearest, in Fractions for speed)."""
    if z == 0:
        return Fraction(0)
    a = abs(z)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** max(e - 23, -149)
    r = _round_half_even(a / quantum) * quantum
    return r if z > 0 else -r


def grid_errors(y, N=GRID_N, fp32_add=False):
    """[(m_i - u_i) - y for i < N], exact Fractions: the subtractive-dither error, in steps, of a
    coordinate whose scaled value is y = x / delta (a float or Fraction), with
    m_i = round_half_even(y + u_i) (DitherGrid.v grid_err), or of fl32(y + u_i) when fp32_add
    (what fast/core/quant.py computes: eta = 2^-18 in DitherGrid.v for |y| <= 126.5)."""
    y = Fraction(y)
    out = []
    for i in range(N):
        z = y + grid_u(i, N)
        m = _round_half_even(_fl32(z) if fp32_add else z)
        out.append(Fraction(m) - z)
    return out


def grid_error_mean(y, N=GRID_N, fp32_add=False):
    """The exact mean of grid_errors(y): |mean| <= 1/(2N) + eta (DitherGrid.v abs_grid_err_mean_le);
    NOT 0 in general (y = 1/(2N): mean = -1/(2N))."""
    errs = grid_errors(y, N, fp32_add)
    return sum(errs, Fraction(0)) / N


@workdps(DPS)
def grid_error_mgf(y, a, N=GRID_N, fp32_add=False):
    """E exp(a (e - E e)) over the grid, e the dither error of grid_errors(y): at most
    exp(a^2 (1 - 1/N^2) / 24) for N = 2^K (DitherGrid.v grid_err_mgf_le)."""
    errs = grid_errors(y, N, fp32_add)
    mu = sum(errs, Fraction(0)) / N
    a = mpf(a)
    total = mpf(0)
    for e in errs:
        c = e - mu
        total += exp(a * mpf(c.numerator) / c.denominator)
    return total / N


@workdps(DPS)
def dither_radius_grid(q, delta, scale, n, d, eta=0, rho=0, N=GRID_N):
    """One token's radius on the grid (DitherGrid.v token_failure_le): with b_i = s q_i delta_i,
    c = sum_i |b_i| (1/(2N) + eta) + rho + sqrt(sum_i b_i^2 / 12) sqrt(2 ln(2n/d)), and
    P(|eps| > c) <= d/n. eta: rounding slack of the code's m (0 exact, 2^-18 for fl32(y + u));
    rho: bound on the rest of the error (fp32 roundings of the quantizer, logit rounding)."""
    if len(delta) != len(q):
        raise ValueError(f"delta: {len(delta)} steps for a query of length {len(q)}")
    if not 0 < mpf(d) <= 2 * n:
        raise ValueError(f"d must lie in (0, 2n] (got {d})")
    b = [mpf(scale) * mpf(qi) * mpf(di) for qi, di in zip(q, delta)]
    bias = sum(abs(bi) for bi in b) * (mpf(1) / (2 * N) + mpf(eta))
    proxy = sum(bi ** 2 for bi in b) / 12
    return bias + mpf(rho) + sqrt(proxy) * sqrt(2 * log(2 * mpf(n) / mpf(d)))


# ---- b-bit codes (proofs/DitherCode.v) -------------------------------------------------------

def code_range(signed, b):
    """(lo, hi), exact ints: the b-bit code range, signed symmetric [-(2^(b-1) - 1), 2^(b-1) - 1]
    (int8_dither b = 8, int4_dither b = 4) or unsigned [0, 2^b - 1] (kivi2_dither b = 2)
    (DitherCode.v code_lo, code_hi; code_range_fits_b_bits: lo <= hi, hi - lo + 1 <= 2^b)."""
    if int(b) != b or b < 1:
        raise ValueError(f"b must be an integer >= 1 (got {b})")
    return (1 - 2 ** (b - 1), 2 ** (b - 1) - 1) if signed else (0, 2 ** b - 1)


def in_code_range(y, signed, b, eta=0, N=GRID_N):
    """lo - (1/(2N) - eta) < y < hi + (1/(2N) - eta), exact (DitherCode.v in_code_range)."""
    lo, hi = code_range(signed, b)
    room = Fraction(1, 2 * N) - Fraction(eta)
    return lo - room < Fraction(y) < hi + room


def bcode_errors(y, signed, b, N=GRID_N, fp32_add=False):
    """[(m_i - u_i) - y for i < N], exact: grid_errors with the code clamped into the b-bit range,
    m_i = clamp(round_half_even(y + u_i)) (or of fl32(y + u_i)) (DitherCode.v bcode, grid_err).
    Equal to grid_errors(y) when y is in the code range (bcode_eq_of_in_range); a step above it,
    every error is <= -(1/2 + 1/(2N)) (bcode_err_mean_le_of_above_range)."""
    lo, hi = code_range(signed, b)
    y = Fraction(y)
    out = []
    for i in range(N):
        z = y + grid_u(i, N)
        m = min(hi, max(lo, _round_half_even(_fl32(z) if fp32_add else z)))
        out.append(Fraction(m) - z)
    return out


def bcode_error_mean(y, signed, b, N=GRID_N, fp32_add=False):
    """The exact mean of bcode_errors: |mean| <= 1/(2N) + eta for y in the code range
    (DitherCode.v abs_bcode_err_mean_le)."""
    return sum(bcode_errors(y, signed, b, N, fp32_add), Fraction(0)) / N


@workdps(DPS)
def bcode_error_mgf(y, a, signed, b, N=GRID_N, fp32_add=False):
    """E exp(a (e - E e)) over the grid for the clamped b-bit code: <= exp(a^2 (1 - 1/N^2)/24)
    for y in the code range (DitherCode.v bcode_err_mgf_le)."""
    errs = bcode_errors(y, signed, b, N, fp32_add)
    mu = sum(errs, Fraction(0)) / N
    a = mpf(a)
    return sum((exp(a * mpf((e - mu).numerator) / (e - mu).denominator) for e in errs), mpf(0)) / N


ETA_SMALL = Fraction(8, 2 ** 24) + Fraction(1, 2 ** 150)  # DitherCode.v eta_small: 8 u32 + 2^-150


def code_round32(z):
    """round_half_even(fl32(z)), exact (DitherCode.v code_round32 with ties to even: the code's
    torch.round of the fp32 y + u). Within a step of a code range inside [-7, 7] it is within
    1/2 + ETA_SMALL of z (code_round32_close)."""
    return _round_half_even(_fl32(Fraction(z)))
