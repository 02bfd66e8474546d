"""Page box certificate, fast vs reference (spec T7i-T7m; math.md T8).

differential: the stored box of fast.build_page_box_witness contains the exact box
(reference.evict.page_box of the exact keys: lo rounded down, hi up); fast.pagebox_bound on
the stored witness is >= the exact (60-digit) reference.evict.page_box_bound on the same stored
witness, and not looser than the fp32 rounding explains; property: >= the exact evicted mass
for random queries and for keys at the box corners (the bound attained), for fp16 and fp32
boxes, with and without the hierarchy (any refinement), on exact and on quantized evicted keys.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

from conformance._check import DPS, expect, le, replay
from fast.core.evict import log_z_kept_lower
from fast.core.pagebox import build_page_box_witness, page_upper, pagebox_bound, pagebox_log_odds
from fast.core.rope import rope_bands
from reference.evict import box_max_logit, evict_tv, page_box, page_box_bound

# Margins: REL = 1e-9 in the exponent (times 1 + |log X| + |log L|, <= ~1e2 here) and one fp32
# rounding up (2^-23 relative): fast <= ref (1 + 1e-5) + 1e-30.
LOOSE_REL, LOOSE_ABS = mpf("1e-5"), mpf("1e-30")
F32 = st.floats(-3, 3, width=32)


@st.composite
def cases(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2]))
    D = 2 * draw(st.integers(1, 3))
    n_kept = draw(st.integers(1, 4))
    n_ev = draw(st.integers(1, 9))
    vec = st.lists(F32, min_size=D, max_size=D)
    return {"H": H, "Hkv": Hkv, "D": D, "page_size": draw(st.integers(1, 4)), "fmt": draw(st.sampled_from(["fp16", "fp32"])),
            "keys": draw(st.lists(st.lists(vec, min_size=n_kept + n_ev, max_size=n_kept + n_ev), min_size=Hkv, max_size=Hkv)),
            "n_kept": n_kept, "q": draw(st.lists(vec, min_size=H, max_size=H)),
            "aim": draw(st.sampled_from(["random", "corner"])), "gain": draw(st.floats(0.5, 8)),
            "hierarchy": draw(st.sampled_from([None, [2, 0.0], [2, 0.5], [3, 1.0]])),
            "scale": draw(st.sampled_from([0.25, 0.5, 1.0]))}


def build(case):
    """keys [1, Hkv, N, D]; with aim "corner" every page's last evicted key is moved to the corner
    of its page's box that query head 0 of its KV head favours (the box bound is then attained)."""
    D, Hkv, H, P = case["D"], case["Hkv"], case["H"], case["page_size"]
    keys = torch.tensor(case["keys"], dtype=torch.float32)[None]
    if case["fmt"] == "fp16" and case["aim"] == "corner":                   # representable: the corner is exact
        keys = keys.half().float()                                          # (random: fp32 keys, rounded outward)
    q = case["gain"] * torch.tensor(case["q"], dtype=torch.float32)[None]   # [1, H, D]
    N, nk = keys.shape[2], case["n_kept"]
    if case["aim"] == "corner":
        for g in range(Hkv):
            qg = q[0, g * (H // Hkv)]
            for a in range(nk, N, P):
                page = keys[0, g, a:min(a + P, N)]
                keys[0, g, min(a + P, N) - 1] = torch.where(qg >= 0, page.amax(0), page.amin(0))
    ev_idx = torch.arange(nk, N).expand(1, Hkv, -1).contiguous()
    w = build_page_box_witness(keys, ev_idx, page_size=P, fmt=case["fmt"])
    return keys, q, ev_idx, w


def exact_logits(q_row, key_rows, s):
    return [s * fsum(mpf(a) * mpf(b) for a, b in zip(q_row, k)) for k in key_rows]


@workdps(DPS)
def check_fast_ge_reference(case):
    keys, q, ev_idx, w = build(case)
    s, H, Hkv, P, nk = case["scale"], case["H"], case["Hkv"], case["page_size"], case["n_kept"]
    kw = {} if case["hierarchy"] is None else {"super_size": case["hierarchy"][0], "refine": case["hierarchy"][1]}
    lz = log_z_kept_lower(q, keys[:, :, :nk], s)
    fast = pagebox_bound(q, w, lz, s, **kw)
    flat = pagebox_bound(q, w, lz, s)
    upper = page_upper(q, w, s)                                             # [1, H, pages]
    for g in range(Hkv):
        members = ev_idx[0, g].tolist()
        for p in range(w.counts.shape[2]):
            page = [keys[0, g, j].tolist() for j in members[p * P:(p + 1) * P]]
            n_p, lo, hi = page_box(page)
            expect(n_p == int(w.counts[0, g, p]), check_fast_ge_reference, case, f"page {p}: count")
            for c in range(case["D"]):                                      # the stored box holds the exact one
                expect(mpf(w.lo[0, g, p, c].item()) <= lo[c] and hi[c] <= mpf(w.hi[0, g, p, c].item()),
                       check_fast_ge_reference, case, f"page {p} channel {c}: stored box does not contain the keys")
    if case["hierarchy"] is not None:                                       # super-page boxes hold their keys
        S = case["hierarchy"][0]
        sup = w.super_pages(S)
        for g in range(Hkv):
            members = ev_idx[0, g].tolist()
            for p in range(sup.counts.shape[2]):
                part = [keys[0, g, j].tolist() for j in members[p * S * P:(p + 1) * S * P]]
                n_p, lo, hi = page_box(part)
                expect(n_p == int(sup.counts[0, g, p]), check_fast_ge_reference, case, f"super-page {p}: count")
                for c in range(case["D"]):
                    expect(mpf(sup.lo[0, g, p, c].item()) <= lo[c] and hi[c] <= mpf(sup.hi[0, g, p, c].item()),
                           check_fast_ge_reference, case, f"super-page {p} channel {c}: box does not contain its keys")
    for h in range(H):
        g = h // (H // Hkv)
        q_row = q[0, h].tolist()
        pages = []
        for p in range(w.counts.shape[2]):
            lo = [mpf(v) for v in w.lo[0, g, p].double().tolist()]
            hi = [mpf(v) for v in w.hi[0, g, p].double().tolist()]
            pages.append((int(w.counts[0, g, p]), lo, hi, None))
            u_ref = box_max_logit(q_row, lo, hi, s)                            # U_p itself, exact (T7i)
            expect(le(u_ref, mpf(upper[0, h, p].item())), check_fast_ge_reference, case,
                   f"head {h} page {p}: fast U {upper[0, h, p].item()} < reference {u_ref}")
        ref = page_box_bound(q_row, pages, mpf(lz[0, h].item()), s)
        got, got_flat = mpf(fast[0, h].item()), mpf(flat[0, h].item())
        expect(le(ref, got_flat), check_fast_ge_reference, case, f"head {h}: fast {got_flat} < reference {ref}")
        expect(got_flat <= ref * (1 + LOOSE_REL) + LOOSE_ABS, check_fast_ge_reference, case,
               f"head {h}: fast {got_flat} looser than reference {ref} beyond the fp32 margin")
        expect(le(got_flat, got), check_fast_ge_reference, case, f"head {h}: hierarchy {got} below the flat read {got_flat}")
        truth = evict_tv(exact_logits(q_row, keys[0, g].tolist(), mpf(s)), list(range(nk)))
        expect(le(truth, got), check_fast_ge_reference, case, f"head {h}: fast {got} < true evicted mass {truth}")


@settings(max_examples=80)
@replay("test_fast_pagebox_bound_ge_reference")
@given(case=cases())
def test_fast_pagebox_bound_ge_reference(case):
    """differential: stored box contains the exact box; fast U_p >= reference U_p; fast bound >=
    reference bound and within the margins; hierarchy >= flat; property: >= the true evicted
    mass, random queries and corner keys (bound attained)."""
    check_fast_ge_reference(case)


def check_widened(seed):
    """property (T7l, T7k): boxes of quantized evicted keys widened by their band witness rho
    bound the EXACT keys' evicted mass; composed with the quantized kept part (compose_tv, the
    forms on p~^K) they bound TV(p, p~^K); truth in fp64 (slack 1e-12). Returns (max truth /
    bound, whether the unwidened box of the served keys fell below the truth)."""
    from fast.core.witness import witness
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, N, D, nk = 2, 4, 2, 40, 16, 12
    bands = rope_bands(D, 4, "rotate_half")
    keys = torch.randn(B, Hkv, N, D, generator=g) * 0.5
    step = 0.05 * (1 + seed % 3)
    served = (keys / step).round() * step
    rho = witness(keys, served, bands)
    q = torch.randn(B, H, D, generator=g) * (1 + seed % 4)
    if seed % 2:                                                            # aim the heads at an evicted key
        q = 3 * keys[:, torch.arange(H) // (H // Hkv), N - 1]
    s = 0.25
    ev_idx = torch.arange(nk, N).expand(B, Hkv, -1).contiguous()
    w = build_page_box_witness(served, ev_idx, page_size=1 if seed % 4 == 0 else 5, rho=rho, bands=bands)
    lz = log_z_kept_lower(q, keys[:, :, :nk], s)                            # kept part exact here
    bound = pagebox_bound(q, w, lz, s, **({"super_size": 2, "refine": 0.3} if seed % 3 == 0 else {}))
    x = s * torch.einsum("bhd,bhnd->bhn", q.double(), keys.double().repeat_interleave(H // Hkv, 1))
    truth = torch.softmax(x, -1)[..., nk:].sum(-1)
    assert bool((bound.double() >= truth - 1e-12).all()), f"seed {seed}: {bound.tolist()} < {truth.tolist()}"
    unwidened = build_page_box_witness(served, ev_idx, page_size=1)          # tight: the served keys themselves
    missed = bool((pagebox_bound(q, unwidened, lz, s).double() < truth).any())
    # T7k with quantized kept keys too: L from the served kept logits minus c, plus the forms on p~^K
    from fast.core.certify import tv_bound_forms
    from fast.core.evict import compose_tv
    from fast.core.witness import logit_error_bound
    c = logit_error_bound(q, rho[:, :, :nk], bands, s)
    lz_q = log_z_kept_lower(q, served[:, :, :nk], s, c=c)
    rep = H // Hkv
    x_served = s * torch.einsum("bhd,bhnd->bhn", q.double(), served[:, :, :nk].double().repeat_interleave(rep, 1))
    p_tk = torch.softmax(x_served, -1)
    composed = compose_tv(pagebox_bound(q, w, lz_q, s), tv_bound_forms(p_tk.float(), c)["min"])
    whole = 0.5 * (torch.softmax(x, -1) - torch.cat([p_tk, torch.zeros(B, H, N - nk, dtype=torch.float64)], -1)).abs().sum(-1)
    assert bool((composed.double() >= whole - 1e-12).all()), f"seed {seed}: composed {composed.tolist()} < {whole.tolist()}"
    return float((truth / bound.double()).max()), missed


def test_fast_widened_box_bounds_exact_keys():
    """property: widened boxes of the served (quantized) evicted keys bound the exact evicted
    mass; the unwidened box of the served keys alone does not always (the widening is needed)."""
    runs = [check_widened(seed) for seed in range(24)]
    assert max(r[0] for r in runs) > 0.01                                   # the check is not vacuous
    assert any(r[1] for r in runs), "the served keys' box alone never failed: the test cannot see the widening"


def test_fast_pagebox_rejects_bad_input():
    """property: malformed inputs raise ValueError naming the argument."""
    keys = torch.randn(1, 1, 6, 4)
    ev = torch.arange(2, 6)[None, None]
    w = build_page_box_witness(keys, ev, page_size=2)
    q, lz = torch.randn(1, 1, 4), torch.zeros(1, 1)
    bad = [(lambda: pagebox_bound(q * float("nan"), w, lz, 0.5), "q"),
           (lambda: pagebox_bound(q[0], w, lz, 0.5), "q"),
           (lambda: pagebox_bound(q, w, lz, -1.0), "scale"),
           (lambda: pagebox_bound(q, w, lz[0], 0.5), "log_z_kept_lower"),
           (lambda: pagebox_log_odds(q, w, lz, 0.5, super_size=2, refine=2.0), "refine"),
           (lambda: build_page_box_witness(keys, ev, page_size=0), "page_size"),
           (lambda: build_page_box_witness(keys, ev, fmt="bf16"), "fmt"),
           (lambda: build_page_box_witness(keys * 1e6, ev), "fp16"),
           (lambda: build_page_box_witness(keys, ev + 10), "evict_index"),
           (lambda: build_page_box_witness(keys, ev, rho=torch.ones(1, 1, 6, 2)), "bands")]
    for call, name in bad:
        try:
            call()
        except ValueError as e:
            assert name in str(e), (name, str(e))
        else:
            raise AssertionError(f"no ValueError for bad {name}")
