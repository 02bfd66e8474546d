"""Differential: fast.core.witness and fast.logit_error_bound against reference.band (spec T4).

fast >= reference (the reference returns the upper end of a 60-digit interval enclosure)
and fast <= reference (1 + 1e-4) + 1e-6, over D in {32, 64, 128}, NB in {1, 2, 4, 8},
GQA ratios 1..4, fp32/fp16/bf16 inputs, tiny / ordinary / 1e4-scale magnitudes and both
RoPE layouts. The reference side runs on a subsample of tokens (mpmath cost).
Shrunk failures: conformance/corpus_fast/test_fast_witness.json, replayed by @example.
"""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf

import fast
from fast.core.witness import max_packable
from reference import band as ref
from conformance._check import replay

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAG = {"tiny": 1e-3, "ordinary": 1.0, "huge": 1e3}  # keys; errors are ~1e-2 of that; 1e3 keys give ~1e4-scale logits
REL, ABS = mpf("1e-4"), mpf("1e-6")



CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "Hkv": st.integers(1, 3), "G": st.integers(1, 4),
    "N": st.integers(1, 64), "D": st.sampled_from([32, 64, 128]), "NB": st.sampled_from([1, 2, 4, 8]),
    "layout": st.sampled_from(["rotate_half", "interleaved"]), "dtype": st.sampled_from(sorted(DTYPES)),
    "mag": st.sampled_from(sorted(MAG)), "sparse": st.booleans()})


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    dt, m = DTYPES[case["dtype"]], MAG[case["mag"]]
    B, Hkv, N, D = case["B"], case["Hkv"], case["N"], case["D"]
    k = (torch.randn(B, Hkv, N, D, generator=g) * m).to(dt)
    err = torch.randn(B, Hkv, N, D, generator=g) * m * 1e-2
    if case["sparse"]:  # error concentrated in one band-aligned chunk (adversarial for plain norms)
        err[..., D // 2:] = 0
    k_hat = (k.float() + err).to(dt)
    q = (torch.randn(B, Hkv * case["G"], D, generator=g) * m).to(dt)
    return q, k, k_hat, fast.rope_bands(D, case["NB"], case["layout"])


def sample_tokens(N, n=6):
    return sorted({0, N - 1} | set(range(0, N, max(1, N // n))))


def floats(t):
    return [float(v) for v in t.double()]


def check_witness(case):
    q, k, k_hat, bands = build(case)
    rho = fast.witness(k, k_hat, bands)
    assert rho.dtype == torch.float32 and rho.shape == (*k.shape[:3], case["NB"])
    bl = bands.tolist()
    for b in range(case["B"]):
        for h in range(case["Hkv"]):
            for j in sample_tokens(case["N"]):
                want = ref.witness(floats(k[b, h, j]), floats(k_hat[b, h, j]), bl)
                for nb, w in enumerate(want):
                    f = mpf(float(rho[b, h, j, nb]))
                    msg = f"band {nb} token ({b},{h},{j}): fast {f} ref {w}; reproduce check_witness({json.dumps(case)})"
                    assert f >= w, "unsound " + msg
                    assert f <= w * (1 + REL) + ABS, "loose " + msg


def check_logit_error_bound(case):
    q, k, k_hat, bands = build(case)
    rho = fast.witness(k, k_hat, bands)
    s = 1 / math.sqrt(case["D"])
    c = fast.logit_error_bound(q, rho, bands, s)
    assert c.dtype == torch.float32 and c.shape == (case["B"], q.shape[1], case["N"])
    bl = bands.tolist()
    for b in range(case["B"]):
        for h in range(q.shape[1]):
            toks = sample_tokens(case["N"], 3)
            want = ref.logit_error_bound(floats(q[b, h]), [floats(rho[b, h // case["G"], j]) for j in toks], bl, s)
            for j, w in zip(toks, want):
                f = mpf(float(c[b, h, j]))
                msg = f"token ({b},{h},{j}): fast {f} ref {w}; reproduce check_logit_error_bound({json.dumps(case)})"
                assert f >= w, "unsound " + msg
                assert f <= w * (1 + REL) + ABS, "loose " + msg


@settings(max_examples=120)
@replay("test_witness_ge_reference")
@given(case=CASE)
def test_witness_ge_reference(case):
    """Differential: fast.core.witness >= reference.band.witness, within 1e-4 relative."""
    check_witness(case)


@settings(max_examples=120)
@replay("test_logit_error_bound_ge_reference")
@given(case=CASE)
def test_logit_error_bound_ge_reference(case):
    """Differential: fast.logit_error_bound >= reference.band.logit_error_bound (GQA), within 1e-4 relative."""
    check_logit_error_bound(case)


@settings(max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), mag=st.sampled_from([1e-7, 1e-3, 1.0, 1e3]), fine=st.booleans())
def test_packed_witness_ge_rho(seed, mag, fine):
    """Property: unpack(pack(rho)) >= rho, and at most one log step (2^(1/8), the fine table's 2^(1/16)) above it
    or at code 1; above the table's top regular code (the fine table's ~28) the top code, the largest fp32."""
    rho = torch.rand(4, 64, generator=torch.Generator().manual_seed(seed)) * mag
    rho[0, :3] = 0
    back = fast.unpack_witness(fast.pack_witness(rho, fine=fine), fine=fine)
    assert bool((back >= rho).all()), (seed, mag)
    floor = fast.unpack_witness(torch.tensor([1], dtype=torch.uint8), fine=fine)
    step = 2 ** (1 / 16) if fine else 2 ** (1 / 8)
    regular = rho <= max_packable(fine)
    assert bool((back[regular] <= torch.maximum(rho[regular] * step * (1 + 1e-6), floor)).all()), (seed, mag)
    assert bool((back[~regular] == torch.finfo(torch.float32).max).all())
    assert bool((back[rho == 0] == 0).all())


@pytest.mark.parametrize("fine", [False, True])
def test_log_table_is_strictly_increasing(fine):
    """A5d: pack_witness takes the first table entry >= rho (searchsorted), sound only on a sorted
    table; the tables the library and the kernels decode are strictly increasing, code 0 is 0 and
    every code i >= 1 holds at least 2^((i - 160)/8) (the fine table: 2^((i - 177)/16)), the value it stands for."""
    from fractions import Fraction
    from fast.core.witness import FINE_STEPS, FINE_ZERO, LOG_STEPS, LOG_ZERO, _log_table
    steps, zero = (FINE_STEPS, FINE_ZERO) if fine else (LOG_STEPS, LOG_ZERO)
    t = _log_table("cpu", fine)
    assert float(t[0]) == 0.0 and bool((t[1:] > t[:-1]).all())
    for i in range(1, 256):  # 2^(k/s) >= v  <=>  2^k >= v^s, in exact rationals
        v = Fraction(float(t[i]))
        assert Fraction(2) ** (i - zero) <= v ** steps, i
