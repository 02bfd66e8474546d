"""Differential: fast.core.subspace against reference.subspace (spec T4d, T4e), and the truth from exact keys.

- encode: tau and sigma >= the 60-digit ||U r'|| and ||r'_b|| for the fast path's own a (never tighter
  than the reference), and within 1e-6 relative + 1e-30 of them (not needlessly loose);
- shift_bounds: [lo, hi] contains the reference interval built from the same stored (a, tau, sigma)
  and the fast path's own p;
- end to end: lo <= s q . (k - k~) <= hi, exact, for keys the test quantizes itself (int8 / int4 /
  fp8 round trips of fast.core.quant, or a black box), U from query_basis or a random non-orthonormal
  matrix, queries drawn near the basis, aimed at the residual or at random, GQA, tiny and large scales.
"""

import json
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf, workdps

import fast
from conformance._check import DPS, expect, replay
from fast.core import subspace
from reference import subspace as ref

CODECS = ("int8", "int4", "fp8_e4m3", "box")
MAG = {"tiny": 1e-3, "ordinary": 1.0, "large": 300.0}

CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "Hkv": st.integers(1, 2), "G": st.integers(1, 3),
    "N": st.integers(1, 12), "D": st.sampled_from([32, 64]), "NB": st.sampled_from([1, 4, 8]),
    "m": st.sampled_from([1, 2, 4, 8]), "codec": st.sampled_from(CODECS), "mag": st.sampled_from(sorted(MAG)),
    "basis": st.sampled_from(["svd", "random"]), "query": st.sampled_from(["near", "residual", "random"])})


def build(case):
    """(q [B, H, D], k, k_hat [B, Hkv, N, D], U, bands, s) for one case: keys quantized here."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, G, N, D, m = (case[x] for x in ("B", "Hkv", "G", "N", "D", "m"))
    mag = MAG[case["mag"]]
    k = torch.randn(B, Hkv, N, D, generator=g) * mag
    if case["codec"] == "box":  # a black box: any served copy
        k_hat = k + torch.randn(B, Hkv, N, D, generator=g) * mag * 0.05
    else:
        k_hat = fast.dequantize(fast.quantize(k, case["codec"]))
    prior = torch.randn(B, Hkv * G, 24, D, generator=g) * mag  # earlier queries: a few dominant directions
    prior[..., : D // 4] *= 8
    if case["basis"] == "svd":
        U = subspace.query_basis(prior, Hkv, m)
    else:
        U = torch.randn(B, Hkv, m, D, generator=g)
    bands = fast.rope_bands(D, case["NB"])
    q = prior[:, :, -1] + torch.randn(B, Hkv * G, D, generator=g) * mag * 0.1
    if case["query"] == "residual":  # aim every query head at its KV head's first token's error
        r = (k - k_hat)[:, :, 0].repeat_interleave(G, dim=1)
        q = r / r.norm(dim=-1, keepdim=True).clamp(min=1e-30) * mag * 8
    elif case["query"] == "random":
        q = torch.randn(B, Hkv * G, D, generator=g) * mag
    return q.float().contiguous(), k, k_hat.float(), U, bands, 1 / math.sqrt(D)


def f(t):
    return [float(x) for x in t.double().reshape(-1)]


def tokens(N):
    return sorted({0, N - 1, N // 2})


@workdps(DPS)
def check_subspace(case):
    q, k, k_hat, U, bands, s = build(case)
    codes, scale, tau, sigma = subspace.encode(k, k_hat, U, bands)
    a = subspace.coefficients(codes, scale)
    lo, hi, p = subspace.shift_bounds(q, U, a, tau, sigma, bands, s, return_p=True)
    B, H, D = q.shape
    Hkv, G, bl = k.shape[1], H // k.shape[1], bands.tolist()
    for b in range(B):
        for hk in range(Hkv):
            Ul = [f(row) for row in U[b, hk]]
            for j in tokens(k.shape[2]):
                aj = f(a[b, hk, j])
                tau_r, sigma_r = ref.witness_terms(f(k[b, hk, j]), f(k_hat[b, hk, j]), Ul, aj, bl)
                rep = f"token ({b},{hk},{j}): tau {float(tau[b, hk, j])} vs {tau_r}, sigma {f(sigma[b, hk, j])} vs {sigma_r}"
                expect(mpf(float(tau[b, hk, j])) >= tau_r, check_subspace, case, "tau below the reference " + rep)
                expect(all(mpf(x) >= y for x, y in zip(f(sigma[b, hk, j]), sigma_r)), check_subspace, case, "sigma below " + rep)
                expect(mpf(float(tau[b, hk, j])) <= tau_r * (1 + mpf("1e-6")) + mpf("1e-30"), check_subspace, case, "tau loose " + rep)
                for h in range(hk * G, (hk + 1) * G):
                    r_lo, r_hi = ref.shift_interval(f(q[b, h]), Ul, aj, f(p[b, h]), float(tau[b, hk, j]),
                                                    f(sigma[b, hk, j]), bl, s)
                    t_lo, t_hi = ref.logit_shift(f(q[b, h]), f(k[b, hk, j]), f(k_hat[b, hk, j]), s)
                    got = (mpf(float(lo[b, h, j])), mpf(float(hi[b, h, j])))
                    where = f"head {h} token {j}: fast [{got[0]}, {got[1]}], reference [{r_lo}, {r_hi}], truth [{t_lo}, {t_hi}]"
                    expect(got[0] <= r_lo and got[1] >= r_hi, check_subspace, case, "tighter than the reference " + where)
                    expect(got[0] <= t_lo and t_hi <= got[1], check_subspace, case, "truth outside " + where)


@replay("test_fast_subspace")
@settings(max_examples=60, deadline=None)
@given(case=CASE)
def test_fast_subspace(case):
    """Differential (fast vs reference) and property (truth inside)."""
    check_subspace(case)


def test_near_queries_get_a_narrower_interval_than_the_band_witness():
    """The point of the witness: for queries near the basis' span, the interval is narrower than the band
    witness's [-c, c] on most tokens (here an fp8 cache, 8 of 64 directions carry the queries)."""
    case = {"seed": 5, "B": 1, "Hkv": 1, "G": 3, "N": 64, "D": 64, "NB": 8, "m": 8, "codec": "fp8_e4m3",
            "mag": "ordinary", "basis": "svd", "query": "near"}
    q, k, k_hat, U, bands, s = build(case)
    q = (subspace.query_basis(q[:, :, None].repeat(1, 1, 2, 1), 1, 8)[:, 0, :3] * 5).contiguous()  # in the span
    prior = q[:, :, None].repeat(1, 1, 4, 1)
    U = subspace.query_basis(prior + 1e-3 * torch.randn(prior.shape, generator=torch.Generator().manual_seed(1)), 1, 8)
    codes, scale, tau, sigma = subspace.encode(k, k_hat, U, bands)
    lo, hi = subspace.shift_bounds(q, U, subspace.coefficients(codes, scale), tau, sigma, bands, s)
    c = fast.logit_error_bound(q, fast.witness(k, k_hat, bands), bands, s)
    assert float(((hi - lo) < 2 * c.double()).double().mean()) > 0.9, json.dumps(case)


def test_mutations_are_caught():
    """The differential has teeth: an encode that drops tau, or a read that drops q's residual part,
    fails check_subspace on cases where those terms matter."""
    case = {"seed": 2, "B": 1, "Hkv": 1, "G": 1, "N": 4, "D": 32, "NB": 4, "m": 2, "codec": "box",
            "mag": "ordinary", "basis": "random", "query": "residual"}
    orig_encode, orig_bands = subspace.encode, subspace.band_norms_up
    try:
        subspace.encode = lambda *x: (lambda c, sc, t, s: (c, sc, torch.zeros_like(t), s))(*orig_encode(*x))
        try:
            check_subspace(case)
            raise RuntimeError("a zero tau went unnoticed")
        except AssertionError:
            pass
        subspace.encode = orig_encode
        subspace.band_norms_up = lambda x, b: orig_bands(x, b) * 0.5
        try:
            check_subspace(case)
            raise RuntimeError("halved band norms went unnoticed")
        except AssertionError:
            pass
    finally:
        subspace.encode, subspace.band_norms_up = orig_encode, orig_bands
