"""The worst case of TV over per-token logit-shift intervals (issue 20; proofs/Box.v).

With p ∝ p~ e^{eps}, eps_j in [lo_j, hi_j], a_j = p~_j e^{hi_j}, b_j = p~_j e^{lo_j}, B = sum b:
for S = {j : p_j > p~_j}, TV(p, p~) = p_S - p~_S <= V(S) - p~_S, V(S) = a_S / (a_S + b_{S^c})
(x / (x + y) increases in x and decreases in y). The exact worst case F* = max_S [V(S) - p~_S]
is a maximum over 2^n sets; this module bounds it from above (sound) and below (a measurement).

Upper bound. With w_j(u) = (1 - u) a_j + u b_j, every S satisfies sum_S w_j(V(S)) = V(S) B, so for
every lambda >= 0 (weak duality):
    V(S) - p~_S <= e(V(S), lambda),   e(u, lambda) = u - lambda u B + sum_j (lambda w_j(u) - p~_j)^+.
e(., lambda) is convex (w_j is affine in u), so on an interval [u0, u1] it is at most its larger end
value. Hence for every grid 0 = u_0 < ... < u_K = 1 and any lambda_k >= 0:
    TV <= max_k max(e(u_k, lambda_k), e(u_{k+1}, lambda_k))                 (proofs/Box.v)
lambda = 0 gives e(u, 0) = u: the term is never above u_{k+1}. Any grid and any lambdas are
sound; tightness: lambda_k = 1 / (the fractional-knapsack threshold ratio w_j / p~_j at an end
of the interval), tried at both ends, and the interval holding the max is cut further.
Lower estimate (not a bound): f(S) <= F* for the prefix sets of each greedy ordering.

box_bounds runs in fp64 without outward rounding: the measurement core. box_bound_enclosed (the
certificate, every rounding outward) runs on CPU in the C++ twin csrc/cpu_fused.cpp kvcert_box_bound (the
same algorithm and margins, tests/test_box_cpp.py); the torch code below is its readable twin.
"""

import math

import numpy as np
import torch

from fast.core import _checks, native
from fast.core.certify import EXP_EPS, SATURATE_C, U32, U64, down64, gamma, up32, up64
from fast.core.threads import read_threads

GRID0 = 33   # initial levels: uniform in [0, 1] (hist_box: HIST_GRID0)
ROUNDS = 12  # refinement rounds: the interval holding the max is cut into SPLIT pieces
SPLIT = 4


def _greedy(p, a, b, Btot, u, lower=True):
    """lambda [R, K] (1 / the threshold ratio of the greedy knapsack at level u) and the best
    prefix value f(S) [R, K] of that greedy ordering (a lower estimate of F*; None if not lower)."""
    w = (1 - u)[..., None] * a[:, None, :] + u[..., None] * b[:, None, :]  # [R, K, n]
    pp = p[:, None, :].expand_as(w)
    ratio = torch.where(pp > 0, w / pp.clamp(min=1e-300), torch.zeros_like(w))
    order = torch.argsort(ratio, dim=-1, descending=True)
    ws, ps, rs = (torch.gather(t, -1, order) for t in (w, pp, ratio))
    cw = ws.cumsum(-1)
    need = (u * Btot[:, None])[..., None]
    # none reaches u B (rounding, at u = 1): the last token with ratio > 0 (those with ratio 0 have w = 0), not lambda = 0
    last = ((rs > 0).sum(-1, keepdim=True) - 1).clamp(min=0)
    t = torch.minimum(torch.searchsorted(cw.contiguous(), need.contiguous()), last)
    r_t = torch.gather(rs, -1, t)[..., 0]
    lam = torch.where(r_t > 0, 1.0 / r_t.clamp(min=1e-300), torch.zeros_like(r_t))
    if not lower:
        return lam, None
    a_s = torch.gather(a[:, None, :].expand_as(w), -1, order).cumsum(-1)
    b_s = torch.gather(b[:, None, :].expand_as(w), -1, order).cumsum(-1)
    den = a_s + (Btot[:, None, None] - b_s).clamp(min=0)
    f = a_s / den.clamp(min=1e-300) - ps.cumsum(-1)
    return lam, f.amax(-1)


def _e(p, a, b, Btot, u, lam):
    """e(u, lambda) [R, K] for levels u and multipliers lam [R, K]."""
    w = (1 - u)[..., None] * a[:, None, :] + u[..., None] * b[:, None, :]
    return u - lam * u * Btot[:, None] + (lam[..., None] * w - p[:, None, :]).clamp(min=0).sum(-1)


def _terms(p, a, b, Btot, u0, u1, l0, l1):
    """Per-interval bound [R, M] for intervals [u0, u1] with the lambdas l0, l1 of their ends:
    min over lambda in {0, l0, l1} of max(e(u0, lambda), e(u1, lambda)) (lambda = 0 gives u1)."""
    best = u1.clone()
    for lk in (l0, l1):
        best = torch.minimum(best, torch.maximum(_e(p, a, b, Btot, u0, lk), _e(p, a, b, Btot, u1, lk)))
    return best


def grid_search(p, a, b, Btot, rounds=ROUNDS, lower=True, grid0=GRID0):
    """The intervals (u0, u1, l0, l1) [R, M] of the refined grid (grid0 uniform levels, then `rounds` cuts), their terms
    [R, M] and the lower estimate [R] (None with lower=False). The intervals of each row partition [0, 1] (unordered)."""
    R = p.shape[0]
    U = torch.linspace(0, 1, grid0, dtype=p.dtype, device=p.device).expand(R, -1).contiguous()
    lam, f = _greedy(p, a, b, Btot, U, lower)
    lower = f.amax(-1) if lower else None
    u0, u1, l0, l1 = U[:, :-1], U[:, 1:], lam[:, :-1], lam[:, 1:]
    T = _terms(p, a, b, Btot, u0, u1, l0, l1)
    frac = torch.arange(1, SPLIT, dtype=p.dtype, device=p.device) / SPLIT
    for _ in range(rounds):
        k = T.argmax(-1, keepdim=True)
        a0, a1, m0, m1 = (t.gather(1, k) for t in (u0, u1, l0, l1))
        new = torch.minimum(torch.maximum(a0 + (a1 - a0) * frac, a0), a1).cummax(-1).values  # [R, SPLIT - 1], in order
        ln, fn = _greedy(p, a, b, Btot, new, lower is not None)
        if lower is not None:
            lower = torch.maximum(lower, fn.amax(-1))
        su = torch.cat([a0, new, a1], 1)
        sl = torch.cat([m0, ln, m1], 1)
        st = _terms(p, a, b, Btot, su[:, :-1], su[:, 1:], sl[:, :-1], sl[:, 1:])
        keep = torch.ones_like(T, dtype=torch.bool).scatter_(1, k, False)
        M = T.shape[1] - 1
        u0, u1, l0, l1, T = (torch.cat([x[keep].view(R, M), y], 1) for x, y in
                             ((u0, su[:, :-1]), (u1, su[:, 1:]), (l0, sl[:, :-1]), (l1, sl[:, 1:]), (T, st)))
    return (u0, u1, l0, l1), T, lower


def box_bounds(p, lo, hi, rounds=ROUNDS):
    """(lower, upper) [R] fp64 with lower <= F* <= upper (upper: in exact arithmetic).

    p: [R, n] rows of a distribution (>= 0, each summing to 1); lo <= hi: [R, n] the intervals of
    eps_j. fp64, no outward rounding: the measurement core.
    """
    p, lo, hi = (t.to(torch.float64) for t in (p, lo, hi))
    shift = ((lo + hi) * 0.5 * p).sum(-1, keepdim=True)  # the bound is unchanged by a common shift
    a = p * torch.exp(hi - shift)
    b = p * torch.exp(lo - shift)
    _, T, lower = grid_search(p, a, b, b.sum(-1), rounds)
    return lower.clamp(min=0), T.amax(-1)


# ---- the certificate: the same bound, every rounding outward (spec T9, assumption A12) ----

RHO = EXP_EPS + 8 * U64  # relative error of the computed g_j = lam ((1 - u) e^{hi_j} + u e^{lo_j})


def _e_up(q_lo, q_hi, E_lo, E_hi, S2, u, lam, n):
    """[R, M] fp64 >= box_e(q_lo, q_hi, lo, hi, u, lam) (proofs/Box.v) for fp64 u, lam [R, M].

    E = fl(exp(.)) within EXP_EPS; S2 = fl(sum q_lo E_lo) (one sum per row).
    g_j exact <= computed g (1 + 4 RHO) (exp, 1 - u, two products, a sum: within RHO, RHO < 1e-14);
    t = fl(g (1 + 8 RHO)) >= g (1 + 8 RHO)(1 - u64) >= g (1 + 4 RHO) >= g_j exact; kp = max(0, fl(t - 1)):
    fl keeps the sign of t - 1, and t - 1 <= fl(t - 1)(1 + u64) when t >= 1, so kappa_j^+ <= kp (1 + u64).
    T1 = sum q_hi kappa^+ <= fl(sum q_hi kp)(1 + u64)(1 + 2 gamma_{n+1}) (n products and an n-term
    sum of nonnegatives) <= that times (1 + 2 gamma_{n+2}); T2 = lam u sum q_lo e^{lo} >= lam u S2
    (1 - 2 (EXP_EPS + gamma_{n+1})), each product moved one ulp down; e = u - T2 + T1, each
    operation one ulp outward.
    """
    g = lam[..., None] * ((1 - u)[..., None] * E_hi[:, None, :] + u[..., None] * E_lo[:, None, :])
    kp = (g * (1 + 8 * RHO) - 1).clamp(min=0)
    t1 = up64((q_hi[:, None, :] * kp).sum(-1) * (1 + 2 * gamma(n + 2)))
    t2 = down64(down64(down64(S2 * (1 - 2 * (EXP_EPS + gamma(n + 1))))[:, None] * lam) * u).clamp(min=0)
    return up64(up64(u + t1) - t2)


def _certified_terms(q_lo, q_hi, lo, hi, grid):
    """[R, M] fp64: per interval, min over lambda in {0, l0, l1} of the larger end value of e_up."""
    u0, u1, l0, l1 = grid
    n = q_lo.shape[-1]
    E_lo, E_hi = torch.exp(lo), torch.exp(hi)
    S2 = (q_lo * E_lo).sum(-1)
    best = u1.clone()  # lambda = 0: box_e(u, 0) = u (Box.v box_e_lam0)
    for lam in (l0, l1):
        t = torch.maximum(_e_up(q_lo, q_hi, E_lo, E_hi, S2, u0, lam, n), _e_up(q_lo, q_hi, E_lo, E_hi, S2, u1, lam, n))
        best = torch.fmin(best, t)  # a NaN t (inf - inf or 0 * inf after an overflow) skips that lambda: as +inf, sound
    return best


def _chain(grid):
    """Make the intervals of each row chain exactly (sorted by u0, u1 of one = u0 of the next, from
    0 to 1): the grid of Box.v tv_le_box_grid. The refinement builds them that way; sorting puts
    them in order and the checks make a broken grid an error, not a wrong bound."""
    u0, u1, l0, l1 = grid
    for key in (1, 0):  # by u0, ties (empty intervals) by u1
        order = (u0, u1)[key].argsort(dim=-1, stable=True)
        u0, u1, l0, l1 = (t.gather(1, order) for t in (u0, u1, l0, l1))
    ok = (u0[:, 0] == 0).all() and (u1[:, -1] == 1).all() and (u1[:, :-1] == u0[:, 1:]).all() and (u0 <= u1).all()
    if not bool(ok):
        raise RuntimeError("box grid: the intervals do not chain from 0 to 1")
    return u0, u1, l0, l1


def _check_enclosed(q_lo, q_hi, lo, hi, rounds, grid0=GRID0):
    """ValueError unless the inputs are what kvcert_box_bound trusts them to be."""
    ts = {"q_lo": q_lo, "q_hi": q_hi, "lo": lo, "hi": hi}
    for name, t in ts.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float64 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"box_bound_enclosed: {name} must be a 2-D fp64 CPU tensor")
        if t.shape != q_lo.shape:
            raise ValueError(f"box_bound_enclosed: {name} has shape {tuple(t.shape)}, q_lo {tuple(q_lo.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"box_bound_enclosed: {name} is not contiguous")
    if q_lo.shape[1] < 1:
        raise ValueError("box_bound_enclosed: no tokens (n = 0)")
    if not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"box_bound_enclosed: rounds must be an int >= 0 (got {rounds!r})")
    if not isinstance(grid0, int) or grid0 < 2:
        raise ValueError(f"box_bound_enclosed: grid0 must be an int >= 2 (got {grid0!r})")
    if not bool(torch.isfinite(q_lo).all() and torch.isfinite(q_hi).all()):
        raise ValueError("box_bound_enclosed: q_lo, q_hi must be finite")
    if bool(lo.isnan().any() or hi.isnan().any()):  # +-inf: a saturated row (bound 1)
        raise ValueError("box_bound_enclosed: NaN in lo or hi")
    if not bool(((q_lo >= 0) & (q_lo <= q_hi)).all()):
        raise ValueError("box_bound_enclosed: need 0 <= q_lo <= q_hi")
    if not bool((lo <= hi).all()):
        raise ValueError("box_bound_enclosed: need lo <= hi")


def _box_bound_cpp(q_lo, q_hi, lo, hi, rounds, grid0=GRID0):
    """box_bound_enclosed in C++ (csrc/cpu_fused.cpp kvcert_box_bound) on inputs _check_enclosed passed: the same
    algorithm, the margins from here."""
    R, n = q_lo.shape
    M = (grid0 - 1) + rounds * (SPLIT - 1)
    levels = torch.linspace(0, 1, grid0, dtype=torch.float64)
    bound = torch.empty(R, dtype=torch.float64)
    grid = tuple(torch.empty(R, M, dtype=torch.float64) for _ in range(4))
    if R:
        bad = native._lib().kvcert_box_bound(
            q_lo.data_ptr(), q_hi.data_ptr(), lo.data_ptr(), hi.data_ptr(), R, n, levels.data_ptr(), grid0, rounds, SPLIT,
            SATURATE_C, 1 + 8 * RHO, 1 + 2 * gamma(n + 2), 1 - 2 * (EXP_EPS + gamma(n + 1)), read_threads(),
            bound.data_ptr(), *(t.data_ptr() for t in grid))
        if bad:
            raise RuntimeError("box grid: the intervals do not chain from 0 to 1")
    return bound, grid


def box_bound_enclosed(q_lo, q_hi, lo, hi, rounds=ROUNDS, backend="auto", grid0=GRID0):
    """(bound [R] fp64, grid): bound >= TV(softmax x, softmax xt) whenever q_lo <= softmax(xt) <= q_hi
    and lo_j <= x_j - xt_j <= hi_j for every token j (proofs/Box.v tv_le_box_grid), and bound >=
    the exact value of reference.box:box_grid_bound on the returned grid (u0, u1, l0, l1) [R, M].

    q_lo, q_hi, lo, hi: [R, n] fp64, 0 <= q_lo <= q_hi, lo <= hi (tokens outside the softmax: q = 0).
    The grid and lambdas are chosen on the midpoint distribution (any choice is sound); rows with
    max hi > SATURATE_C or min lo < -SATURATE_C report 1.
    backend: "cpp" the C++ twin (CPU tensors, checked: ValueError; rows with no midpoint distribution,
    sum (q_lo + q_hi) = 0, report 1 with a uniform grid, as do saturated rows), "torch" the code below,
    "auto" the C++ twin where the extension is available and the inputs are CPU tensors it takes, else torch.
    grid0: the grid search's initial uniform levels (any grid is sound; more: tighter, slower).
    """
    if backend not in ("auto", "torch", "cpp"):
        raise ValueError(f"box_bound_enclosed: backend must be auto, torch or cpp (got {backend!r})")
    if backend == "auto":
        ts = [t.contiguous() for t in (q_lo, q_hi, lo, hi)]
        if all(t.device.type == "cpu" for t in ts) and native.available():
            _check_enclosed(*ts, rounds, grid0)  # bad input (NaN, q_lo > q_hi, lo > hi) is refused, never bounded
            return _box_bound_cpp(*ts, rounds, grid0)
    elif backend == "cpp":
        if not native.available():
            raise RuntimeError("box_bound_enclosed: backend cpp, but the C++ extension is not available")
        _check_enclosed(q_lo, q_hi, lo, hi, rounds, grid0)
        return _box_bound_cpp(q_lo, q_hi, lo, hi, rounds, grid0)
    R, n = q_lo.shape
    big = (hi.amax(-1) > SATURATE_C) | (lo.amin(-1) < -SATURATE_C)  # the clamps below would narrow a box: report 1
    lo_c, hi_c = lo.clamp(min=-SATURATE_C), hi.clamp(max=SATURATE_C)
    mid = 0.5 * (q_lo + q_hi)
    p = mid / mid.sum(-1, keepdim=True)
    a, b = p * torch.exp(hi_c), p * torch.exp(lo_c)
    grid, _, _ = grid_search(p, a, b, b.sum(-1), rounds, lower=False, grid0=grid0)
    grid = _chain(grid)
    T = _certified_terms(q_lo, q_hi, lo_c, hi_c, grid)
    bound = torch.where(big, torch.ones_like(T[:, 0]), T.amax(-1).clamp(max=1.0))
    return bound, grid


def box_tv_bound(p_tilde, c, *, return_grid=False):
    """The box form (spec T9): [B, H] fp32 >= TV(p, p~ / S) for p proportional to p~ e^{eps},
    |eps_j| <= c_j, S the row sum (the contract of fast.core.certify.tv_bound_forms).
    p_tilde, c: [B, H, N]. q_lo / q_hi: p~_j / S with rigorous fp64 bounds on S (gamma_N).
    return_grid=True also returns the fp64 inputs and grid that reference.box:box_grid_bound
    evaluates exactly (the differential test)."""
    _checks.weights_and_bounds(p_tilde, c)
    B, H, N = p_tilde.shape
    p = p_tilde.to(torch.float64).reshape(B * H, N)
    c64 = c.to(torch.float64).reshape(B * H, N)
    S = p.sum(-1, keepdim=True)
    if not bool((S > 0).all()):
        raise ValueError("p_tilde: a row sums to zero")
    g = 2 * gamma(N)
    q_hi = up64(p / down64(S * (1 - g)))
    q_lo = down64(p / up64(S * (1 + g))).clamp(min=0)
    bound, grid = box_bound_enclosed(q_lo, q_hi, -c64, c64)
    out = up32(bound).view(B, H)
    if return_grid:
        return out, {"q_lo": q_lo, "q_hi": q_hi, "lo": -c64, "hi": c64, "grid": grid}
    return out


TINY32 = 2.0 ** -126


def _exp_enclosure(e, D):
    """(e_up, e_dn) fp64 torch, e^theta rounded up and e^-theta rounded down, theta = u32 T + 2 EXP32_EPS (T =
    min(2e / ((D + 4) u32), 88)): a served weight w_j = fl(exp(fl(x^_j - m))) has e^{x^_j - m} within w_j e^{+-theta}
    +- 2^-126 (box_form_of_read). e: numpy fp64, the logit rounding bound."""
    from fast.core.certify import EXP32_EPS, _up
    theta = torch.from_numpy(_up(U32 * np.minimum(2 * e / ((D + 4) * U32), 88.0) + 2 * EXP32_EPS))
    return up64(torch.exp(theta) * (1 + EXP_EPS)), down64(torch.exp(-theta) * (1 - EXP_EPS))


def _z_enclosure(W, N, e_up, e_dn):
    """(z_dn, z_up): bounds of sum_j e^{x^_j - m} from W, the fp64 sum of the N served weights (within 2 gamma_N)."""
    g = 2 * gamma(N)
    z_dn = down64(down64(down64(W * (1 - g)) * e_dn) - N * TINY32)
    z_up = up64(up64(up64(W * (1 + g)) * e_up) + N * TINY32)
    return z_dn, z_up


def box_form_of_read(cert, w, c, e, vmask, D, lo=None, hi=None):
    """Add the box form to a decode certificate of fast.core.attention.attention_torch (opt-in):
    cert["box"] [B, H] fp32 and cert["min"] = min(min, box). Like every other form, the box carries r_w
    (fast.core.certify.weight_rounding): it bounds the TV to the fp32 weights served.

    The target is the one of the other forms (fast.core.certify.forms_from_pmz): TV(softmax(x),
    softmax(x^)), x the exact logits, x^ the fp32 logits, |x_j - x^_j| <= c_eff_j <= c_j + d with
    d = up(2e + 2^-149). q = softmax(x^) is enclosed from the fp32 weights w_j = fl(exp(fl(x^_j - m)))
    (0 at masked tokens): e^{x^_j - m} lies within w_j e^{+-theta} +- 2^-126, theta = u32 T + 2 EXP32_EPS
    (as in output_error_bound), and sum_j e^{x^_j - m} >= 1 (the argmax term), so
      q_hi = (w e^theta + 2^-126) / (W e^-theta - N 2^-126),  q_lo = (w e^-theta - 2^-126)^+ / (W e^theta + N 2^-126),
    W the fp64 sum of w within 2 gamma_N, every operation rounded outward; masked tokens q = 0.
    c: [B, H, N] fp32/fp64 (c + 2^-150 >= the witness bound, 0 at exact and masked tokens), e: [B, H]
    numpy fp64, vmask: [B, 1 or H, N] bool or None. Signed intervals (the query-subspace witness,
    fast.core.attention.subspace_forms): lo, hi [B, H, N] fp64 with lo_j <= x_j - x~_j <= hi_j in place of
    -c, c (c unused); the box is then [lo - d, hi + d], rounded outward."""
    from fast.core.certify import _up, weight_rounding
    B, H, N = w.shape
    e = np.asarray(e, dtype=np.float64)
    d = torch.from_numpy(_up(2 * e + 2.0 ** -149)).to(w.device).view(B, H, 1)
    signed = lo is not None
    if not signed:
        hi = up64(c.to(torch.float64) + d)
        lo = -hi
    else:
        lo, hi = down64(lo - d), up64(hi + d)
    e_up, e_dn = (t.to(w.device).view(B, H, 1) for t in _exp_enclosure(e, D))
    w64 = w.to(torch.float64)
    z_dn, z_up = _z_enclosure(w64.sum(-1, keepdim=True), N, e_up, e_dn)
    tiny = TINY32
    q_hi = up64(up64(up64(w64 * e_up) + tiny) / z_dn)
    q_lo = down64(down64(down64(w64 * e_dn) - tiny).clamp(min=0) / z_up).clamp(min=0)  # p >= 0: 0 is a lower bound
    if vmask is not None:
        m = vmask.expand(B, H, N)
        q_hi, q_lo, hi, lo = q_hi.masked_fill(~m, 0.0), q_lo.masked_fill(~m, 0.0), hi.masked_fill(~m, 0.0), lo.masked_fill(~m, 0.0)
    # centred: x - t has the same softmax, so [lo - t, hi - t] are intervals of T9a too; t the midpoint of
    # [min lo, max hi] keeps them inside box_bound_enclosed's range (it reports 1 beyond +-SATURATE_C)
    if signed:
        t = 0.5 * lo.amin(-1, keepdim=True) + 0.5 * hi.amax(-1, keepdim=True)
        lo, hi = down64(lo - t), up64(hi - t)
    bound, _ = box_bound_enclosed(q_lo.reshape(B * H, N), q_hi.reshape(B * H, N), lo.reshape(B * H, N), hi.reshape(B * H, N))
    # + r_w: the TV to the fp32 weights actually served, as every other form (proofs/Served.v tv_served_le)
    r_w = torch.from_numpy(weight_rounding(e, N, D)).to(w.device).reshape(B * H)
    cert["box"] = up32(up64(bound + r_w).clamp(max=1.0)).view(B, H)
    cert["min"] = torch.minimum(cert["min"], cert["box"])
    return cert


# ---- the box form over a histogram of c (spec T9c): the fused read's box ----

HIST_KEY0, HIST_KEY1 = 113 << 4, 135 << 4  # csrc hist_bin: the grid values 2^-14 and 2^8 (fp32 bits >> 19)
HIST_K = HIST_KEY1 - HIST_KEY0 + 2         # the grid values from 2^-14 to 2^8, then the overflow bin
# hist_box's pseudo-tokens and initial levels: the box's grid search costs in proportion to both. A row's histogram keeps
# HIST_M groups (csrc hist_emit merges neighbours beyond: any grouping is sound); SmolLM2's vLLM rows occupy ~20 bins
HIST_M = 16
HIST_GRID0 = 17


def hist_grid():
    """[HIST_K] fp64: bin k's grid value, the fp32 with bits (HIST_KEY0 + k) << 19 (every token of the bin has c^ <=
    it: csrc hist_bin bins c^ by the value it rounds up to), the overflow bin's +inf."""
    keys = torch.arange(HIST_KEY0, HIST_KEY1 + 1, dtype=torch.int32) << 19
    return torch.cat([keys.view(torch.float32).double(), torch.tensor([math.inf], dtype=torch.float64)])


def hist_bins(hist, stats, NB, N, D, backend="auto"):
    """The pseudo-tokens of hist_box (one per occupied bin, then empty ones: q = 0, interval [0, 0], nothing in box_e)
    for R rows: (q_lo, q_hi, lo, hi) [R, M] fp64 contiguous, M the most occupied bins of a row (module doc of
    hist_box). hist [R, 3 K] (the kernel's: each row's occupied bins first), stats [R, 5] fp64. backend: "torch" the
    code below, "cpp" its C++ twin (csrc kvcert_hist_bins: the same operations, the same bits), "auto" the C++ one
    where the extension is available."""
    if backend not in ("auto", "torch", "cpp"):
        raise ValueError(f"hist_bins: backend must be auto, torch or cpp (got {backend!r})")
    R, K = hist.shape[0], hist.shape[1] // 3
    M = max(int((hist[:, 2 * K:] > 0).sum(-1).max()), 1) if R else 1
    e = stats[:, 4].numpy()
    e_up, e_dn = (t.view(-1, 1) for t in _exp_enclosure(e, D))
    z_dn, z_up = _z_enclosure(stats[:, :1], N, e_up, e_dn)
    g = 2 * gamma(N)
    d = up64(2 * stats[:, 4:] + 2.0 ** -149)
    f1, f2 = 1 + 2 * NB * U32, 1 + 2.0 ** -40
    if backend == "cpp" or (backend == "auto" and native.available()):
        out = tuple(torch.empty(R, M, dtype=torch.float64) for _ in range(4))
        if R:
            h = hist.to(torch.float64).contiguous()
            vec = [t.reshape(R).contiguous() for t in (e_up, e_dn, z_dn, z_up, d)]
            native._lib().kvcert_hist_bins(h.data_ptr(), R, K, M, *(t.data_ptr() for t in vec), 1 + g, 1 - g, f1, f2, TINY32,
                                           read_threads(), *(t.data_ptr() for t in out))
        return out
    cb, Wk, nk = (hist[:, i * K:i * K + M] for i in range(3))
    occ = nk > 0
    q_hi = up64(up64(up64(up64(Wk * (1 + g)) * e_up) + nk * TINY32) / z_dn)
    q_lo = down64(down64(down64(down64(Wk * (1 - g)) * e_dn) - nk * TINY32).clamp(min=0) / z_up).clamp(min=0)
    hk = up64(up64(up64(cb * f1) * f2) + d)
    q_lo, q_hi, hk = (torch.where(occ, t, 0.0).contiguous() for t in (q_lo, q_hi, hk))
    return q_lo, q_hi, (-hk).contiguous(), hk


def hist_box(cert, hist, stats, NB, N, D, above=0.0):
    """Add the box form to a fused read's certificate: cert ([B, T, H] fp32 dict, fast.core.cpu_fused._certificate of
    stats [B, T, H, 5], the kernel's Z, S1, S2, max c^, e) gets cert["box"] and cert["min"] = min(min, box), the box
    computed on the rows whose min > above (the others' box: 1). hist [B, T, H, 3 K]: the kernel's histogram
    (cpu_fused._run(hist=...)): the tokens a row reads (the others: q = 0) binned by the grid value (1 + i/16) 2^e
    their c^_j rounds up to (hist_grid), per row its occupied bins k in order: the largest c^_j of the bin's tokens g_k (+inf: the overflow
    bin, c^ > 2^8), the fp64 sum W_k of their weights w_j and their count n_k, then zeros (a row with more than K
    occupied bins: neighbours merged, csrc hist_emit; a group of tokens like any bin). N: the token count the
    epilogue used (>= each row's).

    Each bin is one pseudo-token of Box.v (spec T9c, proofs/BoxMerge.v box_e_merge): its tokens share the interval
    [-h_k, h_k], h_k = up(up(up(g_k f) (1 + 2^-40)) + d) >= c_j + d (f = 1 + 2 NB u32: the epilogue's bound on the
    exact witness from c^, _sums_to_pmz; d = up(2e + 2^-149): the logits' rounding, box_form_of_read); its
    q_hi = up((up(W_k (1 + g)) e_up + n_k 2^-126) / z_dn) >= the sum of its tokens' q_hi and q_lo = (down((down(W_k
    (1 - g)) e_dn - n_k 2^-126) / z_up))^+ <= the sum of their q_lo (box_form_of_read's enclosures; W_k within
    g = 2 gamma_N of the exact sum: nonnegative terms; assumption A12). Then box_bound_enclosed over the bins
    (hist_bins), + r_w (the served weights' rounding, as every form)."""
    from fast.core.certify import weight_rounding
    B, T, H = cert["min"].shape
    R = B * T * H
    box = torch.ones(R, dtype=torch.float32)
    st = stats.reshape(R, 5)
    sel = (cert["min"].reshape(R) > above).nonzero().flatten()
    if len(sel):
        bound, _ = box_bound_enclosed(*hist_bins(hist.reshape(R, hist.shape[-1])[sel], st[sel], NB, N, D), grid0=HIST_GRID0)
        r_w = torch.from_numpy(weight_rounding(st[sel, 4].numpy(), N, D))
        box[sel] = up32(up64(bound + r_w).clamp(max=1.0))
    cert["box"] = box.view(B, T, H)
    cert["min"] = torch.minimum(cert["min"], cert["box"])
    return cert
