"""Eviction certificate, fast vs reference (spec T7b, T7c; math.md T8).

differential: fast.evict_bound on the witness that fast.build_group_witness stores is >= the
exact (60-digit) reference.evict.evict_bound on the same stored witness, and not looser than
the fp32 rounding explains; the stored radii are >= the exact radii from the stored centre;
fast.log_z_kept_lower is <= the exact log Z_K.
property: the fast bound is >= the exact evicted mass (T7a) for random and aimed queries.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, expect, le, replay
from fast.core.evict import build_group_witness, evict_bound, log_z_kept_lower
from fast.core.rope import rope_bands
from reference.band import witness as ref_band_witness
from reference.evict import evict_bound as ref_evict_bound
from reference.evict import evict_tv

# The fast bound is the exact value plus margins: REL = 1e-9 in the exponent (times
# 1 + |log U| + |log L|, at most ~1e2 here) and one fp32 rounding up (2^-23 relative).
# So fast <= ref (1 + 1e-5) + 1e-30 (absolute part: fp32 underflow of a tiny bound).
LOOSE_REL, LOOSE_ABS = mpf("1e-5"), mpf("1e-30")
F32 = st.floats(-3, 3, width=32)


@st.composite
def cases(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2]))
    NB = draw(st.sampled_from([1, 2]))
    D = 2 * NB * draw(st.integers(1, 2))
    n_kept = draw(st.integers(1, 4))
    n_ev = draw(st.integers(1, 7))
    vec = st.lists(F32, min_size=D, max_size=D)
    return {"H": H, "Hkv": Hkv, "D": D, "NB": NB, "group_size": draw(st.integers(1, 4)),
            "keys": draw(st.lists(st.lists(vec, min_size=n_kept + n_ev, max_size=n_kept + n_ev),
                                  min_size=Hkv, max_size=Hkv)),
            "n_kept": n_kept, "q": draw(st.lists(vec, min_size=H, max_size=H)),
            "aim": draw(st.sampled_from(["random", "evicted"])), "gain": draw(st.floats(0.5, 4)),
            "scale": draw(st.sampled_from([0.25, 0.5, 1.0]))}


def build(case):
    D, NB, Hkv, H = case["D"], case["NB"], case["Hkv"], case["H"]
    keys = torch.tensor(case["keys"], dtype=torch.float32)[None]            # [1, Hkv, N, D]
    N = keys.shape[2]
    q = torch.tensor(case["q"], dtype=torch.float32)[None]                  # [1, H, D]
    if case["aim"] == "evicted":                                            # aim each head at its last evicted key
        q = case["gain"] * keys[:, torch.arange(H) // (H // Hkv), N - 1]
    bands = rope_bands(D, NB, "rotate_half")
    ev_idx = torch.arange(case["n_kept"], N).expand(1, Hkv, -1).contiguous()
    w = build_group_witness(keys, ev_idx, bands, group_size=case["group_size"])
    return keys, q, bands, ev_idx, w


def exact_logits(q_row, key_rows, s):
    return [s * fsum(mpf(a) * mpf(b) for a, b in zip(q_row, k)) for k in key_rows]


@workdps(DPS)
def check_fast_ge_reference(case):
    """differential: fast >= exact reference on the stored witness, and within the margin."""
    keys, q, bands, ev_idx, w = build(case)
    s, H, Hkv = case["scale"], case["H"], case["Hkv"]
    blist = bands.tolist()
    lz = log_z_kept_lower(q, keys[:, :, :case["n_kept"]], s)                 # [1, H]
    fast = evict_bound(q, w.groups, lz, s, bands)                           # [1, H]
    for h in range(H):
        g = h // (H // Hkv)
        q_row = q[0, h].tolist()
        kept = keys[0, g, :case["n_kept"]].tolist()
        log_zk = log(fsum(exp(x) for x in exact_logits(q_row, kept, mpf(s))))
        expect(le(mpf(lz[0, h].item()), log_zk), check_fast_ge_reference, case,
               f"head {h}: log_z_kept_lower {lz[0, h].item()} > exact log Z_K {log_zk}")
        groups = []
        for gi in range(w.counts.shape[2]):
            n_g = int(w.counts[0, g, gi])
            if n_g == 0:
                continue
            mu = [mpf(v) for v in w.centres[0, g, gi].double().tolist()]
            radii = [mpf(v) for v in w.radii[0, g, gi].double().tolist()]
            members = ev_idx[0, g, gi * case["group_size"]:(gi + 1) * case["group_size"]].tolist()
            for j in members:                                               # stored radii >= exact radii
                exact_r = ref_band_witness(keys[0, g, j].tolist(), mu, blist)
                for rb, eb in zip(radii, exact_r):
                    expect(le(eb, rb), check_fast_ge_reference, case, f"radius {rb} < exact {eb} (group {gi})")
            groups.append((n_g, mu, radii))
        ref = ref_evict_bound(q_row, groups, mpf(lz[0, h].item()), s, blist)
        got = mpf(fast[0, h].item())
        expect(le(ref, got), check_fast_ge_reference, case, f"head {h}: fast {got} < reference {ref}")
        expect(got <= ref * (1 + LOOSE_REL) + LOOSE_ABS, check_fast_ge_reference, case,
               f"head {h}: fast {got} looser than reference {ref} beyond the fp32 margin")
        truth = evict_tv(exact_logits(q_row, keys[0, g].tolist(), mpf(s)), list(range(case["n_kept"])))
        expect(le(truth, got), check_fast_ge_reference, case, f"head {h}: fast {got} < true evicted mass {truth}")


@settings(max_examples=60)
@replay("test_fast_evict_bound_ge_reference")
@given(case=cases())
def test_fast_evict_bound_ge_reference(case):
    """differential: fast.evict_bound >= reference.evict.evict_bound (same stored witness), not
    looser than its margins; property: >= the true evicted mass, random and aimed queries."""
    check_fast_ge_reference(case)


def test_fast_evict_bound_rejects_bad_input():
    """property: malformed inputs raise ValueError naming the argument."""
    keys = torch.randn(1, 1, 6, 4)
    bands = rope_bands(4, 2, "rotate_half")
    w = build_group_witness(keys, torch.arange(2, 6)[None, None], bands, group_size=2)
    q = torch.randn(1, 1, 4)
    lz = torch.zeros(1, 1)
    for bad, name in ((q * float("nan"), "q"), (q[0], "q")):
        try:
            evict_bound(bad, w.groups, lz, 0.5, bands)
        except ValueError as e:
            assert name in str(e)
        else:
            raise AssertionError(f"no ValueError for bad {name}")
    try:
        evict_bound(q, w.groups, lz, -1.0, bands)
    except ValueError as e:
        assert "scale" in str(e)
    else:
        raise AssertionError("no ValueError for a negative scale")


def check_composition(seed):
    """property (T7d): eviction plus int8-style quantization of the kept keys.
    TV(p, p~^K) <= compose_tv(evict_bound(L from x~ - c), tv_bound_forms(p~^K, c)), where the
    group witness is built from the served keys with their band witness rho. The truth is
    computed in fp64 (relative error ~1e-15; slack 1e-12)."""
    from fast.core.certify import tv_bound_forms
    from fast.core.evict import compose_tv
    from fast.core.witness import logit_error_bound, witness
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, N, D, n_keep = 2, 4, 2, 40, 16, 12
    bands = rope_bands(D, 4, "rotate_half")
    keys = torch.randn(B, Hkv, N, D, generator=g) * 0.5
    step = 0.05 * (1 + seed % 3)
    served = (keys / step).round() * step                                   # a uniform quantizer
    rho = witness(keys, served, bands)                                      # >= band norms of keys - served
    q = torch.randn(B, H, D, generator=g) * (1 + seed % 4)
    s = 0.25
    ev_idx = torch.arange(n_keep, N).expand(B, Hkv, -1).contiguous()
    w = build_group_witness(served, ev_idx, bands, group_size=7, rho=rho)
    c = logit_error_bound(q, rho[:, :, :n_keep], bands, s)                  # [B, H, n_keep]
    lz = log_z_kept_lower(q, served[:, :, :n_keep], s, c=c)
    tv_e = evict_bound(q, w.groups, lz, s, bands)
    rep = H // Hkv
    x_served = s * torch.einsum("bhd,bhnd->bhn", q.double(), served[:, :, :n_keep].double().repeat_interleave(rep, 1))
    p_tilde_k = torch.softmax(x_served, -1)
    tv_q = tv_bound_forms(p_tilde_k.float(), c)["min"]
    bound = compose_tv(tv_e, tv_q)
    x = s * torch.einsum("bhd,bhnd->bhn", q.double(), keys.double().repeat_interleave(rep, 1))
    p = torch.softmax(x, -1)
    p_tk = torch.cat([p_tilde_k, torch.zeros(B, H, N - n_keep, dtype=torch.float64)], -1)
    truth = 0.5 * (p - p_tk).abs().sum(-1)
    ok = bool((bound.double() >= truth - 1e-12).all())
    assert ok, f"seed {seed}: composed bound {bound.tolist()} < truth {truth.tolist()}"
    return float((truth / bound.double()).max())


def test_composed_bound_holds_with_quantized_kept_keys():
    """property: the triangle composition of the eviction and quantization certificates bounds
    the TV between exact full attention and served attention over the kept, quantized keys."""
    worst = max(check_composition(seed) for seed in range(24))
    assert worst > 0.01                                                      # the check is not vacuous
