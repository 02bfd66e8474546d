"""T8: the proved floating-point margin covers the exact sum, for the reference's simulated
roundings and for the sums torch actually computes."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf, workprec

from reference import floats

F32 = st.floats(min_value=0, max_value=2.0 ** 100, width=32, allow_subnormal=True)
F64 = st.floats(min_value=0, max_value=1e300, allow_subnormal=True)


def exact_sum(values):
    with workprec(floats.EXACT_BITS):
        return sum((mpf(v) for v in values), mpf(0))


def check_margin(values, computed, fmt):
    bound = floats.sum_upper_bound(computed, len(values), fmt)
    exact = exact_sum(values)
    assert exact <= bound, f"reproducer: fmt={fmt} values={values!r} computed={computed!r} exact={exact} bound={bound}"


@settings(max_examples=300)
@given(st.lists(F32, min_size=1, max_size=40))
def test_fsum_margin_bounds_exact_sum(values):
    """property: the reference's left-to-right fp32 sum, divided by 1 - gamma_n, bounds the exact sum."""
    check_margin(values, floats.fsum(values, "fp32"), "fp32")


@settings(max_examples=200)
@given(st.lists(F32, min_size=1, max_size=300), st.lists(F64, min_size=1, max_size=300))
def test_torch_sum_within_margin(v32, v64):
    """differential: torch's own reduction order (a tree) stays within the proved margin."""
    check_margin(v32, float(torch.tensor(v32, dtype=torch.float32).sum()), "fp32")
    check_margin(v64, float(torch.tensor(v64, dtype=torch.float64).sum()), "fp64")


@settings(max_examples=300)
@given(F32, F32)
def test_round_nearest_matches_hardware_fp32(a, b):
    """differential: the reference rounding of a + b equals numpy's fp32 addition."""
    hw = float(np.float32(a) + np.float32(b))
    ref = floats.round_nearest(mpf(a) + mpf(b), "fp32")
    assert ref == mpf(hw), f"reproducer: a={a!r} b={b!r} hw={hw!r} ref={ref}"


def test_margin_is_needed():
    """property: without the margin the computed fp32 sum can undershoot the exact one."""
    values = [1.0] + [2.0 ** -25] * 8  # each 2^-25 is lost to rounding at 1.0
    computed = floats.fsum(values, "fp32")
    assert computed < exact_sum(values) <= floats.sum_upper_bound(computed, len(values))
