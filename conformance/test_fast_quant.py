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
from fast.core.quant import FP8, QMAX, RTZ
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
    if case["scheme"] in RTZ:  # one per-tensor scale (1.0), and the clamp makes the error unbounded: keep inside
        x = torch.clamp(x.float(), -RTZ[case["scheme"]][1], RTZ[case["scheme"]][1]).to(x.dtype)
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


# ---- round-toward-zero fp8 (vLLM's CPU cast): bit model, step bound, clamp (issue 9) ----

RTZ_FORMATS = {"fp8_e4m3_rtz": (torch.float8_e4m3fn, 448.0, 2.0 ** -6), "fp8_e5m2_rtz": (torch.float8_e5m2, 57344.0, 2.0 ** -14)}
RTZ_SCALES = (1.0, 0.375, 2.0 ** -10, 3000.0, 2.0 ** 20)


def rtz_table(scheme):
    dtype = RTZ_FORMATS[scheme][0]
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float64)
    return torch.unique(vals[torch.isfinite(vals)].abs())  # sorted magnitudes, 0 included


def rtz_inputs(scheme, scale, seed=0):
    """fp32 inputs: every fp8 value times the scale, its fp32 neighbours, midpoints, random values
    in every binade, fp32 subnormals, values within 2^-30 below multiples of 2^-9 (the e4m3 quirk),
    and (separately) values beyond the clamp."""
    g = torch.Generator().manual_seed(seed)
    t = rtz_table(scheme).to(torch.float32)
    fmax = RTZ_FORMATS[scheme][1]
    base = torch.cat([t, torch.nextafter(t, torch.zeros(())), torch.nextafter(t, torch.full((), 1e9)), (t[1:] + t[:-1]) / 2,
                      torch.rand(20000, generator=g) * 2.0 ** torch.randint(-24, 16, (20000,), generator=g).float(),
                      torch.tensor([2.0 ** -149, 2.0 ** -130, 2.0 ** -127, 0.0]),
                      torch.arange(1, 9) * 2.0 ** -9 - 2.0 ** -31, torch.arange(1, 9) * 2.0 ** -9 - 2.0 ** -29])
    base = base[base <= fmax]
    x = torch.cat([base, -base]) * scale
    return x[torch.isfinite(x)].to(torch.float32)


def rtz_truth(x, scheme, scale):
    """Bytes' magnitudes from the table: v = fl32(x fl32(1/scale)) clamped, cut toward zero; for e4m3
    below 2^-6 the cast first rounds v 2^-120 to an fp32 subnormal (what vLLM's bit cut sees)."""
    dtype, fmax, normal_min = RTZ_FORMATS[scheme]
    v = (x * torch.tensor(1.0 / scale, dtype=torch.float32)).clamp(-fmax, fmax)
    a = v.abs()
    if scheme == "fp8_e4m3_rtz":
        sub = (a * torch.tensor(2.0 ** -120, dtype=torch.float32)).to(torch.float64) * 2.0 ** 120
        a = torch.where(a < normal_min, sub, a.to(torch.float64))
    else:
        a = a.to(torch.float64)
    table = rtz_table(scheme)
    idx = torch.searchsorted(table, a, right=True) - 1  # largest table value <= a
    return table[idx], v


def test_rtz_codes_match_the_table_truth():
    """Property: the codec's bytes are the truncation toward zero read off the table of all fp8
    values (+ the clamp, the sign byte 0x80 for a negative value cut to 0, 0x00 for 0)."""
    for scheme in RTZ_FORMATS:
        dtype = RTZ_FORMATS[scheme][0]
        for scale in RTZ_SCALES:
            x = rtz_inputs(scheme, scale)
            qt = fast.quantize(x.view(1, 1, -1, 1), scheme, scale=scale)
            mag, v = rtz_truth(x, scheme, scale)
            got = qt.codes.view(-1).view(dtype).to(torch.float64)
            assert torch.equal(got.abs(), mag), (scheme, scale, x[(got.abs() != mag)][:5])
            neg = (qt.codes.view(-1) & 0x80) != 0
            assert torch.equal(neg, v < 0), (scheme, scale)  # -0.0 -> 0x80, +-0.0 input -> 0x00


def test_rtz_step_bound_holds_exhaustively():
    """Property: |x - x~| <= step/2 on every input above (err rounded UP in fp64, so the check is
    rigorous), and the bound is the truncation one: the worst relative error reaches 2^(1-p)
    (2^-3 e4m3, 2^-2 e5m2: twice round-to-nearest) within 1%."""
    for scheme, rel in (("fp8_e4m3_rtz", 2.0 ** -3), ("fp8_e5m2_rtz", 2.0 ** -2)):
        worst = 0.0
        for scale in RTZ_SCALES:
            x = rtz_inputs(scheme, scale, seed=1).view(1, 1, -1, 1)
            qt = fast.quantize(x, scheme, scale=scale)
            assert not qt.clipped
            xh = fast.dequantize(qt).to(torch.float64)
            err = torch.nextafter((x.to(torch.float64) - xh).abs(), torch.tensor(float("inf"), dtype=torch.float64))
            half = qt.step().to(torch.float64) / 2
            bad = err > half
            assert not bool(bad.any()), (scheme, scale, x[bad][:5], xh[bad][:5], half[bad][:5])
            big = xh.abs() >= scale * RTZ_FORMATS[scheme][2]
            worst = max(worst, float(((x.double() - xh).abs()[big] / xh.abs()[big]).max()))
        assert rel * 0.99 <= worst <= rel * (1 + 1e-6), (scheme, worst)


def test_rtz_clamp_is_flagged_and_step_refused():
    """Beyond the range the cast clamps at +-fmax: the error is unbounded, so step() refuses and
    the cache measures the witness."""
    for scheme, (_, fmax, _) in RTZ_FORMATS.items():
        x = torch.tensor([1.0, -3.0, 10 * fmax]).view(1, 1, 3, 1)
        qt = fast.quantize(x, scheme)
        assert qt.clipped and float(fast.dequantize(qt)[0, 0, 2, 0]) == fmax
        try:
            qt.step()
        except ValueError as e:
            assert "clamped" in str(e)
        else:
            raise AssertionError(f"{scheme}: step() accepted a clamped tensor")
        ok = fast.quantize(x[:, :, :2], scheme)
        assert not ok.clipped and not ok.cat(fast.quantize(x[:, :, 2:], scheme, token_start=2)).step is None
        assert ok.cat(fast.quantize(x[:, :, 2:], scheme, token_start=2)).clipped


def test_rtz_rejects_bad_scales():
    x = torch.randn(1, 1, 4, 8)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 0.1, "1"):
        try:
            fast.quantize(x, "fp8_e4m3_rtz", scale=bad)
        except ValueError:
            continue
        raise AssertionError(f"scale {bad!r} accepted")
    try:
        fast.quantize(x, "int8", scale=1.0)
    except ValueError:
        pass
    else:
        raise AssertionError("a scale was accepted by int8")
