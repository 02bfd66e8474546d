"""Dithered quantization, probabilistic tier (math.md T6), exact at 60 digits.

Caveat (spec assumption A2): these radii hold for queries that do not depend on the
dither. Autoregressive decoding feeds outputs back, so this tier is stated for
non-adaptive queries; the deterministic tier (reference.band) has no such caveat.
"""
from mpmath import log, mpf, sqrt, workdps

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
