"""Query-subspace witness (spec T4d, T4e): the reference interval against the exact logit shift (property).

For any U (orthonormal or not), any a and any p, the exact s q . (k - kt) lies in
reference.subspace.shift_interval built from the exact witness terms; the interval is tight when
the query is aimed at the residual r' and U is orthonormal with a = U r, p = U q; and each term of
the radius is needed (dropping the p . (U r') term or the q' . r' term breaks it on such reads).
"""
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

from conformance._check import DPS, expect, le, replay
from reference.rope import rope_bands
from reference.subspace import logit_shift, shift_interval, witness_terms

coord = st.floats(-4, 4)


@st.composite
def reads(draw):
    D = draw(st.sampled_from([4, 8, 16]))
    m = draw(st.integers(1, min(4, D)))
    vec = st.lists(coord, min_size=D, max_size=D)
    return {"D": D, "m": m, "NB": draw(st.sampled_from([1, 2])), "k": draw(vec), "kt": draw(vec), "q": draw(vec),
            "U": [draw(vec) for _ in range(m)], "a": draw(st.lists(coord, min_size=m, max_size=m)),
            "p": draw(st.lists(coord, min_size=m, max_size=m)), "s": draw(st.sampled_from([0.125, 1.0])),
            "aim": draw(st.sampled_from(["none", "residual", "subspace"]))}


def _query(case, rp):
    """The drawn query, or one aimed at the residual r' (q' parallel to r': band Cauchy-Schwarz
    tight) or lying in the span of U (q = U^T p: q' = 0)."""
    U, D = case["U"], case["D"]
    if case["aim"] == "residual":
        return [mpf(x) for x in rp]
    if case["aim"] == "subspace":
        return [fsum(mpf(U[k][i]) * mpf(case["p"][k]) for k in range(len(U))) for i in range(D)]
    return [mpf(x) for x in case["q"]]


@workdps(DPS)
def check_interval_holds(case):
    """lo <= s q . (k - kt) <= hi for the interval of T4e at the exact witness terms, any U, a, p."""
    D, U, a = case["D"], case["U"], case["a"]
    bands = rope_bands(D, case["NB"], "rotate_half")
    uta = [fsum(mpf(U[k][i]) * mpf(a[k]) for k in range(len(U))) for i in range(D)]
    rp = [mpf(case["k"][i]) - mpf(case["kt"][i]) - uta[i] for i in range(D)]
    q = _query(case, rp)
    tau, sigma = witness_terms(case["k"], case["kt"], U, a, bands)
    lo, hi = shift_interval(q, U, a, case["p"], tau, sigma, bands, case["s"])
    t_lo, t_hi = logit_shift(q, case["k"], case["kt"], case["s"])
    expect(le(lo, t_lo) and le(t_hi, hi), check_interval_holds, case, f"truth [{t_lo}, {t_hi}] not in [{lo}, {hi}]")


@replay("test_subspace_interval_holds")
@settings(max_examples=150, deadline=None)
@given(case=reads())
def test_subspace_interval_holds(case):
    check_interval_holds(case)


def _orthonormal_case():
    """U = the first two coordinate axes of R^4 (orthonormal), a = U r, p = U q."""
    k, kt = [1.0, -2.0, 0.5, 0.25], [0.5, -1.0, 0.0, 0.0]
    U = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    return k, kt, U


def test_interval_is_tight_for_an_aimed_query():
    """Property: orthonormal U, a = U r, p = U q, q' parallel to r': the interval's end is the truth."""
    k, kt, U = _orthonormal_case()
    q = [3.0, 1.0, 0.5, 0.25]  # q' = (0, 0, 0.5, 0.25) = r'
    a, p = [0.5, -1.0], [3.0, 1.0]
    bands = rope_bands(4, 1, "rotate_half")
    tau, sigma = witness_terms(k, kt, U, a, bands)
    lo, hi = shift_interval(q, U, a, p, tau, sigma, bands, 1.0)
    t_lo, t_hi = logit_shift(q, k, kt, 1.0)
    assert tau == 0 and abs(hi - t_hi) < mpf(10) ** -50 and lo < t_lo


def test_each_radius_term_is_needed():
    """Property with teeth: with a != U r (so U r' != 0) and q in the span of U, the truth leaves the
    interval once the p . (U r') term (tau) is dropped; with q' aimed at r', once sigma is dropped."""
    k, kt, U = _orthonormal_case()
    bands = rope_bands(4, 1, "rotate_half")
    a = [0.0, 0.0]  # a stale coefficient vector: r' = r, U r' = (0.5, -1)
    tau, sigma = witness_terms(k, kt, U, a, bands)
    q, p = [2.0, -3.0, 0.0, 0.0], [2.0, -3.0]
    t = logit_shift(q, k, kt, 1.0)[1]
    assert tau > 0 and le(t, shift_interval(q, U, a, p, tau, sigma, bands, 1.0)[1])
    assert shift_interval(q, U, a, p, 0, sigma, bands, 1.0)[1] < t
    q, p = [0.0, 0.0, 0.5, 0.25], [0.0, 0.0]
    a = [0.5, -1.0]
    tau, sigma = witness_terms(k, kt, U, a, bands)
    t = logit_shift(q, k, kt, 1.0)[1]
    assert le(t, shift_interval(q, U, a, p, tau, sigma, bands, 1.0)[1])
    assert shift_interval(q, U, a, p, tau, [0], bands, 1.0)[1] < t
