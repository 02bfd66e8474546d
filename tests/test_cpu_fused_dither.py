"""The fused C++ read of dithered codes (int8_dither, int4_dither; fast.core.cpu_fused seg(dither=...), csrc dither_row,
dither_u, dither_sums) and the dither tier's estimate from its sums.

Differential (fused vs the twin's dequantize): the dither regenerated at read gives the SAME output and stats, bit for
bit, as the kernel reading fast.dequantize of the codes as fp32 rows, in the AVX2 and the scalar build, for every
counter range (seeds up to 2^64 - 1, layers up to 2^32 - 1, tokens near 2^63) and head sizes where the AVX2 Philox
runs (D >= 64) and where it does not. Differential (fused vs reference): the estimate is >= the exact (60-digit)
formula reference.softmax.tv_bound_forms(softmax(s <q, k~>), c) with c the exact radius of
reference.dither.dither_radius_grid (grid bias 2^-17 + 2^-18 and the quantizer's rho, as fast.core.dither), and not
looser than the twin's fast.core.dither.dither_forms by more than the Taylor room. Truth: over many dither draws
with the query drawn first (spec A2), the estimate bounds the total variation to the attention over the exact keys,
computed here in fp64 from keys the library never touched. Mutations: a wrong seed, token, layer or stream is
another read; bad inputs: one ValueError each.
"""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

import fast
from fast.core import cpu_fused
from fast.core.dither import QUANT_RHO, dither_forms, radius_factor
from fast.core.quant import TOKEN_COUNT, dequantize, quantize
from fast.core.witness import _log_table
from reference import dither as ref_dither
from reference import softmax as ref

DITHER = st.fixed_dictionaries({
    "seed": st.integers(0, 2 ** 64 - 1), "layer": st.integers(0, 2 ** 32 - 1), "high": st.booleans(),
    "scheme": st.sampled_from(["int8_dither", "int4_dither"]), "B": st.integers(1, 2), "T": st.integers(1, 3),
    "Hkv": st.integers(1, 2), "G": st.integers(1, 3), "N": st.integers(1, 40), "D": st.sampled_from([16, 64, 80, 136]),
    "groups": st.sampled_from([1, 2]), "mag": st.sampled_from([0.5, 3.0]), "tail": st.integers(0, 3),
    "padding": st.booleans()})


def _case(case):
    """Codes, the two kernel segments (dithered codes + an exact tail) and the same cache as fp32 rows."""
    g = torch.Generator().manual_seed(case["seed"] % 2 ** 31)
    B, T, Hkv, G, N, D, R = (case[x] for x in ("B", "T", "Hkv", "G", "N", "D", "tail"))
    start = TOKEN_COUNT - 1 - N if case["high"] else case["seed"] % 2 ** 40
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    kw = dict(seed=case["seed"], layer=case["layer"], token_start=start, group_size=D // case["groups"])
    kq, vq = quantize(k, case["scheme"], stream=0, **kw), quantize(v, case["scheme"], stream=1, **kw)
    NB = 8 if D % 16 == 0 else 4
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k, dequantize(kq), bands)).contiguous()
    valid = torch.ones(B, Hkv, N, dtype=torch.bool)
    if case["padding"] and N > 2:
        valid[0, :, : N // 2] = False
    kt, vt = torch.randn(B, Hkv, R, D, generator=g), torch.randn(B, Hkv, R, D, generator=g)
    tail = cpu_fused.seg(Hkv, R, k=kt.contiguous(), v=vt.contiguous()) if R else cpu_fused.seg(Hkv, 0)
    codes = cpu_fused.seg(Hkv, N, **cpu_fused.dither_parts(kq, vq), rho=rho, valid=valid)
    rows = cpu_fused.seg(Hkv, N, k=dequantize(kq).contiguous(), v=dequantize(vq).contiguous(), rho=rho, valid=valid)
    T = min(T, N + R)
    q = (torch.randn(B, T, Hkv * G, D, generator=g) * case["mag"]).contiguous()
    qpos = (N + R - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T)
    if case["padding"] and N > 2:  # every row reads a key (row 0's first N // 2 tokens are padding)
        qpos = torch.clamp(qpos, min=N // 2)
    qpos = qpos.contiguous()
    ng = (kq.scales.shape[-1], vq.scales.shape[-1])
    return dict(k=k, kq=kq, kd=dequantize(kq), step=kq.step(), kt=kt, q=q, qpos=qpos, bands=bands, valid=valid,
                segs=[codes, tail], rows=[rows, tail], ng=ng, lut=_log_table("cpu").to(torch.float32).contiguous(),
                b64=bands.to(torch.int64).contiguous(), s=D ** -0.5)


def _assert_reads_as_rows(c, rep):
    """The kernel over the dithered codes (dither regenerated at read) gives the output and stats of the kernel over the
    twin's decoded fp32 rows, bit for bit, in both builds, and the two builds' dither sums agree bit for bit."""
    for sc in (False, True):
        got = cpu_fused._run(c["q"], c["qpos"], c["segs"], c["s"], c["b64"], *c["ng"], True, c["lut"], scalar=sc, dither_F=3.0)
        want = cpu_fused._run(c["q"], c["qpos"], c["rows"], c["s"], c["b64"], 1, 1, True, c["lut"], scalar=sc)
        assert torch.equal(got[0], want[0]), "output differs from the decoded rows' " + rep
        assert torch.equal(got[1].view(torch.int64), want[1].view(torch.int64)), "stats differ " + rep
        if sc:
            assert torch.equal(got[2].view(torch.int64), vector[2].view(torch.int64)), "dither sums: builds differ " + rep
        vector = got


KIVI = st.fixed_dictionaries({
    "seed": st.integers(0, 2 ** 64 - 1), "layer": st.integers(0, 2 ** 32 - 1), "high": st.booleans(), "B": st.integers(1, 2),
    "T": st.integers(1, 3), "Hkv": st.integers(1, 2), "G": st.integers(1, 3), "blocks": st.integers(1, 2),
    "D": st.sampled_from([16, 64, 96]), "mag": st.sampled_from([0.5, 3.0]), "tail": st.integers(0, 3),
    "offset": st.sampled_from([0.0, 6.0])})


def _kivi_case(case):
    """kivi2_dither codes (keys per channel over blocks of 32 tokens, values per token in groups of 32 channels, 2-bit
    dithered codes), the kernel segments and the same cache as the twin's decoded fp32 rows."""
    from fast.core.schemes import KIVI_GROUP, KiviDither
    g = torch.Generator().manual_seed(case["seed"] % 2 ** 31)
    B, T, Hkv, G, D, R = (case[x] for x in ("B", "T", "Hkv", "G", "D", "tail"))
    N = KIVI_GROUP * case["blocks"]
    start = TOKEN_COUNT - 1 - N if case["high"] else case["seed"] % 2 ** 40
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    if case["offset"]:  # keys far from 0 beside their spread: the zero point's term max(scale, |zero| 2^-7) decides the step
        k = k * 0.02 + case["offset"]
    kq = KiviDither.encode(k, "k", case["layer"], start, case["seed"])
    vq = KiviDither.encode(v, "v", case["layer"], start, case["seed"])
    kd, vd = kq.decode(), vq.decode()
    NB = 8 if D % 16 == 0 else 4
    bands = fast.rope_bands(D, NB)
    rho = fast.pack_witness(fast.witness(k, kd, bands)).contiguous()
    kt, vt = torch.randn(B, Hkv, R, D, generator=g), torch.randn(B, Hkv, R, D, generator=g)
    tail = cpu_fused.seg(Hkv, R, k=kt.contiguous(), v=vt.contiguous()) if R else cpu_fused.seg(Hkv, 0)
    codes = cpu_fused.seg(Hkv, N, k_asym=cpu_fused.AsymKeys(kq.get("codes"), kq.get("scale"), kq.get("zero"), 2, KIVI_GROUP),
                          v_asym=cpu_fused.AsymValues(vq.get("codes"), vq.get("scale"), vq.get("zero"), 2),
                          dither=cpu_fused.Dither(case["seed"], case["layer"], start), rho=rho)
    rows = cpu_fused.seg(Hkv, N, k=kd.contiguous(), v=vd.contiguous(), rho=rho)
    T = min(T, N + R)
    q = (torch.randn(B, T, Hkv * G, D, generator=g) * case["mag"]).contiguous()
    qpos = (N + R - T + torch.arange(T, dtype=torch.int32)).view(1, T).expand(B, T).contiguous()
    return dict(k=k, kd=kd, step=kq.step(), kt=kt, q=q, qpos=qpos, bands=bands, valid=torch.ones(B, Hkv, N, dtype=torch.bool),
                segs=[codes, tail], rows=[rows, tail], ng=codes["ng"], lut=_log_table("cpu").to(torch.float32).contiguous(),
                b64=bands.to(torch.int64).contiguous(), s=D ** -0.5)


@settings(max_examples=15, deadline=None)
@given(case=KIVI)
def test_kivi_dither_codes_read_as_the_twins_decoded_rows(case):
    """kivi2_dither's 2-bit dithered asymmetric codes (csrc asym_row with the dither): x~ = fl(fl((code - u) scale) + zero)
    regenerated at read gives the twin's KiviDither.decode() rows bit for bit (output and stats), in both builds."""
    _assert_reads_as_rows(_kivi_case(case), f"case {json.dumps(case)}")


def _estimate_covers_reference(c, d, rep):
    """The kernel's dither estimate at budget d (F = radius_factor(N, d)) of the first and last rows, each >= the exact
    60-digit forms at the exact grid radius (_reference_estimate). Returns (the estimate dict, [(got, want)])."""
    N = c["kd"].shape[2] + c["kt"].shape[2]
    F = radius_factor(N, d)
    out, stats, dstats = cpu_fused._run(c["q"], c["qpos"], c["segs"], c["s"], c["b64"], *c["ng"], True, c["lut"], dither_F=F)
    est = cpu_fused._certificate(dstats, c["bands"].shape[0], N, c["q"].shape[-1])
    assert est is not None
    B, T, H, _ = c["q"].shape
    pairs = []
    for b, t, h in sorted({(0, 0, 0), (B - 1, T - 1, H - 1)}):
        want = _reference_estimate(c, b, t, h, N, d)
        got = mpf(float(est["min"][b, t, h]))
        assert got >= want, f"unsound: fused {got} exact {want} row ({b},{t},{h}) {rep}"
        pairs.append((got, want))
    return est, pairs


@settings(max_examples=8, deadline=None)
@given(case=KIVI, d=st.sampled_from([1e-3, 1e-9]))
@workdps(60)
def test_kivi_dither_estimate_covers_the_reference(case, d):
    """kivi2_dither's estimate (a dither step per channel and key block, max(scale, |zero| 2^-7) (1 + 2^-10)) is >= the
    exact forms at the exact grid radius of every token."""
    _, pairs = _estimate_covers_reference(_kivi_case(case), d, f"case {json.dumps(case)} d {d}")
    for got, want in pairs:
        if not case["offset"]:  # (large keys: the kernel's logit rounding e, not in the reference, dominates a small bound)
            assert got <= want * 1.5 + mpf(1e-4), f"the estimate must follow the reference: {got} vs {want}"


@settings(max_examples=30, deadline=None)
@given(case=DITHER)
def test_dither_codes_read_as_the_twins_dequantized_rows(case):
    _assert_reads_as_rows(_case(case), f"case {json.dumps(case)}")


def _reference_estimate(c, b, t, h, F_n, d):
    """The exact dither-tier forms of one row: softmax of the exact logits s <q, k~> over the row's readable tokens
    (codes then the exact tail), with each code token's exact grid radius (tail tokens: 0)."""
    q, s = c["q"], c["s"]
    G = q.shape[2] // c["kd"].shape[1]
    kv, kd, step = h // G, c["kd"].double(), c["step"].double()
    N, R = kd.shape[2], c["kt"].shape[2]
    qpos = int(c["qpos"][b, t])
    qh = [float(x) for x in q[b, t, h].double()]
    logits, radius = [], []
    for j in range(N + R):
        if j > qpos or (j < N and not bool(c["valid"][b, kv, j])):
            continue
        row = kd[b, kv, j] if j < N else c["kt"][b, kv, j - N].double()
        logits.append(mpf(s) * fsum(mpf(a) * mpf(float(x)) for a, x in zip(qh, row)))
        if j < N:
            delta = [float(x) for x in step[b, kv, j]]
            rho = mpf(s) * fsum(abs(mpf(a)) * mpf(dl) for a, dl in zip(qh, delta)) * mpf(QUANT_RHO)
            radius.append(ref_dither.dither_radius_grid(qh, delta, s, F_n, d, eta=mpf(2) ** -18, rho=rho))
        else:
            radius.append(mpf(0))
    return ref.tv_bound_forms(ref.softmax(logits), radius)["min"]


@settings(max_examples=20, deadline=None)
@given(case=DITHER, d=st.sampled_from([1e-3, 1e-9]))
@workdps(60)
def test_dither_estimate_covers_the_reference(case, d):
    c = _case(case)
    rep = f"case {json.dumps(case)} d {d}"
    est, _ = _estimate_covers_reference(c, d, rep)
    N, T = c["kd"].shape[2] + c["kt"].shape[2], c["q"].shape[1]
    # beside the twin's fp64 dither_forms (decode rows, no tail: its inputs): within the Taylor room of the epilogue
    if c["kt"].shape[2] == 0 and T == 1 and not case["padding"]:
        from fast.integrations.hf_meter import served_probs
        kd = dequantize(c["kq"])
        p = served_probs(c["q"][:, 0], kd, c["s"], torch.ones(kd.shape[:3], dtype=torch.bool))
        tw = dither_forms(c["q"][:, 0], p, c["kq"].step(), c["kq"].max_abs(), c["s"], N, d)["min"]
        cm = est["max_c"][:, 0].double()
        assert bool((est["min"][:, 0] <= tw * (1 + 1e-3 + cm * cm) + 1e-6).all()), rep


def test_dither_estimate_bounds_the_true_distance():
    """Truth: 300 dither draws (seeds) of one cache, the query drawn before them (A2). The estimate at d = 1e-2 must
    bound TV(softmax(s <q, k>), the served attention) in every draw but at most a few (a union-bound tier: the
    expected count of failures is at most 3); the truth is fp64 attention over the exact keys k."""
    g = torch.Generator().manual_seed(5)
    B, Hkv, G, N, D, s = 1, 2, 2, 64, 64, 0.125
    k, v = torch.randn(B, Hkv, N, D, generator=g) * 2, torch.randn(B, Hkv, N, D, generator=g)
    q = (torch.randn(B, 1, Hkv * G, D, generator=g) * 3).contiguous()
    qpos = torch.full((B, 1), N - 1, dtype=torch.int32)
    bands = fast.rope_bands(D, 8)
    b64, lut = bands.to(torch.int64).contiguous(), _log_table("cpu").to(torch.float32).contiguous()
    qd = q[:, 0].double().view(B, Hkv, G, D)
    p_true = torch.softmax(s * torch.einsum("bhgd,bhnd->bhgn", qd, k.double()), -1)
    fails, worst = 0, 0.0
    F = radius_factor(N, 1e-2)
    for seed in range(300):
        kq, vq = quantize(k, "int8_dither", seed=seed, stream=0), quantize(v, "int8_dither", seed=seed, stream=1)
        rho = fast.pack_witness(fast.witness(k, dequantize(kq), bands)).contiguous()
        segs = [cpu_fused.seg(Hkv, N, **cpu_fused.dither_parts(kq, vq), rho=rho), cpu_fused.seg(Hkv, 0)]
        _, _, dst = cpu_fused._run(q, qpos, segs, s, b64, 2, 2, True, lut, dither_F=F)
        est = cpu_fused._certificate(dst, 8, N, D)["min"][0, 0].double().view(Hkv, G)
        served = torch.softmax(s * torch.einsum("bhgd,bhnd->bhgn", qd, dequantize(kq).double()), -1)
        tv = 0.5 * (served - p_true).abs().sum(-1)[0]
        fails += int((tv > est).sum())
        worst = max(worst, float((tv / est).max()))
    assert fails <= 3, f"{fails} of {300 * Hkv * G} rows above the estimate (worst ratio {worst:.3f})"
    assert worst > 0.05, f"the truth never comes near the estimate (worst ratio {worst:.3f}): check the harness"


@pytest.mark.parametrize("what", ["seed", "token", "layer", "streams_swapped"])
def test_dither_read_sees_mutations(what):
    """The read regenerates the dither from the counters it is given: another seed, first token, layer or the key and
    value streams swapped decode other rows (the bit-identity above can fail)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 24, 64, generator=g), torch.randn(1, 2, 24, 64, generator=g)
    kq, vq = quantize(k, "int8_dither", seed=9, layer=2, token_start=5), quantize(v, "int8_dither", seed=9, layer=2, token_start=5, stream=1)
    q = torch.randn(1, 1, 4, 64, generator=g).contiguous()
    qpos = torch.tensor([[23]], dtype=torch.int32)
    b64 = fast.rope_bands(64, 8).to(torch.int64).contiguous()
    rows = [cpu_fused.seg(2, 24, k=dequantize(kq).contiguous(), v=dequantize(vq).contiguous()), cpu_fused.seg(2, 0)]
    want = cpu_fused._run(q, qpos, rows, 0.125, b64, 1, 1, False)[0]
    parts = cpu_fused.dither_parts(kq, vq)
    good = cpu_fused._run(q, qpos, [cpu_fused.seg(2, 24, **parts), cpu_fused.seg(2, 0)], 0.125, b64, 2, 2, False)[0]
    assert torch.equal(good, want)
    dt = parts["dither"]
    if what == "streams_swapped":
        parts.update(k=vq.codes, v=kq.codes, k_scales=vq.scales, v_scales=kq.scales)
        rows = [cpu_fused.seg(2, 24, k=dequantize(vq).contiguous(), v=dequantize(kq).contiguous()), cpu_fused.seg(2, 0)]
        want = cpu_fused._run(q, qpos, rows, 0.125, b64, 1, 1, False)[0]
    else:
        parts["dither"] = cpu_fused.Dither(dt.seed + (what == "seed"), dt.layer + (what == "layer"), dt.token_start + (what == "token"))
    got = cpu_fused._run(q, qpos, [cpu_fused.seg(2, 24, **parts), cpu_fused.seg(2, 0)], 0.125, b64, 2, 2, False)[0]
    assert not torch.equal(got, want)


@pytest.mark.parametrize("what", ["streams", "seeds", "schemes", "fp32_rows", "fp8", "counter", "not_dither", "F_small",
                                  "F_uncertified", "F_plain_codes"])
def test_dither_bad_inputs_one_value_error(what):
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 1, 8, 32, generator=g)
    kq, vq = quantize(k, "int8_dither", seed=1), quantize(k, "int8_dither", seed=1, stream=1)
    q, qpos, b64 = torch.randn(1, 1, 1, 32).contiguous(), torch.tensor([[7]], dtype=torch.int32), fast.rope_bands(32, 4).to(torch.int64).contiguous()
    rho = fast.pack_witness(fast.witness(k, dequantize(kq), fast.rope_bands(32, 4))).contiguous()
    lut = _log_table("cpu").to(torch.float32).contiguous()
    with pytest.raises(ValueError):
        if what == "streams":
            cpu_fused.dither_parts(kq, quantize(k, "int8_dither", seed=1))
        elif what == "seeds":
            cpu_fused.dither_parts(kq, quantize(k, "int8_dither", seed=2, stream=1))
        elif what == "schemes":
            cpu_fused.dither_parts(kq, quantize(k, "int4_dither", seed=1, stream=1))
        elif what == "fp32_rows":
            cpu_fused.seg(1, 8, k=k, v=k, dither=cpu_fused.Dither(1, 0))
        elif what == "fp8":
            cpu_fused.seg(1, 8, **cpu_fused.fp8_parts(quantize(k, "fp8_e4m3"), quantize(k, "fp8_e4m3")), dither=cpu_fused.Dither(1, 0))
        elif what == "counter":
            cpu_fused.seg(1, 8, **{**cpu_fused.dither_parts(kq, vq), "dither": cpu_fused.Dither(1, 0, TOKEN_COUNT - 4)})
        elif what == "not_dither":
            cpu_fused.seg(1, 8, **{**cpu_fused.dither_parts(kq, vq), "dither": (1, 0, 0)})
        else:
            parts = cpu_fused.dither_parts(kq, vq)
            if what == "F_plain_codes":
                kp, vp = quantize(k, "int8"), quantize(k, "int8")
                parts = dict(k=kp.codes, v=vp.codes, k_scales=kp.scales, v_scales=vp.scales)
            segs = [cpu_fused.seg(1, 8, **parts, rho=rho), cpu_fused.seg(1, 0)]
            cpu_fused._run(q, qpos, segs, 0.25, b64, 1, 1, what != "F_uncertified", lut, dither_F=0.5 if what == "F_small" else 3.0)

