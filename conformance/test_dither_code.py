"""The dither tier at b-bit codes (spec T6k-T6o, proofs/DitherCode.v): the reference mirrors against
exact truth over the whole grid, and the radius of the reference against truth from exact keys for
the 4-bit and 2-bit dithered codecs.

Caveat (spec A2): these bounds hold for queries (and keys) that do not depend on the dither; the
statistical tests draw q before the dither, independently of it.
"""
import math
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, mpf, workdps

from conformance._check import DPS, expect, le, replay
from conformance.test_dither_grid import failure_rate
from reference.dither import (GRID_N, bcode_error_mean, bcode_error_mgf, bcode_errors, code_range,
                              dither_radius_grid, dither_sigma, grid_errors, in_code_range)

ETA32 = Fraction(1, 2 ** 18)  # fl32(y + u) before round(): ulp/2 for |y + u| < 128 (A6)
BITS = [1, 2, 4, 8]


def _eta(case):
    return ETA32 if case["fp32_add"] else Fraction(0)


def _y_in_range(case):
    """A scaled input in the b-bit code range: lo + t (hi - lo), t in [0, 1] (the edges included)."""
    lo, hi = code_range(case["signed"], case["b"])
    return lo + Fraction(case["t"]) * (hi - lo)


def check_range_fits(case):
    """lo <= hi and hi - lo + 1 <= 2^b (T6k, code_range_fits_b_bits); the unsigned range uses all 2^b codes."""
    lo, hi = code_range(case["signed"], case["b"])
    expect(lo <= hi and hi - lo + 1 <= 2 ** case["b"], check_range_fits, case, f"range [{lo}, {hi}]")
    want = 2 ** case["b"] - (1 if case["signed"] else 0)
    expect(hi - lo + 1 == want, check_range_fits, case, f"{hi - lo + 1} codes, expected {want}")


def test_code_range_fits_b_bits():
    """property: every b in 1..16, signed and unsigned, is a nonempty b-bit range (T6k)."""
    for b in range(1, 17):
        for signed in (False, True):
            check_range_fits({"b": b, "signed": signed})
    assert code_range(True, 8) == (-127, 127) and code_range(True, 4) == (-7, 7) and code_range(False, 2) == (0, 3)


CASES = st.fixed_dictionaries({
    "b": st.sampled_from(BITS), "signed": st.booleans(),
    "t": st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0, 2.0 ** -20, 1 - 2.0 ** -20])),
    "K": st.integers(1, 10), "fp32_add": st.booleans()})


def check_no_clamp_in_range(case):
    """In the code range the clamp never binds at any grid point (T6l, bcode_eq_of_in_range):
    the clamped errors equal the unclamped ones."""
    N, y = 2 ** case["K"], _y_in_range(case)
    expect(in_code_range(y, case["signed"], case["b"], _eta(case), N), check_no_clamp_in_range, case, f"y = {y} not in range")
    got = bcode_errors(y, case["signed"], case["b"], N, case["fp32_add"])
    expect(got == grid_errors(y, N, case["fp32_add"]), check_no_clamp_in_range, case, "the clamp bound")


@settings(max_examples=60, deadline=None)
@replay("test_bcode_is_unclamped_in_range")
@given(case=CASES)
def test_bcode_is_unclamped_in_range(case):
    """property: in the b-bit code range the clamp never binds on the grid (T6l)."""
    check_no_clamp_in_range(case)


@workdps(DPS)
def check_bcode_mean_mgf(case):
    """|E e| <= 1/(2N) + eta and E exp(a (e - E e)) <= exp(a^2 (1 - 1/N^2)/24) for the clamped code
    with y in range (T6n, abs_bcode_err_mean_le, bcode_err_mgf_le)."""
    N, y = 2 ** case["K"], _y_in_range(case)
    mean = bcode_error_mean(y, case["signed"], case["b"], N, case["fp32_add"])
    bound = Fraction(1, 2 * N) + _eta(case)
    expect(abs(mean) <= bound, check_bcode_mean_mgf, case, f"|mean| = {float(abs(mean))} > {float(bound)}")
    a = mpf(case["a"])
    mgf = bcode_error_mgf(y, a, case["signed"], case["b"], N, case["fp32_add"])
    expect(le(mgf, exp(a * a * (1 - mpf(1) / N ** 2) / 24)), check_bcode_mean_mgf, case, f"MGF {mgf}")


@settings(max_examples=40, deadline=None)
@replay("test_bcode_mean_and_mgf_within_bounds")
@given(case=st.fixed_dictionaries({
    "b": st.sampled_from(BITS), "signed": st.booleans(), "t": st.floats(0, 1), "K": st.integers(1, 8),
    "fp32_add": st.booleans(), "a": st.floats(-200, 200)}))
def test_bcode_mean_and_mgf_within_bounds(case):
    """property: the clamped b-bit code keeps T6g-T6h's mean and MGF bounds in range (T6n)."""
    check_bcode_mean_mgf(case)


def test_bcode_mean_at_full_grid_at_the_range_edges():
    """property: on the code's grid (N = 2^16), with the code's fp32 add, at the edges of the int4 and 2-bit
    ranges (where a clamp would bind first) the mean stays within 1/(2N) + eta (T6n)."""
    for signed, b, y in ((True, 4, 7), (True, 4, -7), (False, 2, 3), (False, 2, 0), (False, 2, 3 + 2.0 ** -20)):
        mean = bcode_error_mean(Fraction(y), signed, b, GRID_N, True)
        assert abs(mean) <= Fraction(1, 2 * GRID_N) + ETA32, (signed, b, y, float(mean))


def test_clamping_breaks_the_law_outside_the_range():
    """property (T6m, bcode_err_mean_le_of_above_range): a step above the range every grid error is
    <= -(1/2 + 1/(2N)); even 0.4 step above it the mean (-0.4) is far outside 1/(2N) + eta: which is
    why the dithered codecs refuse such inputs (fast.core.quant.dither_codes) instead of clamping."""
    N = 2 ** 10
    for signed, b in ((True, 4), (False, 2), (True, 8)):
        _, hi = code_range(signed, b)
        errs = bcode_errors(hi + 1, signed, b, N)
        assert max(errs) <= -(Fraction(1, 2) + Fraction(1, 2 * N)), (signed, b, float(max(errs)))
        mean = bcode_error_mean(Fraction(hi) + Fraction(2, 5), signed, b, N)
        assert abs(mean) > Fraction(1, 2 * N) + ETA32, (signed, b, float(mean))
        assert not in_code_range(Fraction(hi) + Fraction(2, 5), signed, b, ETA32, N)


@workdps(DPS)
def check_bcode_token_failure_exact(case):
    """P(|eps| > c) <= d/n for clamped 2-bit codes, the probability computed EXACTLY by enumerating
    the N^D outcomes (T6o, token_failure_le_of_bcode), eps = s sum_i q_i delta_i e_i, y in range."""
    K, q, delta, n, d = case["K"], case["q"], case["delta"], case["n"], case["d"]
    N = 2 ** K
    lo, hi = code_range(case["signed"], case["b"])
    ys = [lo + Fraction(t) * (hi - lo) for t in case["ts"]]
    c = dither_radius_grid(q, delta, case["s"], n, d, eta=0, N=N)
    p = failure_rate(q, delta, case["s"], [bcode_errors(y, case["signed"], case["b"], N) for y in ys], c, N)
    expect(le(p, mpf(d) / n), check_bcode_token_failure_exact, case, f"P = {p} > d/n = {mpf(d) / n}")


@settings(max_examples=25, deadline=None)
@replay("test_bcode_token_failure_exact")
@given(case=st.fixed_dictionaries({
    "K": st.integers(1, 4), "s": st.floats(0.05, 2), "b": st.sampled_from([1, 2]), "signed": st.booleans(),
    "q": st.lists(st.floats(-3, 3), min_size=2, max_size=2),
    "delta": st.lists(st.floats(0, 1), min_size=2, max_size=2),
    "ts": st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.25]), min_size=2, max_size=2),
    "n": st.integers(1, 4), "d": st.floats(0.01, 1)}))
def test_bcode_token_failure_exact(case):
    """property: the grid radius holds for clamped 1- and 2-bit codes, probability computed exactly (T6o)."""
    check_bcode_token_failure_exact(case)


def _token_radius(q, delta, s, n, d):
    """The reference radius (T6o) with the code's eta (A6) and the quantizer's rho (QUANT_RHO per step)."""
    rho = mpf(s) * sum(abs(mpf(a)) * mpf(b) for a, b in zip(q, delta)) * (mpf(2) ** -17 + mpf(2) ** -18)
    return dither_radius_grid(q, delta, s, n, d, eta=mpf(2) ** -18, rho=rho)


def _codec(scheme, k, seed):
    """(k~, delta) of fp32 keys k [1, 1, N, D] under a dithered codec."""
    import fast
    from fast.core.schemes import get_scheme
    if scheme == "kivi2_dither":
        st_ = get_scheme(scheme).encode_k(k, 3, 0, seed)
        return st_.decode(), st_.step()
    qt = fast.quantize(k, scheme, group_size=32, seed=seed, layer=3)
    return fast.dequantize(qt), qt.step()


@workdps(30)
def check_failure_rate_against_exact_keys(scheme):
    """Reference vs truth: keys quantized by the codec, the query drawn before and independently of the
    dither; eps_j from the EXACT keys; the reference radius at n = 1, d = 0.2 (T6o) must fail on at most
    d of the tokens (4 binomial standard errors of slack), and must not be vacuous (some tokens come near)."""
    N, D, d, s = 2048, 32, 0.2, 1 / math.sqrt(32)
    g = torch.Generator().manual_seed(17)
    k = torch.randn(1, 1, N, D, generator=g) * 2 + 0.5
    q = torch.randn(D, generator=g).tolist()
    kt, delta = _codec(scheme, k, seed=2024)
    eps = ((k.double() - kt.double())[0, 0] @ torch.tensor(q, dtype=torch.float64)) * s
    near = bad = 0
    for j in range(N):
        c = _token_radius(q, delta[0, 0, j].double().tolist(), s, 1, d)
        e = abs(mpf(float(eps[j])))
        bad += e > c
        near += e > c / 2
    rate = bad / N
    assert rate <= d + 4 * math.sqrt(d * (1 - d) / N), (scheme, rate)
    assert near / N > 0.01, (scheme, near / N)  # the radius is not vacuous


def test_int4_dither_failure_rate_against_exact_keys():
    """property (reference vs truth): int4_dither, the reference radius, exact keys (T6o)."""
    check_failure_rate_against_exact_keys("int4_dither")


def test_kivi2_dither_failure_rate_against_exact_keys():
    """property (reference vs truth): kivi2_dither keys (per channel over blocks of 32 tokens) (T6o)."""
    check_failure_rate_against_exact_keys("kivi2_dither")


def _repeated_keys(scheme, N, D, g):
    """N tokens sharing one exact key (kivi2_dither: tokens 0 and 1 of every 32-token block carry the
    channel's min and max, the rest the shared key), and the query q_i = sign of the undithered rounding
    error of channel i, computed from the exact key alone (fixed before the dither: A2 holds)."""
    v = torch.rand(D, generator=g) * 2 - 1
    k = v.expand(1, 1, N, D).clone()
    if scheme == "kivi2_dither":
        k[0, 0, 0::32], k[0, 0, 1::32] = -1.0, 1.5
        lo, sc = -1.0, 2.5 / 3
        y = (v - lo) / sc
    else:
        sc = float(v.abs().max()) / 7
        y = v / sc
    q = torch.sign(torch.round(y) - y)
    return k, q.tolist(), [j for j in range(N) if scheme != "kivi2_dither" or j % 32 > 1]


@workdps(30)
def check_repeated_keys_decorrelated(scheme):
    """Reference vs truth on keys the undithered codec rounds coherently: every token shares one key, and
    the query follows the sign of its rounding error, so without dither every token's logit error adds up
    coherently (all of them would fail); with the dither the errors are independent across tokens, and at
    n = 1, d = 0.2 at most d of the tokens (4 binomial standard errors) exceed the reference radius (T6o);
    and their spread across tokens is the reference's sigma (centred sample variance within 20% of
    sigma^2, A1): a dither repeated across tokens gives every token one error (variance 0) and fails."""
    N, D, d = 2048, 32, 0.2
    s = 1 / math.sqrt(D)
    k, q, tokens = _repeated_keys(scheme, N, D, torch.Generator().manual_seed(5))
    kt, delta = _codec(scheme, k, seed=77)
    eps = ((k.double() - kt.double())[0, 0] @ torch.tensor(q, dtype=torch.float64)) * s
    bad = sum(abs(mpf(float(eps[j]))) > _token_radius(q, delta[0, 0, j].double().tolist(), s, 1, d) for j in tokens)
    rate = bad / len(tokens)
    assert rate <= d + 4 * math.sqrt(d * (1 - d) / len(tokens)), (scheme, rate)
    sigma = dither_sigma(q, delta[0, 0, tokens[0]].double().tolist(), s)  # the same steps at every token
    spread = float(eps[tokens].var()) / float(sigma) ** 2
    assert 0.8 <= spread <= 1.2, (scheme, spread)


def test_int4_dither_decorrelates_repeated_keys():
    """property (reference vs truth): int4_dither on repeated keys (T6o, A1)."""
    check_repeated_keys_decorrelated("int4_dither")


def test_kivi2_dither_decorrelates_repeated_keys():
    """property (reference vs truth): kivi2_dither keys on repeated keys (T6o, A1)."""
    check_repeated_keys_decorrelated("kivi2_dither")


def check_code_round32(case):
    """round_half_even(fl32(z)) is within 1/2 + 8 u32 + 2^-150 of z on [-8, 8] and monotone (T6p,
    code_round32_close, code_round32_mono)."""
    from reference.dither import ETA_SMALL, code_round32
    a, b = sorted(Fraction(case["num"][i], 2 ** case["den"][i]) for i in range(2))
    for z in (a, b):
        err = abs(code_round32(z) - z)
        expect(abs(z) > 8 or err <= Fraction(1, 2) + ETA_SMALL, check_code_round32, case, f"z = {z}: error {float(err)}")
    expect(code_round32(a) <= code_round32(b), check_code_round32, case, f"not monotone at {a} <= {b}")


@settings(max_examples=200, deadline=None)
@replay("test_code_round32_close_and_monotone")
@given(case=st.fixed_dictionaries({"num": st.lists(st.integers(-2 ** 40, 2 ** 40), min_size=2, max_size=2),
                                   "den": st.lists(st.integers(36, 60), min_size=2, max_size=2)}))
def test_code_round32_close_and_monotone(case):
    """property: the code's own rounding on [-8, 8] (T6p); the dyadic inputs carry more bits than fp32."""
    check_code_round32(case)


def test_code_round32_needs_its_eta():
    """property (T6p): fl32 before the rounding costs more than 1/2 (here 1/2 + 2^-30: 0.5 + 2^-30 rounds to 0.5 in
    fp32, then to 0 by ties-to-even), and the bound 1/2 + 8 u32 + 2^-150 is what the proof allows."""
    from reference.dither import ETA_SMALL, code_round32
    z = Fraction(1, 2) + Fraction(1, 2 ** 30)
    assert code_round32(z) == 0 and abs(code_round32(z) - z) == Fraction(1, 2) + Fraction(1, 2 ** 30) <= Fraction(1, 2) + ETA_SMALL
