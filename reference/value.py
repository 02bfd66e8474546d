"""Value-error bound (math.md T5), exact at 60 digits."""
from mpmath import mpf, sqrt, workdps

DPS = 60


@workdps(DPS)
def diameter(vectors):
    """diam{v_j} = max_{i,j} ||v_i - v_j|| (spec T5b)."""
    best = mpf(0)
    for a in vectors:
        for b in vectors:
            if len(a) != len(b):
                raise ValueError("diameter: vectors of different lengths")
            sq = mpf(0)
            for x, y in zip(a, b):
                sq += (mpf(x) - mpf(y)) ** 2
            best = max(best, sqrt(sq))
    return best


@workdps(DPS)
def value_error_bound(p_tilde, v_hat, e_norms, tv):
    """||o - o~|| <= tv * (diam{v~} + 2 max_j ||e_j||) + sum_j p~_j ||e_j|| (spec T5a, T5b).

    o = sum p_j v_j (exact), o~ = sum p~_j v~_j (served), e_j = v_j - v~_j with ||e_j|| <=
    e_norms[j]; tv is TV(p, p~) or any upper bound on it (the bound grows with tv).
    diam{v} <= diam{v~} + 2 max ||e_j|| (T5b) makes the bound observable at run time.
    """
    n = len(p_tilde)
    if n == 0 or len(v_hat) != n or len(e_norms) != n:
        raise ValueError(f"value_error_bound: need n > 0 and p_tilde, v_hat, e_norms of one length "
                         f"(got {n}, {len(v_hat)}, {len(e_norms)})")
    es = [mpf(e) for e in e_norms]
    if min(es) < 0 or mpf(tv) < 0:
        raise ValueError("value_error_bound: e_norms and tv must be >= 0")
    spread = mpf(0)
    for p, e in zip(p_tilde, es):
        spread += mpf(p) * e
    return mpf(tv) * (diameter(v_hat) + 2 * max(es)) + spread
