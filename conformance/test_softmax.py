"""Softmax shift bounds (spec T1, T2): the reference bounds against the exact TV."""
from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from mpmath import exp, mpf, tanh, workdps

from conformance._check import DPS, close, expect, le, replay
from reference.softmax import softmax, tv, tv_bound_forms, tv_bound_interval, tv_bound_oracle, tv_bound_tanh

FORMS = ("tanh", "one_minus_b_over_a", "e_form", "min")
logit = st.floats(-8, 8)
unit = st.floats(0, 1)


@st.composite
def boxes(draw, max_n=6):
    """Logits x~ (so p~ = softmax x~), per-token bounds c_j and a point u of the unit box."""
    n = draw(st.integers(1, max_n))
    if draw(st.booleans()):  # one bound for every token: the case the tanh form is made for
        c = [draw(st.floats(0, 3))] * n
    else:
        c = draw(st.lists(st.floats(0, 3), min_size=n, max_size=n))
    return {"x_tilde": draw(st.lists(logit, min_size=n, max_size=n)), "c": c,
            "u": draw(st.lists(unit, min_size=n, max_size=n))}


def corner_shifts(c):
    """The 2^n corners of the box: eps_j = +c_j on S, -c_j off S (the worst cases of T2)."""
    n = len(c)
    return [[mpf(c[j]) if mask >> j & 1 else -mpf(c[j]) for j in range(n)] for mask in range(2**n)]


@workdps(DPS)
def shifted_tv(x_tilde, eps):
    """TV(p, p~) with p = softmax(x~ + eps) and p~ = softmax(x~)."""
    return tv(softmax([mpf(a) + e for a, e in zip(x_tilde, eps)]), softmax(x_tilde))


@workdps(DPS)
def check_interval(case):
    """TV <= tanh((b-a)/4) for every shift in [a, b]: all corners and one inner point (T1a, T1b)."""
    lo, hi, x_tilde = mpf(case["lo"]), mpf(case["lo"]) + mpf(case["width"]), case["x_tilde"]
    bound = tv_bound_interval(lo, hi)
    n = len(x_tilde)
    shifts = [[hi if mask >> j & 1 else lo for j in range(n)] for mask in range(2**n)]
    shifts.append([lo + mpf(u) * (hi - lo) for u in case["u"]])
    worst = max(shifted_tv(x_tilde, eps) for eps in shifts)
    expect(le(worst, bound), check_interval, case, f"TV {worst} > tanh((b-a)/4) = {bound}")
    if bound > 0:
        target(float(worst / bound), label="TV / tanh((b-a)/4)")


@st.composite
def intervals(draw):
    """Logits x~, an interval [lo, lo + width] of shifts and a point u of the unit box."""
    n = draw(st.integers(1, 6))
    return {"x_tilde": draw(st.lists(logit, min_size=n, max_size=n)), "lo": draw(st.floats(-4, 4)),
            "width": draw(st.floats(0, 6)), "u": draw(st.lists(unit, min_size=n, max_size=n))}


@settings(max_examples=300)
@replay("test_interval_bound_ge_true_tv")
@given(case=intervals())
def test_interval_bound_ge_true_tv(case):
    """property: shifts eps_j in [a, b] give TV(p, p~) <= tanh((b-a)/4), at every corner of
    the box (the adversarial shifts) and at a random inner point."""
    check_interval(case)


@workdps(DPS)
def check_forms(case):
    """Every form of T2 >= the exact TV at all corners and one inner point; B <= Z <= A (T2b)."""
    x_tilde, c = case["x_tilde"], case["c"]
    p_tilde = softmax(x_tilde)
    forms = tv_bound_forms(p_tilde, c)
    big_a = sum(p * exp(mpf(cj)) for p, cj in zip(p_tilde, c))
    big_b = sum(p * exp(-mpf(cj)) for p, cj in zip(p_tilde, c))
    shifts = corner_shifts(c) + [[mpf(cj) * (2 * mpf(u) - 1) for cj, u in zip(c, case["u"])]]
    worst = mpf(0)
    for eps in shifts:
        z = sum(p * exp(e) for p, e in zip(p_tilde, eps))
        expect(le(big_b, z) and le(z, big_a), check_forms, case,
               f"Z = {z} outside [B, A] = [{big_b}, {big_a}] at eps {eps}")
        worst = max(worst, shifted_tv(x_tilde, eps))
    for name in FORMS:
        expect(le(worst, forms[name]), check_forms, case, f"TV {worst} > form {name} = {forms[name]}")
    if forms["min"] > 0:
        target(float(worst / forms["min"]), label="TV / min form")


@settings(max_examples=300)
@replay("test_forms_ge_true_tv_adversarial")
@given(case=boxes())
def test_forms_ge_true_tv_adversarial(case):
    """property: with |eps_j| <= c_j, every closed form (tanh, 1 - B/A, (A^2-1)/2, min) is
    >= the exact TV, at all 2^n corners eps = +c on S, -c off S and at a random inner point."""
    check_forms(case)


@workdps(DPS)
def check_two_point(case):
    """p~ = (1/(1+e^c), e^c/(1+e^c)), eps = (c, -c): TV = tanh(c/2) to 40 digits (T1d)."""
    c = mpf(case["c"])
    truth = tv(softmax([c, 0]), softmax([0, c]))  # x~ = (0, c), x = x~ + eps = (c, 0)
    expected = tanh(c / 2)
    expect(abs(truth - expected) <= mpf(10) ** -40, check_two_point, case, f"TV {truth} != tanh(c/2) {expected}")
    for name, value in (("tv_bound_tanh", tv_bound_tanh(c)), ("oracle", tv_bound_oracle(softmax([0, c]), [c, c])),
                        ("forms.tanh", tv_bound_forms(softmax([0, c]), [c, c])["tanh"])):
        expect(abs(value - expected) <= mpf(10) ** -40, check_two_point, case,
               f"{name} {value} != tanh(c/2) {expected}")


@settings(max_examples=100)
@replay("test_tanh_tight_on_two_point")
@given(case=st.fixed_dictionaries({"c": st.floats(0, 10)}))
def test_tanh_tight_on_two_point(case):
    """property: the tanh form is reached exactly on the two-point family (T1d)."""
    check_two_point(case)


@workdps(DPS)
def check_a_mul_b(case):
    """A * B >= 1 (T2a), and the reference's forms are 1 - B/A and (A^2-1)/2 of these A, B."""
    p_tilde, c = softmax(case["x_tilde"]), case["c"]
    big_a = sum(p * exp(mpf(cj)) for p, cj in zip(p_tilde, c))
    big_b = sum(p * exp(-mpf(cj)) for p, cj in zip(p_tilde, c))
    expect(le(1, big_a * big_b), check_a_mul_b, case, f"A*B = {big_a * big_b} < 1")
    forms = tv_bound_forms(p_tilde, c)
    expect(close(forms["one_minus_b_over_a"], 1 - big_b / big_a) and close(forms["e_form"], (big_a**2 - 1) / 2),
           check_a_mul_b, case, f"forms {forms} disagree with A = {big_a}, B = {big_b}")
    capped = max(0, min(1, forms["tanh"], forms["one_minus_b_over_a"], forms["e_form"]))
    expect(close(forms["min"], capped), check_a_mul_b, case, f"min {forms['min']} is not the capped minimum")


@settings(max_examples=200)
@replay("test_a_mul_b_ge_one")
@given(case=boxes(max_n=12))
def test_a_mul_b_ge_one(case):
    """property: A = sum p~ e^c and B = sum p~ e^-c satisfy A * B >= 1 (T2a)."""
    check_a_mul_b(case)


@workdps(DPS)
def check_oracle(case):
    """truth <= oracle = the worst corner, and every closed form >= oracle; logs the looseness."""
    x_tilde, c = case["x_tilde"], case["c"]
    p_tilde = softmax(x_tilde)
    oracle = tv_bound_oracle(p_tilde, c)
    corners = max(shifted_tv(x_tilde, eps) for eps in corner_shifts(c))
    inner = shifted_tv(x_tilde, [mpf(cj) * (2 * mpf(u) - 1) for cj, u in zip(c, case["u"])])
    expect(le(inner, oracle), check_oracle, case, f"TV {inner} at an inner point > oracle {oracle}")
    expect(close(corners, oracle), check_oracle, case, f"oracle {oracle} != worst corner TV {corners}")
    forms = tv_bound_forms(p_tilde, c)
    for name in FORMS:
        expect(le(oracle, forms[name]), check_oracle, case, f"form {name} = {forms[name]} < oracle {oracle}")
    if oracle > mpf(10) ** -12:
        for name in FORMS:
            ratio = float(forms[name] / oracle)
            bucket = next(b for b in (1.01, 1.1, 1.5, 2, 4, 10, 100, float("inf")) if ratio <= b)
            event(f"{name} / oracle: <= {bucket}")
        target(float(oracle / forms["min"]), label="oracle / min form")


@settings(max_examples=250)
@replay("test_forms_ge_oracle")
@given(case=boxes())
def test_forms_ge_oracle(case):
    """property: the enumerated oracle is the exact worst case (>= any inner point, = the worst
    corner) and each closed form is >= it. Events record form/oracle (the looseness)."""
    check_oracle(case)


@workdps(DPS)
def check_spread_not_a_bound(case):
    """The p~-weighted mean deviation of the c_j is NOT a TV bound (math.md T2 counterexample)."""
    p_tilde, c, eps = case["p_tilde"], case["c"], case["eps"]
    truth = tv(softmax([mpf(e) for e in eps]), p_tilde)  # x~ = 0 gives p~ = (1/2, 1/2)
    mean = sum(mpf(p) * mpf(cj) for p, cj in zip(p_tilde, c))
    spread = sum(mpf(p) * abs(mpf(cj) - mean) for p, cj in zip(p_tilde, c))
    expect(abs(truth - mpf("0.0498")) < mpf("0.00005"), check_spread_not_a_bound, case, f"TV {truth} != 0.0498")
    expect(truth > spread, check_spread_not_a_bound, case, f"spread {spread} >= TV {truth}")
    expect(le(truth, tv_bound_forms(p_tilde, c)["min"]), check_spread_not_a_bound, case, "the real forms fail")


def test_weighted_spread_is_not_a_bound():
    """property: p~ = (1/2, 1/2), c = (0.1, 0.1), eps = (+0.1, -0.1) has TV 0.0498 while the
    p~-weighted mean deviation of c is 0; the certified forms still hold."""
    check_spread_not_a_bound({"p_tilde": [0.5, 0.5], "c": [0.1, 0.1], "eps": [0.1, -0.1]})
