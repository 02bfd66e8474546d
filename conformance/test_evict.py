"""Eviction certificates (spec T7): the reference bounds against the exact TV."""
from hypothesis import given, settings, target
from hypothesis import strategies as st
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, close, expect, le, replay
from reference.band import band_norms, logit_error_bound, witness
from reference.evict import evict_bound, evict_tv, group_witness
from reference.rope import rope_bands
from reference.softmax import softmax, tv, tv_bound_forms


def inner(a, b):
    return fsum(mpf(x) * mpf(y) for x, y in zip(a, b))


def kept_softmax(x, kept):
    """p^K: softmax over the kept tokens, 0 on the evicted ones."""
    p_kept = softmax([x[j] for j in kept])
    out = [mpf(0)] * len(x)
    for j, pj in zip(kept, p_kept):
        out[j] = pj
    return out


@workdps(DPS)
def check_mass(case):
    """evict_tv(x, K) = p(E) = TV(p, p^K), the TV computed directly (T7a)."""
    x, kept = case["x"], case["kept"]
    p = softmax(x)
    direct = tv(p, kept_softmax(x, kept))
    mass = fsum(p[j] for j in range(len(x)) if j not in kept)
    value = evict_tv(x, kept)
    expect(close(value, direct) and close(value, mass), check_mass, case,
           f"evict_tv {value}, TV(p, p^K) {direct}, p(E) {mass}")


@st.composite
def evictions(draw):
    n = draw(st.integers(1, 10))
    kept = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    return {"x": draw(st.lists(st.floats(-20, 20), min_size=n, max_size=n)), "kept": sorted(kept)}


@settings(max_examples=200)
@replay("test_evict_tv_equals_mass")
@given(case=evictions())
def test_evict_tv_equals_mass(case):
    """property: the TV of evicting E is exactly the mass p puts on E (T7a)."""
    check_mass(case)


@st.composite
def caches(draw):
    """Kept keys, evicted keys in groups, a query (random, or aimed at an evicted key)."""
    B = draw(st.sampled_from([1, 2]))
    D = 2 * B * draw(st.integers(1, 2))
    vec = st.lists(st.floats(-3, 3), min_size=D, max_size=D)
    groups = draw(st.lists(st.lists(vec, min_size=1, max_size=4), min_size=1, max_size=3))
    return {"B": B, "layout": draw(st.sampled_from(["rotate_half", "interleaved"])),
            "kept": draw(st.lists(vec, min_size=1, max_size=4)), "groups": groups, "q": draw(vec),
            "aim": draw(st.sampled_from(["random", "far_key", "far_band"])),
            "scale": draw(st.sampled_from([0.5, 1.0, 2.0])), "slack": draw(st.floats(0, 2))}


def aimed_query(case, bands):
    """The adversary: q along the evicted key farthest from its group centre (far_key), or
    band by band along that key's offset from the centre (far_band), keeping ||q_b||."""
    q = [mpf(v) for v in case["q"]]
    best, offset = mpf(-1), None
    for keys in case["groups"]:
        _, mu, _ = group_witness(keys, bands)
        for k in keys:
            diff = [mpf(a) - m for a, m in zip(k, mu)]
            size = fsum(v * v for v in diff)
            if size > best:
                best, offset, far = size, diff, k
    if case["aim"] == "far_key":
        length = fsum(v * v for v in q) ** 0.5
        far_len = fsum(mpf(v) ** 2 for v in far) ** 0.5
        return q if far_len == 0 else [length * mpf(v) / far_len for v in far]
    out = list(q)
    for band, qn, rn in zip(bands, band_norms(q, bands), band_norms(offset, bands)):
        if rn > 0:
            for i in band:
                out[i] = qn * offset[i] / rn
    return out


@workdps(DPS)
def check_group_bound(case):
    """x_j <= s<q, mu_g> + s sum_b ||q_b|| R_{g,b} for every evicted key (T7c), and
    evict_tv <= evict_bound with L = Z_K e^{-slack} <= Z_K (T7b)."""
    bands = rope_bands(len(case["q"]), case["B"], case["layout"])
    s = mpf(case["scale"])
    q = case["q"] if case["aim"] == "random" else aimed_query(case, bands)
    q_norms = band_norms(q, bands)
    witnesses = [group_witness(keys, bands) for keys in case["groups"]]
    logits = [s * inner(q, k) for k in case["kept"]]
    for keys, (n_g, mu, radii) in zip(case["groups"], witnesses):
        expect(n_g == len(keys), check_group_bound, case, f"group count {n_g} != {len(keys)}")
        top = s * inner(q, mu) + s * fsum(qb * rb for qb, rb in zip(q_norms, radii))
        for k in keys:
            x = s * inner(q, k)
            expect(le(x, top), check_group_bound, case, f"evicted logit {x} > group bound {top}")
            logits.append(x)
    kept = list(range(len(case["kept"])))
    log_z_kept = log(fsum(exp(x) for x in logits[:len(kept)]))
    truth = evict_tv(logits, kept)
    bound = evict_bound(q, witnesses, log_z_kept - mpf(case["slack"]), s, bands)
    expect(le(truth, bound), check_group_bound, case, f"TV {truth} > eviction bound {bound}")
    if bound > 0:
        target(float(truth / bound), label="TV / eviction bound")


@settings(max_examples=300)
@replay("test_group_bound_holds_adversarial")
@given(case=caches())
def test_group_bound_holds_adversarial(case):
    """property: the group witness bounds every evicted logit and the eviction TV, for random
    queries and queries aimed at the evicted key farthest from its centre."""
    check_group_bound(case)


@st.composite
def compositions(draw):
    """Keys, their quantized copies, a query and a kept set."""
    B = draw(st.sampled_from([1, 2]))
    D = 2 * B * draw(st.integers(1, 2))
    n = draw(st.integers(2, 7))
    vec = st.lists(st.floats(-3, 3), min_size=D, max_size=D)
    keys = draw(st.lists(vec, min_size=n, max_size=n))
    step = draw(st.floats(1e-2, 1))
    kept = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n - 1, unique=True))
    return {"B": B, "keys": keys, "k_hat": [[step * round(v / step) for v in k] for k in keys],
            "q": draw(vec), "scale": draw(st.sampled_from([0.5, 1.0])), "kept": sorted(kept)}


@workdps(DPS)
def check_triangle(case):
    """TV(p, p~^K) <= TV(p, p^K) + TV(p^K, p~^K) (T7d), and the certified composition:
    evict_bound with L = sum_{j in K} e^{x~_j - c_j} <= Z_K plus the T2 forms on p~^K."""
    bands = rope_bands(len(case["q"]), case["B"], "rotate_half")
    s, q, keys, k_hat, kept = mpf(case["scale"]), case["q"], case["keys"], case["k_hat"], case["kept"]
    x = [s * inner(q, k) for k in keys]
    x_hat = [s * inner(q, k) for k in k_hat]
    c = [logit_error_bound(q, witness(k, kh, bands), bands, s) for k, kh in zip(keys, k_hat)]
    p, p_kept, p_hat_kept = softmax(x), kept_softmax(x, kept), kept_softmax(x_hat, kept)
    whole, evicted, quantized = tv(p, p_hat_kept), tv(p, p_kept), tv(p_kept, p_hat_kept)
    expect(le(whole, evicted + quantized), check_triangle, case, f"TV {whole} > {evicted} + {quantized}")
    lower = log(fsum(exp(x_hat[j] - c[j]) for j in kept))
    expect(le(lower, log(fsum(exp(x[j]) for j in kept))), check_triangle, case, f"log L = {lower} > log Z_K")
    groups = [group_witness([keys[j]], bands) for j in range(len(keys)) if j not in kept]
    forms = tv_bound_forms([p_hat_kept[j] for j in kept], [c[j] for j in kept])
    certified = evict_bound(q, groups, lower, s, bands) + forms["min"]
    expect(le(whole, certified), check_triangle, case, f"TV {whole} > certified composition {certified}")


@settings(max_examples=200)
@replay("test_tv_triangle")
@given(case=compositions())
def test_tv_triangle(case):
    """property: eviction plus quantization of the kept tokens composes by the triangle
    inequality, and the certified composition bounds the true TV (T7d)."""
    check_triangle(case)
