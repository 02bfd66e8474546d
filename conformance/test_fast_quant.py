"""Codecs (fast.core.quant) against exact arithmetic: the step bound |x - x~| <= delta/2 that the
zero-memory witness rests on (math.md T4, last paragraph), no clipping, the derived witness
dominating the reference witness of the actual error, and the append-only API.

Labels: property (a law of one implementation) unless marked differential.
Shrunk failures: conformance/corpus_fast/test_fast_quant.json, replayed by @example.
"""

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import mpf

import fast
from fast.core.quant import FP8, QMAX
from reference import band as ref
from conformance._check import replay

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}



CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "scheme": st.sampled_from(list(fast.SCHEMES)),
    "N": st.integers(1, 40), "D": st.sampled_from([32, 64, 128]), "group_size": st.sampled_from([16, 32, 64]),
    "dtype": st.sampled_from(sorted(DTYPES)), "mag": st.sampled_from([1e-6, 1e-2, 1.0, 1e2, 3e4]),
    "outliers": st.booleans(), "per_token_scale": st.booleans(), "token_start": st.integers(0, 2**31)})


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(1, 2, case["N"], case["D"], generator=g) * case["mag"]
    if case["outliers"]:
        x[..., 3] *= 50
    x = torch.clamp(x, -4e5, 4e5)  # fp16 scales reach 65504 * 7 (int4): larger keys are a ValueError (tests/test_fast_bad_input.py)
    if case["dtype"] == "fp16":
        x = torch.clamp(x, -6e4, 6e4)  # inside fp16's range
    x = x.to(DTYPES[case["dtype"]])
    if not case["per_token_scale"] and case["scheme"] in FP8:  # raw cast: keep inside the format's range
        x = torch.clamp(x.float(), -FP8[case["scheme"]][1], FP8[case["scheme"]][1]).to(x.dtype)
    qt = fast.quantize(x, case["scheme"], group_size=min(case["group_size"], case["D"]), seed=case["seed"], layer=3,
                       token_start=case["token_start"], per_token_scale=case["per_token_scale"])
    return x, qt


def check_step(case):
    """|x - dequantize(x)| <= step/2 in exact arithmetic (fp64 holds both sides exactly)."""
    x, qt = build(case)
    xd = fast.dequantize(qt)
    assert xd.shape == x.shape and xd.dtype == torch.float32
    err = (x.double() - xd.double()).abs()  # exact, or within 2^-53 relative (exponents 29+ bits apart): far inside the step margin 2^-10
    half = qt.step().double() / 2  # exact halving
    bad = err > half
    assert not bool(bad.any()), f"step bound violated at {bad.nonzero()[:3].tolist()}; reproduce check_step({json.dumps(case)})"
    if case["scheme"] in QMAX:  # no clipping: codes strictly inside the integer range
        lim = 7 if case["scheme"] == "int4" else 127
        m = (xd.double() / qt._scale_full().double()).abs()
        assert bool((m <= lim + 0.5).all()), f"codes out of range; check_step({json.dumps(case)})"
    assert bool((xd.double().abs().amax(dim=-2) <= qt.max_abs()).all()), f"max_abs; check_step({json.dumps(case)})"


def check_derived_witness(case):
    """Differential: witness_from_step(step) and witness_from_scales >= reference.band.witness(x, x~)."""
    x, qt = build(case)
    bands = fast.rope_bands(case["D"], 4, "rotate_half")
    rhos = {"step": fast.witness_from_step(qt.step(), bands)}
    if case["scheme"] in QMAX:
        rhos["scales"] = fast.witness_from_scales(qt, bands)
    xd = fast.dequantize(qt)
    bl = bands.tolist()
    for j in sorted({0, case["N"] - 1, case["N"] // 2}):
        want = ref.witness([float(v) for v in x[0, 1, j].double()], [float(v) for v in xd[0, 1, j].double()], bl)
        for name, rho in rhos.items():
            for b, w in enumerate(want):
                assert mpf(float(rho[0, 1, j, b])) >= w, f"{name} witness below the true error; check_derived_witness({json.dumps(case)})"


@settings(max_examples=200)
@replay("test_step_bounds_error")
@given(case=CASE)
def test_step_bounds_error(case):
    """Property: every codec's step() bounds its own error elementwise, rounding included."""
    check_step(case)


@settings(max_examples=60)
@replay("test_derived_witness_ge_reference")
@given(case=CASE)
def test_derived_witness_ge_reference(case):
    """Differential: the zero-memory witness >= the reference witness of the actual error."""
    check_derived_witness(case)


def test_nbytes_and_layout():
    """Property: bytes per token per head are what the formats say (fp16 K would be 2 D)."""
    x = torch.randn(2, 3, 10, 64)
    assert fast.quantize(x, "int8", group_size=64).bytes_per_token_head() == 64 + 2
    assert fast.quantize(x, "int8", group_size=32).bytes_per_token_head() == 64 + 4
    assert fast.quantize(x, "int4", group_size=32).bytes_per_token_head() == 32 + 4
    assert fast.quantize(x, "fp8_e4m3").bytes_per_token_head() == 64 + 4
    assert fast.quantize(x, "fp8_e5m2", per_token_scale=False).bytes_per_token_head() == 64


def test_narrow_and_cat_follow_the_dither_counters():
    """Property: quantizing a cache in two appends equals quantizing it at once (dither included)."""
    x = torch.randn(1, 2, 30, 32)
    for scheme in fast.SCHEMES:
        whole = fast.quantize(x, scheme, seed=7, layer=2)
        a = fast.quantize(x[:, :, :11], scheme, seed=7, layer=2)
        b = fast.quantize(x[:, :, 11:], scheme, seed=7, layer=2, token_start=11)
        joined = a.cat(b)
        assert torch.equal(fast.dequantize(joined), fast.dequantize(whole)), scheme
        assert torch.equal(fast.dequantize(whole.narrow(11, 19)), fast.dequantize(b)), scheme


def test_dither_is_centred_and_uniform():
    """Property: the hash dither has mean ~0 and variance ~1/12 (A1 is an assumption; this is a smoke check)."""
    u = fast.dither_noise(seed=1, layer=0, Hkv=4, token_start=0, N=512, D=64).double()
    assert abs(float(u.mean())) < 5 / (12 * u.numel()) ** 0.5  # 5 standard errors
    assert abs(float(u.var()) - 1 / 12) < 0.002
    assert float(u.abs().max()) < 0.5
    assert not torch.equal(u, fast.dither_noise(seed=2, layer=0, Hkv=4, token_start=0, N=512, D=64).double())
