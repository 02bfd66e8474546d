"""Differential: fast.tv_bound_forms against reference.softmax.tv_bound_forms (spec T1c, T2).

Headline property: every fast form >= the reference (exact, 60 digits) on the same
inputs; and not uselessly loose: fast <= ref (1 + 1e-4) + 1e-6. A case is a JSON dict
from which the tensors are rebuilt (seeded), so a failure message is a full reproducer.
Shrunk failures live in conformance/corpus_fast/test_fast_certify.json, replayed by @example.
"""

import json

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import mpf

import fast
from reference import softmax as ref
from conformance._check import replay

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# logit scale, c range per magnitude regime
LOGIT = {"tiny": 1e-3, "ordinary": 2.0, "huge": 1e4, "saturated": 2.0}
CMAG = {"tiny": 1e-6, "ordinary": 0.2, "huge": 0.5, "saturated": 40.0}
FP32_MAX = 3.4e38



def build(case):
    """p_tilde, c: [1, rows, N] in the case's dtype (p_tilde from a softmax of random logits)."""
    g = torch.Generator().manual_seed(case["seed"])
    shape = (1, case["rows"], case["N"])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * LOGIT[case["mag"]]
    p = torch.softmax(x, -1).to(DTYPES[case["dtype"]])
    c = torch.rand(shape, generator=g, dtype=torch.float64) * CMAG[case["mag"]]
    if case["sparse"]:  # error only on the tokens p~ ignores (exact sinks / window elsewhere)
        c = torch.where(p.to(torch.float64) < p.to(torch.float64).amax(-1, keepdim=True), c * 50, torch.zeros_like(c))
    return p, c.to(DTYPES[case["dtype"]])


def check_forms(case, rows=None):
    """fast >= reference and fast <= reference (1 + 1e-4) + 1e-6 for every form (rows: subsample)."""
    p, c = build(case)
    got = fast.tv_bound_forms(p, c)
    for r in range(case["rows"]) if rows is None else rows:
        want = ref.tv_bound_forms([float(v) for v in p[0, r].double()], [float(v) for v in c[0, r].double()])
        for name in fast.core.certify.FORMS:
            f = mpf(float(got[name][0, r]))
            w = want[name]
            msg = f"{name}: fast {f} vs reference {w}; reproduce: check_forms({json.dumps(case)})"
            assert f >= w, "fast below reference (unsound) " + msg
            if w <= FP32_MAX / 2:  # a form beyond fp32 range is reported as +inf: sound, and > 1 anyway
                assert f <= w * (1 + mpf("1e-4")) + mpf("1e-6"), "fast uselessly loose " + msg


CASE_SMALL = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 3), "N": st.integers(1, 48),
    "mag": st.sampled_from(sorted(LOGIT)), "dtype": st.sampled_from(sorted(DTYPES)), "sparse": st.booleans()})
CASE_LARGE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 4), "N": st.integers(49, 3000),
    "mag": st.sampled_from(sorted(LOGIT)), "dtype": st.sampled_from(sorted(DTYPES)), "sparse": st.booleans()})


@settings(max_examples=300)
@replay("test_forms_ge_reference")
@example(case={"seed": 0, "rows": 1, "N": 1, "mag": "ordinary", "dtype": "fp32", "sparse": False})
@given(case=CASE_SMALL)
def test_forms_ge_reference(case):
    """Differential, N <= 48: every row against the reference."""
    check_forms(case)


@settings(max_examples=25)
@replay("test_forms_ge_reference_large_n")
@given(case=CASE_LARGE)
def test_forms_ge_reference_large_n(case):
    """Differential, N up to 3000: the first row against the reference (mpmath cost is O(N))."""
    check_forms(case, rows=[0])


def test_forms_two_point_tight():
    """Differential on the tight family of T1d: p~ = (1/2, 1/2), c = (c, c): tanh form = tanh(c/2)."""
    for cv in (1e-7, 1e-3, 0.1, 1.0, 10.0):
        check_forms_values([0.5, 0.5], [cv, cv])


def check_forms_values(p, c):
    got = fast.tv_bound_forms(torch.tensor([[p]], dtype=torch.float64), torch.tensor([[c]], dtype=torch.float64))
    want = ref.tv_bound_forms(p, c)
    for name in fast.core.certify.FORMS:
        f = mpf(float(got[name][0, 0]))
        assert want[name] <= f <= want[name] * (1 + mpf("1e-4")) + mpf("1e-6"), (name, p, c, f, want[name])


def test_forms_zero_error_is_zero():
    """Property: c = 0 everywhere gives tanh = 0 exactly and the A-forms within fp64 margins of 0."""
    p = torch.softmax(torch.randn(2, 3, 40, dtype=torch.float64), -1)
    got = fast.tv_bound_forms(p, torch.zeros_like(p))
    assert bool((got["tanh"] == 0).all())
    assert float(got["min"].max()) <= 1e-9


def check_unnormalised_rows(case):
    """Property (fast and reference): p~ rounded to fp16/bf16 sums to 1 only approximately; the
    contract (both sides): p~ is taken as weights of the distribution p~ / sum(p~), and every form
    is >= TV(p, p~ / sum p~) with p proportional to p~ e^eps, for any |eps_j| <= c_j (here: signs
    drawn from the seed, and eps = +c on the tokens above the median weight, -c elsewhere)."""
    from mpmath import exp, fsum, workdps
    p, c = build(case)
    got = fast.tv_bound_forms(p, c)
    rng = torch.Generator().manual_seed(case["seed"] + 1)
    with workdps(60):
        for r in range(case["rows"]):
            ps = [mpf(float(v)) for v in p[0, r].double()]
            cs = [mpf(float(v)) for v in c[0, r].double()]
            total = fsum(ps)
            want = ref.tv_bound_forms(ps, cs)
            med = sorted(ps)[len(ps) // 2]
            signs = [[1 if float(u) < 0.5 else -1 for u in torch.rand(len(ps), generator=rng)] for _ in range(3)]
            signs.append([1 if v > med else -1 for v in ps])
            for sg in signs:
                w = [pj * exp(sj * cj) for pj, sj, cj in zip(ps, sg, cs)]
                z = fsum(w)
                truth = fsum(abs(wj / z - pj / total) for wj, pj in zip(w, ps)) / 2
                msg = f"true TV {truth}; reproduce: check_unnormalised_rows({json.dumps(case)})"
                assert want["min"] >= truth, f"reference min {want['min']} < " + msg
                assert mpf(float(got["min"][0, r])) >= truth, f"fast min {float(got['min'][0, r])} < " + msg
                assert want["e_form"] >= 0, f"reference e_form {want['e_form']} < 0; " + msg


UNNORMALISED = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 3), "N": st.integers(2, 48),
    "mag": st.sampled_from(["tiny", "ordinary"]), "dtype": st.sampled_from(["fp16", "bf16"]), "sparse": st.booleans()})


@settings(max_examples=60)
@replay("test_unnormalised_rows")
@example(case={"seed": 0, "rows": 1, "N": 7, "mag": "tiny", "dtype": "bf16", "sparse": False})
@given(case=UNNORMALISED)
def test_unnormalised_rows(case):
    """Property, issue 8 defect 3: a row summing below 1 must not drive (A^2 - 1)/2, hence min, below the true TV."""
    check_unnormalised_rows(case)


def test_unnormalised_row_regression():
    """The issue's example: a bf16 softmax row summing below 1 with tiny c (min used to be 0)."""
    p = torch.softmax(torch.randn(1, 1, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1e-3, -1).to(torch.bfloat16)
    assert float(p.double().sum()) < 1
    c = torch.full((1, 1, 7), 1e-6, dtype=torch.float64)
    assert float(fast.tv_bound_forms(p, c)["e_form"]) > 0
    assert ref.tv_bound_forms([float(v) for v in p[0, 0].double()], [1e-6] * 7)["e_form"] > 0


def test_logit_rounding_covers_subnormal_products():
    """Property (spec T8e): fp32 products below the normal range round with an ABSOLUTE error that a
    relative e misses; fast.core.certify.logit_rounding includes the (2.02 D s + 1) 2^-150 term."""
    from mpmath import fsum, workprec
    D, s = 64, 0.125
    q = torch.full((1, 1, D), 2.0 ** -75)
    k = torch.full((1, 1, 1, D), 0.7 * 2.0 ** -74).to(torch.float32)  # products 0.7 * 2^-149
    x = float((torch.matmul(q[0], k[0, 0].T) * torch.tensor(s, dtype=torch.float32))[0, 0])
    with workprec(400):
        exact = s * fsum(mpf(float(a)) * mpf(float(b)) for a, b in zip(q.view(-1).double(), k.view(-1).double()))
        err = abs(mpf(x) - exact)
    e = float(fast.core.certify.logit_rounding(q, k.abs().amax(-2).double(), s)[0, 0])
    assert err <= mpf(e), (err, e)


@settings(max_examples=200, deadline=None)
@given(e=st.floats(1e-30, 1e2), n=st.integers(1, 1 << 20), D=st.sampled_from([16, 64, 128, 256]),
       drift=st.floats(0, 100), rescales=st.integers(0, 4096))
def test_weight_rounding_ge_reference(e, n, D, drift, rescales):
    """Differential (spec T5c): fast.core.certify.weight_rounding >= the 60-digit eta + n beta / sum a with
    sum a >= 1, eta = expm1(theta) exactly, beta = 2^-126 (the twin's theta, and the Triton kernel's)."""
    import numpy as np
    from mpmath import expm1, workdps
    from fast.core.certify import EXP32_EPS, U32, weight_rounding
    from reference.value import served_weights_tv_bound
    with workdps(60):
        T = min(2 * mpf(e) / ((D + 4) * mpf(U32)), mpf(88))
        for args, theta in (((), mpf(U32) * T + 2 * mpf(EXP32_EPS)),
                            ((drift, rescales), 2 * mpf(U32) * (T + mpf(drift)) + 2 * mpf(EXP32_EPS) * (1 + rescales))):
            if args and not rescales:
                continue  # rescales = 0 is the twin's formula
            fast_r = mpf(float(weight_rounding(np.array([e]), n, D, *args)[0]))
            want = served_weights_tv_bound(n, expm1(theta), mpf(2) ** -126, 1)
            assert fast_r >= want, (fast_r, want, e, n, D, args)
            assert fast_r <= want * (1 + mpf("1e-9")) + mpf("1e-300")  # not loose
