"""Band Cauchy-Schwarz witness (math.md T4), exact at 60 digits.

bands is a list of index lists that partition range(D) (see reference.rope.rope_bands).
The witness and the logit-error bound are upper bounds that must never come out low, so
they are computed in interval arithmetic (mpmath.iv) and the upper end is returned:
the witness is "rounded up when stored", as math.md T4 asks.
"""
from contextlib import contextmanager

from mpmath import iv, mpf, sqrt, workdps

DPS = 60


@contextmanager
def iv_digits(dps):
    """Run a block with mpmath.iv at dps digits (iv has no workdps of its own)."""
    saved = iv.prec
    iv.dps = dps
    try:
        yield
    finally:
        iv.prec = saved


def check_partition(bands, D):
    """ValueError unless bands is a list of non-empty index lists partitioning range(D)."""
    seen = sorted(i for band in bands for i in band)
    if not bands or any(len(band) == 0 for band in bands) or seen != list(range(D)):
        raise ValueError(f"bands must partition range({D}) into non-empty lists (got {bands})")


@workdps(DPS)
def band_norms(x, bands):
    """[||x_b|| for each band b], accurate to 60 digits (spec T4a, T4b)."""
    check_partition(bands, len(x))
    out = []
    for band in bands:
        sq = mpf(0)
        for i in band:
            sq += mpf(x[i]) ** 2
        out.append(sqrt(sq))
    return out


def _iv_band_norms(x, bands):
    """Interval enclosures of the band norms of x (call inside iv_digits)."""
    out = []
    for band in bands:
        sq = iv.mpf(0)
        for i in band:
            xi = iv.mpf(x[i])
            sq += xi ** 2  # a square: nonnegative also when xi straddles 0
        out.append(iv.sqrt(sq))
    return out


@workdps(DPS)
def witness(k, k_hat, bands):
    """rho_b >= ||(k - k_hat)_b|| for each band: the stored witness of one key (spec T4c).

    Computed in interval arithmetic; each rho_b is the upper end of the enclosure, so it is
    never below the exact band norm of the error of the given numbers.
    """
    if len(k) != len(k_hat):
        raise ValueError(f"witness: k has {len(k)} entries, k_hat {len(k_hat)}")
    check_partition(bands, len(k))
    with iv_digits(DPS):
        err = [iv.mpf(a) - iv.mpf(b) for a, b in zip(k, k_hat)]
        return [mpf(norm.b) for norm in _iv_band_norms(err, bands)]


def _one_token_bound(q_norms, rho, scale):
    """Upper end of s * sum_b ||q_b|| rho_b for one token (call inside iv_digits)."""
    if len(rho) != len(q_norms):
        raise ValueError(f"rho has {len(rho)} bands, bands has {len(q_norms)}")
    total = iv.mpf(0)
    for qb, rb in zip(q_norms, rho):
        rb = iv.mpf(rb)
        if rb.a < 0:
            raise ValueError(f"rho: negative witness {rb}")
        total += qb * rb
    return mpf((iv.mpf(scale) * total).b)


@workdps(DPS)
def logit_error_bound(q, rho, bands, scale):
    """c_j = s * sum_b ||q_b|| rho_{j,b} >= |eps_j| = |s <q, r_j>| (spec T4a, T4c).

    rho is one token's witness (a list of B numbers: returns one mpf) or a list of
    per-token witnesses (a list of lists: returns a list of mpf, one per token).
    Computed in interval arithmetic; the upper end is returned. scale must be >= 0.
    """
    check_partition(bands, len(q))
    if not mpf(scale) >= 0:
        raise ValueError(f"scale must be >= 0 (got {scale})")
    per_token = len(rho) > 0 and isinstance(rho[0], (list, tuple))
    with iv_digits(DPS):
        q_norms = _iv_band_norms(q, bands)
        if per_token:
            return [_one_token_bound(q_norms, r, scale) for r in rho]
        return _one_token_bound(q_norms, rho, scale)
