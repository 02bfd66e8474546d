"""The C++ twin of the box certificate (csrc/cpu_fused.cpp kvcert_box_bound, served by
fast.core.box.box_bound_enclosed on CPU): the torch path's bound to 1e-9 (the grid search may differ in the
last bits: its sums run in another order), never below the 60-digit value of the bound on the grid it
returns (reference.box.box_grid_bound), never below the same terms evaluated without the outward margins,
bad inputs refused, and many times faster than the torch path."""

import statistics
import time

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mpmath import mpf, workdps

from fast.core import box, native
from fast.core.certify import EXP_EPS, SATURATE_C, gamma
from reference import box as ref

LOGIT = {"flat": 1e-3, "ordinary": 2.0, "peaked": 8.0}
CMAG = {"tiny": 1e-6, "ordinary": 0.2, "large": 3.0, "huge": 60.0, "edge": 599.0, "over": 650.0}


def build(case):
    """q_lo, q_hi, lo, hi [R, n] fp64 of a case: an enclosure of a softmax (relative width `qw`), some tokens with
    q = 0 (`zeros`), a row all zero (`zero_row`), asymmetric intervals [-c1 + shift, c2 + shift] (`asym`); symmetric
    intervals [-c, c] with c nondecreasing along the row (`sorted`: a histogram's bins, the C++ one-pass threshold
    box_lambda_vee) and `pad` empty tokens after (q = 0, interval [0, 0]: hist_bins' padding, trimmed in C++)."""
    g = torch.Generator().manual_seed(case["seed"])
    R, n = case["rows"], case["n"]
    q = torch.softmax(torch.randn(R, n, generator=g, dtype=torch.float64) * LOGIT[case["logit"]], -1)
    if case["zeros"]:
        q = torch.where(torch.rand(R, n, generator=g, dtype=torch.float64) < 0.3, torch.zeros_like(q), q)
    if case["zero_row"]:
        q[0] = 0
    w = case["qw"]
    q_lo, q_hi = q * (1 - w), q * (1 + w)
    m = CMAG[case["c"]]
    c1 = torch.rand(R, n, generator=g, dtype=torch.float64) * m
    c2 = c1 if not case["asym"] else torch.rand(R, n, generator=g, dtype=torch.float64) * m
    shift = (torch.rand(R, 1, generator=g, dtype=torch.float64) - 0.5) * m if case["asym"] else 0.0
    if case.get("sorted") and not case["asym"]:
        c1 = c2 = c1.sort(-1).values
    lo, hi = -c1 + shift, c2 + shift
    pad = torch.zeros(R, case.get("pad", 0), dtype=torch.float64)
    return tuple(torch.cat([t, pad], 1).contiguous() for t in (q_lo, q_hi, lo, hi))


CASE = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 3), "n": st.integers(1, 40),
    "logit": st.sampled_from(sorted(LOGIT)), "c": st.sampled_from(sorted(CMAG)), "qw": st.sampled_from([0.0, 1e-9, 1e-3, 0.3]),
    "zeros": st.booleans(), "zero_row": st.booleans(), "asym": st.booleans(), "sorted": st.booleans(), "pad": st.integers(0, 4)})


def _chains(grid):
    u0, u1, _, _ = grid
    return bool((u0[:, 0] == 0).all() and (u1[:, -1] == 1).all() and (u1[:, :-1] == u0[:, 1:]).all() and (u0 <= u1).all())


@settings(max_examples=150, deadline=None)
@example(case={"seed": 0, "rows": 2, "n": 1, "logit": "ordinary", "c": "ordinary", "qw": 0.0, "zeros": False, "zero_row": False, "asym": False})
@example(case={"seed": 1, "rows": 3, "n": 40, "logit": "peaked", "c": "edge", "qw": 1e-3, "zeros": True, "zero_row": True, "asym": True})
@example(case={"seed": 2, "rows": 3, "n": 30, "logit": "ordinary", "c": "large", "qw": 1e-3, "zeros": True, "zero_row": False,
               "asym": False, "sorted": True, "pad": 4})
@given(case=CASE)
def test_cpp_is_the_torch_bound(case):
    q_lo, q_hi, lo, hi = build(case)
    bc, gc = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="cpp")
    bt, gt = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="torch")
    assert bc.dtype == torch.float64 and bc.shape == bt.shape and all(a.shape == b.shape for a, b in zip(gc, gt))
    assert _chains(gc)
    assert bool(((bc >= 0) & (bc <= 1) & (bt >= 0) & (bt <= 1)).all()), (bc, bt)
    assert bool(((bc - bt).abs() <= 1e-9 * bt.abs() + 1e-12).all()), (bc, bt, case)


def test_saturated_empty_and_infinite_rows_report_one():
    """max hi > SATURATE_C, min lo < -SATURATE_C (infinities included) and a row with q = 0 everywhere: bound 1,
    a grid that chains; a row at the edge (|lo|, |hi| <= SATURATE_C) is computed."""
    d = lambda *rows: torch.tensor(rows, dtype=torch.float64)
    q = d([0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.0, 0.0], [0.5, 0.5])
    lo = d([-1.0, 0.0], [-float("inf"), 0.0], [-1.0, 0.0], [-1.0, 0.0], [-SATURATE_C, -SATURATE_C])
    hi = d([SATURATE_C + 1, 0.0], [0.0, 0.0], [float("inf"), float("inf")], [1.0, 1.0], [SATURATE_C, SATURATE_C])
    b, grid = box.box_bound_enclosed(q, q, lo, hi, backend="cpp")
    assert b[:4].tolist() == [1.0] * 4 and _chains(grid)
    bt, _ = box.box_bound_enclosed(q, q, lo, hi, backend="torch")
    assert bt[:4].tolist() == [1.0] * 4 and abs(float(b[4] - bt[4])) <= 1e-12 and float(b[4]) <= 1


def test_overflowing_multiplier_is_not_nan():
    """A threshold ratio of e^-600 (lambda = e^600) against a token with q = 0 and hi = 600: g_j overflows and
    0 * inf = NaN in the sum; that lambda is skipped (as +inf), both paths, so the bound is a number (was NaN)."""
    d = lambda *v: torch.tensor([v], dtype=torch.float64)
    q, lo, hi = d(1.0, 0.0), d(-600.0, 600.0), d(-600.0, 600.0)
    for backend in ("cpp", "torch"):
        b, _ = box.box_bound_enclosed(q, q, lo, hi, backend=backend)
        assert 0 <= float(b[0]) <= 1, (backend, b)


SMALL = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "rows": st.integers(1, 2), "n": st.integers(1, 12),
    "logit": st.sampled_from(sorted(LOGIT)), "c": st.sampled_from(["tiny", "ordinary", "large", "huge"]),
    "qw": st.sampled_from([0.0, 1e-9, 1e-3]), "zeros": st.booleans(), "zero_row": st.just(False), "asym": st.booleans(),
    "sorted": st.booleans(), "pad": st.integers(0, 3)})


@workdps(60)
def _reference(q_lo, q_hi, lo, hi, grid, r):
    fl = lambda t: [mpf(v) for v in t[r].tolist()]  # fp64 -> mpf exactly
    u0, u1, l0, l1 = (t[r].tolist() for t in grid)
    return ref.box_grid_bound(fl(q_lo), fl(q_hi), fl(lo), fl(hi), u0, u1, [[a, b] for a, b in zip(l0, l1)])


@settings(max_examples=25, deadline=None)
@example(case={"seed": 3, "rows": 2, "n": 12, "logit": "peaked", "c": "large", "qw": 1e-9, "zeros": True, "zero_row": False, "asym": True})
@given(case=SMALL)
def test_cpp_bound_is_above_the_exact_bound_on_its_grid(case):
    """Soundness of the certified evaluation: the C++ bound >= box_grid_bound at 60 digits on the grid and
    multipliers the C++ code returned (proofs/Box.v tv_le_box_grid), and not uselessly above it."""
    q_lo, q_hi, lo, hi = build(case)
    b, grid = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="cpp")
    for r in range(case["rows"]):
        want = _reference(q_lo, q_hi, lo, hi, grid, r)
        got = mpf(float(b[r]))
        assert want <= got, f"C++ {got} below the exact bound {want} on its grid; case {case}"
        assert got <= min(want, 1) * (1 + mpf("1e-9")) + mpf("1e-12"), f"C++ {got} vs exact {want}; case {case}"


def _unrounded(q_lo, q_hi, lo, hi, grid):
    """box_grid_bound in plain fp64 (no margins, no ulp moves) on a grid: what the certificate would be with its
    outward rounding removed."""
    u0, u1, l0, l1 = grid
    El, Eh = torch.exp(lo), torch.exp(hi)
    S2 = (q_lo * El).sum(-1)[:, None]

    def e(u, lam):
        g = lam[..., None] * ((1 - u)[..., None] * Eh[:, None, :] + u[..., None] * El[:, None, :])
        return u - lam * u * S2 + (q_hi[:, None, :] * (g - 1).clamp(min=0)).sum(-1)

    best = u1.clone()
    for lam in (l0, l1):
        best = torch.fmin(best, torch.maximum(e(u0, lam), e(u1, lam)))
    return best.amax(-1).clamp(max=1.0)


def _raw(q_lo, q_hi, lo, hi, rho_fac, t1_fac, s2_fac):
    """kvcert_box_bound called directly with the given margin factors (the checked inputs of box.py)."""
    R, n = q_lo.shape
    M = (box.GRID0 - 1) + box.ROUNDS * (box.SPLIT - 1)
    levels = torch.linspace(0, 1, box.GRID0, dtype=torch.float64)
    bound = torch.empty(R, dtype=torch.float64)
    grid = [torch.empty(R, M, dtype=torch.float64) for _ in range(4)]
    bad = native._lib().kvcert_box_bound(q_lo.data_ptr(), q_hi.data_ptr(), lo.data_ptr(), hi.data_ptr(), R, n, levels.data_ptr(),
                                         box.GRID0, box.ROUNDS, box.SPLIT, SATURATE_C, rho_fac, t1_fac, s2_fac, 1,
                                         bound.data_ptr(), *(t.data_ptr() for t in grid))
    assert bad == 0
    return bound, grid


@settings(max_examples=60, deadline=None)
@given(case=CASE.filter(lambda c: c["c"] not in ("edge", "over")))
def test_outward_rounding_only_moves_the_bound_up(case):
    """Mutation check: the certified bound >= the same terms in plain fp64 on the same grid (rounding moves up,
    never down), within 1e-9 of them; and kvcert_box_bound with its margin factors set to 1 is never above it."""
    q_lo, q_hi, lo, hi = build(case)
    b, grid = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="cpp")
    plain = _unrounded(q_lo, q_hi, lo, hi, grid)
    assert bool((b >= plain).all()), (b, plain, case)
    assert bool((b <= plain * (1 + 1e-9) + 1e-12).all()), (b, plain, case)
    n = q_lo.shape[1]
    full, g_full = _raw(q_lo, q_hi, lo, hi, 1 + 8 * box.RHO, 1 + 2 * gamma(n + 2), 1 - 2 * (EXP_EPS + gamma(n + 1)))
    bare, g_bare = _raw(q_lo, q_hi, lo, hi, 1.0, 1.0, 1.0)
    assert torch.equal(full, b) and all(torch.equal(x, y) for x, y in zip(g_full, g_bare))
    assert bool((bare <= full).all()), (bare, full, case)


def test_margins_are_applied():
    """The margins are not a no-op: on ordinary rows the certified bound is strictly above the plain fp64 value."""
    q_lo, q_hi, lo, hi = build({"seed": 5, "rows": 3, "n": 50, "logit": "ordinary", "c": "ordinary", "qw": 1e-6,
                                "zeros": False, "zero_row": False, "asym": True})
    b, grid = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="cpp")
    assert bool((b > _unrounded(q_lo, q_hi, lo, hi, grid)).all())
    bare, _ = _raw(q_lo, q_hi, lo, hi, 1.0, 1.0, 1.0)
    assert bool((bare < b).all())


def test_auto_serves_cpp_on_cpu_and_refuses_what_cpp_refuses():
    q_lo, q_hi, lo, hi = build({"seed": 9, "rows": 2, "n": 30, "logit": "ordinary", "c": "ordinary", "qw": 1e-6,
                                "zeros": True, "zero_row": False, "asym": False})
    b, grid = box.box_bound_enclosed(q_lo, q_hi, lo, hi)
    bc, gc = box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="cpp")
    assert torch.equal(b, bc) and all(torch.equal(x, y) for x, y in zip(grid, gc))
    b2, _ = box.box_bound_enclosed(q_lo.t().contiguous().t(), q_hi, lo, hi)  # non-contiguous: auto copies it
    assert torch.equal(b2, bc)
    nan_lo = lo.clone()
    nan_lo[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):  # refused, never bounded (certify or refuse)
        box.box_bound_enclosed(q_lo, q_hi, nan_lo, hi)


def test_bad_inputs_are_refused():
    q_lo, q_hi, lo, hi = build({"seed": 2, "rows": 2, "n": 6, "logit": "ordinary", "c": "ordinary", "qw": 1e-3,
                                "zeros": False, "zero_row": False, "asym": False})

    def with_(t, i, v):
        t = t.clone()
        t.view(-1)[i] = v
        return t

    nc = torch.empty(6, 2, dtype=torch.float64).t()
    nc.copy_(q_lo)
    bad = {
        "fp32": (q_lo.float(), q_hi, lo, hi, 12),
        "1-D": (q_lo[0], q_hi[0], lo[0], hi[0], 12),
        "shape": (q_lo, q_hi[:, :5].contiguous(), lo, hi, 12),
        "non-contiguous": (nc, q_hi, lo, hi, 12),
        "no tokens": (q_lo[:, :0], q_hi[:, :0], lo[:, :0], hi[:, :0], 12),
        "rounds": (q_lo, q_hi, lo, hi, -1),
        "q not finite": (q_lo, with_(q_hi, 3, float("inf")), lo, hi, 12),
        "NaN lo": (q_lo, q_hi, with_(lo, 1, float("nan")), hi, 12),
        "q_lo < 0": (with_(q_lo, 2, -1e-300), q_hi, lo, hi, 12),
        "q_lo > q_hi": (with_(q_lo, 2, 1.0), q_hi, lo, hi, 12),
        "lo > hi": (q_lo, q_hi, with_(lo, 4, 10.0), hi, 12),
    }
    for name, (a, b_, c, d, rounds) in bad.items():
        with pytest.raises(ValueError):
            box.box_bound_enclosed(a, b_, c, d, rounds=rounds, backend="cpp")
            raise AssertionError(f"accepted: {name}")
    with pytest.raises(ValueError):
        box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend="fortran")


def test_cpp_is_faster_than_torch():
    """R = 9 rows of n = 420 tokens: the C++ twin at least 5x faster (medians of 5; the measured gap is far larger).
    tests/test_sanitize.py deselects it: timing under ASan + UBSan says nothing."""
    assert native.available()
    q_lo, q_hi, lo, hi = build({"seed": 11, "rows": 9, "n": 420, "logit": "peaked", "c": "ordinary", "qw": 1e-6,
                                "zeros": False, "zero_row": False, "asym": True})

    def med(backend):
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            box.box_bound_enclosed(q_lo, q_hi, lo, hi, backend=backend)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    med("cpp")
    t_torch, t_cpp = med("torch"), med("cpp")
    assert t_torch >= 5 * t_cpp, (t_torch, t_cpp)
