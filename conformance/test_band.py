"""Band Cauchy-Schwarz witness (spec T4): the reference bound against the exact logit error."""
from hypothesis import given, settings, target
from hypothesis import strategies as st
from mpmath import fsum, mpf, sqrt, workdps

from conformance._check import DPS, expect, le, replay
from reference.band import band_norms, logit_error_bound, witness
from reference.rope import rope_bands, rope_rotate

coord = st.floats(-4, 4)


def inner(a, b):
    return fsum(mpf(x) * mpf(y) for x, y in zip(a, b))


@st.composite
def reads(draw):
    """A key, its compressed copy, a query, positions, and whether q is aimed at the error."""
    B = draw(st.sampled_from([1, 2, 4]))
    D = 2 * B * draw(st.integers(1, 3))
    vec = st.lists(coord, min_size=D, max_size=D)
    k = draw(vec)
    if draw(st.booleans()):  # a real round-to-grid quantizer
        step = draw(st.floats(1e-3, 1))
        k_hat = [step * round(v / step) for v in k]
    else:  # a black box: any compressed copy
        k_hat = draw(vec)
    return {"D": D, "B": B, "layout": draw(st.sampled_from(["rotate_half", "interleaved"])),
            "theta": draw(st.sampled_from([10000.0, 100000.0, 500000.0])), "k": k, "k_hat": k_hat,
            "q": draw(vec), "m": draw(st.integers(0, 2**16)), "n": draw(st.integers(0, 2**16)),
            "scale": draw(st.sampled_from([0.125, 0.08838834764831845, 1.0])), "aligned": draw(st.booleans())}


def aim(q, r, bands):
    """q_b = ||q_b|| r_b / ||r_b||: the query that makes band Cauchy-Schwarz an equality."""
    out = [mpf(v) for v in q]
    for band, qn, rn in zip(bands, band_norms(q, bands), band_norms(r, bands)):
        if rn > 0:
            for i in band:
                out[i] = qn * r[i] / rn
    return out


@workdps(DPS)
def check_witness(case):
    """|s <R_m q, R_n (k - k_hat)>| <= s sum_b ||q_b|| rho_b, with the witness taken before
    rotation (at write time) and after it (T3 + T4c); tight when q is aimed at the error."""
    bands = rope_bands(case["D"], case["B"], case["layout"])
    rot = lambda x, pos: rope_rotate(x, pos, case["theta"], case["layout"])  # noqa: E731
    k_rot, k_hat_rot = rot(case["k"], case["n"]), rot(case["k_hat"], case["n"])
    r_rot = [a - b for a, b in zip(k_rot, k_hat_rot)]
    q_rot = rot(case["q"], case["m"])
    if case["aligned"]:
        q_rot = aim(q_rot, r_rot, bands)
    s = mpf(case["scale"])
    eps = abs(s * inner(q_rot, r_rot))
    pre = logit_error_bound(q_rot, witness(case["k"], case["k_hat"], bands), bands, s)
    post = logit_error_bound(q_rot, witness(k_rot, k_hat_rot, bands), bands, s)
    expect(le(eps, pre), check_witness, case, f"|eps| = {eps} > bound {pre} (witness before rotation)")
    expect(le(eps, post), check_witness, case, f"|eps| = {eps} > bound {post} (witness after rotation)")
    if case["aligned"]:  # the adversary reaches the bound: the test really attacks it
        expect(le(pre, eps), check_witness, case, f"aimed query: |eps| = {eps} well below the bound {pre}")
    elif pre > 0:
        target(float(eps / pre), label="|eps| / bound, random q")


@settings(max_examples=300)
@replay("test_witness_bound_holds_adversarial")
@given(case=reads())
def test_witness_bound_holds_adversarial(case):
    """property: the band witness bounds the logit error for random queries and for queries
    aligned with the error band by band, in both layouts, at random positions, with the
    witness computed before or after rotation."""
    check_witness(case)


@workdps(DPS)
def check_cauchy_schwarz(case):
    """|<q, r>| <= sum_b ||q_b|| ||r_b|| <= ||q|| ||r|| (T4a, T4b), through the reference."""
    q, r = case["q"], case["r"]
    if case["parallel"]:  # r a multiple of q: plain Cauchy-Schwarz is an equality
        r = [mpf(case["t"]) * mpf(v) for v in q]
    bands = rope_bands(len(q), case["B"], case["layout"])
    banded = logit_error_bound(q, witness(r, [0] * len(r), bands), bands, 1)
    plain = sqrt(fsum(mpf(v) ** 2 for v in q)) * sqrt(fsum(mpf(v) ** 2 for v in r))
    expect(le(abs(inner(q, r)), banded), check_cauchy_schwarz, case, f"|<q, r>| = {abs(inner(q, r))} > banded {banded}")
    expect(le(banded, plain), check_cauchy_schwarz, case, f"banded {banded} > ||q|| ||r|| = {plain}")


@st.composite
def pairs(draw):
    B = draw(st.sampled_from([1, 2, 4]))
    D = 2 * B * draw(st.integers(1, 3))
    vec = st.lists(coord, min_size=D, max_size=D)
    return {"B": B, "layout": draw(st.sampled_from(["rotate_half", "interleaved"])), "q": draw(vec),
            "r": draw(vec), "parallel": draw(st.booleans()), "t": draw(st.floats(-3, 3))}


@settings(max_examples=200)
@replay("test_band_bound_le_plain_cauchy_schwarz")
@given(case=pairs())
def test_band_bound_le_plain_cauchy_schwarz(case):
    """property: the band bound sits between |<q, r>| and ||q|| ||r||, including the equality
    case r parallel to q."""
    check_cauchy_schwarz(case)


def test_witness_rejects_bad_bands():
    """property: bands that do not partition the coordinates are refused (the bound would be
    unsound if a coordinate were left out)."""
    for bands in ([[0, 1]], [[0, 1], [1, 2, 3]], [[0, 1, 2, 3], []]):
        try:
            witness([1, 2, 3, 4], [0, 0, 0, 0], bands)
        except ValueError:
            continue
        raise AssertionError(f"witness accepted bands {bands}")
