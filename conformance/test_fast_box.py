"""Differential: fast.core.box.box_tv_bound against reference.box (spec T9, proofs/Box.v).

Headline property: the fast bound >= the reference's exact value of the same bound (the grid,
multipliers and enclosure the fast code used, at 60 digits) >= the exact box worst case
(enumeration) >= the true TV; and not uselessly loose: fast <= reference (1 + 1e-9) + 1e-12.
"""

import json

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import exp, fsum, mpf, tanh, workdps

import math

import fast
from conformance._check import DPS, expect, le, replay
from conformance.test_fast_attention import build as build_read, dense
from reference import band as ref_band
from reference import softmax as sm
from fast.core.attention import logit_rounding, max_abs
from fast.core.box import box_tv_bound
from fast.core.certify import tv_bound_forms
from reference import box as ref

LOGIT = {"flat": 1e-3, "ordinary": 2.0, "peaked": 8.0}
CMAG = {"tiny": 1e-6, "ordinary": 0.2, "large": 3.0}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def build(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (1, case["rows"], case["N"])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * LOGIT[case["logit"]]
    p = torch.softmax(x, -1).to(DTYPES[case["dtype"]])
    c = torch.rand(shape, generator=g, dtype=torch.float64) * CMAG[case["c"]]
    if case["sparse"]:  # error only off the top token (an exact sink elsewhere)
        c = torch.where(p.double() < p.double().amax(-1, keepdim=True), c, torch.zeros_like(c))
    return p, c.to(DTYPES[case["dtype"]])


@workdps(DPS)
def check_fast_ge_reference(case):
    p, c = build(case)
    got, info = box_tv_bound(p, c, return_grid=True)
    u0, u1, l0, l1 = (t.tolist() for t in info["grid"])
    for r in range(case["rows"]):
        fl = lambda t: [mpf(v) for v in t[r].tolist()]  # fp64 -> mpf exactly
        want = ref.box_grid_bound(fl(info["q_lo"]), fl(info["q_hi"]), fl(info["lo"]), fl(info["hi"]),
                                  u0[r], u1[r], [[a, b] for a, b in zip(l0[r], l1[r])])
        f = mpf(float(got[0, r]))
        msg = f"fast {f} vs reference {want}; case {json.dumps(case)}"
        expect(le(want, f), check_fast_ge_reference, case, "fast below reference (unsound) " + msg)
        expect(f <= min(want, 1) * (1 + mpf("1e-6")) + mpf("1e-12"), check_fast_ge_reference, case, "fast uselessly loose " + msg)
        if case["N"] <= 10:
            ps = [mpf(v) for v in p[0, r].double().tolist()]
            total = fsum(ps)
            q = [v / total for v in ps]
            cs = [mpf(v) for v in c[0, r].double().tolist()]
            oracle = ref.box_oracle(q, [-v for v in cs], cs)
            expect(le(oracle, want), check_fast_ge_reference, case, f"reference {want} < box worst case {oracle}")
            w = [v * exp(s) for v, s in zip(q, cs)]  # eps = +c: one vertex of the box
            z = fsum(w)
            truth = fsum(abs(a / z - b) for a, b in zip(w, q)) / 2
            expect(le(truth, oracle), check_fast_ge_reference, case, f"true TV {truth} > box worst case {oracle}")


CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 3), "N": st.integers(1, 40),
    "logit": st.sampled_from(sorted(LOGIT)), "c": st.sampled_from(sorted(CMAG)),
    "dtype": st.sampled_from(sorted(DTYPES)), "sparse": st.booleans()})


@settings(max_examples=40, deadline=None)
@replay("test_fast_box_ge_reference")
@example(case={"seed": 0, "rows": 1, "N": 1, "logit": "ordinary", "c": "ordinary", "dtype": "fp32", "sparse": False})
@given(case=CASE)
def test_fast_box_ge_reference(case):
    check_fast_ge_reference(case)


def test_fast_box_ge_true_tv_from_exact_keys():
    """Truth from exact keys the code under test never touched: k~ = k + r, c_j >= s |q . r_j|
    (Cauchy-Schwarz over all D coordinates), p~ = softmax(s q . k~): the box bound >= TV."""
    g = torch.Generator().manual_seed(7)
    B, H, N, D = 2, 3, 300, 64
    s = D ** -0.5
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    r = torch.randn(B, H, N, D, generator=g, dtype=torch.float64) * 0.05
    x = torch.einsum("bhd,bhnd->bhn", q, k) * s
    xt = torch.einsum("bhd,bhnd->bhn", q, k + r) * s
    c = s * q.norm(dim=-1, keepdim=True) * r.norm(dim=-1)
    p, pt = torch.softmax(x, -1), torch.softmax(xt, -1)
    truth = 0.5 * (p - pt).abs().sum(-1)
    got = box_tv_bound(pt, c)
    assert bool((got.double() >= truth).all()), (got, truth)
    forms = tv_bound_forms(pt, c)["min"]
    assert bool((got <= forms).all()), (got, forms)  # many tokens, even spread: the box form is the tighter one


def test_fast_box_bad_input():
    p = torch.full((1, 1, 4), 0.25)
    for bad in (torch.tensor([[[0.1, -0.1, 0.0, 0.0]]]), torch.tensor([[[0.1, float("nan"), 0.0, 0.0]]]), torch.zeros(1, 1, 3)):
        try:
            box_tv_bound(p, bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted c = {bad}")


READ = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "Hkv": st.integers(1, 2), "G": st.integers(1, 2),
    "N": st.integers(1, 10), "D": st.sampled_from([32, 64]), "NB": st.sampled_from([1, 4, 8]),
    "layout": st.sampled_from(["rotate_half", "interleaved"]), "cache": st.sampled_from(["float", "int8", "int4", "fp8_e4m3"]),
    "witness": st.sampled_from(["stored", "packed", "derived"]), "mag": st.sampled_from(["tiny", "ordinary", "huge"]),
    "dtype": st.sampled_from(["fp32", "fp16", "bf16"]), "padding": st.booleans(), "exact": st.booleans(),
    "group": st.sampled_from(["16", "D"])})


@workdps(DPS)
def check_read_box(case):
    """decode_attention(box_form=True) bounds TV(softmax x, softmax x^) (x^ the fp32 logits, within e of
    x~ = s q.k~). So with p~ = softmax(x~) (reference, 60 digits) and tanh(e/2) >= TV(softmax x^, p~) (T1c):
    the box worst case at (p~, c) (N <= 10, enumeration) and the true TV(softmax x, p~) from the exact
    keys are both <= box + tanh(e/2); and min = min(forms, box)."""
    q, k, v, kc, vc, rho, bands, valid, exact = build_read(case)
    s = 1 / math.sqrt(case["D"])
    _, plain = fast.decode_attention(q, kc, vc, rho, s, bands=bands, valid=valid, exact=exact, backend="torch")
    _, cert = fast.decode_attention(q, kc, vc, rho, s, bands=bands, valid=valid, exact=exact, backend="torch", box_form=True)
    expect(bool((cert["min"] == torch.minimum(plain["min"], cert["box"])).all()), check_read_box, case, "min != min(forms, box)")
    if rho is None:
        rho = fast.witness_from_step(kc.step(), bands)
    elif rho.dtype == torch.uint8:
        rho = fast.unpack_witness(rho)
    kd = dense(kc)
    e_all = logit_rounding(q, max_abs(kc if isinstance(kc, fast.QTensor) else kd), s)
    for b in range(case["B"]):
        for h in range(q.shape[1]):
            kv = h // case["G"]
            toks = [j for j in range(case["N"]) if valid is None or bool(valid[b, j])]
            qh = [mpf(float(x)) for x in q[b, h].double()]
            served = sm.softmax([s * fsum(a * mpf(float(x)) for a, x in zip(qh, kd[b, kv, j].double())) for j in toks])
            truth = sm.tv(sm.softmax([s * fsum(a * mpf(float(x)) for a, x in zip(qh, k[b, kv, j].double())) for j in toks]), served)
            c = ref_band.logit_error_bound([float(x) for x in q[b, h].double()],
                                           [[float(x) for x in rho[b, kv, j].double()] for j in toks], bands.tolist(), s)
            if exact is not None:
                c = [mpf(0) if bool(exact[b, kv, j]) else cj for cj, j in zip(c, toks)]
            oracle = ref.box_oracle(served, [-x for x in c], c)
            f = mpf(float(cert["box"][b, h]))
            slack = tanh(mpf(float(e_all[b, h])) / 2)
            msg = f"row ({b},{h}): box {f}, box worst case {oracle}, true TV {truth}, tanh(e/2) {slack}"
            expect(le(oracle, f + slack), check_read_box, case, "box below the box worst case " + msg)
            if exact is None:
                expect(le(truth, f + slack), check_read_box, case, "box below the true TV " + msg)


@settings(max_examples=40, deadline=None)
@replay("test_fast_read_box")
@given(case=READ)
def test_fast_read_box(case):
    check_read_box(case)


def test_box_form_is_opt_in():
    """The default certificate has no box form (the forms alone); box_form=True adds "box" and never raises min."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 32, generator=g)
    k = torch.randn(1, 1, 20, 32, generator=g)
    kc = fast.quantize(k, "int4", group_size=16)
    rho = fast.witness(k, fast.dequantize(kc), fast.rope_bands(32, 4))
    bands = fast.rope_bands(32, 4)
    _, plain = fast.decode_attention(q, kc, kc, rho, 32 ** -0.5, bands=bands, backend="torch")
    _, boxed = fast.decode_attention(q, kc, kc, rho, 32 ** -0.5, bands=bands, backend="torch", box_form=True)
    assert "box" not in plain and "box" in boxed
    assert bool((boxed["min"] <= plain["min"]).all())
    try:
        fast.decode_attention(q, kc, kc, rho, 32 ** -0.5, bands=bands, backend="triton", box_form=True)
    except ValueError as err:
        assert "torch backend only" in str(err)
    else:
        raise AssertionError("box_form on the triton backend accepted")
