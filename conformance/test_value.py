"""Value-error bound (spec T5): the reference bound against the exact output error."""
from hypothesis import given, settings, target
from hypothesis import strategies as st
from mpmath import fsum, mpf, sqrt, workdps

from conformance._check import DPS, expect, le, replay
from reference.softmax import softmax, tv, tv_bound_forms
from reference.value import diameter, value_error_bound


def norm(v):
    return sqrt(fsum(mpf(x) ** 2 for x in v))


def weighted(p, vectors):
    """sum_j p_j v_j."""
    return [fsum(pj * mpf(v[i]) for pj, v in zip(p, vectors)) for i in range(len(vectors[0]))]


@st.composite
def outputs(draw):
    """Logits, logit shifts, values, value errors (random, or one common error vector)."""
    n = draw(st.integers(1, 6))
    D = draw(st.integers(1, 4))
    vec = st.lists(st.floats(-5, 5), min_size=D, max_size=D)
    small = st.lists(st.floats(-0.5, 0.5), min_size=D, max_size=D)
    if draw(st.booleans()):
        errors = [draw(small)] * n  # every token off by the same vector: sum p~ ||e|| is reached
    else:
        errors = draw(st.lists(small, min_size=n, max_size=n))
    return {"x": draw(st.lists(st.floats(-8, 8), min_size=n, max_size=n)),
            "eps": draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n)),
            "v": draw(st.lists(vec, min_size=n, max_size=n)), "e": errors}


@workdps(DPS)
def check_value(case):
    """||o - o~|| <= value_error_bound(p~, v~, ||e||, tv) with tv the exact TV and with the
    certified min form of T2 (T5a); diam{v} <= diam{v~} + 2 max ||e_j|| (T5b)."""
    x, eps, v, e = case["x"], case["eps"], case["v"], case["e"]
    p = softmax(x)
    p_tilde = softmax([mpf(a) - b for a, b in zip(x, eps)])
    v_hat = [[mpf(a) - b for a, b in zip(vj, ej)] for vj, ej in zip(v, e)]
    e_norms = [norm(ej) for ej in e]
    out = weighted(p, v)
    out_hat = weighted(p_tilde, v_hat)
    err = norm([a - b for a, b in zip(out, out_hat)])
    exact_tv = tv(p, p_tilde)
    bound = value_error_bound(p_tilde, v_hat, e_norms, exact_tv)
    expect(le(err, bound), check_value, case, f"||o - o~|| = {err} > bound {bound} (exact TV {exact_tv})")
    certified_tv = tv_bound_forms(p_tilde, [abs(mpf(a)) for a in eps])["min"]
    certified = value_error_bound(p_tilde, v_hat, e_norms, certified_tv)
    expect(le(err, certified), check_value, case,
           f"||o - o~|| = {err} > bound {certified} (certified TV {certified_tv})")
    expect(le(diameter(v), diameter(v_hat) + 2 * max(e_norms)), check_value, case,
           f"diam v = {diameter(v)} > diam v~ + 2 max ||e|| = {diameter(v_hat) + 2 * max(e_norms)}")
    if bound > 0:
        target(float(err / bound), label="||o - o~|| / bound")


@settings(max_examples=300)
@replay("test_value_bound_holds")
@given(case=outputs())
def test_value_bound_holds(case):
    """property: the output error is within the T5 bound, fed the exact TV or the certified one."""
    check_value(case)
