"""Reference: the box form of spec T9 (proofs/Box.v) on any grid and any multipliers.

Headline property: for every grid chaining from 0 to 1 and every multipliers lam >= 0,
reference.box.box_grid_bound >= the exact box worst case (box_oracle, enumeration of S) >= the
true TV of any shift inside the intervals (vertices and interior points), with asymmetric
intervals [lo_j, hi_j] and an enclosure ql <= q <= qh.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, fsum, mpf, workdps

from conformance._check import DPS, expect, le, replay
from reference import box as ref
from reference import softmax as sm

CASE = st.fixed_dictionaries({"seed": st.integers(0, 2**31 - 1), "n": st.integers(1, 7),
                              "logit": st.sampled_from([0.0, 1.0, 4.0]), "width": st.sampled_from([1e-4, 0.05, 0.5, 3.0]),
                              "levels": st.integers(1, 12), "slack": st.sampled_from([0.0, 1e-3])})


def build(case):
    rng = random.Random(case["seed"])
    n = case["n"]
    q = sm.softmax([rng.gauss(0, 1) * case["logit"] for _ in range(n)])
    lo, hi = [], []
    for _ in range(n):
        a, b = sorted(rng.uniform(-1, 1) * case["width"] for _ in range(2))
        lo.append(mpf(a))
        hi.append(mpf(b))
    s = mpf(case["slack"])
    ql, qh = [v * (1 - s) for v in q], [v * (1 + s) for v in q]
    pts = sorted({0.0, 1.0} | {rng.random() for _ in range(case["levels"])})
    u0, u1 = pts[:-1], pts[1:]
    cands = [[mpf(rng.choice([0.0, 0.5, 1.0, 2.0])) * rng.random() * 3 for _ in range(rng.randint(1, 3))] for _ in u0]
    return rng, q, lo, hi, ql, qh, u0, u1, cands


@workdps(DPS)
def check_grid_bound_ge_oracle_ge_true(case):
    rng, q, lo, hi, ql, qh, u0, u1, cands = build(case)
    bound = ref.box_grid_bound(ql, qh, lo, hi, u0, u1, cands)
    oracle = ref.box_oracle(q, lo, hi)
    expect(le(oracle, bound), check_grid_bound_ge_oracle_ge_true, case, f"grid bound {bound} < box worst case {oracle}")
    shifts = [[rng.choice([a, b]) for a, b in zip(lo, hi)] for _ in range(4)]
    shifts += [[a + (b - a) * mpf(rng.random()) for a, b in zip(lo, hi)] for _ in range(2)]
    for eps in shifts:
        w = [v * exp(e) for v, e in zip(q, eps)]
        z = fsum(w)
        truth = fsum(abs(x / z - v) for x, v in zip(w, q)) / 2
        expect(le(truth, oracle), check_grid_bound_ge_oracle_ge_true, case, f"true TV {truth} > box worst case {oracle}")


@settings(max_examples=150, deadline=None)
@replay("test_grid_bound_ge_oracle_ge_true")
@given(case=CASE)
def test_grid_bound_ge_oracle_ge_true(case):
    check_grid_bound_ge_oracle_ge_true(case)


def test_oracle_matches_softmax_oracle_on_symmetric_boxes():
    """box_oracle with lo = -c, hi = c is reference.softmax.tv_bound_oracle (math.md T2)."""
    q = sm.softmax([0.3, -1.2, 2.0, 0.0])
    c = [mpf("0.1"), mpf("0.7"), mpf("0.02"), mpf("1.5")]
    assert abs(ref.box_oracle(q, [-v for v in c], c) - sm.tv_bound_oracle(q, c)) < mpf(10) ** -50


def test_lam_zero_gives_the_top_level():
    """box_e(u, 0) = u (proofs/Box.v box_e_lam0): with no multiplier the term is the interval's top."""
    q = sm.softmax([0.0, 1.0])
    assert ref.box_e(q, q, [-1, -1], [1, 1], "0.25", 0) == mpf("0.25")


def test_bad_grid_is_an_error():
    q = sm.softmax([0.0, 1.0])
    for u0, u1 in (([0.0, 0.5], [0.5, 0.9]), ([0.1, 0.5], [0.5, 1.0]), ([0.0, 0.4], [0.5, 1.0])):
        try:
            ref.box_grid_bound(q, q, [-1, -1], [1, 1], u0, u1, [[1.0], [1.0]])
        except ValueError:
            continue
        raise AssertionError(f"grid {u0}, {u1} accepted")
