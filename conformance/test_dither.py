"""Dithered quantization, probabilistic tier (spec T6): the lemmas numerically, and the
radius of the reference against a real subtractive-dither quantizer.

Caveat (spec A2): the radius holds for queries that do not depend on the dither; the
statistical test draws q before the dither, independently of it.
"""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import binomial, exp, mpf, quad, sinh, workdps

from conformance._check import DPS, close, expect, le, replay
from reference.dither import budget_local, dither_radius, dither_sigma


@workdps(DPS)
def check_sinh(case):
    """sinh x <= x exp(x^2/6) for x >= 0 (T6a)."""
    x = mpf(case["x"])
    expect(le(sinh(x), x * exp(x * x / 6)), check_sinh, case, f"sinh({x}) = {sinh(x)} > x exp(x^2/6)")


@settings(max_examples=300)
@replay("test_sinh_bound")
@given(case=st.fixed_dictionaries({"x": st.floats(0, 60)}))
def test_sinh_bound(case):
    """property: sinh x <= x exp(x^2/6) on [0, 60] (T6a)."""
    check_sinh(case)


@workdps(DPS)
def check_mgf(case):
    """int_{-1/2}^{1/2} e^{y u} du = sinh(y/2)/(y/2) <= exp(y^2/24) (T6b), the integral by quadrature."""
    y = mpf(case["y"])
    integral = quad(lambda u: exp(y * u), [-0.5, 0, 0.5])
    closed = sinh(y / 2) / (y / 2) if y != 0 else mpf(1)
    expect(abs(integral - closed) <= mpf(10) ** -35 * closed, check_mgf, case,
           f"quadrature {integral} != closed form {closed}")
    expect(le(closed, exp(y * y / 24)), check_mgf, case, f"MGF {closed} > exp(y^2/24) = {exp(y * y / 24)}")


@settings(max_examples=100)
@replay("test_uniform_mgf_bound")
@given(case=st.fixed_dictionaries({"y": st.floats(-40, 40)}))
def test_uniform_mgf_bound(case):
    """property: the uniform MGF on [-1/2, 1/2] is sub-Gaussian with proxy 1/12 (T6b)."""
    check_mgf(case)


def quantize_with_dither(keys, deltas, u):
    """Subtractive dither (math.md T6): m = round(k/delta + u), k~ = delta (m - u)."""
    codes = np.round(keys / deltas + u)
    assert np.abs(codes).max() <= 127, "clipped: the error would not be uniform"
    return deltas * (codes - u)


def binom_cdf(f, n, p):
    """P(Bin(n, p) <= f), exactly."""
    p = mpf(p)
    return sum(binomial(n, k) * p**k * (1 - p) ** (n - k) for k in range(f + 1))


@workdps(DPS)
def test_empirical_failure_rate_below_budget():
    """property (statistical, fixed seed): with c_j = dither_radius(q, deltas, s, n, d), the
    rate of reads where some |eps_j| > c_j is below d, for d = 0.05 and d = 0.2. 40 key sets
    x 2000 dither draws each; the assertion is one-sided: if the true rate were d or more,
    seeing this few failures would have probability < 1e-6 (the exact binomial tail).
    (Measured: rates 0.0018 and 0.015; a variance proxy 3x too small gives 0.23 and 0.40.)"""
    seed, configs, draws, n, D, group = 20261202, 40, 2000, 4, 16, 8
    for d in (0.05, 0.2):
        rng = np.random.default_rng(seed)
        scale = 1 / np.sqrt(D)
        failures = 0
        for config in range(configs):
            keys = rng.standard_normal((n, D)) * rng.uniform(0.1, 3.0, D)  # keys: [n, D]
            q = rng.standard_normal(D) * 2.0  # drawn before the dither, independent of it
            # one step per token and group of 8 channels, small enough that nothing clips
            group_max = np.abs(keys).reshape(n, D // group, group).max(axis=2)
            deltas = np.repeat(group_max / 126.0, group, axis=1)
            radius = np.array([float(c) for c in dither_radius(q.tolist(), deltas.tolist(), scale, n, d)])
            u = rng.uniform(-0.5, 0.5, (draws, n, D))  # a fresh dither for every read
            eps = scale * ((quantize_with_dither(keys, deltas, u) - keys) @ q)  # eps: [draws, n]
            failures += int(np.any(np.abs(eps) > radius, axis=1).sum())
        total = configs * draws
        tail = binom_cdf(failures, total, d)
        assert tail < mpf("1e-6"), (
            f"seed {seed}, d {d}: {failures} failures in {total} reads (rate {failures / total:.4f}) "
            f"is compatible with a rate >= d (P = {tail})")


@workdps(DPS)
def test_radius_matches_sigma():
    """property: the radius is sigma * sqrt(2 ln(2n/d)) and sigma^2 = s^2 sum q^2 delta^2 / 12,
    so n * 2 exp(-c^2 / (2 sigma^2)) = d (T6d); out-of-range budgets are refused."""
    q, deltas, s, n, d = [1.0, -2.0, 0.5], [[0.1, 0.2, 0.3], [0.0, 0.0, 1.0]], 0.5, 7, 0.01
    sigmas = dither_sigma(q, deltas, s)
    by_hand = mpf(s) ** 2 * (mpf(1) * mpf(0.1) ** 2 + 4 * mpf(0.2) ** 2 + mpf(0.25) * mpf(0.3) ** 2) / 12
    expect(close(sigmas[0] ** 2, by_hand), test_radius_matches_sigma, {}, f"sigma {sigmas[0]}, by hand {by_hand ** 0.5}")
    for sigma, c in zip(sigmas, dither_radius(q, deltas, s, n, d)):
        expect(close(n * 2 * exp(-c * c / (2 * sigma * sigma)), d), test_radius_matches_sigma, {}, f"c = {c}")
    for bad_d in (0, 1, -0.1, 1.5):
        try:
            dither_radius(q, deltas, s, n, bad_d)
        except ValueError:
            continue
        raise AssertionError(f"dither_radius accepted d = {bad_d}")


@workdps(DPS)
def check_budget(case):
    """sum over l < L, h < H, t = 1..T of budget_local = delta_req T/(T+1) <= delta_req (T6e)."""
    delta_req, L, H, T = case["delta_req"], case["L"], case["H"], case["T"]
    total = mpf(0)
    for t in range(1, T + 1):
        total += L * H * budget_local(delta_req, L, H, t)  # the same local budget for every (l, h)
    expect(le(total, delta_req), check_budget, case, f"budgets sum to {total} > delta_req {delta_req}")
    expect(close(total, mpf(delta_req) * T / (T + 1)), check_budget, case,
           f"budgets sum to {total}, not delta_req T/(T+1)")


@settings(max_examples=100)
@replay("test_budget_schedule_sums_below_request")
@given(case=st.fixed_dictionaries({"delta_req": st.floats(1e-12, 1, exclude_max=True, exclude_min=True),
                                   "L": st.integers(1, 80), "H": st.integers(1, 64), "T": st.integers(1, 400)}))
def test_budget_schedule_sums_below_request(case):
    """property: the any-time schedule keeps the union of every check of a request within
    delta_req, whatever the number of steps (T6e)."""
    check_budget(case)


def test_budget_rejects_out_of_range():
    """property: budget_local refuses delta_req outside (0, 1) and t < 1."""
    for args in ((0, 1, 1, 1), (1, 1, 1, 1), (1.5, 1, 1, 1), (0.1, 1, 1, 0), (0.1, 0, 1, 1), (0.1, 1, 1, 1.5)):
        try:
            budget_local(*args)
        except ValueError:
            continue
        raise AssertionError(f"budget_local{args} did not raise ValueError")
