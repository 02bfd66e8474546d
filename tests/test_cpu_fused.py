"""fast.core.cpu_fused (the fused C++ read) against the torch twin and the exact reference.

Differential (fused vs twin): the output of fast.core.attention.attention_rows on the same
inputs (T causal rows, batch with padding, GQA, int8 codes or fp32 rows, witness stored /
packed / derived, exact tokens). Differential (fused vs reference): every certificate form >= the
exact (60-digit) formula reference.softmax.tv_bound_forms(softmax(s<q, k~>), c) on each row's
readable tokens, c = reference.band.logit_error_bound (0 on exact tokens), and not looser than
the twin's certificate by more than the Taylor bounds cost (module doc: relative O(cm^2)).
Property: kv_exp meets the exp error model on every fp32 input (exhaustive). Bad inputs: one
ValueError each.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

import fast
from fast.core import attention as twin
from fast.core import cpu_fused
from fast.core.certify import EXP32_EPS, FORMS, TINY, U32
from fast.core.quant import quantize
from fast.core.witness import _log_table
from reference import band as ref_band
from reference import softmax as ref

ROOT = Path(__file__).resolve().parents[1]


def test_extension_builds():
    assert cpu_fused.available(), "g++ with OpenMP could not build fast/core/csrc/cpu_fused.cpp"


def test_failed_build_is_not_retried(tmp_path):
    """Without a working compiler available() is False, and the build is tried once per process, not at every call
    (a server without g++ would otherwise compile at every read and write)."""
    code = ("import subprocess, fast.core.native as n\n"
            "calls = []\n"
            "run = subprocess.run\n"
            "n.subprocess.run = lambda *a, **k: calls.append(1) or run(*a, **k)\n"
            "print([n.available() for _ in range(3)], len(calls))\n")
    env = {**os.environ, "CXX": "false", "KVCERT_BUILD_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[False,", "False,", "False]", "1"], r.stdout


def test_exp_exhaustive():
    """Property: kv_exp on EVERY fp32 x in [-104, 0] is within EXP32_EPS (relative) of e^x where
    e^x >= 2^-126 and within 2^-126 (absolute) below: the error model forms_from_pmz assumes."""
    rel_ulps, abs_err = cpu_fused.exp_check(-104.0)
    assert rel_ulps * U32 <= EXP32_EPS, f"kv_exp relative error {rel_ulps} u32 > {EXP32_EPS / U32}"
    assert abs_err <= TINY[torch.float32]
    assert cpu_fused.exp_one(0.0) == 1.0 and cpu_fused.exp_one(-200.0) == 0.0


CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 3),
    "G": st.integers(1, 3), "N": st.integers(1, 40), "D": st.sampled_from([32, 64, 96]), "NB": st.sampled_from([1, 4, 8]),
    "cache": st.sampled_from(["int8", "int4", "float", "fp8_e4m3", "fp8_e5m2_rtz"]), "group": st.sampled_from([16, 0]),
    "witness": st.sampled_from(["stored", "packed", "derived"]), "mag": st.sampled_from([1e-3, 1.0, 30.0]),
    "padding": st.booleans(), "exact": st.booleans(), "kpos": st.booleans()})


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, N, D, G = case["B"], case["T"], case["Hkv"], case["N"], case["D"], case["G"]
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    q = torch.randn(B, T, Hkv * G, D, generator=g) * case["mag"]
    bands = fast.rope_bands(D, case["NB"])
    if case["cache"] == "float":
        kc, vc = k + 0.01 * torch.randn(B, Hkv, N, D, generator=g), v
        rho = fast.witness(k, kc, bands)
    else:
        gs = case["group"] or D
        kc, vc = fast.quantize(k, case["cache"], group_size=gs), fast.quantize(v, case["cache"], group_size=gs)
        rho = None if case["witness"] == "derived" else fast.witness(k, fast.dequantize(kc), bands)
    if case["witness"] == "packed":
        rho = fast.pack_witness(rho)
    k_pos = None
    if case["kpos"]:  # storage order != positions (after eviction: sorted, with gaps)
        k_pos = torch.sort(torch.randperm(3 * N, generator=g)[:N])[0].expand(B, N).contiguous()
    kp = torch.arange(N).expand(B, N) if k_pos is None else k_pos
    q_pos = kp[:, -1:] - torch.arange(T - 1, -1, -1).view(1, T)  # the last T keys' positions (causal)
    q_pos = torch.maximum(q_pos, kp[:, :1])
    valid = None
    if case["padding"] and N > 1:
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, : N // 2] = False
        q_pos = torch.maximum(q_pos, kp[:, N // 2: N // 2 + 1])
    exact = None
    if case["exact"]:
        exact = torch.zeros(B, Hkv, N, dtype=torch.bool)
        exact[..., :1] = True
        exact[..., -2:] = True
    return q, k, kc, vc, rho, bands, q_pos, k_pos, valid, exact


def dense(t):
    return fast.dequantize(t) if isinstance(t, fast.QTensor) else t.float()


@workdps(60)
def check_rows(case):
    q, k, kc, vc, rho, bands, q_pos, k_pos, valid, exact = build(case)
    s = 1 / math.sqrt(case["D"])
    args = dict(bands=bands, q_pos=q_pos, k_pos=k_pos, valid=valid, exact=exact)
    out, cert = cpu_fused.attention_rows(q, kc, vc, rho, s, **args)
    out_t, cert_t = twin.attention_rows(q, kc, vc, rho, s, backend="torch", **args)
    rep = f"reproduce: check_rows({json.dumps(case)})"
    # fp32 both sides, sums in different orders (8 lanes + chunks vs BLAS), exps a few ulp apart (Sleef vs
    # kv_exp): a few 1e-6 relative. Both logits lie within e = s (D + 4) u32 sum |q||k~| of the exact one,
    # so the weights may differ by a factor e^{2e}: large logits ("mag" 30) widen the tolerance by 4 e.
    kd0 = dense(kc)
    e_max = float((q.abs().sum(-1).max() * kd0.abs().max()) * s * (case["D"] + 4) * 2.0 ** -24)
    tol = 2e-5 + 4 * e_max
    torch.testing.assert_close(out, out_t, rtol=tol, atol=tol * max(1.0, float(out_t.abs().max())), msg=lambda m: f"{m}\n{rep}")
    # reference: exact formula on each row's readable tokens
    if rho is None:
        rho = fast.witness_from_step(kc.step(), bands)
    elif rho.dtype == torch.uint8:
        rho = fast.unpack_witness(rho)
    kd = dense(kc)
    B, T, H, D = q.shape
    G = case["G"]
    kp = torch.arange(case["N"]).expand(B, -1) if k_pos is None else k_pos
    for b, t, h in sorted({(0, 0, 0), (B - 1, T - 1, H - 1)}):
        kv = h // G
        toks = [j for j in range(case["N"]) if (valid is None or bool(valid[b, j])) and int(kp[b, j]) <= int(q_pos[b, t])]
        qh = [mpf(float(x)) for x in q[b, t, h].double()]
        logits = [s * fsum(a * mpf(float(x)) for a, x in zip(qh, kd[b, kv, j].double())) for j in toks]
        c = ref_band.logit_error_bound([float(x) for x in q[b, t, h].double()],
                                       [[float(x) for x in rho[b, kv, j].double()] for j in toks], bands.tolist(), s)
        if exact is not None:
            c = [mpf(0) if bool(exact[b, kv, j]) else cj for cj, j in zip(c, toks)]
        want = ref.tv_bound_forms(ref.softmax(logits), c)
        for name in FORMS:
            f, w, tw = mpf(float(cert[name][b, t, h])), want[name], mpf(float(cert_t[name][b, t, h]))
            msg = f"{name} row ({b},{t},{h}): fused {f} exact {w} twin {tw}; {rep}"
            assert f >= w, "unsound " + msg
            cm = float(cert["max_c"][b, t, h])
            if tw < 1:  # not saturated: the Taylor / chord bounds of P and M cost relative O(cm^2) at most
                assert f <= tw * (1 + 1e-4 + cm * cm) + 1e-7, "loose " + msg
        assert float(cert["B"][b, t, h]) <= float(fsum(p * mpf(math.e) ** (-cj) for p, cj in zip(ref.softmax(logits), c))), rep


@settings(max_examples=40, deadline=None)
@given(case=CASE)
def test_rows_match_twin_and_reference(case):
    check_rows(case)


def test_long_cache_several_chunks():
    """Differential at N > CHUNK (several work items per head, max and sums across chunks), batch 2
    with different lengths, T = 4 causal rows: output vs twin, certificate >= twin's exact formula."""
    case = {"seed": 7, "B": 2, "T": 4, "Hkv": 3, "G": 3, "N": 1300, "D": 64, "NB": 8, "cache": "int8", "group": 0,
            "witness": "packed", "mag": 1.0, "padding": True, "exact": True, "kpos": False}
    q, k, kc, vc, rho, bands, q_pos, k_pos, valid, exact = build(case)
    s = 0.125
    args = dict(bands=bands, q_pos=q_pos, k_pos=k_pos, valid=valid, exact=exact)
    out, cert = cpu_fused.attention_rows(q, kc, vc, rho, s, **args)
    out_t, cert_t = twin.attention_rows(q, kc, vc, rho, s, backend="torch", **args)
    torch.testing.assert_close(out, out_t, rtol=2e-5, atol=2e-6)  # see check_rows
    for name in FORMS:  # the twin is itself >= the exact formula: the fused one may exceed it only slightly
        assert bool((cert[name] >= cert_t[name] * (1 - 1e-5)).all()), name
        assert bool((cert[name] <= cert_t[name] * (1 + 1e-3)).all()), name
    # certify=False: same output, no certificate
    out2, none = cpu_fused.attention_rows(q, kc, vc, rho, s, certify=False, **args)
    assert none is None and torch.equal(out2, out)


def test_large_witness_falls_back_to_twin():
    """A row with max c_eff > CMAX32 is recomputed by the twin (fp64 terms): same certificate."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 2, 32, generator=g) * 50
    k, v = torch.randn(1, 1, 20, 32, generator=g), torch.randn(1, 1, 20, 32, generator=g)
    rho = torch.full((1, 1, 20, 4), 5.0)
    bands = fast.rope_bands(32, 4)
    qp = torch.tensor([[19]])
    out, cert = cpu_fused.attention_rows(q, k, v, rho, 32 ** -0.5, bands=bands, q_pos=qp)
    _, cert_t = twin.attention_rows(q, k, v, rho, 32 ** -0.5, bands=bands, q_pos=qp, backend="torch")
    for name in FORMS:
        assert torch.equal(cert[name], cert_t[name])


def test_unsupported_input_goes_to_twin():
    """A value witness (v_err: no fused value bound) is read by the twin: its bits exactly."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 30, 64, generator=g), torch.randn(1, 2, 30, 64, generator=g)
    q = torch.randn(1, 2, 4, 64, generator=g)
    kq, vq = fast.quantize(k, "int8"), fast.quantize(v, "int8")
    v_err = (fast.dequantize(vq) - v).norm(dim=-1)
    bands = fast.rope_bands(64, 8)
    qp = torch.tensor([[28, 29]])
    assert not cpu_fused._supported(kq, vq, v_err)
    out, cert = cpu_fused.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp, v_err=v_err)
    out_t, cert_t = twin.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp, v_err=v_err, backend="torch")
    assert torch.equal(out, out_t) and all(torch.equal(cert[n], cert_t[n]) for n in FORMS)


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "fp8_e5m2_rtz", "int8_dither", "int4_dither"])
def test_codec_qtensor_through_the_kernel(scheme):
    """fp8 QTensors (witness derived from their step when none is given, as the twin derives it) are read by the
    kernel: the twin's output up to fp32 summation order; the certificate (min) at most the twin's (whose logit
    bound e takes the format's largest code times the scale, the kernel the decoded rows' own max |k~|: much smaller
    for the round-toward-zero casts without token scales), every form within the Taylor room O(cm^2) of the module doc (soundness against the exact formula:
    test_rows_match_twin_and_reference, whose cases include fp8). Dithered QTensors alike (the dither regenerated at
    read: tests/test_cpu_fused_dither.py)."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 30, 64, generator=g), torch.randn(1, 2, 30, 64, generator=g)
    q = torch.randn(1, 2, 4, 64, generator=g)
    kw = dict(seed=5) if "dither" in scheme else {}
    kq, vq = fast.quantize(k, scheme, **kw), fast.quantize(v, scheme, stream=1, **kw) if kw else fast.quantize(v, scheme)
    bands = fast.rope_bands(64, 8)
    qp = torch.tensor([[28, 29]])
    out, cert = cpu_fused.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp)
    out_t, cert_t = twin.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp, backend="torch")
    torch.testing.assert_close(out, out_t, rtol=2e-5, atol=1e-6)
    assert cpu_fused._supported(kq, vq, None)
    assert bool((cert["min"] <= cert_t["min"] * (1 + 1e-6)).all())
    cm = cert["max_c"].double()
    for n in FORMS:
        assert bool((cert[n] <= cert_t[n] * (1 + 1e-4 + cm * cm) + 1e-7).all()), n


def _inputs():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 1, 10, 32, generator=g), torch.randn(1, 1, 10, 32, generator=g)
    q = torch.randn(1, 1, 2, 32, generator=g)
    return q, fast.quantize(k, "int8"), fast.quantize(v, "int8"), fast.rope_bands(32, 4), torch.tensor([[9]])


@pytest.mark.parametrize("what", ["q_nan", "k_scale_inf", "v_scale_nan", "v_float_nan", "no_key", "qpos_shape",
                                  "kv_shape"])
def test_bad_input_one_value_error(what):
    q, kq, vq, bands, qp = _inputs()
    valid = None
    k, v = kq, vq
    if what == "q_nan":
        q[0, 0, 0, 0] = float("nan")
    elif what == "k_scale_inf":
        kq.scales[0, 0, 3, 0] = float("inf")
    elif what == "v_scale_nan":
        vq.scales[0, 0, 3, 0] = float("nan")
    elif what == "v_float_nan":
        k, v = fast.dequantize(kq), fast.dequantize(vq)
        v[0, 0, 2, 5] = float("nan")
        return_rho = torch.zeros(1, 1, 10, 4)
        with pytest.raises(ValueError):
            cpu_fused.attention_rows(q, k, v, return_rho, 0.125, bands=bands, q_pos=qp)
        return
    elif what == "no_key":
        valid = torch.zeros(1, 10, dtype=torch.bool)
    elif what == "qpos_shape":
        qp = torch.tensor([[9, 9]])
    elif what == "kv_shape":
        v = fast.quantize(torch.randn(1, 1, 9, 32), "int8")
    with pytest.raises(ValueError):
        cpu_fused.attention_rows(q, k, v, None, 0.125, bands=bands, q_pos=qp, valid=valid)


def test_logit_rounding_covers_subnormal_products():
    """Regression (spec T8e, proofs/FloatDot.v): products q_i k_i below the normal range round
    with an ABSOLUTE error that no relative term covers. The kernel's e (stats[..., 4]) must be
    >= the proved bound reference.floats.logit_rounding_bound (relative + absolute part) on
    fp32 rows whose products are all subnormal (q = k = 2^-70): before the fix e was ~0."""
    from reference import floats as ref_floats
    B, T, Hkv, G, N, D, NB = 1, 1, 1, 1, 4, 64, 8
    q = torch.full((B, T, Hkv * G, D), 2.0 ** -70)
    k = torch.full((B, Hkv, N, D), 2.0 ** -70)
    v = torch.randn(B, Hkv, N, D, generator=torch.Generator().manual_seed(0))
    s = 0.125
    bands = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    rho = torch.zeros(B, Hkv, N, NB)
    s0 = cpu_fused.seg(Hkv, N, k=k.contiguous(), v=v.contiguous(), rho=rho.contiguous())
    _, stats = cpu_fused._run(q.contiguous(), torch.full((B, T), N - 1, dtype=torch.int32), [s0, cpu_fused.seg(Hkv, 0)],
                              s, bands, 1, 1, True)
    rel, absolute = ref_floats.logit_rounding_bound([float(x) for x in q[0, 0, 0]], [float(x) for x in k[0, 0, 0]], s)
    bound = (rel + absolute).b  # the interval's upper end
    e = stats[0, 0, 0, 4].item()
    assert mpf(e) >= bound, (e, str(rel), str(absolute))


def _has_avx2():
    try:
        return " avx2 " in open("/proc/cpuinfo").read().replace("\n", " ")
    except OSError:
        return False


def test_inline_next_up_is_the_librarys_nextafter():
    """The kernel's up()/upf() (std::nextafter toward +inf without the library call, used for every
    rounded-up bound: kappa, e, the epilogue) and down() (toward -inf: the box's margins) give the library's
    bits on +-0, subnormals, +-inf, NaN, +-DBL_MAX and 10^6 random bit patterns of each width; a mismatch would make a bound one ulp low."""
    import ctypes
    lib = cpu_fused._lib()
    lib.kvcert_up_check.argtypes = [ctypes.c_int64, ctypes.c_uint64]
    lib.kvcert_up_check.restype = ctypes.c_int64
    assert lib.kvcert_up_check(10 ** 6, 12345) == 0


def _kappa(q, bands, s, margin, scalar):
    import ctypes
    lib = cpu_fused._lib(scalar)
    lib.kvcert_kappa.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_double, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p]
    lib.kvcert_kappa.restype = ctypes.c_float
    n, D = q.shape
    NB, W = bands.shape
    k64, k32 = torch.empty(n, NB, dtype=torch.float64), torch.empty(n, NB, dtype=torch.float32)
    nan = lib.kvcert_kappa(q.data_ptr(), n, D, bands.data_ptr(), NB, W, s, margin, k64.data_ptr(), k32.data_ptr())
    return k64, k32, nan


KAPPA = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "n": st.integers(1, 5), "NB": st.sampled_from([1, 3, 4, 6, 8, 16]),
    "W": st.sampled_from([1, 2, 4, 8]), "s": st.sampled_from([0.125, 1e-30, 3e20, 0.0]),
    "mag": st.sampled_from([1e-42, 1e-20, 1.0, 1e30]), "special": st.sampled_from(["none", "zero_band", "inf", "nan"])})


@settings(max_examples=60, deadline=None)
@given(case=KAPPA)
def test_kappa_same_bits_as_scalar_and_bounds_the_band_norm(case):
    """kappa_b (the kernel's band-norm bound, four bands per AVX2 register): the vector and the scalar
    build give the same fp64 and fp32 bits (zero bands, subnormal and huge q, Inf, NaN, s = 0, band
    counts off the vector width), and, where finite, k32 >= k64 >= s ||q_b|| EXACTLY (rationals:
    k64^2 >= s^2 sum_w q_w^2). The stats test cannot see a missing ulp here: the fp32 rounding up hides it."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(case["seed"])
    NB, W, n = case["NB"], case["W"], case["n"]
    D = NB * W
    bands = torch.randperm(D, generator=g).view(NB, W).contiguous()
    q = (torch.randn(n, D, generator=g, dtype=torch.float64) * case["mag"]).to(torch.float32)
    if case["special"] == "zero_band":
        q[:, bands[0]] = 0.0
    elif case["special"] != "none":
        q[0, bands[:, 0]] = float(case["special"])  # in every band of row 0: vector lanes and the scalar tail
    margin = cpu_fused._band_margin(W)
    (v64, v32, vnan), (s64, s32, snan) = (_kappa(q, bands, case["s"], margin, sc) for sc in (False, True))
    assert torch.equal(v64.view(torch.int64), s64.view(torch.int64)), case
    assert torch.equal(v32.view(torch.int32), s32.view(torch.int32)), case
    assert (vnan == snan) or (math.isnan(vnan) and math.isnan(snan))
    overflow = bool((v64 > torch.finfo(torch.float32).max).any())  # kappa beyond fp32: flagged like Inf
    assert math.isnan(vnan) == (case["special"] in ("inf", "nan") or overflow), case
    for i in range(n):
        for b in range(NB):
            if not math.isfinite(float(v64[i, b])):
                continue
            ss = sum(Fraction(float(q[i, int(d)])) ** 2 for d in bands[b])
            assert Fraction(float(v64[i, b])) ** 2 >= Fraction(case["s"]) ** 2 * ss, (case, i, b)
            assert float(v32[i, b]) >= float(v64[i, b]) >= 2.0 ** -60


def test_log_table_is_the_grid_the_kernel_decodes():
    """The AVX2 witness decode (mantissa permute + exponent add) applies to both shipped tables, and the
    check behind it rejects a table off the grid by one ulp (the kernel then gathers)."""
    from fast.core.witness import _log_table
    for fine in (False, True):  # the coarse table (8 codes per octave) and the fine one of vLLM's pages (16)
        lut = _log_table("cpu", fine).to(torch.float32)
        assert cpu_fused.lut_is_grid(lut)
        for i in (77, 180):
            bad = lut.clone()
            bad[i] = torch.nextafter(bad[i], torch.tensor(1e9))
            assert not cpu_fused.lut_is_grid(bad)
        bad = lut.clone()
        bad[0] = 1e-9
        assert not cpu_fused.lut_is_grid(bad)


def test_vector_build_is_the_vector_one():
    """The bit-identity test below compares the AVX2 build with the scalar one; on an AVX2 machine the
    default build must really contain the AVX2 paths (else the comparison would be scalar vs scalar)."""
    assert cpu_fused._lib(scalar=True).kvcert_fused_avx2() == 0
    assert cpu_fused._lib().kvcert_fused_avx2() == int(_has_avx2())


SEGS = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 2),
    "G": st.integers(1, 3), "N0": st.integers(0, 45), "N1": st.integers(1, 12), "D": st.sampled_from([64, 80, 144]),
    "groups": st.sampled_from([1, 2, 8]), "codec": st.sampled_from(["int8", "int4"]), "holes": st.booleans(), "exact": st.booleans(), "certify": st.booleans(),
    "mag": st.sampled_from([1e-3, 1.0, 30.0]), "fine": st.booleans()})


@settings(max_examples=30, deadline=None)
@given(case=SEGS)
def test_vector_paths_same_bits_as_scalar(case):
    """The AVX2 blocks of pass 1 (8 tokens, hadd transpose), the witness decode (byte transpose, codes 0 and exact
    tokens zeroed; the coarse log table or the fine one, 16 codes per octave), the 8-lane
    sums and the register accumulators of pass 2 run the scalar code's operations in its order: output, stats and the
    box form's histogram of c equal bit for bit, on two segments
    (int8 codes with packed witness + fp32 tail with positions), token counts off the block size,
    D beyond one 64-channel block, holes in the valid mask (NaN value scales there: never read), T causal rows."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N0, N1, D = (case[x] for x in ("B", "T", "Hkv", "G", "N0", "N1", "D"))
    T = min(T, N1)  # every row reads a key: row 0 sits at or after the first fp32-tail token
    NB, H = 8, Hkv * G
    bands = fast.rope_bands(D, NB)
    k, v = torch.randn(B, Hkv, N0, D, generator=g), torch.randn(B, Hkv, N0, D, generator=g)
    kq = fast.quantize(k, case["codec"], group_size=D // case["groups"])
    vq = fast.quantize(v, case["codec"], group_size=D // case["groups"])
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands), fine=case["fine"]).contiguous()
    if case["exact"] and N0:  # code 0 (rho = 0: a band stored exactly) at some (token, band) inside the blocks
        rho[torch.rand(rho.shape, generator=g) < 0.1] = 0
    valid = torch.ones(B, Hkv, N0, dtype=torch.uint8)
    if case["holes"] and N0:
        holes = torch.randperm(N0, generator=g)[: N0 // 3]
        valid[..., holes] = 0
        vq.scales[..., holes, :] = float("nan")  # a row skips the tokens it does not read (w = 0): their values too
    exact = None
    if case["exact"] and N0:  # tokens held exactly (c = 0) inside the 8-token blocks
        exact = (torch.rand(B, Hkv, N0, generator=g) < 0.3).to(torch.uint8)
    s0 = cpu_fused.seg(Hkv, N0, k=kq.codes.contiguous(), v=vq.codes.contiguous(), k_scales=kq.scales.contiguous().view(torch.int16),
                       v_scales=vq.scales.contiguous().view(torch.int16), rho=rho, valid=valid, exact=exact) if N0 else cpu_fused.seg(Hkv, 0)
    k1, v1 = torch.randn(B, Hkv, N1, D, generator=g), torch.randn(B, Hkv, N1, D, generator=g)
    pos = torch.arange(N0, N0 + N1, dtype=torch.int32).view(1, 1, N1).expand(B, Hkv, N1).contiguous()
    s1 = cpu_fused.seg(Hkv, N1, k=k1, v=v1, pos=pos, valid=torch.ones(B, Hkv, N1, dtype=torch.uint8))
    q = (torch.randn(B, T, H, D, generator=g) * case["mag"]).contiguous()
    qpos = (N0 + N1 - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    from fast.core.witness import _log_table
    lut = _log_table("cpu", case["fine"]).to(torch.float32).contiguous()
    assert cpu_fused.lut_is_grid(lut)  # the AVX2 build decodes it in registers, the scalar build gathers
    b64 = bands.to(torch.int64).contiguous()
    from fast.core.box import HIST_K
    hists = [torch.full((B, T, H, 3 * HIST_K), math.nan, dtype=torch.float64) if case["certify"] else None for _ in range(2)]
    got = [cpu_fused._run(q, qpos, [s0, s1], D ** -0.5, b64, case["groups"] if N0 else 1, case["groups"] if N0 else 1,
                          case["certify"], lut, scalar=sc, hist=hists[sc]) for sc in (False, True)]
    rep = f"case {json.dumps(case)}"
    assert torch.equal(got[0][0], got[1][0]), "output differs: " + rep
    assert torch.equal(got[0][1], got[1][1]), "stats differ: " + rep
    if case["certify"]:  # the box form's histogram of c (csrc hist_chunk): every entry written, the same bits
        assert torch.equal(hists[0], hists[1]), "histograms differ: " + rep


PAGED = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 2),
    "G": st.integers(1, 3), "N": st.integers(1, 70), "bs": st.sampled_from([8, 12, 16, 24, 32]), "D": st.sampled_from([64, 80]),
    "transposed": st.booleans(), "certify": st.booleans()})


@settings(max_examples=25, deadline=None)
@given(case=PAGED)
def test_paged_read_same_bits_as_contiguous(case):
    """cpu_fused.paged_seg reads a paged cache in place (vLLM's CPU layout: keys [D, bs] per block, blocks
    shuffled, one table per sequence): output and stats equal bit for bit the read of the same keys,
    values and witness laid out contiguously, in the vector and the scalar build."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N, bs, D = (case[x] for x in ("B", "T", "Hkv", "G", "N", "bs", "D"))
    T, NB, H = min(T, N), 8, Hkv * G
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    rho = torch.rand(B, Hkv, N, NB, generator=g) * 1e-2
    nblk = -(-N // bs)
    nb = B * nblk + 3
    perm = torch.randperm(nb, generator=g)[: B * nblk].view(B, nblk).to(torch.int32)
    table = torch.cat([perm, torch.full((B, 2), nb - 1, dtype=torch.int32)], 1).contiguous()  # unused tail entries
    kc = torch.full((nb, Hkv, D, bs) if case["transposed"] else (nb, Hkv, bs, D), float("nan"))
    vc, rc = torch.full((nb, Hkv, bs, D), float("nan")), torch.full((nb, Hkv, bs, NB), float("nan"))
    for b in range(B):
        for j in range(N):
            blk, off = int(table[b, j // bs]), j % bs
            if case["transposed"]:
                kc[blk, :, :, off] = k[b, :, j]
            else:
                kc[blk, :, off] = k[b, :, j]
            vc[blk, :, off], rc[blk, :, off] = v[b, :, j], rho[b, :, j]
    q = torch.randn(B, T, H, D, generator=g).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    b64 = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    flat = [cpu_fused.seg(Hkv, N, k=k, v=v, rho=rho), cpu_fused.seg(Hkv, 0)]
    paged = [cpu_fused.paged_seg(N, k=kc, v=vc, rho=rc, table=table, k_transposed=case["transposed"]), cpu_fused.seg(Hkv, 0)]
    for sc in (False, True):
        want = cpu_fused._run(q, qpos, flat, D ** -0.5, b64, 1, 1, case["certify"], scalar=sc)
        got = cpu_fused._run(q, qpos, paged, D ** -0.5, b64, 1, 1, case["certify"], scalar=sc)
        rep = f"scalar={sc} case {json.dumps(case)}"
        assert torch.equal(got[0], want[0]), "output differs: " + rep
        assert torch.equal(got[1], want[1]), "stats differ: " + rep


def test_paged_seg_refuses_bad_tables():
    """A block id outside the cache, a short or non-int32 table, a non-fp32 cache: one ValueError each."""
    kc, vc = torch.zeros(4, 1, 64, 8), torch.zeros(4, 1, 8, 64)
    ok = torch.tensor([[0, 1]], dtype=torch.int32)
    cpu_fused.paged_seg(16, k=kc, v=vc, rho=None, table=ok, k_transposed=True)
    for table, what in ((torch.tensor([[0, 4]], dtype=torch.int32), "block ids"), (torch.tensor([[0]], dtype=torch.int32), "int32"),
                        (ok.long(), "int32"), (torch.tensor([[-1, 0]], dtype=torch.int32), "block ids")):
        with pytest.raises(ValueError, match=what):
            cpu_fused.paged_seg(16, k=kc, v=vc, rho=None, table=table, k_transposed=True)
    with pytest.raises(ValueError, match="fp32"):
        cpu_fused.paged_seg(16, k=kc.half(), v=vc, rho=None, table=ok, k_transposed=True)


def test_paged_seg_reuse_reads_as_a_fresh_segment():
    """paged_seg(reuse=d) (a serving loop's per-layer segment): the same dict updated for the same base and batch,
    read bit for bit as a fresh segment at every length and table (the checks _run keeps in it stay valid); another
    base or batch gets a new dict; a bad table is refused with reuse too."""
    g = torch.Generator().manual_seed(3)
    D, bs, nb, Hkv, H = 16, 8, 6, 2, 4
    kc, vc, rho = torch.randn(nb, Hkv, D, bs, generator=g), torch.randn(nb, Hkv, bs, D, generator=g), torch.rand(nb, Hkv, bs, 4, generator=g)
    base = cpu_fused.paged_base(k=kc, v=vc, rho=rho, k_transposed=True)
    bands, empty = fast.rope_bands(D, 4).long().contiguous(), cpu_fused.seg(Hkv, 0)
    d = None
    for n, table in ((5, [[3, 1]]), (16, [[0, 5]]), (17, [[2, 4, 1]]), (9, [[5, 0]])):
        table = torch.tensor(table, dtype=torch.int32)
        q, qpos = torch.randn(1, 1, H, D, generator=g), torch.tensor([[n - 1]], dtype=torch.int32)
        fresh = cpu_fused.paged_seg(n, table=table, base=base)
        d0, d = d, cpu_fused.paged_seg(n, table=table, base=base, reuse=d)
        assert d0 is None or d is d0
        a = cpu_fused._run(q, qpos, [fresh, empty], 0.25, bands, 1, 1, True)
        b = cpu_fused._run(q, qpos, [d, empty], 0.25, bands, 1, 1, True)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    other = cpu_fused.paged_base(k=kc.clone(), v=vc, rho=rho, k_transposed=True)
    assert cpu_fused.paged_seg(4, table=table, base=other, reuse=d) is not d
    assert cpu_fused.paged_seg(4, table=table.expand(2, -1).contiguous(), base=base, reuse=d) is not d
    with pytest.raises(ValueError, match="block ids"):
        cpu_fused.paged_seg(9, table=torch.tensor([[5, 6]], dtype=torch.int32), base=base, reuse=d)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), D=st.sampled_from([16, 64, 80]), bs=st.sampled_from([8, 32]),
       spread=st.sampled_from([0.0, 10.0, 40.0]), same=st.booleans())
def test_paged_witness_is_the_witness(seed, n, D, bs, spread, same):
    """cpu_fused.paged_witness (C++, in place on vLLM's key layout): equal to fast.core.witness.witness of
    the key against the stored key (up to one fp32 ulp: the sum order may differ), never below the exact band
    norm (mpmath, 60 digits), RHO_MIN for nonzero values below it (so also where the cache holds the key exactly);
    slots < 0 left untouched. cpu_fused.witness_codes (C++, the packed codes of the same witness: the transformers
    cache's flush, vLLM's int8 / int4 / fp8 pages): pack_witness's code of that witness, and never below the exact
    band norm either."""
    from fast.core.witness import pack_witness, unpack_witness, witness
    g = torch.Generator().manual_seed(seed)
    Hkv, NB, nb = 2, 4, 3
    mags = torch.exp2((torch.randn(D, generator=g) * spread).clamp(-60, 60))  # finite products, subnormal differences
    key = torch.randn(n, Hkv, D, generator=g) * mags
    kt = torch.randn(nb, Hkv, D, bs, generator=g) * mags[:, None]
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[0] = -1 if n > 1 else slots[0]
    if same:  # a slot holding the key exactly: witness 0
        i = n - 1
        kt[slots[i] // bs, :, :, slots[i] % bs] = key[i]
    rho = torch.full((nb, Hkv, bs, NB), -7.0)
    bands = fast.rope_bands(D, NB)
    cpu_fused.paged_witness(key, kt, slots, rho, bands)
    for i, sl in enumerate(slots.tolist()):
        if sl < 0:
            continue
        got = rho[sl // bs, :, sl % bs]
        st_ = kt[sl // bs, :, :, sl % bs]
        want = witness(key[i][None, :, None], st_[None, :, None], bands, backend="torch")[0, :, 0]
        want = torch.where((want > 0) & (want < cpu_fused.RHO_MIN), torch.tensor(cpu_fused.RHO_MIN), want)
        assert (got.view(torch.int32) - want.view(torch.int32)).abs().max() <= 1, (got, want)
        codes = cpu_fused.witness_codes(key[i], st_.contiguous(), bands)  # [Hkv, NB]
        assert torch.equal(codes, pack_witness(got)), (codes, got)  # the code of the C++ witness (RHO_MIN aside)
        assert (codes.int() - pack_witness(want).int()).abs().max() <= 1
        with workdps(60):
            for h in range(Hkv):
                for b in range(NB):
                    exact = fsum((mpf(float(key[i, h, d])) - mpf(float(st_[h, d]))) ** 2 for d in bands[b].tolist()) ** 0.5
                    assert mpf(float(got[h, b])) >= exact, (h, b, float(got[h, b]), exact)
                    assert mpf(float(unpack_witness(codes[h, b]))) >= exact, (h, b, int(codes[h, b]), exact)
        if same and i == n - 1:  # up64(0) > 0, raised to the kernel's minimum: tiny, still a witness
            assert bool((got == cpu_fused.RHO_MIN).all()), got
    assert int((rho == -7.0).sum()) == (nb * bs - int((slots >= 0).sum())) * Hkv * NB  # nothing else written
    key[-1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cpu_fused.paged_witness(key, kt, slots, rho, bands)
    with pytest.raises(ValueError, match="NaN"):
        cpu_fused.witness_codes(key, key.nan_to_num(), bands)
    # nonfinite="top": NaN/Inf rows (in either argument) get the top code, every other row the codes it gets alone
    khat = key.nan_to_num() + 0.25
    khat[0, -1, 3] = float("inf")
    top = cpu_fused.witness_codes(key, khat, bands, nonfinite="top")
    bad = ~(torch.isfinite(key).all(-1) & torch.isfinite(khat).all(-1))
    assert int(bad.sum()) == 2 and bool((top[bad] == 255).all())
    assert torch.equal(top[~bad], cpu_fused.witness_codes(key[~bad], khat[~bad], bands))
    with mock.patch.object(cpu_fused, "available", lambda: False):  # torch's path (no extension)
        twin = cpu_fused.witness_codes(key, khat, bands, nonfinite="top")
    assert bool((twin[bad] == 255).all()) and bool(((twin[~bad].int() - top[~bad].int()).abs() <= 1).all())
    huge = torch.full((1, D), 3e38)
    with pytest.raises(ValueError, match="largest fp32"):  # finite rows whose witness overflows fp32: still refused
        cpu_fused.witness_codes(huge, -huge, bands, nonfinite="top")
    with pytest.raises(ValueError, match="nonfinite"):
        cpu_fused.witness_codes(key, khat, bands, nonfinite="skip")


EPI = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 40), "N": st.sampled_from([1, 7, 1024, 65536]),
    "NB": st.sampled_from([4, 8]), "D": st.sampled_from([64, 128]), "cmax": st.sampled_from([0.0, 1e-6, 0.05, 1.0, 6.0, 30.0]),
    "e": st.sampled_from([0.0, 1e-9, 1e-5, 1e-2, 5.0]), "zeros": st.booleans()})


@settings(max_examples=200, deadline=None)
@given(case=EPI)
def test_epilogue_cpp_is_the_numpy_epilogue(case):
    """The C++ certificate epilogue (csrc: epilogue) runs the numpy code's fp64 operations in its order: the same
    certificate (every key, within one fp32 ulp: expm1 comes from glibc there and from torch here, both inside
    EXP_EPS), the same refusals (None: rows for the fp64 twin) on stats from tiny to saturated witnesses."""
    g = torch.Generator().manual_seed(case["seed"])
    R = case["rows"]
    st_ = torch.rand(R, 1, 3, 5, dtype=torch.float64, generator=g)
    cm = st_[..., 3] * case["cmax"]
    z = 1 + st_[..., 0] * 50
    st_[..., 1] = z * cm * st_[..., 1]  # S1 <= Z cm, S2 <= S1 cm: as the kernel's sums are
    st_[..., 2] = st_[..., 1] * cm * st_[..., 2]
    st_[..., 0], st_[..., 3], st_[..., 4] = z, cm, st_[..., 4] * case["e"]
    if case["zeros"]:
        st_[0, ..., 1:4] = 0.0
    a = cpu_fused._certificate(st_, case["NB"], case["N"], case["D"])
    b = cpu_fused._certificate_numpy(st_, case["NB"], case["N"], case["D"])
    assert (a is None) == (b is None), case
    if a is None:
        return
    for key in b:
        d = (a[key].view(torch.int32).long() - b[key].view(torch.int32).long()).abs().max().item()
        assert d <= 1, (key, d, case)


# ---- inputs the kernel trusts: each bad one is a ValueError before the C++ code runs ----

@pytest.mark.parametrize("what", ["fp32_scales", "groups_off_D", "scales_short", "codes_int16", "v_scales_short"])
def test_qtensor_checked_before_the_kernel(what):
    """Regression (issue 19 #4): attention_rows passed a QTensor's scales to the kernel as int16 without a
    check: fp32 scales were read as pairs of fp16 halves (a finite, wrong certificate), 3 groups of a
    32-channel head left channels of the dequantized row unset, scales for 5 of 10 tokens were read past
    their end (heap-buffer-overflow under ASan). Now: one ValueError each."""
    from fast.core.quant import QTensor
    q, kq, vq, bands, qp = _inputs()
    mk = lambda t, **kw: QTensor(**{**t.__dict__, **kw})
    k, v = kq, vq
    if what == "fp32_scales":
        k = mk(kq, scales=kq.scales.float())
    elif what == "groups_off_D":
        k = mk(kq, scales=torch.ones(1, 1, 10, 3, dtype=torch.float16))
    elif what == "scales_short":
        k = mk(kq, scales=kq.scales[:, :, :5].contiguous())
    elif what == "codes_int16":
        k = mk(kq, codes=kq.codes.to(torch.int16))
    elif what == "v_scales_short":
        v = mk(vq, scales=vq.scales[:, :, :1].contiguous())
    with pytest.raises(ValueError, match="scales|codes"):
        cpu_fused.attention_rows(q, k, v, None, 0.125, bands=bands, q_pos=qp)


def _kernel_args(bad):
    """A valid two-segment _run call (int8 codes + fp32 tail), then one input made bad."""
    g = torch.Generator().manual_seed(5)
    B, T, Hkv, H, N0, N1, D, NB = 2, 2, 2, 4, 20, 6, 32, 4
    bands = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    k, v = torch.randn(B, Hkv, N0, D, generator=g), torch.randn(B, Hkv, N0, D, generator=g)
    kq, vq = fast.quantize(k, "int8", group_size=16), fast.quantize(v, "int8", group_size=16)
    a = {"k": kq.codes, "v": vq.codes, "k_scales": kq.scales, "v_scales": vq.scales,
         "rho": fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands)), "valid": torch.ones(B, Hkv, N0, dtype=torch.uint8),
         "pos": torch.arange(N0, dtype=torch.int32).expand(B, Hkv, N0).contiguous()}
    t = {"k": torch.randn(B, Hkv, N1, D, generator=g), "v": torch.randn(B, Hkv, N1, D, generator=g),
         "pos": torch.arange(N0, N0 + N1, dtype=torch.int32).expand(B, Hkv, N1).contiguous()}
    r = {"q": torch.randn(B, T, H, D, generator=g), "qpos": torch.full((B, T), N0 + N1 - 1, dtype=torch.int32), "s": D ** -0.5,
         "bands": bands, "ngk": 2, "ngv": 2, "certify": True, "lut": __import__("fast.core.witness", fromlist=["_log_table"])._log_table("cpu").float()}
    seg_bad = {
        "k_fp16": lambda: a.update(k=a["k"].half()), "v_short": lambda: a.update(v=a["v"][:, :, :-1]),
        "k_scales_fp32": lambda: a.update(k_scales=a["k_scales"].float()), "v_scales_fp32": lambda: a.update(v_scales=a["v_scales"].float()),
        "k_scales_3_groups": lambda: a.update(k_scales=torch.ones(B, Hkv, N0, 3, dtype=torch.float16)),
        "k_scales_short": lambda: a.update(k_scales=a["k_scales"][:, :, :5]), "no_scales": lambda: a.update(k_scales=None),
        "rho_short": lambda: a.update(rho=a["rho"][:, :, :3]), "rho_fp16": lambda: a.update(rho=a["rho"].half()),
        "valid_short": lambda: a.update(valid=a["valid"][..., :4]), "pos_int64": lambda: a.update(pos=a["pos"].long()),
        "k_not_rowmajor": lambda: a.update(k=a["k"].transpose(2, 3).contiguous().transpose(2, 3)),
        "kv_dtypes": lambda: a.update(v=a["v"].float(), v_scales=None), "tail_fp16": lambda: t.update(k=t["k"].half()),
        "tail_hkv": lambda: t.update(k=t["k"][:, :1], v=t["v"][:, :1]), "tail_pos_short": lambda: t.update(pos=t["pos"][..., :2]),
        "D_not_multiple_of_8": lambda: a.update(k=a["k"][..., :12].contiguous(), v=a["v"][..., :12].contiguous()),
    }
    run_bad = {
        "q_fp16": lambda: r.update(q=r["q"].half()), "q_not_contiguous": lambda: r.update(q=r["q"].transpose(1, 2)),
        "q_batch": lambda: r.update(q=r["q"][:1].contiguous(), qpos=r["qpos"][:1].contiguous()),
        "q_head_dim": lambda: r.update(q=torch.randn(B, T, H, 64)), "q_heads": lambda: r.update(q=torch.randn(B, T, 3, D)),
        "qpos_int64": lambda: r.update(qpos=r["qpos"].long()), "qpos_shape": lambda: r.update(qpos=r["qpos"][:, :1].contiguous()),
        "band_index_D": lambda: r["bands"].__setitem__((0, 0), D), "band_index_negative": lambda: r["bands"].__setitem__((1, 1), -100000),
        "band_count": lambda: r.update(bands=fast.rope_bands(D, 8).to(torch.int64).contiguous()),
        "ngk": lambda: r.update(ngk=3), "ngv": lambda: r.update(ngv=1), "no_lut": lambda: r.update(lut=None),
        "lut_short": lambda: r.update(lut=r["lut"][:128]), "no_witness": lambda: a.update(rho=None),
        "scale_nan": lambda: r.update(s=float("nan")), "tail_codes": None,
    }
    late = bad in run_bad and bad not in ("no_witness", "tail_codes")  # bad _run arguments, after a good call
    if bad in seg_bad:
        seg_bad[bad]()
    elif run_bad.get(bad) is not None and not late:
        run_bad[bad]()
    s0 = cpu_fused.seg(Hkv, a["k"].shape[2], **a)
    if bad == "tail_codes":  # segment 1 is read as exact fp32 rows (c = 0): codes or a witness there are refused
        s1 = cpu_fused.seg(Hkv, N0, **a)
    else:
        s1 = cpu_fused.seg(t["k"].shape[1], t["k"].shape[2], **t)
    if late:  # the same segments, bands and table passed _run's checks once: its check cache must not let a bad one by
        cpu_fused._run(r["q"], r["qpos"], [s0, s1], r["s"], r["bands"], r["ngk"], r["ngv"], r["certify"], r["lut"])
        run_bad[bad]()
    return cpu_fused._run(r["q"], r["qpos"], [s0, s1], r["s"], r["bands"], r["ngk"], r["ngv"], r["certify"], r["lut"])


KERNEL_BAD = ["k_fp16", "v_short", "k_scales_fp32", "v_scales_fp32", "k_scales_3_groups", "k_scales_short", "no_scales", "rho_short",
              "rho_fp16", "valid_short", "pos_int64", "k_not_rowmajor", "kv_dtypes", "tail_fp16", "tail_hkv", "tail_pos_short",
              "D_not_multiple_of_8", "q_fp16", "q_not_contiguous", "q_batch", "q_head_dim", "q_heads", "qpos_int64", "qpos_shape",
              "band_index_D", "band_index_negative", "band_count", "ngk", "ngv", "no_lut", "lut_short", "no_witness", "scale_nan",
              "tail_codes"]


def test_kernel_args_baseline_runs():
    out, stats = _kernel_args(None)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(stats).all())


@pytest.mark.parametrize("bad", KERNEL_BAD)
def test_kernel_inputs_checked(bad):
    """Regression (issue 19 #4): seg / _run (the calls hf_fused and the vLLM plugin make) check every dtype,
    shape, stride, count, band index and table the kernel indexes blindly: one ValueError each (before, most
    of these ran: wrong numbers, reads past the end, a witness read as c = 0)."""
    with pytest.raises(ValueError):
        _kernel_args(bad)


@pytest.mark.parametrize("what", ["band_big", "band_negative", "band_float", "slots_float", "kt_fp16", "key_2d"])
def test_paged_witness_checks_its_inputs(what):
    """Regression (issue 19 #5): a band index of 100000 segfaulted, -100000 read the stack out of bounds."""
    n, Hkv, D, nb, bs, NB = 3, 2, 16, 2, 8, 4
    key, kt = torch.randn(n, Hkv, D), torch.randn(nb, Hkv, D, bs)
    slots, rho, bands = torch.tensor([0, 5, 9]), torch.zeros(nb, Hkv, bs, NB), fast.rope_bands(D, NB).clone()
    cpu_fused.paged_witness(key, kt, slots, rho, bands)
    if what == "band_big":
        bands[1, 1] = 100000
    elif what == "band_negative":
        bands[0, 0] = -100000
    elif what == "band_float":
        bands = bands.float()
    elif what == "slots_float":
        slots = slots.float()
    elif what == "kt_fp16":
        kt = kt.half()
    elif what == "key_2d":
        key = key[0]
    with pytest.raises(ValueError):
        cpu_fused.paged_witness(key, kt, slots, rho, bands)


def test_paged_seg_checks_its_inputs():
    """paged_seg: an empty block size, a head size off the kernel's, a cache off the CPU layout: ValueError."""
    ok = torch.tensor([[0, 1]], dtype=torch.int32)
    for kc, vc in ((torch.zeros(4, 1, 64, 0), torch.zeros(4, 1, 0, 64)), (torch.zeros(4, 1, 12, 8), torch.zeros(4, 1, 8, 12)),
                   (torch.zeros(4, 1, 64, 8), torch.zeros(4, 1, 8, 64, dtype=torch.float64))):
        with pytest.raises(ValueError):
            cpu_fused.paged_seg(16, k=kc, v=vc, rho=None, table=ok, k_transposed=True)


def test_exp_error_path_is_defined():
    """kv_exp on NaN (the error path: the logit flag raises) converts no NaN to an integer (UBSan: the sanitizer
    run below) and gives 0 as before; -inf gives 0."""
    assert cpu_fused.exp_one(float("nan")) == 0.0 and cpu_fused.exp_one(float("-inf")) == 0.0


def test_top_log_code_same_bits_and_refused_to_the_twin():
    """The reserved top witness code 255 (issue 19 #6: the largest fp32, >= any finite witness) decodes in the
    AVX2 grid paths (byte transpose, per token) as in the scalar table read: the same stats bits (NaN sums
    included); a row with such a token gets no fp32 certificate from the kernel (the twin's fp64 terms: vacuous)."""
    from fast.core.witness import _log_table
    lut = _log_table("cpu").to(torch.float32).contiguous()
    assert cpu_fused.lut_is_grid(lut) and float(lut[255]) == torch.finfo(torch.float32).max
    off = lut.clone()
    off[255] = 2.0 ** 11.875  # where the grid would put code 255: not the table the kernel decodes
    assert not cpu_fused.lut_is_grid(off)
    g = torch.Generator().manual_seed(11)
    B, T, Hkv, G, N0, D, NB = 1, 2, 2, 2, 24, 64, 8
    bands = fast.rope_bands(D, NB)
    k, v = torch.randn(B, Hkv, N0, D, generator=g), torch.randn(B, Hkv, N0, D, generator=g)
    kq, vq = fast.quantize(k, "int8", group_size=D), fast.quantize(v, "int8", group_size=D)
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands)).contiguous()
    rho[0, 1, 5, 3] = rho[0, 1, 17, 0] = rho[0, 0, 22, 7] = 255
    valid = torch.ones(B, Hkv, N0, dtype=torch.uint8)
    valid[0, 0, 22] = 0  # an unread token with the top code: w = 0 times c = inf in the sums
    s0 = cpu_fused.seg(Hkv, N0, k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales, rho=rho, valid=valid)
    q = (torch.randn(B, T, Hkv * G, D, generator=g) * 30).contiguous()  # kappa > 1: c = kappa * fp32 max overflows
    qpos = torch.full((B, T), N0 - 1, dtype=torch.int32)
    b64 = bands.to(torch.int64).contiguous()
    got = [cpu_fused._run(q, qpos, [s0, cpu_fused.seg(Hkv, 0)], D ** -0.5, b64, 1, 1, True, lut, scalar=sc) for sc in (False, True)]
    assert torch.equal(got[0][0], got[1][0])
    assert torch.equal(got[0][1].view(torch.int64), got[1][1].view(torch.int64))
    assert not bool(torch.isfinite(got[0][1][0, :, :, :4]).all())  # the top code's c overflowed
    assert cpu_fused._certificate(got[0][1], NB, N0, D) is None and cpu_fused._certificate_numpy(got[0][1], NB, N0, D) is None
    # only the unread token holds the top code: every max c is finite, the NaN sums alone must refuse
    rho2 = rho.clone()
    rho2[0, 1, 5, 3], rho2[0, 1, 17, 0] = rho[0, 1, 4, 3], rho[0, 1, 4, 0]
    s0 = cpu_fused.seg(Hkv, N0, k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales, rho=rho2, valid=valid)
    _, st2 = cpu_fused._run(q, qpos, [s0, cpu_fused.seg(Hkv, 0)], D ** -0.5, b64, 1, 1, True, lut)
    assert bool(torch.isnan(st2[..., 1]).any()) and bool(torch.isfinite(st2[..., 3]).all())
    assert cpu_fused._certificate(st2, NB, N0, D) is None and cpu_fused._certificate_numpy(st2, NB, N0, D) is None
    # through attention_rows: the twin's certificate, vacuous on the heads that read a top code, sound
    out, cert = cpu_fused.attention_rows(q, kq, vq, rho, D ** -0.5, bands=bands, q_pos=qpos.long(), valid=valid[:, 0].bool())
    assert bool((cert["min"][..., 2:] == 1).all()) and bool(torch.isfinite(cert["min"]).all())


# ---- int4: packed codes read in place ----

INT4 = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 2),
    "G": st.integers(1, 3), "N": st.integers(1, 45), "D": st.sampled_from([64, 80]), "group": st.sampled_from(["one", "16", "even", "odd"]),
    "certify": st.booleans(), "mag": st.sampled_from([1e-3, 1.0, 30.0])})


@settings(max_examples=30, deadline=None)
@given(case=INT4)
def test_int4_codes_read_as_the_twins_dequantized_rows(case):
    """Differential (fused int4 vs the twin's dequantize): the kernel reading packed int4 codes + fp16 scales in
    place gives the SAME output and certificate sums, bit for bit, as the kernel reading fast.dequantize of them
    as fp32 rows (k~ = (nibble - 8) scale is exact in fp32: any other nibble order, scale or group gives other
    logits), in the AVX2 build (8 channels unpacked per register) and the scalar one, group widths odd and even
    (5: a group boundary inside a byte); the logit bound e from the scales (|code| <= 7) is >= the one from the
    rows' own max |k~| and is the twin's (fast.core.certify.logit_rounding_np with QTensor.max_abs) up to fp64
    rounding."""
    from fast.core.certify import logit_rounding_np
    from fast.core.witness import _log_table
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N, D = (case[x] for x in ("B", "T", "Hkv", "G", "N", "D"))
    T, NB, H = min(T, N), 8, Hkv * G
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    gs = {"one": D, "16": 16, "even": 10 if D == 80 else 32, "odd": 5 if D == 80 else 1}[case["group"]]
    kq, vq = fast.quantize(k, "int4", group_size=gs), fast.quantize(v, "int4", group_size=gs)
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands)).contiguous()
    q = (torch.randn(B, T, H, D, generator=g) * case["mag"]).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), D ** -0.5
    ng = D // gs
    codes = [cpu_fused.seg(Hkv, N, k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales, rho=rho), cpu_fused.seg(Hkv, 0)]
    rows = [cpu_fused.seg(Hkv, N, k=fast.dequantize(kq).contiguous(), v=fast.dequantize(vq).contiguous(), rho=rho), cpu_fused.seg(Hkv, 0)]
    rep = f"case {json.dumps(case)}"
    got = {}
    for sc in (False, True):
        got[sc] = cpu_fused._run(q, qpos, codes, s, b64, ng, ng, case["certify"], lut, scalar=sc)
        want = cpu_fused._run(q, qpos, rows, s, b64, 1, 1, case["certify"], lut, scalar=sc)
        assert torch.equal(got[sc][0], want[0]), "output differs from the dequantized rows' " + rep
        assert torch.equal(got[sc][1][..., :4].view(torch.int64), want[1][..., :4].view(torch.int64)), "sums differ " + rep
        assert bool((got[sc][1][..., 4] >= want[1][..., 4]).all()), "e below the rows' own bound " + rep
    assert torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1].view(torch.int64), got[True][1].view(torch.int64)), rep
    kmax = kq.max_abs().numpy()  # [B, Hkv, D]
    q64 = q.double().numpy()
    for b in range(B):
        for t in range(T):
            for h in range(H):
                e_twin = float(logit_rounding_np(q64[b, t, h][None, None], kmax[b, h // G][None, None], s).reshape(-1)[0])
                e = float(got[True][1][b, t, h, 4])
                assert e_twin * (1 - 1e-12) <= e <= e_twin * (1 + 1e-9) + 2.0 ** -140, (e, e_twin, rep)


@pytest.mark.parametrize("what", ["nibble_zero_key", "nibble_zero_value", "codes_int8", "codes_unpacked_width", "fp32_scales",
                                  "groups_off_D", "scales_short", "mixed_schemes"])
def test_int4_bad_inputs_one_value_error(what):
    """int4 inputs the kernel trusts: codes that are not uint8 [B, Hkv, N, D / 2] (int8 bytes, one byte per channel),
    scales not fp16 per token and group, keys and values of two schemes (the twin would take them: refused here
    only where they would be misread), and a packed 0 nibble (code -8, which quantize never writes and the
    logit bound's |code| <= 7 does not cover): one ValueError each, before any number is returned."""
    from fast.core.quant import QTensor
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 1, 10, 32, generator=g), torch.randn(1, 1, 10, 32, generator=g)
    q = torch.randn(1, 1, 2, 32, generator=g)
    kq, vq = fast.quantize(k, "int4", group_size=16), fast.quantize(v, "int4", group_size=16)
    bands, qp = fast.rope_bands(32, 4), torch.tensor([[9]])
    cpu_fused.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp)  # the good call runs
    mk = lambda t, **kw: QTensor(**{**t.__dict__, **kw})
    if what == "nibble_zero_key":
        kq.codes[0, 0, 3, 5] &= 0xF0  # channel 10's nibble
    elif what == "nibble_zero_value":
        vq.codes[0, 0, 9, 2] &= 0x0F  # channel 5's nibble of the newest token (read with weight > 0)
    elif what == "codes_int8":
        kq = mk(kq, codes=kq.codes.to(torch.int8))
    elif what == "codes_unpacked_width":
        kq = mk(kq, codes=torch.cat([kq.codes, kq.codes], -1))
    elif what == "fp32_scales":
        vq = mk(vq, scales=vq.scales.float())
    elif what == "groups_off_D":
        kq = mk(kq, scales=torch.ones(1, 1, 10, 3, dtype=torch.float16))
    elif what == "scales_short":
        kq = mk(kq, scales=kq.scales[:, :, :4].contiguous())
    elif what == "mixed_schemes":  # int4 keys with int8 values: the twin reads them, the kernel must not
        vq = fast.quantize(v, "int8", group_size=16)
        out, cert = cpu_fused.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp)
        out_t, cert_t = twin.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp, backend="torch")
        assert torch.equal(out, out_t)  # went to the twin
        with pytest.raises(ValueError):
            cpu_fused.seg(1, 10, k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales)
        return
    with pytest.raises(ValueError):
        cpu_fused.attention_rows(q, kq, vq, None, 0.125, bands=bands, q_pos=qp)


# ---- asymmetric codes: kivi2 (2-bit keys per channel block, values per token group), pre-RoPE keys rotated at read ----

ASYM = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 2),
    "G": st.integers(1, 3), "blocks": st.integers(1, 2), "D": st.sampled_from([64, 80]), "layout": st.sampled_from(["kivi2", "prerope4", "prerope8"]),
    "t0": st.sampled_from([0, 40]), "certify": st.booleans(), "mag": st.sampled_from([1e-3, 1.0, 30.0]), "holes": st.booleans()})


def _asym_case(case):
    """(codes segment, the same keys and values decoded by the twin as fp32 rows, q, qpos, ngv) for an ASYM case."""
    from fast.core.prerope import PreRopeKeys, rope_tables
    from fast.core.schemes import KiviKeys, KiviValues
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, G, D, T = (case[x] for x in ("B", "Hkv", "G", "D", "T"))
    if case["layout"] == "kivi2" and D % 32:  # kivi2's values: groups of 32 channels
        D = 96
    N = 32 * case["blocks"]
    k, v = torch.randn(B, Hkv, N, D, generator=g) * 3, torch.randn(B, Hkv, N, D, generator=g)
    bands = fast.rope_bands(D, 8)
    if case["layout"] == "kivi2":
        kk, vv = KiviKeys.encode(k), KiviValues.encode(v)
        kd, vd = kk.decode(), vv.decode()
        rho = fast.pack_witness(fast.witness(k, kd, bands))
        vkw = dict(v_asym=cpu_fused.AsymValues(vv.get("codes"), vv.get("scale"), vv.get("zero"), 2))
        ka = cpu_fused.AsymKeys(kk.get("codes"), kk.get("scale"), kk.get("zero"), 2, 32)
        ngv = vv.get("scale").shape[-1]
    else:
        bits, rope = int(case["layout"][-1]), rope_tables(D, 10000.0, 256)
        kk = PreRopeKeys.encode(k, rope, bits, case["t0"])
        vq = fast.quantize(v, "int8", group_size=16)
        kd, vd = kk.decode(), fast.dequantize(vq)
        rho = fast.pack_witness(kk.witness_t3(k, bands))
        vkw = dict(v=vq.codes, v_scales=vq.scales)
        ka = cpu_fused.AsymKeys(kk.get("codes"), kk.get("scale"), kk.get("zero"), bits, 32, (rope[0], rope[1], case["t0"]))
        ngv = vq.scales.shape[-1]
    valid = None
    if case["holes"]:
        valid = (torch.rand(B, Hkv, N, generator=g) > 0.3).to(torch.uint8)
        valid[..., -1] = 1
    rho = rho.contiguous() if case["certify"] else None
    codes = [cpu_fused.seg(Hkv, N, k_asym=ka, rho=rho, valid=valid, **vkw), cpu_fused.seg(Hkv, 0)]
    rows = [cpu_fused.seg(Hkv, N, k=kd.contiguous(), v=vd.contiguous(), rho=rho, valid=valid), cpu_fused.seg(Hkv, 0)]
    q = (torch.randn(B, T, Hkv * G, D, generator=g) * case["mag"]).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    return codes, rows, q, qpos, ngv, bands, (kk, k, kd)


@settings(max_examples=30, deadline=None)
@given(case=ASYM)
@example(case={"seed": 1, "B": 1, "T": 1, "Hkv": 1, "G": 3, "blocks": 2, "D": 64, "layout": "kivi2", "t0": 0, "certify": True,
               "mag": 1.0, "holes": False})  # kivi2 keys of two blocks: each 8 tokens' scales and zeros from their own block
def test_asym_codes_read_as_the_twins_decoded_rows(case):
    """Differential (fused kivi2 / pre-RoPE vs the twin's decode): the kernel reading the 2-, 4- or 8-bit asymmetric
    codes + fp16 scales and zeros in place (keys per channel over blocks of 32 tokens, rotated to their positions
    at read for pre-RoPE keys; kivi2 values per token group, pre-RoPE's int8 values) gives the SAME output and
    certificate stats (sums and logit bound e), bit for bit, as the kernel reading the twin's decode() of them as
    fp32 rows (k~ = fl(code scale + zero), rotated by prerope._rotate's fp32 operations: another bit order, scale,
    zero, table row or rotation sign gives other logits), in the AVX2 build and the scalar one."""
    codes, rows, q, qpos, ngv, bands, _ = _asym_case(case)
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), q.shape[-1] ** -0.5
    rep = f"case {json.dumps(case)}"
    got = {}
    for sc in (False, True):
        got[sc] = cpu_fused._run(q, qpos, codes, s, b64, 1, ngv, case["certify"], lut, scalar=sc)
        want = cpu_fused._run(q, qpos, rows, s, b64, 1, 1, case["certify"], lut, scalar=sc)
        assert torch.equal(got[sc][0], want[0]), "output differs from the decoded rows' " + rep
        assert torch.equal(got[sc][1].view(torch.int64), want[1].view(torch.int64)), "stats differ " + rep
    assert torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1].view(torch.int64), got[True][1].view(torch.int64)), rep


@pytest.mark.parametrize("what", ["wrong_position", "sign_flip", "zero_shift", "bit_order"])
def test_asym_read_sees_mutations(what):
    """The differential above can fail: a kernel given another table row (pos0 + 1), the inverse rotation's sign,
    zeros one fp16 ulp off or the codes in another bit order reads other keys, and its logits (so the output) differ
    from the twin's decoded rows."""
    case = {"seed": 3, "B": 1, "T": 1, "Hkv": 1, "G": 2, "blocks": 1, "D": 64, "layout": "prerope4", "t0": 8,
            "certify": True, "mag": 1.0, "holes": False}
    if what in ("zero_shift", "bit_order"):
        case["layout"] = "kivi2"
    codes, rows, q, qpos, ngv, bands, (kk, _, _) = _asym_case(case)
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), 0.125
    want = cpu_fused._run(q, qpos, rows, s, b64, 1, 1, True, lut)[0]
    assert torch.equal(cpu_fused._run(q, qpos, codes, s, b64, 1, ngv, True, lut)[0], want)
    ka = codes[0]
    c0 = ka["c"]
    if what == "wrong_position":
        c0.rpos0 += 1
    elif what == "sign_flip":  # the inverse rotation: -sin
        t = -ka["rope"][1]
        ka["mutant"] = t
        c0.rsin = t.data_ptr()
    elif what == "zero_shift":
        t = kk.get("zero").view(torch.int16) + 1
        ka["mutant"] = t
        c0.kz = t.data_ptr()
    else:  # the four 2-bit codes of each byte in the reverse order
        b = kk.get("codes").contiguous()
        t = ((b & 3) << 6) | ((b & 12) << 2) | ((b >> 2) & 12) | (b >> 6)
        ka["mutant"] = t
        c0.k = t.data_ptr()
    assert not torch.equal(cpu_fused._run(q, qpos, codes, s, b64, 1, ngv, True, lut)[0], want), what


@pytest.mark.parametrize("what", ["bits", "block", "scales_shape", "zeros_dtype", "rope_range", "rope_width", "both_k",
                                  "values_int4", "codes_width"])
def test_asym_bad_inputs_one_value_error(what):
    """Everything seg() trusts for asymmetric codes is checked: bit widths, a block that does not divide the tokens,
    scales / zeros of another shape or dtype, table positions beyond the tables, tables of another width, keys given
    twice, values that are neither 2-bit asymmetric nor int8, codes of another width: one ValueError each."""
    from dataclasses import replace
    case = {"seed": 1, "B": 1, "T": 1, "Hkv": 1, "G": 1, "blocks": 1, "D": 64, "layout": "prerope4", "t0": 0,
            "certify": True, "mag": 1.0, "holes": False}
    codes, rows, q, qpos, ngv, bands, (kk, k, _) = _asym_case(case)
    from fast.core.prerope import rope_tables
    cos, sin, _ = rope_tables(64, 10000.0, 256)
    ka = cpu_fused.AsymKeys(kk.get("codes"), kk.get("scale"), kk.get("zero"), 4, 32, (cos, sin, 0))
    vq = fast.quantize(torch.randn(1, 1, 32, 64), "int8")
    kw = dict(k_asym=ka, v=vq.codes, v_scales=vq.scales)
    cpu_fused.seg(1, 32, **kw)  # the good call
    bad = {"bits": dict(kw, k_asym=replace(ka, bits=3)), "block": dict(kw, k_asym=replace(ka, block=24)),
           "scales_shape": dict(kw, k_asym=replace(ka, scales=ka.scales[..., :32])),
           "zeros_dtype": dict(kw, k_asym=replace(ka, zeros=ka.zeros.float())),
           "rope_range": dict(kw, k_asym=replace(ka, rope=(cos, sin, 240))),
           "rope_width": dict(kw, k_asym=replace(ka, rope=(cos[:, :16].contiguous(), sin[:, :16].contiguous(), 0))),
           "both_k": dict(kw, k=kk.get("codes")),
           "values_int4": dict(kw, v=fast.quantize(torch.randn(1, 1, 32, 64), "int4").codes),
           "codes_width": dict(kw, k_asym=replace(ka, codes=torch.cat([ka.codes, ka.codes], -1)))}[what]
    with pytest.raises(ValueError):
        cpu_fused.seg(1, 32, **bad)


def _paged_slab(g, B, Hkv, N, bs, row, fill):
    """A block table [B, ceil(N / bs) + 2] over shuffled blocks (2 spare columns) and a byte page of `row` bytes per
    (slot, head), one slab per (block, head) filled with `fill`; part(off, width, dtype) views bytes [off, off + width)
    of every slot as [num_blocks, Hkv, bs, X] (kvcert's packed vLLM page)."""
    nblk = -(-N // bs)
    nb = B * nblk + 3
    perm = torch.randperm(nb, generator=g)[: B * nblk].view(B, nblk).to(torch.int32)
    table = torch.cat([perm, torch.full((B, 2), nb - 1, dtype=torch.int32)], 1).contiguous()
    slab = torch.full((nb, Hkv, bs * row), fill, dtype=torch.uint8)
    return table, lambda off, width, dt: slab[:, :, off * bs: (off + width) * bs].view(dt).view(nb, Hkv, bs, -1)


@settings(max_examples=30, deadline=None)
@given(case=PAGED, ng=st.sampled_from([1, 2]), u8=st.booleans(), codec=st.sampled_from(["int8", "int4"]), fine=st.booleans())
@example(case={"seed": 0, "B": 2, "T": 2, "Hkv": 2, "G": 2, "N": 70, "bs": 12, "D": 64, "transposed": False, "certify": True},
         ng=1, u8=True, codec="int8", fine=True)  # the fine table decoded token by token (block size off 8)
def test_paged_codes_same_bits_as_contiguous(case, ng, u8, codec, fine):
    """int8 codes, or packed int4 codes (two a byte), read in place from a paged cache packed as kvcert's vLLM cache
    packs them (per (block, head) one byte slab: key codes [bs, W], value codes [bs, W] (W = D, or D / 2 for int4), key
    and value fp16 scales [bs, ng], witness [bs, NB]): output and stats equal bit for bit the read of the same codes
    laid out contiguously (seg), in the vector and the scalar build, with fp32 or uint8 log-code witnesses (the coarse
    or the fine table: a block size off 8 decodes token by token, a contiguous read 8 tokens at once); int8 codes
    declared int4 are refused."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N, bs, D = (case[x] for x in ("B", "T", "Hkv", "G", "N", "bs", "D"))
    T, NB, H = min(T, N), 8, Hkv * G
    kq = quantize(torch.randn(B, Hkv, N, D, generator=g), codec, group_size=D // ng)
    vq = quantize(torch.randn(B, Hkv, N, D, generator=g), codec, group_size=D // ng)
    if u8:
        rho = torch.randint(0, 200, (B, Hkv, N, NB), generator=g, dtype=torch.uint8)
    else:
        rho = torch.rand(B, Hkv, N, NB, generator=g) * 1e-2
    rb, W, cd = rho.element_size() * NB, kq.codes.shape[3], kq.codes.dtype
    table, part = _paged_slab(g, B, Hkv, N, bs, 2 * W + 4 * ng + rb, 0x7F)  # unused slots: garbage codes
    kc, vc = part(0, W, cd), part(W, W, cd)
    ks, vs = part(2 * W, 2 * ng, torch.int16), part(2 * W + 2 * ng, 2 * ng, torch.int16)
    rc = part(2 * W + 4 * ng, rb, rho.dtype)
    for b in range(B):
        for j in range(N):
            blk, off = int(table[b, j // bs]), j % bs
            kc[blk, :, off], vc[blk, :, off] = kq.codes[b, :, j], vq.codes[b, :, j]
            ks[blk, :, off], vs[blk, :, off] = kq.scales[b, :, j].view(torch.int16), vq.scales[b, :, j].view(torch.int16)
            rc[blk, :, off] = rho[b, :, j]
    q = torch.randn(B, T, H, D, generator=g).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    b64 = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    lut = _log_table("cpu", fine).to(torch.float32).contiguous() if u8 else None
    flat = [cpu_fused.seg(Hkv, N, k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales, rho=rho), cpu_fused.seg(Hkv, 0)]
    paged = [cpu_fused.paged_seg(N, k=kc, v=vc, k_scales=ks, v_scales=vs, rho=rc, table=table, k_transposed=False,
                                 int4=codec == "int4"), cpu_fused.seg(Hkv, 0)]
    assert paged[0]["ng"] == flat[0]["ng"] == (ng, ng) and paged[0]["D"] == D
    for sc in (False, True):
        want = cpu_fused._run(q, qpos, flat, D ** -0.5, b64, ng, ng, case["certify"], lut=lut, scalar=sc)
        got = cpu_fused._run(q, qpos, paged, D ** -0.5, b64, ng, ng, case["certify"], lut=lut, scalar=sc)
        rep = f"scalar={sc} ng={ng} u8={u8} {codec} case {json.dumps(case)}"
        assert torch.equal(got[0], want[0]), "output differs: " + rep
        assert torch.equal(got[1], want[1]), "stats differ: " + rep
    if codec == "int4":
        with pytest.raises(ValueError, match="packed int4 codes"):  # int8 codes declared int4 are refused
            cpu_fused.paged_seg(N, k=kc.view(torch.int8), v=vc.view(torch.int8), k_scales=ks, v_scales=vs, rho=rc,
                                table=table, k_transposed=False, int4=True)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(2, 70), min_size=1, max_size=4), T=st.integers(1, 2),
       G=st.integers(1, 3), bs=st.sampled_from([8, 16, 24]), codec=st.sampled_from(["int8", "int4"]), certify=st.booleans(),
       scalar=st.booleans())
def test_paged_lens_reads_each_sequence_as_alone(seed, lens, T, G, bs, codec, certify, scalar):
    """paged_seg(lens=...): one _run over sequences of different lengths gives each sequence's output and stats bit
    for bit as its own read (B = 1, n = its length, its table row): each is read in its own chunks, whatever else
    shares the call (CHUNK 40 here: 70 tokens split in chunks of 40, 45 in chunks of 24); every slot past a
    sequence's end holds NaN scales and the top witness code, so a read that looked past any end would raise. Vector
    and scalar builds."""
    with mock.patch.object(cpu_fused, "CHUNK", 40):
        _lens_case(seed, lens, T, G, bs, codec, certify, scalar)


def _lens_case(seed, lens, T, G, bs, codec, certify, scalar):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, NB, n = len(lens), 2, 64, 8, max(lens)
    H = Hkv * G
    kq = quantize(torch.randn(B, Hkv, n, D, generator=g), codec, group_size=D)
    vq = quantize(torch.randn(B, Hkv, n, D, generator=g), codec, group_size=D)
    rho = torch.randint(0, 200, (B, Hkv, n, NB), generator=g, dtype=torch.uint8)
    W, cd = kq.codes.shape[3], kq.codes.dtype
    table, part = _paged_slab(g, B, Hkv, n, bs, 2 * W + 4 + NB, 0xFF)  # fp16 NaN scales, top witness codes
    kc, vc, ks, vs, rc = part(0, W, cd), part(W, W, cd), part(2 * W, 2, torch.int16), part(2 * W + 2, 2, torch.int16), part(2 * W + 4, NB, torch.uint8)
    for b in range(B):
        for j in range(lens[b]):  # only each sequence's own tokens are written
            blk, off = int(table[b, j // bs]), j % bs
            kc[blk, :, off], vc[blk, :, off] = kq.codes[b, :, j], vq.codes[b, :, j]
            ks[blk, :, off], vs[blk, :, off] = kq.scales[b, :, j].view(torch.int16), vq.scales[b, :, j].view(torch.int16)
            rc[blk, :, off] = rho[b, :, j]
    base = cpu_fused.paged_base(k=kc, v=vc, k_scales=ks, v_scales=vs, rho=rc if certify else None, k_transposed=False,
                                int4=codec == "int4")
    q = torch.randn(B, T, H, D, generator=g).contiguous()
    ln = torch.tensor(lens, dtype=torch.int32)
    qpos = (ln[:, None] - T + torch.arange(T, dtype=torch.int32)).contiguous()
    b64 = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    lut, empty = _log_table("cpu").to(torch.float32).contiguous(), cpu_fused.seg(Hkv, 0)
    got = cpu_fused._run(q, qpos, [cpu_fused.paged_seg(n, table=table, base=base, lens=ln), empty], D ** -0.5, b64, 1, 1,
                         certify, lut=lut, scalar=scalar)
    for b in range(B):
        one = cpu_fused._run(q[b:b + 1].contiguous(), qpos[b:b + 1].contiguous(),
                             [cpu_fused.paged_seg(lens[b], table=table[b:b + 1], base=base), empty], D ** -0.5, b64, 1, 1,
                             certify, lut=lut, scalar=scalar)
        assert torch.equal(got[0][b], one[0][0]), f"output of sequence {b} differs: lens {lens}"
        assert torch.equal(got[1][b], one[1][0]), f"stats of sequence {b} differ: lens {lens}"
    if B > 1 and min(lens) < n:  # without lens every sequence reads n tokens: the NaN past the short ones' ends
        with pytest.raises(ValueError, match="NaN"):
            cpu_fused._run(q, qpos, [cpu_fused.paged_seg(n, table=table, base=base), empty], D ** -0.5, b64, 1, 1, certify,
                           lut=lut, scalar=scalar)


def test_paged_lens_checked():
    """lens: int32 [B] on the CPU, each in [1, n], each row's own blocks valid (the ids past a row's blocks are not
    read, so not checked), and segment 1 empty: one ValueError each."""
    kc, vc = torch.zeros(4, 1, 64, 8), torch.zeros(4, 1, 8, 64)
    base = cpu_fused.paged_base(k=kc, v=vc, rho=None, k_transposed=True)
    table = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)  # row 1's second id is past its 8 tokens
    seg = cpu_fused.paged_seg(16, table=table, base=base, lens=torch.tensor([16, 8], dtype=torch.int32))
    q, qpos = torch.randn(2, 1, 1, 64), torch.tensor([[15], [7]], dtype=torch.int32)
    bands = fast.rope_bands(64, 8).long().contiguous()
    cpu_fused._run(q, qpos, [seg, cpu_fused.seg(1, 0)], 0.125, bands, 1, 1, False)
    for lens, what in ((torch.tensor([16, 9], dtype=torch.int32), "block ids"), (torch.tensor([16, 0], dtype=torch.int32), "lens"),
                       (torch.tensor([17, 8], dtype=torch.int32), "lens"), (torch.tensor([16, 8]), "lens"),
                       (torch.tensor([16], dtype=torch.int32), "lens")):
        with pytest.raises(ValueError, match=what):
            cpu_fused.paged_seg(16, table=table, base=base, lens=lens)
    with pytest.raises(ValueError, match="segment 1"):
        cpu_fused._run(q, qpos, [seg, cpu_fused.seg(1, 2, k=torch.zeros(2, 1, 2, 64), v=torch.zeros(2, 1, 2, 64))], 0.125,
                       bands, 1, 1, False)
    lens = torch.tensor([16, 8], dtype=torch.int32)  # checked once, kept while its version holds: a write is seen
    cpu_fused.paged_seg(16, table=table, base=base, lens=lens)
    lens[1] = 17
    with pytest.raises(ValueError, match="lens"):
        cpu_fused.paged_seg(16, table=table, base=base, lens=lens)


def test_paged_codes_refused_without_scales_or_transposed():
    """int8 codes in a paged cache need both scales and the untransposed key layout; scales need codes."""
    kc, vc = torch.zeros(4, 1, 8, 64, dtype=torch.int8), torch.zeros(4, 1, 8, 64, dtype=torch.int8)
    sc = torch.ones(4, 1, 8, 1, dtype=torch.float16)
    ok = torch.tensor([[0, 1]], dtype=torch.int32)
    cpu_fused.paged_seg(16, k=kc, v=vc, k_scales=sc, v_scales=sc, rho=None, table=ok, k_transposed=False)
    for kw in (dict(k_scales=sc), dict(k_scales=sc, v_scales=sc, k_transposed=True)):
        with pytest.raises(ValueError, match="int8 codes"):
            cpu_fused.paged_seg(16, k=kc, v=vc, rho=None, table=ok, **{"k_transposed": False, **kw})
    with pytest.raises(ValueError, match="only with int8 codes"):
        cpu_fused.paged_seg(16, k=kc.float(), v=vc.float(), k_scales=sc, v_scales=sc, rho=None, table=ok, k_transposed=False)
    with pytest.raises(ValueError, match="do not divide"):
        s3 = torch.ones(4, 1, 8, 3, dtype=torch.float16)
        cpu_fused.paged_seg(16, k=kc, v=vc, k_scales=s3, v_scales=s3, rho=None, table=ok, k_transposed=False)


# ---- fp8 codes read in place ----

FP8 = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "T": st.integers(1, 3), "Hkv": st.integers(1, 2),
    "G": st.integers(1, 3), "N": st.integers(1, 45), "D": st.sampled_from([16, 64, 80]),
    "scheme": st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_e5m2_rtz", "fp8_e4m3/raw"]),
    "tensor_scale": st.sampled_from([1.0, 0.0078125, 3.0]), "certify": st.booleans(), "mag": st.sampled_from([1e-3, 1.0, 30.0])})


@settings(max_examples=15, deadline=None)
@given(case=FP8)
def test_fp8_codes_read_as_the_twins_dequantized_rows(case):
    """Differential (fused fp8 vs the twin's dequantize): fp8 codes read in place (round-to-nearest with per-token fp32
    scales or none, vLLM's round-toward-zero casts with a tensor scale: e4m3 decodes as c 2^-120 s 2^120) give the
    SAME output and stats, bit for bit, as the kernel reading fast.dequantize of them as fp32 rows, in the AVX2 and
    the scalar build: the kernel decodes with the twin's fp32 operations in their order (another order, table or
    scale gives other bits at subnormal and rounded products)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N, D = (case[x] for x in ("B", "T", "Hkv", "G", "N", "D"))
    T, NB, H = min(T, N), 8 if D % 8 == 0 and D >= 64 else 2, Hkv * G
    scheme, raw = case["scheme"].split("/")[0], case["scheme"].endswith("/raw")
    k = torch.randn(B, Hkv, N, D, generator=g) * torch.logspace(-8, 2, N).view(1, 1, N, 1)  # subnormal codes too
    v = torch.randn(B, Hkv, N, D, generator=g)
    kw = dict(scale=case["tensor_scale"]) if scheme.endswith("_rtz") else dict(per_token_scale=not raw)
    kq, vq = quantize(k, scheme, **kw), quantize(v, scheme, **kw)
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands)).contiguous()
    q = (torch.randn(B, T, H, D, generator=g) * case["mag"]).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), D ** -0.5
    codes = [cpu_fused.seg(Hkv, N, **cpu_fused.fp8_parts(kq, vq), rho=rho), cpu_fused.seg(Hkv, 0)]
    rows = [cpu_fused.seg(Hkv, N, k=fast.dequantize(kq).contiguous(), v=fast.dequantize(vq).contiguous(), rho=rho),
            cpu_fused.seg(Hkv, 0)]
    rep = f"case {json.dumps(case)}"
    for sc in (False, True):
        got = cpu_fused._run(q, qpos, codes, s, b64, 1, 1, case["certify"], lut, scalar=sc)
        want = cpu_fused._run(q, qpos, rows, s, b64, 1, 1, case["certify"], lut, scalar=sc)
        assert torch.equal(got[0], want[0]), "output differs from the dequantized rows' " + rep
        assert torch.equal(got[1].view(torch.int64), want[1].view(torch.int64)), "stats differ " + rep


def test_fp8_decoded_by_bits_only_where_that_is_the_table():
    """The AVX2 kernel decodes fp8 bytes by bit arithmetic (csrc fp8_bits) in place of the table gather only for a
    table it reproduces entry for entry (fp8_format): torch's e4m3fn and e5m2 tables (every byte, subnormals and
    specials included) are recognised; a table with one entry off by one ulp, or one finite entry where the format
    has a NaN, is not (the gather reads it as given); the scalar build always gathers."""
    lib = cpu_fused._lib()
    tables = {fmt: cpu_fused._fp8_table(dt) for fmt, dt in ((1, torch.float8_e4m3fn), (2, torch.float8_e5m2))}
    for fmt, t in tables.items():
        assert lib.kvcert_fp8_format(t.data_ptr()) == (fmt if _has_avx2() else 0)
        assert cpu_fused._lib(scalar=True).kvcert_fp8_format(t.data_ptr()) == 0
        for i in (1, 37, 0x80 | 3, 0x7B):  # a subnormal, a normal, a negative subnormal, e5m2's largest finite
            bad = t.clone()
            bad[i] = torch.nextafter(bad[i], torch.tensor(float("inf")))
            assert lib.kvcert_fp8_format(bad.data_ptr()) == 0, (fmt, i)
        nan = t.clone()
        nan[nan.isnan()] = 1.0
        assert lib.kvcert_fp8_format(nan.data_ptr()) == 0, fmt


@pytest.mark.parametrize("what", ["nan_key", "nan_value", "order_dropped", "scale_dropped", "table_e5m2"])
def test_fp8_read_sees_mutations_and_nan_codes(what):
    """A NaN fp8 code (key or value) is refused by the kernel's flags; a decode that drops the 2^-120 ... 2^120
    order of vLLM's e4m3 read (fl(c s) instead: other bits where c 2^-120 s is subnormal), the token scales, or reads
    e4m3 bytes as e5m2 (refused here: some are Inf / NaN) is not the dequantized rows' read (the bit-identity above
    can fail)."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(1, 2, 24, 64, generator=g), torch.randn(1, 2, 24, 64, generator=g)
    scheme = "fp8_e4m3_rtz" if what == "order_dropped" else "fp8_e4m3"
    if what == "order_dropped":  # c ~ 4, s = 2^-30: c 2^-120 s ~ 2^-148, rounded to the subnormal grid
        k, v = k * 2.0 ** -28, v * 2.0 ** -28
    kw = dict(scale=2.0 ** -30) if scheme.endswith("_rtz") else {}
    kq, vq = quantize(k, scheme, **kw), quantize(v, scheme, **kw)
    parts = cpu_fused.fp8_parts(kq, vq)
    bands = fast.rope_bands(64, 8)
    q = torch.randn(1, 1, 4, 64, generator=g).contiguous()
    qpos = torch.tensor([[23]], dtype=torch.int32)
    b64 = bands.to(torch.int64).contiguous()
    rows = [cpu_fused.seg(2, 24, k=fast.dequantize(kq).contiguous(), v=fast.dequantize(vq).contiguous()), cpu_fused.seg(2, 0)]
    want = cpu_fused._run(q, qpos, rows, 0.125, b64, 1, 1, False)[0]
    if what in ("nan_key", "nan_value"):
        t = parts["k" if what == "nan_key" else "v"].view(torch.uint8)
        t[0, 1, 5, 3] = 0x7F  # e4m3fn's NaN
        with pytest.raises(ValueError, match="non-finite logits" if what == "nan_key" else "value cache"):
            cpu_fused._run(q, qpos, [cpu_fused.seg(2, 24, **parts), cpu_fused.seg(2, 0)], 0.125, b64, 1, 1, False)
        return
    f8 = parts["fp8"]
    if what == "order_dropped":  # unmutated, the kernel's decode keeps the order (keys and values, subnormal products;
        # q 2^28: logits of order 1, so that a key's last bits reach the output)
        qb = (q * 2.0 ** 28).contiguous()
        same, ref = (cpu_fused._run(qb, qpos, [sg, cpu_fused.seg(2, 0)], 0.125, b64, 1, 1, False)[0]
                     for sg in (cpu_fused.seg(2, 24, **parts), rows[0]))
        assert torch.equal(same, ref)
        parts["fp8"] = cpu_fused.Fp8Read(f8.dtype, f8.scale)
    elif what == "scale_dropped":
        parts["k_scales"] = parts["v_scales"] = None
    else:
        parts["fp8"] = cpu_fused.Fp8Read(torch.float8_e5m2)
        parts["k"], parts["v"] = parts["k"].view(torch.uint8), parts["v"].view(torch.uint8)
    try:  # another read, or refused (e4m3 bytes read as e5m2 include Inf / NaN values)
        other = cpu_fused._run(q, qpos, [cpu_fused.seg(2, 24, **parts), cpu_fused.seg(2, 0)], 0.125, b64, 1, 1, False)[0]
        assert not torch.equal(other, want)
    except ValueError:
        assert what == "table_e5m2"
    parts = cpu_fused.fp8_parts(kq, vq)
    assert torch.equal(cpu_fused._run(q, qpos, [cpu_fused.seg(2, 24, **parts), cpu_fused.seg(2, 0)], 0.125, b64, 1, 1, False)[0], want)


# ---- fp16 rows (a registered scheme's stored output) read in place ----

@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), T=st.integers(1, 3), Hkv=st.integers(1, 2),
       G=st.integers(1, 3), N=st.integers(1, 45), D=st.sampled_from([16, 64, 80]), certify=st.booleans())
def test_fp16_rows_read_as_the_twins_decoded_rows(seed, B, T, Hkv, G, N, D, certify):
    """fp16 rows read in place (F16C in the AVX2 build, half_to_float in the scalar one; subnormal and normal halves)
    give the SAME output and stats, bit for bit, as the kernel reading their fp32 values (Fp16Stored.decode: x.float());
    a flipped bit of the stored halves is seen."""
    g = torch.Generator().manual_seed(seed)
    T, NB, H = min(T, N), 8 if D % 8 == 0 and D >= 64 else 2, Hkv * G
    k = (torch.randn(B, Hkv, N, D, generator=g) * torch.logspace(-7, 2, N).view(1, 1, N, 1)).half()  # subnormals too
    v = torch.randn(B, Hkv, N, D, generator=g).half()
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k.float() * 1.001, k.float(), bands)).contiguous()
    q = torch.randn(B, T, H, D, generator=g).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), D ** -0.5
    halves = [cpu_fused.seg(Hkv, N, k=k, v=v, rho=rho), cpu_fused.seg(Hkv, 0)]
    rows = [cpu_fused.seg(Hkv, N, k=k.float(), v=v.float(), rho=rho), cpu_fused.seg(Hkv, 0)]
    for sc in (False, True):
        got = cpu_fused._run(q, qpos, halves, s, b64, 1, 1, certify, lut, scalar=sc)
        want = cpu_fused._run(q, qpos, rows, s, b64, 1, 1, certify, lut, scalar=sc)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int64), want[1].view(torch.int64)), sc
    v2 = v.clone()
    v2.view(torch.int16)[0, 0, :, 0] ^= 1 << 9  # a mantissa bit of channel 0 of every token's value (row 0 reads them)
    other = cpu_fused._run(q, qpos, [cpu_fused.seg(Hkv, N, k=k, v=v2, rho=rho), cpu_fused.seg(Hkv, 0)], s, b64, 1, 1,
                           certify, lut)
    assert not torch.equal(other[0], want[0])


# ---- the output bound's sums (value_bound) ----

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), T=st.integers(1, 3), Hkv=st.integers(1, 2),
       G=st.integers(1, 3), N0=st.integers(1, 40), N1=st.integers(0, 9), scheme=st.sampled_from(["int8", "int4"]),
       vscale=st.floats(-4, 3), centre=st.sampled_from(["mean", "zero", "far"]), mag=st.sampled_from([0.3, 3.0, 30.0]))
def test_output_bound_from_the_kernel_sums_holds_against_exact_values(seed, B, T, Hkv, G, N0, N1, scheme, vscale, centre, mag):
    """The fused read's output bound (_run(value=...) sums -> attention.output_error_from_kernel, as hf_fused takes it):
    ||o - out|| <= out_err per (row, query head), o the fp64 attention over the exact keys and values the test made
    (never touched by the kernel), out the kernel's output over quantized keys and values (segment 0) and exact rows
    (segment 1), causal rows; any centre (the radii's) is sound. The sums themselves: max e_j and the per-channel
    max |v~| exactly, the radii's max within its rounding of the exact one, sum w e / sum w between the readable
    tokens' smallest and largest e."""
    from fast.core.attention import output_error_from_kernel
    from fast.integrations.hf_layer import value_error_norms
    g = torch.Generator().manual_seed(seed)
    D, NB, H, N = 64, 8, Hkv * G, N0 + N1
    T = min(T, N)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = (torch.randn(B, Hkv, N, D, generator=g) + 2.0) * 10 ** vscale  # an offset: the centre matters
    kq, vq = quantize(k[:, :, :N0], scheme), quantize(v[:, :, :N0], scheme)
    kd, vd = fast.dequantize(kq), fast.dequantize(vq)
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k[:, :, :N0], kd, bands)).contiguous()
    v_err = value_error_norms(v[:, :, :N0], vd).contiguous()
    parts = dict(k=kq.codes, v=vq.codes, k_scales=kq.scales, v_scales=vq.scales)
    segs = [cpu_fused.seg(Hkv, N0, **parts, rho=rho, v_err=v_err),
            cpu_fused.seg(Hkv, N1, k=k[:, :, N0:].contiguous(), v=v[:, :, N0:].contiguous())]
    served_v = torch.cat([vd, v[:, :, N0:]], 2)
    c = {"mean": served_v.mean(2), "zero": torch.zeros(B, Hkv, D), "far": served_v.mean(2) + 100 * 10 ** vscale}[centre]
    q = (torch.randn(B, T, H, D, generator=g) * mag).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    lut, b64, s = _log_table("cpu").to(torch.float32).contiguous(), bands.to(torch.int64).contiguous(), D ** -0.5
    ngk, ngv = segs[0]["ng"]
    out, st, (vst, vmax) = cpu_fused._run(q, qpos, segs, s, b64, ngk, ngv, True, lut, value=c.contiguous())
    cert = cpu_fused._certificate(st, NB, N, D)  # None: the epilogue needs fp64 terms (a huge witness): TV <= 1
    tv = torch.ones(B, T, H) if cert is None else cert["min"]
    bound = output_error_from_kernel(st[..., 0], vst, vmax, tv, N, D)
    # the truth: exact keys and values, fp64, row t of query head h reads tokens <= its position
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)  # [B, H, N, D]
    x = torch.einsum("bthd,bhnd->bthn", q.double(), kk) * s
    vis = torch.arange(N)[None, :] <= qpos[0].long()[:, None]  # [T, N]
    o = torch.einsum("bthn,bhnd->bthd", x.masked_fill(~vis[None, :, None], float("-inf")).softmax(-1), vv)
    err = (o - out.double()).norm(dim=-1)
    assert bool((err <= bound.double()).all()), (float((err / bound).max()), centre)
    # the sums
    assert torch.equal(vmax, served_v.abs().amax(2))
    e_all = torch.cat([v_err, torch.zeros(B, Hkv, N1)], 2).double().repeat_interleave(G, 1)  # [B, H, N]
    e_vis = torch.where(vis[None, :, None], e_all[:, None], 0.0)  # [B, T, H, N]
    assert torch.equal(vst[..., 1], e_vis.amax(-1))
    rad = (served_v.double() - c.double()[:, :, None]).norm(dim=-1).repeat_interleave(G, 1)
    rmax = torch.where(vis[None, :, None], rad[:, None], 0.0).amax(-1)
    assert bool((vst[..., 2] >= rmax).all()) and bool((vst[..., 2] <= rmax * (1 + 1e-12) + 1e-300).all())
    ratio = vst[..., 0] / st[..., 0]
    lo = torch.where(vis[None, :, None], e_all[:, None], float("inf")).amin(-1)
    assert bool((ratio >= lo * (1 - 1e-12)).all()) and bool((ratio <= vst[..., 1] * (1 + 1e-12)).all())


def test_value_sums_refuse_bad_inputs():
    k = torch.zeros(1, 1, 8, 64)
    with pytest.raises(ValueError, match="v_err"):
        cpu_fused.seg(1, 8, k=k, v=k, v_err=torch.full((1, 1, 8), -1.0))
    with pytest.raises(ValueError, match="v_err"):
        cpu_fused.seg(1, 8, k=k, v=k, v_err=torch.zeros(1, 1, 7))
    segs = [cpu_fused.seg(1, 8, k=k, v=k, rho=torch.zeros(1, 1, 8, 8)), cpu_fused.seg(1, 0)]
    q, qpos, b64 = torch.zeros(1, 1, 1, 64), torch.tensor([[7]], dtype=torch.int32), fast.rope_bands(64, 8).to(torch.int64).contiguous()
    for bad in (torch.full((1, 1, 64), float("nan")), torch.zeros(1, 2, 64), 1.0):
        with pytest.raises(ValueError, match="value"):
            cpu_fused._run(q, qpos, segs, 0.125, b64, 1, 1, True, value=bad)
    with pytest.raises(ValueError, match="certified read"):
        cpu_fused._run(q, qpos, segs, 0.125, b64, 1, 1, False, value=0)


def test_fp16_rows_refuse_scales_dither_and_mixed_dtypes():
    k = torch.zeros(1, 1, 8, 64, dtype=torch.float16)
    sc = torch.ones(1, 1, 8, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="only for integer codes"):
        cpu_fused.seg(1, 8, k=k, v=k, k_scales=sc, v_scales=sc)
    with pytest.raises(ValueError, match="fp16 and fp32 rows carry no dither"):
        cpu_fused.seg(1, 8, k=k, v=k, dither=cpu_fused.Dither(1, 0, 0))
    with pytest.raises(ValueError, match="both fp16 rows"):
        cpu_fused.seg(1, 8, k=k, v=k.float())


@pytest.mark.parametrize("what", ["scales_fp16", "one_scale", "scale_shape", "codes_int8", "pre_inexact", "scale_zero",
                                  "dtype", "mixed", "rtz_scales_differ"])
def test_fp8_bad_inputs_one_value_error(what):
    """fp8 inputs the kernel trusts: codes not fp8 / uint8 [B, Hkv, N, D], scales not fp32 [B, Hkv, N, 1] for both
    streams, decode factors fp32 cannot hold or <= 0, a table dtype that is not fp8, keys and values of two schemes
    or two tensor scales: one ValueError each."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 1, 10, 32, generator=g), torch.randn(1, 1, 10, 32, generator=g)
    kq, vq = quantize(k, "fp8_e5m2"), quantize(v, "fp8_e5m2")
    parts = cpu_fused.fp8_parts(kq, vq)
    cpu_fused.seg(1, 10, **parts)  # the good call
    f8 = parts["fp8"]
    if what == "scales_fp16":
        parts["k_scales"], parts["v_scales"] = parts["k_scales"].half(), parts["v_scales"].half()
    elif what == "one_scale":
        parts["v_scales"] = None
    elif what == "scale_shape":
        parts["k_scales"] = parts["k_scales"][:, :, :9]
    elif what == "codes_int8":
        parts["k"] = parts["k"].view(torch.int8)
    elif what == "pre_inexact":
        parts["fp8"] = cpu_fused.Fp8Read(f8.dtype, 1.0, 0.1)
    elif what == "scale_zero":
        parts["fp8"] = cpu_fused.Fp8Read(f8.dtype, 0.0)
    elif what == "dtype":
        parts["fp8"] = cpu_fused.Fp8Read(torch.float16)
    if what == "mixed":
        with pytest.raises(ValueError, match="one scheme"):
            cpu_fused.fp8_parts(kq, quantize(v, "fp8_e4m3"))
        return
    if what == "rtz_scales_differ":
        with pytest.raises(ValueError, match="tensor scales differ"):
            cpu_fused.fp8_parts(quantize(k, "fp8_e4m3_rtz", scale=2.0), quantize(v, "fp8_e4m3_rtz"))
        return
    with pytest.raises(ValueError):
        cpu_fused.seg(1, 10, **parts)


@settings(max_examples=12, deadline=None)
@given(case=PAGED, scheme=st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz"]), u8=st.booleans())
def test_paged_fp8_codes_same_bits_as_contiguous(case, scheme, u8):
    """fp8 codes read in place from a paged cache packed as kvcert's vLLM cache packs them (per (block, head) one byte
    slab: key codes [bs, D], value codes [bs, D], key and value fp32 scales [bs, 1] (round-to-nearest; none for the
    round-toward-zero cast), witness [bs, NB]): output and stats equal bit for bit the read of the same codes laid out
    contiguously (seg), in the vector and the scalar build."""
    g = torch.Generator().manual_seed(case["seed"])
    B, T, Hkv, G, N, bs, D = (case[x] for x in ("B", "T", "Hkv", "G", "N", "bs", "D"))
    T, NB, H = min(T, N), 8, Hkv * G
    kw = dict(scale=2.0 ** -3) if scheme.endswith("_rtz") else {}
    kq = quantize(torch.randn(B, Hkv, N, D, generator=g), scheme, **kw)
    vq = quantize(torch.randn(B, Hkv, N, D, generator=g), scheme, **kw)
    parts = cpu_fused.fp8_parts(kq, vq)
    scaled = parts["k_scales"] is not None
    rho = (torch.randint(0, 200, (B, Hkv, N, NB), generator=g, dtype=torch.uint8) if u8
           else torch.rand(B, Hkv, N, NB, generator=g) * 1e-2)
    rb = rho.element_size() * NB
    sw = 4 if scaled else 0
    table, part = _paged_slab(g, B, Hkv, N, bs, 2 * D + 2 * sw + rb, 0x7F)  # unused slots: NaN codes
    kc, vc = part(0, D, torch.uint8), part(D, D, torch.uint8)
    ks, vs = (part(2 * D, sw, torch.float32), part(2 * D + sw, sw, torch.float32)) if scaled else (None, None)
    rc = part(2 * D + 2 * sw, rb, rho.dtype)
    for b in range(B):
        for j in range(N):
            blk, off = int(table[b, j // bs]), j % bs
            kc[blk, :, off], vc[blk, :, off] = parts["k"].view(torch.uint8)[b, :, j], parts["v"].view(torch.uint8)[b, :, j]
            if scaled:
                ks[blk, :, off], vs[blk, :, off] = parts["k_scales"][b, :, j], parts["v_scales"][b, :, j]
            rc[blk, :, off] = rho[b, :, j]
    q = torch.randn(B, T, H, D, generator=g).contiguous()
    qpos = (N - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    b64 = fast.rope_bands(D, NB).to(torch.int64).contiguous()
    lut = _log_table("cpu").to(torch.float32).contiguous() if u8 else None
    flat = [cpu_fused.seg(Hkv, N, **parts, rho=rho), cpu_fused.seg(Hkv, 0)]
    paged = [cpu_fused.paged_seg(N, k=kc, v=vc, k_scales=ks, v_scales=vs, rho=rc, table=table, k_transposed=False,
                                 fp8=parts["fp8"]), cpu_fused.seg(Hkv, 0)]
    for sc in (False, True):
        want = cpu_fused._run(q, qpos, flat, D ** -0.5, b64, 1, 1, case["certify"], lut=lut, scalar=sc)
        got = cpu_fused._run(q, qpos, paged, D ** -0.5, b64, 1, 1, case["certify"], lut=lut, scalar=sc)
        rep = f"scalar={sc} {scheme} u8={u8} case {json.dumps(case)}"
        assert torch.equal(got[0], want[0]), "output differs: " + rep
        assert torch.equal(got[1], want[1]), "stats differ: " + rep


def test_paged_fp8_refusals():
    """fp8 codes in a paged cache: bytes not transposed, scales fp32 [.., bs, 1] for both or neither, slabs contiguous,
    a valid Fp8Read: one ValueError each."""
    kc, vc = torch.zeros(4, 1, 8, 64, dtype=torch.uint8), torch.zeros(4, 1, 8, 64, dtype=torch.uint8)
    sc = torch.ones(4, 1, 8, 1)
    ok = torch.tensor([[0, 1]], dtype=torch.int32)
    f8 = cpu_fused.Fp8Read(torch.float8_e4m3fn)
    cpu_fused.paged_seg(16, k=kc, v=vc, k_scales=sc, v_scales=sc, rho=None, table=ok, k_transposed=False, fp8=f8)
    bad = [dict(k_transposed=True), dict(v_scales=None), dict(k_scales=sc.half(), v_scales=sc.half()),
           dict(k_scales=torch.ones(4, 1, 8, 2), v_scales=torch.ones(4, 1, 8, 2)), dict(k=kc.view(torch.int8)),
           dict(fp8=cpu_fused.Fp8Read(torch.float16)), dict(fp8=cpu_fused.Fp8Read(torch.float8_e4m3fn, -1.0)),
           dict(v=torch.zeros(4, 1, 64, 8, dtype=torch.uint8).transpose(2, 3))]
    for kw in bad:
        args = dict(k=kc, v=vc, k_scales=sc, v_scales=sc, rho=None, table=ok, k_transposed=False, fp8=f8)
        with pytest.raises(ValueError):
            cpu_fused.paged_seg(16, **{**args, **kw})
