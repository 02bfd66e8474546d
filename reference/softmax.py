"""Softmax, total variation and the TV bounds of math.md T1-T2, exact at 60 digits.

Inputs are sequences of numbers (float, int, str or mpf); outputs are mpf. Every public
function works at DPS decimal digits whatever the caller's mpmath precision.
"""
from mpmath import exp, fabs, mpf, tanh, workdps

DPS = 60
MAX_ORACLE_N = 16


def _nums(xs, name):
    """A list of mpf from a non-empty sequence; ValueError on NaN or infinity."""
    out = [mpf(x) for x in xs]
    if not out:
        raise ValueError(f"{name}: empty")
    for v in out:
        if v != v or abs(v) == mpf("inf"):
            raise ValueError(f"{name}: not finite ({v})")
    return out


def _shift_bounds(c, n=None):
    """Per-token bounds c_j >= 0 as a list of mpf (a scalar c is one bound for every token)."""
    cs = _nums(c, "c") if hasattr(c, "__len__") else [mpf(c)] * (n or 1)
    if n is not None and len(cs) != n:
        raise ValueError(f"c: {len(cs)} bounds for {n} tokens")
    for v in cs:
        if not v >= 0 or v == mpf("inf"):
            raise ValueError(f"c: bounds must be finite and >= 0 (got {v})")
    return cs


@workdps(DPS)
def softmax(x):
    """softmax(x)_j = e^{x_j} / sum_i e^{x_i} (math.md Notation; the p and p~ of every row, T1-T7)."""
    xs = _nums(x, "x")
    top = max(xs)
    w = [exp(v - top) for v in xs]
    z = sum(w)
    return [v / z for v in w]


@workdps(DPS)
def tv(p, q):
    """TV(p, q) = 1/2 sum_j |p_j - q_j| (spec T7d: a metric, so the triangle inequality holds)."""
    ps, qs = _nums(p, "p"), _nums(q, "q")
    if len(ps) != len(qs):
        raise ValueError(f"tv: lengths differ ({len(ps)} vs {len(qs)})")
    total = mpf(0)
    for a, b in zip(ps, qs):
        total += fabs(a - b)
    return total / 2


@workdps(DPS)
def tv_bound_interval(a, b):
    """tanh((b - a)/4): the TV bound for logit shifts eps_j in [a, b] (spec T1b).

    It is also the exp-free core (spec T1a) read with f_j = e^{eps_j}: m = e^a, M = e^b,
    k = sqrt(M/m) = e^{(b-a)/2} and (k-1)/(k+1) = tanh((b-a)/4).
    """
    lo, hi = mpf(a), mpf(b)
    if not lo <= hi:
        raise ValueError(f"tv_bound_interval: need a <= b (got a={lo}, b={hi})")
    return tanh((hi - lo) / 4)


@workdps(DPS)
def tv_bound_tanh(c):
    """tanh(max_j c_j / 2): the TV bound when |eps_j| <= c_j (spec T1c; tight by spec T1d).

    c is a sequence of per-token bounds or one scalar bound for every token.
    """
    return tanh(max(_shift_bounds(c)) / 2)


@workdps(DPS)
def tv_bound_forms(p_tilde, c):
    """The observable TV bounds of spec T2 from p~ and per-token bounds |eps_j| <= c_j.

    Contract (shared with fast.tv_bound_forms): p_tilde is a row of nonnegative finite weights
    with a positive sum S, taken as the distribution p~ / S (a softmax rounded to fp16/bf16/fp32
    sums to 1 only approximately; T2 is about the normalised row, and p, proportional to
    p~_j e^{eps_j}, does not depend on S). The bound is on TV(p, p~ / S).
    A = sum p~_j e^{c_j} / S, B = sum p~_j e^{-c_j} / S (spec T2a: A*B >= 1; T2b: B <= Z <= A).
    Returns a dict of mpf: tanh (T1c), one_minus_b_over_a = 1 - B/A (T2c),
    e_form = (A^2 - 1)/2 (T2d), and min = the smallest of the three, capped at 1 and
    floored at 0 (TV >= 0; the 60-digit sums can put (A^2 - 1)/2 a hair below 0 when every c_j = 0).
    """
    ps = _nums(p_tilde, "p_tilde")
    cs = _shift_bounds(c, len(ps))
    for v in ps:
        if v < 0:
            raise ValueError(f"p_tilde: negative entry {v}")
    total = sum(ps)
    if not total > 0:
        raise ValueError("p_tilde: the row sums to zero")
    big_a = mpf(0)
    big_b = mpf(0)
    for p, cj in zip(ps, cs):
        big_a += p * exp(cj)
        big_b += p * exp(-cj)
    big_a, big_b = big_a / total, big_b / total
    forms = {
        "tanh": tanh(max(cs) / 2),
        "one_minus_b_over_a": 1 - big_b / big_a,
        "e_form": (big_a * big_a - 1) / 2,
    }
    forms["min"] = max(mpf(0), min(mpf(1), forms["tanh"], forms["one_minus_b_over_a"], forms["e_form"]))
    return forms


@workdps(DPS)
def tv_bound_oracle(p_tilde, c):
    """The exact worst-case TV over the box |eps_j| <= c_j, by enumeration of S (math.md T2).

    max over subsets S of [a_S / (a_S + b_notS) - p~(S)], a_j = p~_j e^{c_j},
    b_j = p~_j e^{-c_j}: for a fixed S, p(S) - p~(S) is largest with eps = +c on S and -c
    off S, and TV = max_S (p(S) - p~(S)). Reference only: n <= 16 (2^n subsets).
    Used by the tests to measure how loose the closed forms of spec T2 are.
    """
    ps = _nums(p_tilde, "p_tilde")
    cs = _shift_bounds(c, len(ps))
    n = len(ps)
    if n > MAX_ORACLE_N:
        raise ValueError(f"tv_bound_oracle: n = {n} > {MAX_ORACLE_N} (2^n subsets)")
    a = [p * exp(cj) for p, cj in zip(ps, cs)]
    b = [p * exp(-cj) for p, cj in zip(ps, cs)]
    best = mpf(0)
    for mask in range(1, 2**n):
        a_in = mpf(0)
        b_out = mpf(0)
        p_in = mpf(0)
        for j in range(n):
            if mask >> j & 1:
                a_in += a[j]
                p_in += ps[j]
            else:
                b_out += b[j]
        if a_in + b_out > 0:
            best = max(best, a_in / (a_in + b_out) - p_in)
    return best
