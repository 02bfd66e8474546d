"""Eviction on a quantized cache (spec T7e-T7h): radii and kept mass measured on the STORED
keys, certified against the truth from the EXACT keys.

property (reference vs truth): reference.evict.group_witness_of_stored radii bound the exact
evicted keys' offsets from the centre (T7e); reference.evict.log_z_kept_lower <= exact log Z_K
(T7f); the composed bound U/(L+U) + min forms on K is >= TV(p, p~^K) (T7g, T7h).
The fast side: conformance/test_fast_evict_glue.py.
"""
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, expect, le, replay
from reference.band import band_norms, logit_error_bound, witness
from reference.evict import evict_bound, group_witness_of_stored, log_z_kept_lower
from reference.rope import rope_bands
from reference.softmax import softmax, tv, tv_bound_forms


def inner(a, b):
    return fsum(mpf(x) * mpf(y) for x, y in zip(a, b))


def quantize(k, step):
    """A uniform quantizer (exact in binary: step is a power of two)."""
    return [round(v / step) * step for v in k]


@st.composite
def caches(draw):
    NB = draw(st.sampled_from([1, 2]))
    D = 2 * NB * draw(st.integers(1, 2))
    vec = st.lists(st.floats(-3, 3, width=32), min_size=D, max_size=D)
    return {"NB": NB, "kept": draw(st.lists(vec, min_size=1, max_size=4)),
            "evicted": draw(st.lists(vec, min_size=1, max_size=5)), "q": draw(vec),
            "step": draw(st.sampled_from([2.0 ** -6, 2.0 ** -3, 0.5])),
            "scale": draw(st.sampled_from([0.5, 1.0, 2.0])),
            "aim": draw(st.sampled_from(["random", "far_key"]))}


@workdps(DPS)
def check_stored_witness(case):
    """T7e radii, T7f kept mass, T7h composed bound, each against the exact keys."""
    D = len(case["q"])
    bands = rope_bands(D, case["NB"], "rotate_half")
    s = mpf(case["scale"])
    kept, ev = case["kept"], case["evicted"]
    kept_st = [quantize(k, case["step"]) for k in kept]
    ev_st = [quantize(k, case["step"]) for k in ev]
    kept_rho = [witness(k, kt, bands) for k, kt in zip(kept, kept_st)]
    ev_rho = [witness(k, kt, bands) for k, kt in zip(ev, ev_st)]
    n_g, mu, radii = group_witness_of_stored(ev_st, ev_rho, bands)
    q = case["q"]
    if case["aim"] == "far_key":                                            # q along the farthest exact offset
        far = max(ev, key=lambda k: fsum((mpf(a) - m) ** 2 for a, m in zip(k, mu)))
        q = [mpf(a) - m for a, m in zip(far, mu)]
    q_norms = band_norms(q, bands)
    for j, k in enumerate(ev):                                              # T7e
        off = band_norms([mpf(a) - m for a, m in zip(k, mu)], bands)
        for b, (o, r) in enumerate(zip(off, radii)):
            expect(le(o, r), check_stored_witness, case, f"evicted {j} band {b}: exact offset {o} > radius {r}")
        top = s * inner(q, mu) + s * fsum(a * r for a, r in zip(q_norms, radii))
        expect(le(s * inner(q, k), top), check_stored_witness, case, f"evicted {j}: exact logit above the group bound")
    c = logit_error_bound(q, kept_rho, bands, s)
    lz = log_z_kept_lower(q, kept_st, c, s)                                 # T7f
    x_kept = [s * inner(q, k) for k in kept]
    log_zk = log(fsum(exp(x) for x in x_kept))
    expect(le(lz, log_zk), check_stored_witness, case, f"log_z_kept_lower {lz} > exact log Z_K {log_zk}")
    x_served = [s * inner(q, k) for k in kept_st]                           # T7g, T7h
    p_served = softmax(x_served)
    bound = evict_bound(q, [(n_g, mu, radii)], lz, s, bands) + tv_bound_forms(p_served, c)["min"]
    x_all = x_kept + [s * inner(q, k) for k in ev]
    truth = tv(softmax(x_all), p_served + [mpf(0)] * len(ev))
    expect(le(truth, bound), check_stored_witness, case, f"composed bound {bound} < TV(p, p~^K) {truth}")


@settings(max_examples=60, deadline=None)
@replay("test_stored_witness_bounds_exact_keys")
@given(case=caches())
def test_stored_witness_bounds_exact_keys(case):
    """property: T7e-T7h on the reference, against the exact keys."""
    check_stored_witness(case)
