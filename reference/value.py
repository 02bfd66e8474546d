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


@workdps(DPS)
def served_weights_tv_bound(n, eta, beta, sum_a):
    """TV(a / sum a, w / sum w) <= eta + n beta / sum a for per-weight errors |w_j - a_j| <=
    eta a_j + beta (spec T5c, proofs/Served.v tv_normalized_le_of_rel_abs)."""
    if n < 1 or mpf(eta) < 0 or mpf(beta) < 0 or mpf(sum_a) <= 0:
        raise ValueError("served_weights_tv_bound: n >= 1, eta, beta >= 0, sum_a > 0")
    return mpf(eta) + n * mpf(beta) / mpf(sum_a)


@workdps(DPS)
def out_quotient_bound(E, V, W, g, u, eta):
    """|rn(S^ / W^) - S / W| <= (1 + u)(E + g V W) / ((1 - g) W) + u V + eta for |S^ - S| <= E,
    |W^ - W| <= g W, |S| <= V W (spec T5d, proofs/Served.v out_quotient_le)."""
    E, V, W, g, u, eta = (mpf(x) for x in (E, V, W, g, u, eta))
    if not (W > 0 and 0 <= g < 1 and E >= 0 and V >= 0):
        raise ValueError("out_quotient_bound: W > 0, 0 <= g < 1, E, V >= 0")
    return (1 + u) * (E + g * V * W) / ((1 - g) * W) + u * V + eta
