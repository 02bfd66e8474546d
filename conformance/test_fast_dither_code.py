"""Differential: the dithered b-bit codecs of fast.core (int8_dither, int4_dither, kivi2_dither) against
reference.dither's b-bit mirrors (spec T6k-T6o, proofs/DitherCode.v).

Codes: bit for bit the reference's clamp(round_half_even(fl32(y + u))) with the code's own y, which the
reference checks lies in the code range (so no clamp binds: T6l). Rest: (x~ - x) - sc e within QUANT_RHO
steps (A6) and |x - x~| <= step/2, exact. Radii: fast >= reference, within 1e-4 relative.
Caveat (spec A2): the radii hold for queries fixed before the dither is drawn.
"""
import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf

import fast
from conformance._check import expect, replay
from conformance.test_fast_dither import quant_rho
from fast.core.dither import QUANT_RHO, dither_forms
from fast.core.quant import _kivi_full, dither_codes, max_abs
from fast.core.schemes import _unpack2, get_scheme
from reference import dither as ref

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RANGE = {"int8_dither": (True, 8), "int4_dither": (True, 4), "kivi2_dither": (False, 2)}  # (signed, b)
ETA32 = Fraction(1, 2 ** 18)


def _x(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(1, case["Hkv"], case["N"], case["D"], generator=g) * case["mag"] + case["shift"]
    return x.to(DTYPES[case["dtype"]])


def encode(case):
    """(x fp32, codes m, scale sc, zero z, u, x~, delta) of the case, all [1, Hkv, N, D] fp32 tensors."""
    x, scheme, seed = _x(case), case["scheme"], case["seed"] + 1
    shape = tuple(x.shape)
    if scheme == "kivi2_dither":
        kind = case.get("kind", "k")
        stored = getattr(get_scheme(scheme), "encode_" + kind)(x, 2, 0, seed)
        m = _unpack2(stored.get("codes")).float()
        sc, z = _kivi_full(stored.get("scale"), kind, shape), _kivi_full(stored.get("zero"), kind, shape)
        xh, delta = stored.decode(), stored.step()
        stream = 0 if kind == "k" else 1
    else:
        qt = fast.quantize(x, scheme, group_size=case["G"], seed=seed, layer=2)
        c = qt.codes
        m = (torch.stack([c & 15, c >> 4], -1).view(shape).float() - 8) if scheme == "int4_dither" else c.float()
        sc, z = qt._scale_full(), torch.zeros(shape)
        xh, delta = fast.dequantize(qt), qt.step()
        stream = 0
    u = fast.dither_noise(seed, 2, case["Hkv"], 0, case["N"], case["D"], stream=stream)
    return x.float(), m, sc, z, u, xh, delta


def _rows(case):
    cols = encode(case)
    return zip(*(t.flatten().tolist() for t in cols))


def _y(scheme, X, S, Z):
    """The code's scaled input, exactly: fl32(x / sc), kivi2_dither fl32(fl32(x - z) / sc)."""
    return ref._fl32(ref._fl32(X - Z) / S) if scheme == "kivi2_dither" else ref._fl32(X / S)


def check_codes_match_reference(case):
    """fast codes == clamp(round_half_even(fl32(y + u))) into the b-bit range, and y in range (T6k, T6l)."""
    signed, b = RANGE[case["scheme"]]
    lo, hi = ref.code_range(signed, b)
    for x, m, s, z, u, _, _ in _rows(case):
        y = _y(case["scheme"], Fraction(x), Fraction(s), Fraction(z))
        expect(ref.in_code_range(y, signed, b, ETA32), check_codes_match_reference, case, f"y = {float(y)} outside [{lo}, {hi}]")
        want = min(hi, max(lo, ref.code_round32(y + Fraction(u))))  # the clamp: DitherCode.v bcode
        expect(m == want, check_codes_match_reference, case, f"code {m}, reference {want} (x = {x}, u = {u})")


def check_rest_within_rho(case):
    """|(x~ - x) - sc e| <= QUANT_RHO delta, e = (m - u) - y, and |x - x~| <= delta / 2, exact (A6, A7)."""
    for x, m, s, z, u, xh, dl in _rows(case):
        X, S, D = Fraction(x), Fraction(s), Fraction(dl)
        e = (Fraction(m) - Fraction(u)) - _y(case["scheme"], X, S, Fraction(z))
        rest = abs((Fraction(xh) - X) - S * e)
        expect(S <= D and rest <= Fraction(QUANT_RHO) * D, check_rest_within_rho, case,
               f"rest {float(rest)} > QUANT_RHO delta = {float(QUANT_RHO * D)} (x = {x})")
        expect(abs(Fraction(xh) - X) <= D / 2, check_rest_within_rho, case, f"|x - x~| > delta/2 at x = {x}")


CASE = st.fixed_dictionaries({
    "scheme": st.sampled_from(sorted(RANGE)), "kind": st.sampled_from(["k", "v"]),
    "seed": st.integers(0, 2 ** 31 - 1), "Hkv": st.integers(1, 2), "N": st.just(32), "D": st.sampled_from([32, 64]),
    "G": st.sampled_from([16, 32]), "dtype": st.sampled_from(sorted(DTYPES)),
    "mag": st.sampled_from([1e-3, 1.0, 50.0]), "shift": st.sampled_from([0.0, 0.5, -20.0, 300.0])})


@settings(max_examples=20, deadline=None)
@replay("test_dither_codes_match_reference")
@given(case=CASE)
def test_dither_codes_match_reference(case):
    """differential: every dithered code is the reference's clamped b-bit code of an in-range y (T6l)."""
    check_codes_match_reference(case)


@settings(max_examples=20, deadline=None)
@replay("test_dither_rest_within_rho")
@given(case=CASE)
def test_dither_rest_within_rho(case):
    """differential: the codecs' fp32 roundings stay within the radius's rho, and |x - x~| <= step/2 (A6)."""
    check_rest_within_rho(case)


def test_kivi2_dither_rest_with_a_far_zero_point():
    """differential (A6): a group far from 0 relative to its range (|zero| >> scale) is where the zero
    point's fp32 rounding dominates; step() = max(scale, |zero| 2^-7)(1 + 2^-10) keeps it within rho."""
    for kind in ("k", "v"):
        case = {"scheme": "kivi2_dither", "kind": kind, "seed": 3, "Hkv": 1, "N": 32, "D": 32, "G": 32,
                "dtype": "fp32", "mag": 1e-3, "shift": 300.0}
        check_rest_within_rho(case)


def check_radius(case):
    """fast.dither_radius on the codec's steps >= the reference grid radius (T6o), within 1e-4 relative."""
    _, _, _, _, _, _, delta = encode(case)
    g = torch.Generator().manual_seed(case["seed"] + 2)
    q = torch.randn(1, case["Hkv"] * 2, case["D"], generator=g) * case["mag"]
    s, n, d = 1 / math.sqrt(case["D"]), 10 ** 3, 1e-4
    rad = fast.dither_radius(q, delta, s, n, d)
    for h in range(q.shape[1]):
        qh = q[0, h].double().tolist()
        for j in (0, case["N"] - 1):
            dj = delta[0, h // 2, j].double().tolist()
            want = ref.dither_radius_grid(qh, dj, s, n, d, eta=mpf(2) ** -18, rho=quant_rho(qh, dj, s))
            got = mpf(float(rad[0, h, j]))
            msg = f"head {h} token {j}: fast {got} ref {want}; reproduce check_radius({json.dumps(case)})"
            assert got >= want, "unsound " + msg
            assert got <= want * (1 + mpf("1e-4")) + mpf("1e-6"), "loose " + msg


@settings(max_examples=30, deadline=None)
@replay("test_dither_radius_ge_reference_b_bit")
@given(case=CASE)
def test_dither_radius_ge_reference_b_bit(case):
    """differential: the fast radius on int4_dither / kivi2_dither steps is never below the reference (T6o)."""
    check_radius(case)


@pytest.mark.parametrize("lo,hi", [(-7, 7), (0, 3), (-127, 127)])
def test_dither_codes_refuse_outside_the_range(lo, hi):
    """property (T6m): a scaled input outside the code range is refused, never clamped; the reference
    shows why: clamped, its mean error there (0.4 step beyond hi) is far outside 1/(2N) + eta."""
    u = torch.zeros(1)
    assert float(dither_codes(torch.tensor([float(hi)]), u, lo, hi)) == hi  # the edge is in range
    for y in (hi + 0.4, lo - 0.4):
        with pytest.raises(ValueError, match="outside the code range"):
            dither_codes(torch.tensor([y]), u, lo, hi)
    signed = lo < 0
    b = (hi - lo + 2).bit_length() - 1 if signed else (hi - lo + 1).bit_length() - 1
    assert ref.code_range(signed, b) == (lo, hi)
    assert abs(ref.bcode_error_mean(Fraction(hi) + Fraction(2, 5), signed, b, 2 ** 10)) > Fraction(1, 2 ** 11) + ETA32


@pytest.mark.parametrize("scheme", ["int4_dither", "kivi2_dither"])
def test_dither_forms_cover_true_tv_from_exact_keys(scheme):
    """differential (fast vs truth): 300 reads, each with its own dither seed and a query drawn before it;
    the fast dither tier's TV number (budget d = 0.05 per read) against the true TV from the EXACT keys
    must fail on at most d of the reads (4 binomial standard errors), and must not be vacuous (< 1)."""
    R, N, D, d = 300, 64, 32, 0.05
    s = 1 / math.sqrt(D)
    g = torch.Generator().manual_seed(11)
    bad, vals = 0, []
    for r in range(R):
        k = torch.randn(1, 1, N, D, generator=g) * 1.5
        q = torch.randn(1, 1, D, generator=g) * 2
        if scheme == "kivi2_dither":
            stored = get_scheme(scheme).encode_k(k, 0, 0, 1000 + r)
            kt, delta = stored.decode(), stored.step()
        else:
            qt = fast.quantize(k, scheme, group_size=32, seed=1000 + r)
            kt, delta = fast.dequantize(qt), qt.step()
        p = torch.softmax(q.double() @ k.double()[0, 0].T * s, -1)
        pt = torch.softmax(q.double() @ kt.double()[0, 0].T * s, -1)
        tv = float(0.5 * (p - pt).abs().sum())
        bound = float(dither_forms(q, pt.view(1, 1, N), delta, max_abs(kt), s, N, d)["min"])
        bad += tv > bound
        vals.append(bound)
    assert bad <= R * d + 4 * math.sqrt(R * d * (1 - d)), (scheme, bad)
    assert sorted(vals)[R // 2] < 1, (scheme, sorted(vals)[R // 2])
