"""The box form over the fused read's histogram of c (fast.core.box.hist_box, csrc hist_chunk; spec T9c).

Property: every token's witness bound (fast.core.witness.logit_error_bound64, fp64, from the stored witness) fits
under the interval of a bin of its row (the bins' largest c^ cover the tokens' c sorted from the top, with their
counts: a matching exists), and the same check with each bin's value 1e-4 lower fails (the check can fail).
Soundness vs truth: the box >= the TV between softmax over the exact keys and over the stored ones (fp64), keys
the library did not touch. Differential: within a few % of the twin's box over the tokens (Box.v's box at
each token's own c: a bin's tokens take its largest c). Bad input: one ValueError each.
"""

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import fast
from fast.core import box, cpu_fused
from fast.core.attention import attention_rows
from fast.core.certify import U32
from conformance.test_fast_hist_box import CASE, build as _read
from fast.core.witness import _log_table, logit_error_bound64

LONG = ({"seed": 5, "B": 2, "Hkv": 2, "G": 3, "N": 1100, "D": 64, "codec": "int8", "mag": 1.0, "padding": True, "exact": True},
        {"seed": 6, "B": 1, "Hkv": 1, "G": 2, "N": 700, "D": 96, "codec": "int4", "mag": 0.3, "padding": False, "exact": False})


def cases(test):
    """Hypothesis over CASE, with two long reads (several chunks) always among them."""
    for case in LONG:
        test = example(case=case)(test)
    return settings(max_examples=25, deadline=None)(given(case=CASE)(test))


def _token_c(q, rho, valid, exact, D, G):
    """[B, H, N] fp64: each token's witness bound (0 where the row does not read it or the token is exact)."""
    B, _, H, _ = q.shape
    c = logit_error_bound64(q[:, 0], rho, fast.rope_bands(D, 8), D ** -0.5)
    for m in (valid, None if exact is None else 1 - exact):
        if m is not None:
            c = c * m.repeat_interleave(G, 1).double()
    return c


def _matched(c, counts, values):
    """Whether the tokens' c (sorted from the top) fit under the bins' values expanded by their counts."""
    vals = torch.repeat_interleave(values, counts.long()).sort(descending=True).values
    return len(vals) == len(c) and bool((c.sort(descending=True).values <= vals).all())


def test_hist_k_is_the_kernels():
    assert cpu_fused._lib().kvcert_hist_k() == box.HIST_K
    g = box.hist_grid()
    assert g[0] == 2.0 ** -14 and g[-2] == 2.0 ** 8 and math.isinf(g[-1]) and len(g) == box.HIST_K
    m, e = torch.frexp(g[:-1])  # each value (1 + i/16) 2^e
    assert bool(((2 * m - 1) * 16 == torch.round((2 * m - 1) * 16)).all()) and bool((g[1:] > g[:-1]).all())


@cases
def test_every_token_fits_under_a_bin_of_its_row(case):
    q, k, kq, rho, valid, exact, stats, hist, _ = _read(case, box.HIST_K)
    D, G, N = case["D"], case["G"], case["N"]
    c = _token_c(q, rho, valid, exact, D, G)
    K = box.HIST_K
    cb, W, n = hist[:, 0, :, :K], hist[:, 0, :, K:2 * K], hist[:, 0, :, 2 * K:]
    f = (1 + 2 * 8 * U32) * (1 + 2.0 ** -40)  # the epilogue's margin from c^ to the exact witness bound (hist_box)
    grid = box.hist_grid()
    B, H = W.shape[:2]
    for b in range(B):
        for h in range(H):
            m = int((n[b, h] > 0).sum())  # the occupied bins first, in increasing order, then zeros
            assert m >= 1 and bool((n[b, h, :m] > 0).all()) and not bool(cb[b, h, m:].any() or W[b, h, m:].any())
            read = torch.ones(N, dtype=torch.bool) if valid is None else valid[b, h // G].bool()  # the tokens the row reads
            assert n[b, h].sum() == int(read.sum()) and bool((n[b, h] == n[b, h].round()).all()) and bool((W[b, h] >= 0).all())
            assert math.isclose(float(W[b, h].sum()), float(stats[b, 0, h, 0]), rel_tol=1e-12)
            top = cb[b, h, :m]
            # one bin per grid value: the bins' largest c^ round up to distinct, increasing grid values; +inf only
            # for the overflow bin (c^ > 2^8), the last
            fin = top[:-1] if math.isinf(top[-1]) else top
            assert bool(torch.isfinite(fin).all()) and (len(fin) == m or float(c[b, h].max()) > 2.0 ** 8 * 0.99)
            k = torch.searchsorted(grid[:-1], fin)
            assert bool((k[1:] > k[:-1]).all()) and bool((fin <= grid[k]).all()), f"bins out of order: {case}"
            assert _matched(c[b, h, read], n[b, h, :m], top * f * (1 + 1e-9)), f"a token above its bin: {case}"
            if len(fin) == m and float(top[-1]) > 0:  # the largest bin's value is its largest token's c^: any lower, it is out
                assert not _matched(c[b, h, read], n[b, h, :m], top * f * (1 - 1e-4)), f"the mutant passed: {case}"


def _true_tv(q, k, kq, valid, G):
    """TV [B, H] between softmax over the exact keys and over the stored ones, fp64, the rows' readable tokens."""
    D = q.shape[-1]
    kd = fast.dequantize(kq)

    def probs(keys):
        x = torch.einsum("bhd,bhnd->bhn", q[:, 0].double(), keys.double().repeat_interleave(G, 1)) * D ** -0.5
        if valid is not None:
            x = x.masked_fill(valid.repeat_interleave(G, 1) == 0, -math.inf)
        return torch.softmax(x, -1)

    return 0.5 * (probs(k) - probs(kd)).abs().sum(-1)


@cases
def test_hist_box_bounds_the_true_tv_and_is_near_the_token_box(case):
    q, k, kq, rho, valid, exact, stats, hist, bands = _read(case, box.HIST_K)  # every bin kept: the binning's looseness
    D, N = case["D"], case["N"]
    if exact is not None:  # a token flagged exact holds its exact key (c = 0 there): the truth is what is stored
        k = torch.where(exact.bool()[..., None], fast.dequantize(kq), k)
    cert = cpu_fused._certificate(stats, 8, N, D)
    assume(cert is not None)  # a witness too large for the fp32 epilogue: the twin certifies that read
    closed = cert["min"].clone()
    cert = box.hist_box(cert, hist, stats, 8, N, D)
    tv = _true_tv(q, k, kq, None if valid is None else valid.bool(), case["G"])
    got = cert["box"][:, 0].double()
    assert bool((got >= tv).all()), f"unsound: box {got.tolist()} < TV {tv.tolist()}; {case}"
    assert torch.equal(cert["min"], torch.minimum(closed, cert["box"]))
    # the twin's box over each token's own c (attention_rows(box_form=True), the torch read)
    vm = None if valid is None else valid[:, 0].bool()
    _, ct = attention_rows(q, kq, kq, rho, D ** -0.5, bands=bands, q_pos=torch.full((case["B"], 1), N - 1), valid=vm,
                           exact=None if exact is None else exact.bool(), backend="torch", box_form=True)
    tw = ct["box"][:, 0].double()
    live = tw < 0.5  # away from saturation
    assert bool((got[live] >= 0.98 * tw[live] - 1e-6).all()), (got[live], tw[live], case)
    assert bool((got[live] <= 1.04 * tw[live] + 1e-5).all()), (got[live], tw[live], case)


def _bits(t):
    return t.contiguous().view(torch.int64)  # the sign of a zero counts


@cases
def test_hist_bins_cpp_is_the_torch_code_bit_for_bit(case):
    """csrc kvcert_hist_bins (what hist_box runs) against box.hist_bins' torch code: the same fp64 operations in the
    same order, so the same bits (zeros' signs included), on the kernel's histogram kept whole and merged to
    HIST_M and to 3 slots; plus an overflow bin (+inf), a bin whose weights all underflowed (W = 0) and an empty row."""
    for M in (box.HIST_K, box.HIST_M, 3):
        _, _, _, _, _, _, stats, hist, _ = _read(case, M)
        R = stats.shape[0] * stats.shape[1] * stats.shape[2]
        h, st = hist.reshape(R, 3 * M).clone(), stats.reshape(R, 5)
        h[0, :3 * M:M] = torch.tensor([math.inf, 0.0, 2.0], dtype=torch.float64)  # slot 0 of row 0: c^ inf, W 0, n 2
        if R > 1:
            h[1] = 0.0  # no occupied slot
        got = box.hist_bins(h, st, 8, case["N"], case["D"], backend="cpp")
        want = box.hist_bins(h, st, 8, case["N"], case["D"], backend="torch")
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)), f"M {M}, {case}"
    with pytest.raises(ValueError, match="backend"):
        box.hist_bins(h, st, 8, case["N"], case["D"], backend="numpy")


def test_above_skips_the_rows_already_below_it():
    case = {"seed": 3, "B": 2, "Hkv": 2, "G": 2, "N": 300, "D": 64, "codec": "int4", "mag": 0.3, "padding": False,
            "exact": False}
    *_, stats, hist, _ = _read(case)
    cert = cpu_fused._certificate(stats, 8, 300, 64)
    closed = cert["min"].clone()
    t = float(closed.median())
    some = box.hist_box({k: v.clone() for k, v in cert.items()}, hist, stats, 8, 300, 64, above=t)
    every = box.hist_box({k: v.clone() for k, v in cert.items()}, hist, stats, 8, 300, 64)
    over = closed > t
    assert bool(over.any()) and bool((~over).any())
    assert bool((some["box"][~over] == 1).all()) and torch.equal(some["min"][~over], closed[~over])
    assert torch.equal(some["box"][over], every["box"][over])
    assert bool((every["box"] < closed).all())  # int4 with c over several octaves: the box is tighter on every row


def _merged(h, M):
    """A full histogram row [3 HIST_K] with neighbours merged until M bins are left, as csrc hist_emit does (the pair
    whose merge widens least, W_i (c_i+1 - c_i), the lowest on a tie, NaN as +inf), as [3 M]."""
    K = h.shape[0] // 3
    m = int((h[2 * K:] > 0).sum())
    c, w, n = (h[i * K:i * K + m].tolist() for i in range(3))
    while len(c) > M:
        best, least = 0, math.inf
        for i in range(len(c) - 1):
            cost = w[i] * (c[i + 1] - c[i])
            if cost < least:  # NaN and +inf never win
                best, least = i, cost
        w[best + 1] += w[best]
        n[best + 1] += n[best]
        del c[best], w[best], n[best]
    out = torch.zeros(3, M, dtype=torch.float64)
    out[:, :len(c)] = torch.tensor([c, w, n], dtype=torch.float64)
    return out.flatten()


@pytest.mark.parametrize("M", [1, 3, 8])
def test_few_bins_merge_neighbours_and_stay_sound(M):
    """A histogram of M bins (fewer than a row's occupied ones) is the full one with its neighbours merged (same bits),
    and its box still bounds the true TV."""
    case = LONG[0]
    q, k, kq, rho, valid, exact, stats, full, _ = _read(case, box.HIST_K)
    *_, stats_m, few, _ = _read(case, M)
    assert torch.equal(stats, stats_m)
    B, H = full.shape[0], full.shape[2]
    rows_full, rows_few = full.reshape(B * H, -1), few.reshape(B * H, -1)
    assert bool(((rows_full[:, 2 * box.HIST_K:] > 0).sum(-1) > M).all())  # every row merges
    for r in range(B * H):
        assert torch.equal(rows_few[r], _merged(rows_full[r], M)), f"row {r} is not the full histogram, merged"
    k = torch.where(exact.bool()[..., None], fast.dequantize(kq), k)
    cert = cpu_fused._certificate(stats, 8, case["N"], case["D"])
    got = box.hist_box(cert, few, stats, 8, case["N"], case["D"])["box"][:, 0].double()
    tv = _true_tv(q, k, kq, valid.bool(), case["G"])
    assert bool((got >= tv).all()), f"unsound with {M} bins: box {got.tolist()} < TV {tv.tolist()}"


def test_long_prefill_read_in_blocks_has_the_bits_of_one_call(monkeypatch):
    """cpu_fused.hist_run (what vLLM's prefill reads with the box call) splits a read's positions so that the kernel's
    histogram scratch stays under HIST_SCRATCH; each block's rows get the bits of the read in one call (out, stats,
    histogram), here with the scratch cut so that 45 positions over 1,100 keys take 7 calls."""
    g = torch.Generator().manual_seed(7)
    Hkv, G, N, T, D = 2, 3, 1100, 45, 64
    k, v = torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g)
    kq, vq = fast.quantize(k, "int8", group_size=D), fast.quantize(v, "int8", group_size=D)
    rho = fast.pack_witness(fast.witness(k, fast.dequantize(kq), fast.rope_bands(D, 8)), fine=True).contiguous()
    s0 = cpu_fused.seg(Hkv, N, k=kq.codes.contiguous(), v=vq.codes.contiguous(), k_scales=kq.scales.contiguous().view(torch.int16),
                       v_scales=vq.scales.contiguous().view(torch.int16), rho=rho)
    q = torch.randn(1, T, Hkv * G, D, generator=g)
    qpos = torch.arange(N - T, N, dtype=torch.int32)[None].contiguous()
    args = (q, qpos, [s0, cpu_fused.seg(Hkv, 0)], D ** -0.5, fast.rope_bands(D, 8).to(torch.int64).contiguous(), 1, 1)
    lut = _log_table("cpu", True).to(torch.float32).contiguous()
    hist1 = torch.empty(1, T, Hkv * G, 3 * box.HIST_M, dtype=torch.float64)
    out1, st1 = cpu_fused._run(*args, True, lut, hist=hist1)
    assert cpu_fused.hist_rows(N, Hkv, G) >= T  # the default scratch: one call
    per = cpu_fused.HIST_SCRATCH // cpu_fused.hist_rows(N, Hkv, G)
    monkeypatch.setattr(cpu_fused, "HIST_SCRATCH", 7 * per)
    assert cpu_fused.hist_rows(N, Hkv, G) == 7
    hist2 = torch.empty_like(hist1)
    out2, st2 = cpu_fused.hist_run(*args, lut=lut, hist=hist2)
    assert torch.equal(out1, out2) and torch.equal(st1, st2) and torch.equal(hist1, hist2)


@pytest.mark.parametrize("what", ["shape", "too many bins", "dtype", "uncertified"])
def test_bad_hist_one_value_error(what):
    g = torch.Generator().manual_seed(0)
    kq = fast.quantize(torch.randn(1, 1, 20, 64, generator=g), "int8", group_size=64)
    rho = fast.pack_witness(fast.witness(torch.randn(1, 1, 20, 64, generator=g), fast.dequantize(kq), fast.rope_bands(64, 8)),
                            fine=True).contiguous()
    s0 = cpu_fused.seg(1, 20, k=kq.codes.contiguous(), v=kq.codes.contiguous(), k_scales=kq.scales.contiguous().view(torch.int16),
                       v_scales=kq.scales.contiguous().view(torch.int16), rho=rho)
    shape, dtype, certify = (1, 1, 1, 3 * box.HIST_K), torch.float64, True
    if what == "shape":
        shape = (1, 1, 1, 100)  # not 3 M
    elif what == "too many bins":
        shape = (1, 1, 1, 3 * box.HIST_K + 3)
    elif what == "dtype":
        dtype = torch.float32
    else:
        certify = False
    lut = _log_table("cpu", True).to(torch.float32).contiguous()
    with pytest.raises(ValueError, match="hist"):
        cpu_fused._run(torch.randn(1, 1, 1, 64), torch.full((1, 1), 19, dtype=torch.int32), [s0, cpu_fused.seg(1, 0)], 0.125,
                       fast.rope_bands(64, 8).to(torch.int64).contiguous(), 1, 1, certify, lut,
                       hist=torch.zeros(shape, dtype=dtype))
