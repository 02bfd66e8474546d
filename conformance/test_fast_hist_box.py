"""Differential: fast.core.box.hist_box (the box over the fused read's histogram of c, spec T9c) against reference.box.

Headline property: on a kernel read's histogram (cpu_fused._run(hist=...)), the fast box over the bins (hist_bins,
box_bound_enclosed) >= the reference's exact value (60 digits) of Box.v's bound on the same bins, grid and
multipliers, and not uselessly loose (<= reference (1 + 1e-6) + 1e-12); hist_box reports that bound + r_w.
A row with a bin past the grid (c^ above 2^8, or an infinite witness: int4 keys of large scale) has an unbounded
interval, which the reference refuses: there the fast box must be 1.
"""

import json

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import mpf, workdps

import fast
from conformance._check import DPS, expect, le, replay
from fast.core import box, cpu_fused
from fast.core.certify import weight_rounding, up32, up64
from fast.core.witness import _log_table
from reference import box as ref

CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "B": st.integers(1, 2), "Hkv": st.integers(1, 2), "G": st.integers(1, 3),
    "N": st.integers(1, 1100), "D": st.sampled_from([64, 96]), "codec": st.sampled_from(["int8", "int4"]),
    "mag": st.sampled_from([0.3, 1.0, 3.0]), "padding": st.booleans(), "exact": st.booleans()})


def build(case, M=box.HIST_M):
    """One certified decode read (T = 1) through the kernel with its histogram of M bins a row (more occupied: neighbours
    merged): (q, k, kq, rho, valid, exact, stats, hist, bands)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, G, N, D = case["B"], case["Hkv"], case["G"], case["N"], case["D"]
    H = Hkv * G
    bands = fast.rope_bands(D, 8)
    # keys whose scale varies by token: the witness bounds c spread over several octaves
    k = torch.randn(B, Hkv, N, D, generator=g) * torch.exp(torch.randn(B, Hkv, N, 1, generator=g))
    v = torch.randn(B, Hkv, N, D, generator=g)
    kq, vq = fast.quantize(k, case["codec"], group_size=D), fast.quantize(v, case["codec"], group_size=D)
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), bands), fine=True).contiguous()
    valid = exact = None
    if case["padding"] and N > 1:
        valid = torch.ones(B, Hkv, N, dtype=torch.uint8)
        valid[..., torch.randperm(N, generator=g)[: N // 3]] = 0
        valid[..., -1] = 1
    if case["exact"]:
        exact = (torch.rand(B, Hkv, N, generator=g) < 0.2).to(torch.uint8)
    s0 = cpu_fused.seg(Hkv, N, k=kq.codes.contiguous(), v=vq.codes.contiguous(), k_scales=kq.scales.contiguous().view(torch.int16),
                       v_scales=vq.scales.contiguous().view(torch.int16), rho=rho, valid=valid, exact=exact)
    q = (torch.randn(B, 1, H, D, generator=g) * case["mag"]).contiguous()
    qpos = torch.full((B, 1), N - 1, dtype=torch.int32)
    lut = _log_table("cpu", True).to(torch.float32).contiguous()
    hist = torch.empty(B, 1, H, 3 * M, dtype=torch.float64)
    _, stats = cpu_fused._run(q, qpos, [s0, cpu_fused.seg(Hkv, 0)], D ** -0.5, bands.to(torch.int64).contiguous(), 1, 1, True,
                              lut, hist=hist)
    return q, k, kq, fast.unpack_witness(rho, fine=True), valid, exact, stats, hist, bands



@workdps(DPS)
def check_hist_box_ge_reference(case):
    q, k, kq, rho, valid, exact, stats, hist, bands = build(case)
    N, D = case["N"], case["D"]
    R = hist.shape[0] * hist.shape[2]
    st5, h = stats.reshape(R, 5), hist.reshape(R, hist.shape[-1])
    bins = box.hist_bins(h, st5, 8, N, D)
    got, grid = box.box_bound_enclosed(*bins, grid0=box.HIST_GRID0)  # what hist_box runs
    u0, u1, l0, l1 = (t.tolist() for t in grid)
    for r in sorted({0, R - 1}):  # the first and the last row (60 digits: ~0.7 s a row)
        if not torch.isfinite(bins[3][r]).all():  # a c^ past the grid (overflow bin): the box must say 1
            expect(float(got[r]) >= 1.0, check_hist_box_ge_reference, case,
                   f"row {r} has an unbounded bin but its box is {float(got[r])}; case {json.dumps(case)}")
            continue
        fl = lambda t: [mpf(v) for v in t[r].tolist()]  # fp64 -> mpf exactly
        want = ref.box_grid_bound(*(fl(t) for t in bins), u0[r], u1[r], [[a, b] for a, b in zip(l0[r], l1[r])])
        f = mpf(float(got[r]))
        msg = f"fast {f} vs reference {want}; case {json.dumps(case)}"
        expect(le(want, f), check_hist_box_ge_reference, case, "fast below reference (unsound) " + msg)
        expect(f <= min(want, 1) * (1 + mpf("1e-6")) + mpf("1e-12"), check_hist_box_ge_reference, case, "fast uselessly loose " + msg)
    cert = cpu_fused._certificate(stats, 8, N, D)
    if cert is not None:  # hist_box reports that bound + r_w on every row (above = 0)
        want = up32(up64(got + torch.from_numpy(weight_rounding(st5[:, 4].numpy(), N, D))).clamp(max=1.0))
        expect(torch.equal(box.hist_box(cert, hist, stats, 8, N, D)["box"].reshape(R), want), check_hist_box_ge_reference,
               case, f"hist_box is not the bound over hist_bins + r_w; case {json.dumps(case)}")


@settings(max_examples=10, deadline=None)
@given(case=CASE)
@example(case={"seed": 5, "B": 1, "Hkv": 2, "G": 2, "N": 900, "D": 64, "codec": "int8", "mag": 1.0, "padding": True,
               "exact": True})
@replay("test_hist_box_ge_reference")
def test_hist_box_ge_reference(case):
    check_hist_box_ge_reference(case)
