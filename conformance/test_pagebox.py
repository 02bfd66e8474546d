"""Page box witnesses of evicted keys (spec T7i-T7m): the reference against the exact truth.

property: every evicted logit is <= its page's box maximum (T7i), the corner key attains it
(T7i, the bound is exact), the box maximum is the two-dot-product split (T7m), and the
eviction TV is <= reference.evict.page_box_bound for any cover of pages (T7j, T7k); on a
quantized cache, boxes of the STORED keys widened by the band witness bound the EXACT keys
(T7l), composed with the kept part's forms (T7k). Adversarial keys sit at the box corners.
The fast side: conformance/test_fast_pagebox.py.
"""
from hypothesis import given, settings, target
from hypothesis import strategies as st
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, close, expect, le, replay
from reference.band import band_norms, logit_error_bound, witness
from reference.evict import box_max_logit, evict_tv, page_box, page_box_bound
from reference.rope import rope_bands
from reference.softmax import softmax, tv, tv_bound_forms


def inner(a, b):
    return fsum(mpf(x) * mpf(y) for x, y in zip(a, b))


def corner(q, keys):
    """The adversary: the key at the corner of the page's box that maximises <q, k>."""
    _, lo, hi = page_box(keys)
    return [h if mpf(qc) >= 0 else l for qc, l, h in zip(q, lo, hi)]


@st.composite
def caches(draw):
    D = 2 * draw(st.integers(1, 3))
    vec = st.lists(st.floats(-3, 3), min_size=D, max_size=D)
    return {"kept": draw(st.lists(vec, min_size=1, max_size=4)),
            "pages": draw(st.lists(st.lists(vec, min_size=1, max_size=4), min_size=1, max_size=3)),
            "q": draw(vec), "corner": draw(st.booleans()),
            "scale": draw(st.sampled_from([0.5, 1.0, 2.0])), "slack": draw(st.floats(0, 2))}


@workdps(DPS)
def check_box_bound(case):
    """x_j <= U_p for every evicted key, U_p attained by the corner, U_p = s(<q+, hi> + <q-, lo>),
    and evict_tv <= page_box_bound with L = Z_K e^{-slack} <= Z_K."""
    s, q = mpf(case["scale"]), case["q"]
    pages = [list(p) + ([corner(q, p)] if case["corner"] else []) for p in case["pages"]]
    logits = [s * inner(q, k) for k in case["kept"]]
    boxes = []
    for keys in pages:
        n_p, lo, hi = page_box(keys)
        expect(n_p == len(keys), check_box_bound, case, f"page count {n_p} != {len(keys)}")
        u = box_max_logit(q, lo, hi, s)
        split = s * (fsum(max(mpf(a), 0) * b for a, b in zip(q, hi)) + fsum(min(mpf(a), 0) * b for a, b in zip(q, lo)))
        expect(close(u, split), check_box_bound, case, f"box max {u} != split {split} (T7m)")
        top = max(s * inner(q, k) for k in keys)
        for k in keys:
            expect(le(s * inner(q, k), u), check_box_bound, case, f"evicted logit {s * inner(q, k)} > box max {u}")
        if case["corner"]:
            expect(close(top, u), check_box_bound, case, f"corner logit {top} != box max {u}: the bound is not exact")
        logits += [s * inner(q, k) for k in keys]
        boxes.append((n_p, lo, hi, None))
    kept = list(range(len(case["kept"])))
    log_zk = log(fsum(exp(x) for x in logits[:len(kept)]))
    truth = evict_tv(logits, kept)
    bound = page_box_bound(q, boxes, log_zk - mpf(case["slack"]), s)
    expect(le(truth, bound), check_box_bound, case, f"TV {truth} > page box bound {bound}")
    if bound > 0:
        target(float(truth / bound), label="TV / page box bound")


@settings(max_examples=300)
@replay("test_box_bound_holds_adversarial")
@given(case=caches())
def test_box_bound_holds_adversarial(case):
    """property: the box maximum bounds every evicted logit of its page and is attained at the
    corner key; the page box bound is >= the eviction TV for random and corner keys."""
    check_box_bound(case)


def quantize(k, step):
    return [round(v / step) * step for v in k]


@st.composite
def quantized(draw):
    NB = draw(st.sampled_from([1, 2]))
    D = 2 * NB * draw(st.integers(1, 2))
    vec = st.lists(st.floats(-3, 3, width=32), min_size=D, max_size=D)
    return {"NB": NB, "kept": draw(st.lists(vec, min_size=1, max_size=4)),
            "pages": draw(st.lists(st.lists(vec, min_size=1, max_size=4), min_size=1, max_size=3)),
            "q": draw(vec), "step": draw(st.sampled_from([2.0 ** -6, 2.0 ** -3, 0.5])),
            "scale": draw(st.sampled_from([0.5, 1.0]))}


@workdps(DPS)
def check_widened_box(case):
    """T7l: exact logits <= box max of the stored keys + s sum_b ||q_b|| max_j rho_{j,b};
    T7k: TV(p, p~^K) <= X/(L+X) + min forms, L = sum_K e^{x~_j - c_j}, everything from stored keys."""
    D = len(case["q"])
    bands = rope_bands(D, case["NB"], "rotate_half")
    s, q, step = mpf(case["scale"]), case["q"], case["step"]
    kept = case["kept"]
    kept_st = [quantize(k, step) for k in kept]
    c = [logit_error_bound(q, witness(k, kt, bands), bands, s) for k, kt in zip(kept, kept_st)]
    boxes, x_ev = [], []
    for keys in case["pages"]:
        stored = [quantize(k, step) for k in keys]
        rho = [witness(k, kt, bands) for k, kt in zip(keys, stored)]
        widen = [max(r[b] for r in rho) for b in range(len(bands))]
        n_p, lo, hi = page_box(stored)
        boxes.append((n_p, lo, hi, widen))
        u = box_max_logit(q, lo, hi, s) + s * fsum(qb * w for qb, w in zip(band_norms(q, bands), widen))
        for k in keys:
            x = s * inner(q, k)
            expect(le(x, u), check_widened_box, case, f"exact evicted logit {x} > widened box max {u}")
            x_ev.append(x)
    x_kept = [s * inner(q, k) for k in kept]
    x_kept_st = [s * inner(q, k) for k in kept_st]
    n_k = len(kept)
    x_all = x_kept + x_ev
    p = softmax(x_all)
    p_hat = softmax(x_kept_st) + [mpf(0)] * len(x_ev)
    truth = tv(p, p_hat)
    lower = log(fsum(exp(x - cj) for x, cj in zip(x_kept_st, c)))
    forms = tv_bound_forms(softmax(x_kept_st), c)
    certified = page_box_bound(q, boxes, lower, s, bands) + forms["min"]
    expect(le(truth, certified), check_widened_box, case, f"TV {truth} > widened page box composition {certified}")
    expect(le(evict_tv(x_all, list(range(n_k))), page_box_bound(q, boxes, lower, s, bands)), check_widened_box,
           case, "evicted mass above the widened page box bound")


@settings(max_examples=200)
@replay("test_widened_box_bounds_exact_keys")
@given(case=quantized())
def test_widened_box_bounds_exact_keys(case):
    """property: boxes of quantized evicted keys widened by their band witness bound the exact
    keys' logits and, composed with the kept part, the whole served TV."""
    check_widened_box(case)
