"""The dither tier on the code's 16-bit grid (spec T6f-T6i, proofs/DitherGrid.v): the reference
mirrors against exact truth over the whole grid.

Caveat (spec A2): these bounds hold for queries (and keys) that do not depend on the dither.
"""
import itertools
import random
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, mpf, workdps

from conformance._check import DPS, expect, le, replay
from reference.dither import (GRID_N, _fl32, dither_radius, dither_radius_grid, grid_error_mean,
                              grid_error_mgf, grid_errors, grid_u)
from reference.floats import round_nearest

ETA32 = Fraction(1, 2 ** 18)  # the extra rounding of fl32(y + u) before round(): ulp/2 for |y + u| < 128


def _eta(case):
    return ETA32 if case["fp32_add"] else Fraction(0)


def _y(case):
    return Fraction(case["y"])


def check_grid_mean(case):
    """|E e| <= 1/(2N) + eta over the grid of N = 2^K points (T6f, abs_grid_err_mean_le)."""
    N = 2 ** case["K"]
    mean = grid_error_mean(_y(case), N, case["fp32_add"])
    bound = Fraction(1, 2 * N) + _eta(case)
    expect(abs(mean) <= bound, check_grid_mean, case, f"|mean| = {float(abs(mean))} > {float(bound)}")


def check_grid_shape(case):
    """The errors over the grid are N consecutive points spaced 1/N inside [-1/2 - eta, 1/2 + eta]
    (grid_err_sum_eq: a rotation of the symmetric grid, shifted by the mean)."""
    N = 2 ** case["K"]
    errs = sorted(grid_errors(_y(case), N, case["fp32_add"]))
    gaps = {b - a for a, b in zip(errs, errs[1:])}
    expect(gaps <= {Fraction(1, N)}, check_grid_shape, case, f"gaps {sorted(gaps)[:4]} are not all 1/N")
    lim = Fraction(1, 2) + _eta(case)
    expect(-lim <= errs[0] and errs[-1] <= lim, check_grid_shape, case, f"range [{errs[0]}, {errs[-1]}]")


@workdps(DPS)
def check_grid_mgf(case):
    """E exp(a (e - E e)) <= exp(a^2 (1 - 1/N^2) / 24) (T6g, grid_err_mgf_le)."""
    N = 2 ** case["K"]
    a = mpf(case["a"])
    mgf = grid_error_mgf(_y(case), a, N, case["fp32_add"])
    bound = exp(a * a * (1 - mpf(1) / N ** 2) / 24)
    expect(le(mgf, bound), check_grid_mgf, case, f"MGF {mgf} > {bound}")


CASES = st.fixed_dictionaries({
    "y": st.one_of(st.floats(-126.5, 126.5, width=32), st.sampled_from([0.0, 2.0 ** -17, 2.0 ** -18, 3 * 2.0 ** -19, 5e-7, 64.5])),
    "K": st.integers(1, 10),
    "fp32_add": st.booleans()})


@settings(max_examples=60, deadline=None)
@replay("test_grid_mean_within_bound")
@given(case=CASES)
def test_grid_mean_within_bound(case):
    """property: the mean dither error is within 1/(2N) + eta steps of 0 (T6f)."""
    check_grid_mean(case)


@settings(max_examples=60, deadline=None)
@replay("test_grid_errors_are_a_shifted_grid")
@given(case=CASES)
def test_grid_errors_are_a_shifted_grid(case):
    """property: the errors over the grid form a shifted copy of the grid (T6f-g)."""
    check_grid_shape(case)


@settings(max_examples=40, deadline=None)
@replay("test_grid_mgf_le_sub_gaussian")
@given(case=st.fixed_dictionaries({
    "y": st.floats(-126.5, 126.5, width=32), "K": st.integers(1, 8), "fp32_add": st.booleans(),
    "a": st.floats(-200, 200)}))
def test_grid_mgf_le_sub_gaussian(case):
    """property: the centred grid error is sub-Gaussian with proxy (1 - 1/N^2)/12 (T6g)."""
    check_grid_mgf(case)


def test_grid_mean_at_full_grid():
    """property: on the code's grid (N = 2^16), exact and with the code's fp32 add (T6f)."""
    for y in (0.3, -17.25 + 2.0 ** -20, 100.0 + 2.0 ** -17):
        for fp32_add in (False, True):
            check_grid_mean({"y": y, "K": 16, "fp32_add": fp32_add})


def test_grid_mean_is_not_zero():
    """property (tightness): the error is NOT centred; y = 1/(2N) gives mean exactly -1/(2N)."""
    assert grid_error_mean(Fraction(1, 2 * GRID_N)) == Fraction(-1, 2 * GRID_N)
    assert grid_error_mean(Fraction(1, 4 * GRID_N)) == Fraction(-1, 4 * GRID_N)
    assert grid_error_mean(Fraction(0)) == 0


def test_fl32_is_the_reference_rounding():
    """differential: the grid mirror's fast fp32 rounding equals reference.floats.round_nearest."""
    rng = random.Random(9)
    for _ in range(500):
        z = Fraction(rng.randint(-2 ** 40, 2 ** 40), 2 ** rng.randint(0, 170))
        with workdps(700):
            expect_val = round_nearest(mpf(z.numerator) / z.denominator, "fp32")
            assert mpf(_fl32(z).numerator) / _fl32(z).denominator == expect_val, z


def test_code_dither_is_the_grid():
    """differential (fast vs reference): every u the code draws is a grid point u_i, i < 2^16."""
    from fast.core.quant import dither_noise
    u = dither_noise(seed=3, layer=1, Hkv=2, token_start=5, N=64, D=128)
    for v in u.flatten().tolist():
        i2 = Fraction(v) * 2 * GRID_N + GRID_N - 1
        assert i2.denominator == 1 and i2 % 2 == 0 and 0 <= i2 // 2 < GRID_N, v
        assert grid_u(int(i2 // 2)) == Fraction(v)


def failure_rate(q, delta, s, errs, c, N):
    """P(|s sum_i q_i delta_i e_i| > c), exactly: every dither value of every coordinate, errs[i][t]
    the error of coordinate i at dither value t of N (Fractions)."""
    bad = 0
    for idx in itertools.product(range(N), repeat=len(q)):
        eps = sum(mpf(s) * mpf(qi) * mpf(di) * mpf(e[i].numerator) / e[i].denominator
                  for qi, di, e, i in zip(q, delta, errs, idx))
        bad += abs(eps) > c
    return mpf(bad) / N ** len(q)


@workdps(DPS)
def check_token_failure_exact(case):
    """P(|eps| > c) <= d/n, the probability computed EXACTLY by enumerating the N^D outcomes of a
    small grid (T6h, token_failure_le), eps = s sum_i q_i delta_i e_i."""
    K, q, delta, ys, n, d = case["K"], case["q"], case["delta"], case["ys"], case["n"], case["d"]
    N = 2 ** K
    c = dither_radius_grid(q, delta, case["s"], n, d, eta=0, N=N)
    p = failure_rate(q, delta, case["s"], [grid_errors(Fraction(y), N) for y in ys], c, N)
    expect(le(p, mpf(d) / n), check_token_failure_exact, case, f"P = {p} > d/n = {mpf(d) / n}")


@settings(max_examples=25, deadline=None)
@replay("test_token_failure_exact")
@given(case=st.fixed_dictionaries({
    "K": st.integers(1, 4), "s": st.floats(0.05, 2),
    "q": st.lists(st.floats(-3, 3), min_size=2, max_size=2),
    "delta": st.lists(st.floats(0, 1), min_size=2, max_size=2),
    "ys": st.lists(st.floats(-5, 5), min_size=2, max_size=2),
    "n": st.integers(1, 4), "d": st.floats(0.01, 1)}))
def test_token_failure_exact(case):
    """property: the grid radius holds, probability computed exactly (T6h)."""
    check_token_failure_exact(case)


def test_grid_radius_adds_the_bias():
    """property: the grid radius is the code's radius plus s sum |q_i| delta_i (1/(2N) + eta)."""
    q, delta, s = [0.5, -2.0, 1.0], [0.1, 0.2, 0.05], 0.125
    got = dither_radius_grid(q, delta, s, 16, 1e-3, eta=2.0 ** -18)
    base = dither_radius(q, delta, s, 16, 1e-3)
    bias = mpf(s) * sum(abs(mpf(a) * mpf(b)) for a, b in zip(q, delta)) * (mpf(2) ** -17 + mpf(2) ** -18)
    assert abs(got - base - bias) <= mpf(10) ** -40


def test_quantizer_rest_within_rho():
    """property (A6, the rho of T6i): what the code's int8_dither round trip adds to the grid error
    e = (m - u) - fl32(x / sc), i.e. (x~ - x) - sc e, is within (2^-17 + 2^-18) sc per coordinate
    (fl32(x / sc) within 2^-18, fl32((m - u) sc) within 127.5 u sc), computed exactly; and it does
    exceed 2^-18 sc, the room the former GRID_BIAS = 2^-16 left beside the grid mean 2^-17 + 2^-18."""
    import fast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 64, generator=g) * 3
    qt = fast.quantize(x, "int8_dither", group_size=32, seed=5)
    u = fast.dither_noise(5, 0, 2, 0, 64, 64)
    sc = qt.scales.float().repeat_interleave(32, -1)
    worst = Fraction(0)
    for v, s, m, uu, xh in zip(x.flatten().tolist(), sc.flatten().tolist(), qt.codes.flatten().tolist(),
                               u.flatten().tolist(), fast.dequantize(qt).flatten().tolist()):
        X, S = Fraction(v), Fraction(s)
        e = (m - Fraction(uu)) - _fl32(X / S)
        worst = max(worst, abs((Fraction(xh) - X) - S * e) / S)
    assert worst <= Fraction(1, 2 ** 17) + Fraction(1, 2 ** 18), float(worst * 2 ** 18)
    assert worst > Fraction(1, 2 ** 18), float(worst * 2 ** 18)
