"""Pre-RoPE key quantization (fast.core.prerope): the T3 witness against the true post-RoPE error.

Property (fast vs truth): keys made as the model makes them (pre-RoPE keys with outlier channels,
rotated in fp32 with transformers' tables at positions m), encoded by the scheme; for every token
and band, witness_t3 >= the exact band norm of k - k~ (reference.band.witness: interval
arithmetic, 60 digits), with k~ what the cache serves (fp32, or bf16/fp16); and not loose beyond
the stated margins. T3 itself on the fp32 tables: the pre-RoPE error r rotated to any other
position keeps its band norms within the factor 1 + eta (checked at 60 digits).
Shrunk failures: conformance/corpus/<test>.json.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, sqrt, workdps

import fast
from fast.core.prerope import BLOCK, _rotate, prerope_scheme, rope_tables
from reference import band as ref_band
from conformance._check import expect, replay

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "bits": st.sampled_from([4, 8]), "D": st.sampled_from([32, 64]),
    "NB": st.sampled_from([1, 4, 8]), "block": st.integers(0, 60), "theta": st.sampled_from([10000.0, 100000.0]),
    "outliers": st.booleans(), "dtype": st.sampled_from(sorted(DTYPES)), "scale": st.sampled_from([0.01, 1.0, 30.0])})

MAX_POS = 2048


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    D = case["D"]
    x = torch.randn(1, 1, BLOCK, D, generator=g) * case["scale"]
    if case["outliers"]:  # a few channels much larger, stable across tokens (the pre-RoPE picture)
        x[..., :: max(D // 4, 1)] *= 20.0
    cos, sin, eta = rope_tables(D, case["theta"], MAX_POS)
    start = case["block"] * BLOCK
    sl = slice(start, start + BLOCK)
    k = _rotate(x, cos[sl], sin[sl], +1).to(DTYPES[case["dtype"]])  # the model's fp32 RoPE, cast to its dtype
    scheme = prerope_scheme(head_dim=D, theta=case["theta"], max_pos=MAX_POS, bits=case["bits"])
    kq = scheme.encode_k(k, 0, start, 0)
    served = kq.decode().to(k.dtype)  # what CertifiedCache serves
    bands = fast.rope_bands(D, case["NB"])
    rho = kq.witness_t3(k, bands, k.dtype)
    return k, kq, served, rho, bands, (cos, sin, eta), start


@workdps(60)
def check_witness(case):
    k, kq, served, rho, bands, (cos, sin, eta), start = build(case)
    bl = bands.tolist()
    for j in sorted({0, 7, BLOCK - 1}):
        a = [float(v) for v in k[0, 0, j].double()]
        b = [float(v) for v in served[0, 0, j].double()]
        true = ref_band.witness(a, b, bl)
        dq = ref_band.band_norms([float(v) for v in kq.pre()[0, 0, j].double()], bl)
        for band, (t, r, n) in enumerate(zip(true, rho[0, 0, j].tolist(), dq)):
            expect(mpf(r) >= t, check_witness, case, f"token {j} band {band}: witness {r} < true post-RoPE error {t}")
            # not loose: the recovery and rotation margins are a few fp32 ulps of the key, the dtype's rounding
            slack = (mpf(2) ** -21 + {torch.float32: 0, torch.bfloat16: mpf(2) ** -7, torch.float16: mpf(2) ** -10}[k.dtype]) * n
            expect(mpf(r) <= t + slack + mpf(2) ** -100 + t * mpf("1e-6"), check_witness, case,
                   f"token {j} band {band}: witness {r} loose against {t} (slack {slack})")


@workdps(60)
def check_t3(case):
    """(R'_m r)_b for the pre-RoPE error r at other positions m: band norm <= (1 + eta) ||r_b||."""
    k, kq, served, rho, bands, (cos, sin, eta), start = build(case)
    D = case["D"]
    k0 = _rotate(k.float(), cos[start:start + BLOCK], sin[start:start + BLOCK], -1)
    r = (k0 - kq.pre())[0, 0, 3].double().tolist()
    h = D // 2
    rn = ref_band.band_norms(r, bands.tolist())
    for m in (0, 1, start, MAX_POS - 1):
        c, s = cos[m].double().tolist(), sin[m].double().tolist()
        rot = [None] * D
        for i in range(h):
            x, y = mpf(r[i]), mpf(r[i + h])
            rot[i], rot[i + h] = x * mpf(c[i]) - y * mpf(s[i]), y * mpf(c[i]) + x * mpf(s[i])
        for band, idx in enumerate(bands.tolist()):
            nb = sqrt(fsum(rot[i] ** 2 for i in idx))
            expect(nb <= (1 + mpf(eta)) * rn[band] * (1 + mpf(10) ** -40), check_t3, case,
                   f"position {m} band {band}: rotated norm {nb} > (1 + eta) {rn[band]}")


@settings(max_examples=40, deadline=None)
@replay("test_prerope_witness_ge_true_error")
@given(case=CASE)
def test_prerope_witness_ge_true_error(case):
    """Property: the T3 witness bounds the true post-RoPE error of every served key, and is tight."""
    check_witness(case)


@settings(max_examples=15, deadline=None)
@replay("test_prerope_t3_any_position")
@given(case=CASE)
def test_prerope_t3_any_position(case):
    """Property: band norms of the pre-RoPE error survive the fp32 rotation to any position (T3 with eta)."""
    check_t3(case)


def test_prerope_tables_eta_small():
    """eta (fp32 cos/sin tables are not exactly orthogonal) is a few fp32 ulps."""
    _, _, eta = rope_tables(64, 100000.0, 8192)
    assert 0 <= eta < 2.0 ** -22
