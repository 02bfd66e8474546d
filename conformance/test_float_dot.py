"""T8d-T8f (proofs/FloatDot.v): the signed fp32 dot product and the logit rounding bound,
and the lower-direction margin of sums of nonnegative terms, against exact arithmetic.

property (reference vs truth): the reference's simulated fp32 dot products (products rounded
then added, or fused multiply-adds) times fl32(s) stay within reference.floats.
logit_rounding_bound; products below the normal range need its absolute part.
differential (torch vs reference bound): torch's fp32 matmul times the fp32 scale, as
fast.core.attention computes the logits, stays within it; torch's fp32 and fp64 sums of
nonnegative terms, times 1 - gamma_n, stay below the exact sum.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf, workprec

from reference import floats

F32 = st.floats(min_value=-2.0 ** 60, max_value=2.0 ** 60, width=32, allow_subnormal=True)
TINY = st.floats(min_value=-2.0 ** -60, max_value=2.0 ** -60, width=32, allow_subnormal=True)
SCALES = st.sampled_from([1.0, 0.125, 0.08838834764831845, 0.5, 3.0])
POS32 = st.floats(min_value=0, max_value=2.0 ** 100, width=32, allow_subnormal=True)
POS64 = st.floats(min_value=0, max_value=1e300, allow_subnormal=True)


def exact_logit(q, k, s):
    with workprec(floats.EXACT_BITS):
        return mpf(s) * sum((mpf(a) * mpf(b) for a, b in zip(q, k)), mpf(0))


def check_logit(q, k, s, computed):
    rel, absolute = floats.logit_rounding_bound(q, k, s)
    with workprec(floats.EXACT_BITS):
        err = abs(mpf(computed) - exact_logit(q, k, s))
        assert err <= rel + absolute, \
            f"reproducer: q={q!r} k={k!r} s={s!r} computed={computed!r} error={err} bound={rel} + {absolute}"
    return err, rel


def pairs(elements):
    return st.integers(1, 48).flatmap(lambda D: st.tuples(st.lists(elements, min_size=D, max_size=D),
                                                          st.lists(elements, min_size=D, max_size=D)))


@settings(max_examples=200, deadline=None)
@given(pairs(st.one_of(F32, TINY)), SCALES, st.booleans())
def test_reference_logit_within_bound(qk, s, fma):
    """property: fl(fdot(q, k) * fl32(s)), products then sums or fused, within T8e's bound."""
    q, k = qk
    s32 = floats.round_nearest(s, "fp32")
    x = floats.round_nearest(floats.fdot(q, k, "fp32", fma) * s32, "fp32")
    check_logit(q, k, s, x)


@settings(max_examples=200, deadline=None)
@given(pairs(st.one_of(F32, TINY)), SCALES)
def test_torch_logit_within_bound(qk, s):
    """differential: torch.matmul in fp32 times the fp32 scale (fast.core.attention's logits)."""
    q, k = qk
    qt = torch.tensor([q], dtype=torch.float32)
    kt = torch.tensor([k], dtype=torch.float32)
    x = torch.matmul(qt, kt.T) * torch.tensor(s, dtype=torch.float32)
    check_logit(q, k, s, float(x[0, 0]))


@settings(max_examples=200, deadline=None)
@given(pairs(st.integers(-127, 127)), SCALES, st.sampled_from([2.0 ** -24, 6.1e-5, 0.0123, 1.0, 300.0]))
def test_torch_logit_scaled_within_bound(qm, s, sc):
    """differential: the int8 path with one scale per token, fl(fl(fl(q . m) sc) s32), as
    fast.core.attention computes it, within T8e's scaled bound."""
    m, _ = qm
    q = [float(v) for v in torch.randn(len(m), generator=torch.Generator().manual_seed(len(m)))]
    sc32 = float(torch.tensor(sc, dtype=torch.float32))
    x = torch.matmul(torch.tensor([q]), torch.tensor([m], dtype=torch.float32).T) \
        * torch.tensor(sc32, dtype=torch.float32) * torch.tensor(s, dtype=torch.float32)
    rel, absolute = floats.logit_rounding_bound(q, m, s, code_scale=sc32)
    with workprec(floats.EXACT_BITS):
        exact = mpf(s) * mpf(sc32) * sum((mpf(a) * mpf(b) for a, b in zip(q, m)), mpf(0))
        err = abs(mpf(float(x[0, 0])) - exact)
        assert err <= rel + absolute, f"reproducer: q={q!r} m={m!r} s={s!r} sc={sc32!r} error={err} bound={rel} + {absolute}"


def test_subnormal_products_need_the_absolute_term():
    """property: products below the normal range round with an absolute error that the
    relative part (the code's e) does not cover; the proved bound does."""
    D, s = 64, 0.125
    q = [2.0 ** -75] * D
    k = [float(torch.tensor(0.7 * 2.0 ** -74, dtype=torch.float32))] * D    # products 0.7 * 2^-149
    x = torch.matmul(torch.tensor([q]), torch.tensor([k]).T) * torch.tensor(s, dtype=torch.float32)
    err, rel = check_logit(q, k, s, float(x[0, 0]))
    assert err > rel + mpf(2) ** -150                                        # beyond e + one subnormal rounding


def check_lower(values, computed, fmt):
    with workprec(floats.EXACT_BITS):
        exact = sum((mpf(v) for v in values), mpf(0))
    low = floats.sum_lower_bound(computed, len(values), fmt)
    assert low <= exact, f"reproducer: fmt={fmt} values={values!r} computed={computed!r} exact={exact} lower={low}"


@settings(max_examples=200, deadline=None)
@given(st.lists(POS32, min_size=1, max_size=300), st.lists(POS64, min_size=1, max_size=300))
def test_torch_sum_lower_bound(v32, v64):
    """differential: torch's fp32 and fp64 reductions (a tree) times 1 - gamma_n stay <= exact (T8f)."""
    check_lower(v32, float(torch.tensor(v32, dtype=torch.float32).sum()), "fp32")
    check_lower(v64, float(torch.tensor(v64, dtype=torch.float64).sum()), "fp64")


def test_lower_margin_is_needed():
    """property: a computed sum can exceed the exact one (rounding up), so the margin is needed."""
    values = [1.0, 0.75 * 2.0 ** -23]
    computed = floats.fsum(values, "fp32")
    with workprec(floats.EXACT_BITS):
        exact = mpf(1) + mpf(0.75) * mpf(2) ** -23
    assert computed > exact >= floats.sum_lower_bound(computed, 2)
