"""The query-subspace witness (spec T4d, T4e; proofs/Subspace.v), exact at 60 digits.

Vectors are lists of floats, U a list of m rows of length D, bands a list of index lists that
partition range(D). For a key error r = k - kt, any a [m] and any p [m]:
    q . r - (U q) . a = p . (U r') + q' . r',   r' = r - U^T a,  q' = q - U^T p      (T4d)
    |s q . r - s (U q) . a| <= s (||p|| ||U r'|| + sum_b ||q'_b|| ||r'_b||)           (T4d, T4e)
Rigorous ends (mpmath.iv, 60 digits): lower ends of lower bounds, upper ends of upper bounds.
"""

from mpmath import iv, mpf, workdps

from reference.band import DPS, _iv_band_norms, check_partition, iv_digits


def _check(U, D, m=None):
    if not U or any(len(row) != D for row in U):
        raise ValueError(f"U: expected rows of length {D}")
    if m is not None and len(m) != len(U):
        raise ValueError(f"expected {len(U)} coefficients, got {len(m)}")


def _ut(U, a, D):
    """U^T a as iv numbers."""
    return [sum((iv.mpf(U[k][i]) * iv.mpf(a[k]) for k in range(len(U))), iv.mpf(0)) for i in range(D)]


def _norm(x):
    return iv.sqrt(sum((xi ** 2 for xi in x), iv.mpf(0)))


@workdps(DPS)
def witness_terms(k, kt, U, a, bands):
    """(tau, sigma): the exact ||U r'|| and [||r'_b||] for r' = (k - kt) - U^T a (upper ends):
    what the stored tau and sigma of fast.core.subspace.encode must not undercut."""
    D = len(k)
    check_partition(bands, D)
    _check(U, D, a)
    with iv_digits(DPS):
        uta = _ut(U, a, D)
        rp = [iv.mpf(k[i]) - iv.mpf(kt[i]) - uta[i] for i in range(D)]
        ur = [sum((iv.mpf(U[j][i]) * rp[i] for i in range(D)), iv.mpf(0)) for j in range(len(U))]
        tau = mpf(_norm(ur).b)
        sigma = [mpf(n.b) for n in _iv_band_norms(rp, bands)]
    return tau, sigma


@workdps(DPS)
def shift_interval(q, U, a, p, tau, sigma, bands, s):
    """(lo, hi): the interval of T4e for the logit shift s q . r of a token with stored (a, tau, sigma),
    query q and the reader's p: s (U q) . a -+ s (||p|| tau + sum_b ||(q - U^T p)_b|| sigma_b),
    exact (lo: lower end, hi: upper end)."""
    D = len(q)
    check_partition(bands, D)
    _check(U, D, a)
    _check(U, D, p)
    if len(sigma) != len(bands):
        raise ValueError(f"sigma: {len(sigma)} bands, expected {len(bands)}")
    with iv_digits(DPS):
        uq = [sum((iv.mpf(U[k][i]) * iv.mpf(q[i]) for i in range(D)), iv.mpf(0)) for k in range(len(U))]
        centre = iv.mpf(s) * sum((uq[k] * iv.mpf(a[k]) for k in range(len(U))), iv.mpf(0))
        utp = _ut(U, p, D)
        qn = _iv_band_norms([iv.mpf(q[i]) - utp[i] for i in range(D)], bands)
        rad = _norm([iv.mpf(x) for x in p]) * iv.mpf(tau) + sum((qn[b] * iv.mpf(sigma[b]) for b in range(len(bands))), iv.mpf(0))
        rad = iv.mpf(s) * rad
        return mpf((centre - rad).a), mpf((centre + rad).b)


@workdps(DPS)
def logit_shift(q, k, kt, s):
    """The exact s q . (k - kt) as an interval (lower end, upper end): the truth a witness must cover."""
    with iv_digits(DPS):
        x = iv.mpf(s) * sum((iv.mpf(q[i]) * (iv.mpf(k[i]) - iv.mpf(kt[i])) for i in range(len(q))), iv.mpf(0))
        return mpf(x.a), mpf(x.b)
