"""T8g (proofs/Codec.v): the int8 / int4 round trip with the code's fp32 operations.

property (reference vs truth): reference.floats.int_codec_round_trip's x~ is within the proved
bound scale (1/2 + u qmax (1 + 2^-52) + 2^-150), itself below half the code's step
scale (1 + 2^-10) / 2. differential (fast vs reference): fast.dequantize(fast.quantize(x)) equals
the reference round trip coordinate by coordinate, with the fast codec's own fp16 scales.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf, workprec

import fast
from fast.core.quant import QMAX
from reference import floats

F32 = st.floats(min_value=-1e4, max_value=1e4, width=32, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(F32, min_size=8, max_size=8), st.sampled_from(["int8", "int4"]),
       st.sampled_from([1.0, 1e-3, 1e-30, 1e3]))
def test_codec_round_trip_within_half_step(xs, scheme, mag):
    """differential + property: fast round trip == reference round trip, within the T8g bound
    and within half the code's step."""
    x = torch.tensor(xs, dtype=torch.float32).mul(mag).clamp(-4e5, 4e5).view(1, 1, 1, 8)
    qt = fast.quantize(x, scheme, group_size=8)
    xd = fast.dequantize(qt)
    sc = float(qt.scales.flatten()[0])
    half = qt.step().double() / 2
    for i in range(8):
        xi = float(x[0, 0, 0, i])
        xt, bound = floats.int_codec_round_trip(xi, sc, QMAX[scheme])
        with workprec(floats.EXACT_BITS):
            assert xt == mpf(float(xd[0, 0, 0, i])), f"reproducer: x={xi!r} scale={sc!r} {scheme}: fast {float(xd[0, 0, 0, i])} != reference {xt}"
            err = abs(mpf(xi) - xt)
            assert err <= bound <= mpf(float(half[0, 0, 0, i])), \
                f"reproducer: x={xi!r} scale={sc!r} {scheme}: error {err}, bound {bound}, half step {float(half[0, 0, 0, i])}"
