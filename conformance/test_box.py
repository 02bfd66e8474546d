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


MERGE = st.fixed_dictionaries({"seed": st.integers(0, 2**31 - 1), "n": st.integers(1, 12), "M": st.integers(1, 4),
                               "logit": st.sampled_from([0.0, 1.0, 4.0]), "width": st.sampled_from([1e-4, 0.05, 0.5, 3.0]),
                               "slack": st.sampled_from([0.0, 1e-3])})


def merged_case(case):
    """Tokens in bins that share their (symmetric or not) interval, q = softmax, ql/qh an enclosure."""
    rng = random.Random(case["seed"])
    n, M = case["n"], min(case["M"], case["n"])
    bins = list(range(M)) + [rng.randrange(M) for _ in range(n - M)]  # every bin has a member
    rng.shuffle(bins)
    iv = [sorted(rng.uniform(-1, 1) * case["width"] for _ in range(2)) for _ in range(M)]
    if rng.random() < 0.5:
        iv = [(-abs(b), abs(b)) for _, b in iv]  # the band witness's symmetric boxes
    lo, hi = [mpf(iv[m][0]) for m in bins], [mpf(iv[m][1]) for m in bins]
    q = sm.softmax([rng.gauss(0, 1) * case["logit"] for _ in range(n)])
    s = mpf(case["slack"])
    return rng, bins, q, lo, hi, [v * (1 - s) for v in q], [v * (1 + s) for v in q]


@workdps(DPS)
def check_merged_bins_bound_the_tokens(case):
    rng, bins, q, lo, hi, ql, qh = merged_case(case)
    QL, QH, LO, HI = ref.merge_bins(ql, qh, lo, hi, bins)
    QL = [v * (1 - mpf(case["slack"])) for v in QL]  # any lower / upper bound of the bin sums (T9c)
    QH = [v * (1 + mpf(case["slack"])) for v in QH]
    for _ in range(6):
        u, lam = mpf(rng.random()), mpf(rng.choice([0.0, 0.5, 1.0, 2.0])) * rng.random() * 3
        tok, binned = ref.box_e(ql, qh, lo, hi, u, lam), ref.box_e(QL, QH, LO, HI, u, lam)
        expect(le(tok, binned), check_merged_bins_bound_the_tokens, case, f"box_e over bins {binned} < over tokens {tok}")
        if case["slack"] == 0:
            expect(abs(tok - binned) < mpf(10) ** -40, check_merged_bins_bound_the_tokens, case, "exact sums: not equal")
    pts = sorted({0.0, 1.0} | {rng.random() for _ in range(6)})
    cands = [[mpf(rng.random() * 3)] for _ in pts[:-1]]
    bound = ref.box_grid_bound(QL, QH, LO, HI, pts[:-1], pts[1:], cands)
    for _ in range(4):  # T9b over the bins bounds the TV of shifts inside the tokens' own intervals
        eps = [a + (b - a) * mpf(rng.random()) for a, b in zip(lo, hi)]
        w = [v * exp(e) for v, e in zip(q, eps)]
        truth = fsum(abs(x / fsum(w) - v) for x, v in zip(w, q)) / 2
        expect(le(truth, bound), check_merged_bins_bound_the_tokens, case, f"true TV {truth} > bound over bins {bound}")


@settings(max_examples=120, deadline=None)
@given(case=MERGE)
def test_merged_bins_bound_the_tokens(case):
    """T9c (proofs/BoxMerge.v box_e_merge): box_e over bins (sums of the members' ql and qh, their shared interval)
    is >= box_e over the tokens (= with exact sums), and the grid bound over the bins holds against the true TV."""
    check_merged_bins_bound_the_tokens(case)


def test_merged_bins_need_the_sums():
    """A bin's ql, qh must be the members' sums: their min and max in place of them (a mutant) fall below box_e over
    the tokens;
    tokens of one bin with different intervals are refused."""
    q = sm.softmax([0.0, 0.1, 0.2])
    lo, hi, bins = [mpf(-1)] * 3, [mpf(1)] * 3, [0, 0, 0]
    QL, QH, LO, HI = ref.merge_bins(q, q, lo, hi, bins)
    tok = ref.box_e(q, q, lo, hi, "0.3", 2)
    assert abs(ref.box_e(QL, QH, LO, HI, "0.3", 2) - tok) < mpf(10) ** -40
    assert ref.box_e([min(q)], [max(q)], LO, HI, "0.3", 2) < tok  # the members' min and max instead of sums
    try:
        ref.merge_bins(q, q, [mpf(-1), mpf(-1), mpf(-2)], hi, bins)
    except ValueError:
        return
    raise AssertionError("a bin whose tokens' intervals differ was merged")
