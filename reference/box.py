"""The box form of issue 20 (spec T9, proofs/Box.v), exact at 60 digits.

p = softmax(x), q = softmax(xt), lo_j <= x_j - xt_j <= hi_j, ql <= q <= qh. For a level u and a
multiplier lam >= 0:
    box_e(u, lam) = u - lam u sum_j ql_j e^{lo_j} + sum_j qh_j max(0, lam ((1 - u) e^{hi_j} + u e^{lo_j}) - 1).
For intervals [u0_k, u1_k] chaining from 0 to 1, with candidate multipliers per interval:
    TV(p, q) <= max_k min_{lam in cands_k} max(box_e(u0_k, lam), box_e(u1_k, lam))   (tv_le_box_grid)
box_oracle is the exact worst case F* = max_S [a_S / (a_S + b_{S^c}) - q_S] by enumeration (small n).
"""
from mpmath import exp, mpf, workdps

from reference.softmax import _nums as _row  # a non-empty list of finite mpf

DPS = 60
MAX_ORACLE_N = 16


def _check(ql, qh, lo, hi):
    n = len(ql)
    if not (len(qh) == len(lo) == len(hi) == n):
        raise ValueError("ql, qh, lo, hi: lengths differ")
    for a, b in zip(ql, qh):
        if not 0 <= a <= b:
            raise ValueError(f"need 0 <= ql <= qh (got {a}, {b})")
    for a, b in zip(lo, hi):
        if not a <= b:
            raise ValueError(f"need lo <= hi (got {a}, {b})")


@workdps(DPS)
def box_e(ql, qh, lo, hi, u, lam):
    """box_e of proofs/Box.v at level u and multiplier lam (both >= 0)."""
    ql, qh, lo, hi = (_row(v, n) for v, n in ((ql, "ql"), (qh, "qh"), (lo, "lo"), (hi, "hi")))
    _check(ql, qh, lo, hi)
    u, lam = mpf(u), mpf(lam)
    if u < 0 or lam < 0:
        raise ValueError(f"need u >= 0 and lam >= 0 (got {u}, {lam})")
    t2 = lam * u * sum(a * exp(l) for a, l in zip(ql, lo))
    t1 = sum(b * max(mpf(0), lam * ((1 - u) * exp(h) + u * exp(l)) - 1) for b, l, h in zip(qh, lo, hi))
    return u - t2 + t1


@workdps(DPS)
def merge_bins(ql, qh, lo, hi, bins):
    """(QL, QH, LO, HI) over the bins (proofs/BoxMerge.v box_e_merge): bin m's enclosure is the sum of its tokens'
    ql and of their qh, its interval the one they share (ValueError if two members' intervals differ). bins[j] in
    0..M-1 names token j's bin; every bin has a member. box_e over the bins is then >= box_e over the tokens."""
    ql, qh, lo, hi = (_row(v, n) for v, n in ((ql, "ql"), (qh, "qh"), (lo, "lo"), (hi, "hi")))
    _check(ql, qh, lo, hi)
    if len(bins) != len(ql) or any(not isinstance(m, int) or m < 0 for m in bins):
        raise ValueError("bins: one bin index >= 0 per token")
    M = max(bins) + 1
    QL, QH, LO, HI = [mpf(0)] * M, [mpf(0)] * M, [None] * M, [None] * M
    for a, b, l, h, m in zip(ql, qh, lo, hi, bins):
        if LO[m] is not None and (LO[m], HI[m]) != (l, h):
            raise ValueError(f"bin {m}: its tokens' intervals differ")
        QL[m], QH[m], LO[m], HI[m] = QL[m] + a, QH[m] + b, l, h
    if any(v is None for v in LO):
        raise ValueError("bins: every bin 0..M-1 needs a token")
    return QL, QH, LO, HI


@workdps(DPS)
def box_grid_bound(ql, qh, lo, hi, u0, u1, cands):
    """max_k min_{lam in cands[k] + [0]} max(box_e(u0_k, lam), box_e(u1_k, lam)), the bound of
    proofs/Box.v tv_le_box_grid on intervals [u0_k, u1_k] that chain from 0 to 1 (ValueError otherwise)."""
    u0, u1 = _row(u0, "u0"), _row(u1, "u1")
    if len(u0) != len(u1) or len(cands) != len(u0):
        raise ValueError("u0, u1, cands: lengths differ")
    if u0[0] != 0 or u1[-1] != 1 or any(a > b for a, b in zip(u0, u1)) or any(b != a for a, b in zip(u0[1:], u1[:-1])):
        raise ValueError("the intervals must chain from 0 to 1")
    best = mpf(0)
    for a, b, lams in zip(u0, u1, cands):
        term = b  # lam = 0 (Box.v box_e_lam0)
        for lam in lams:
            term = min(term, max(box_e(ql, qh, lo, hi, a, lam), box_e(ql, qh, lo, hi, b, lam)))
        best = max(best, term)
    return best


@workdps(DPS)
def box_oracle(q, lo, hi):
    """F* = max_S [a_S / (a_S + b_{S^c}) - q_S], a = q e^{hi}, b = q e^{lo}, by enumeration (n <= 16):
    the exact worst case of TV(p, q) over lo_j <= eps_j <= hi_j (a test oracle)."""
    q, lo, hi = _row(q, "q"), _row(lo, "lo"), _row(hi, "hi")
    _check(q, q, lo, hi)
    n = len(q)
    if n > MAX_ORACLE_N:
        raise ValueError(f"box_oracle: n = {n} > {MAX_ORACLE_N}")
    a = [v * exp(h) for v, h in zip(q, hi)]
    b = [v * exp(l) for v, l in zip(q, lo)]
    best = mpf(0)
    for mask in range(1, 2 ** n):
        a_in = sum(a[j] for j in range(n) if mask >> j & 1)
        b_out = sum(b[j] for j in range(n) if not mask >> j & 1)
        q_in = sum(q[j] for j in range(n) if mask >> j & 1)
        if a_in + b_out > 0:
            best = max(best, a_in / (a_in + b_out) - q_in)
    return best
