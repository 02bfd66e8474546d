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

box_bounds runs in fp64 without outward rounding: the measurement core.
"""

import torch

GRID0 = 33   # initial levels: uniform in [0, 1]
ROUNDS = 12  # refinement rounds: the interval holding the max is cut into SPLIT pieces
SPLIT = 4


def _greedy(p, a, b, Btot, u):
    """lambda [R, K] (1 / the threshold ratio of the greedy knapsack at level u) and the best
    prefix value f(S) [R, K] of that greedy ordering (a lower estimate of F*)."""
    w = (1 - u)[..., None] * a[:, None, :] + u[..., None] * b[:, None, :]  # [R, K, n]
    pp = p[:, None, :].expand_as(w)
    ratio = torch.where(pp > 0, w / pp.clamp(min=1e-300), torch.zeros_like(w))
    order = torch.argsort(ratio, dim=-1, descending=True)
    ws, ps, rs = (torch.gather(t, -1, order) for t in (w, pp, ratio))
    cw = ws.cumsum(-1)
    need = (u * Btot[:, None])[..., None]
    t = torch.searchsorted(cw.contiguous(), need.contiguous()).clamp(max=w.shape[-1] - 1)
    r_t = torch.gather(rs, -1, t)[..., 0]
    lam = torch.where(r_t > 0, 1.0 / r_t.clamp(min=1e-300), torch.zeros_like(r_t))
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


def grid_search(p, a, b, Btot, rounds=ROUNDS):
    """The intervals (u0, u1, l0, l1) [R, M] of the refined grid, their terms [R, M] and the lower
    estimate [R]. The intervals of each row partition [0, 1] (unordered)."""
    R = p.shape[0]
    U = torch.linspace(0, 1, GRID0, dtype=p.dtype, device=p.device).expand(R, -1).contiguous()
    lam, f = _greedy(p, a, b, Btot, U)
    lower = f.amax(-1)
    u0, u1, l0, l1 = U[:, :-1], U[:, 1:], lam[:, :-1], lam[:, 1:]
    T = _terms(p, a, b, Btot, u0, u1, l0, l1)
    frac = torch.arange(1, SPLIT, dtype=p.dtype, device=p.device) / SPLIT
    for _ in range(rounds):
        k = T.argmax(-1, keepdim=True)
        a0, a1, m0, m1 = (t.gather(1, k) for t in (u0, u1, l0, l1))
        new = a0 + (a1 - a0) * frac  # [R, SPLIT - 1]
        ln, fn = _greedy(p, a, b, Btot, new)
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
