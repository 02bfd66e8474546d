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


def _terms(p, a, b, Btot, U, lam):
    """Per-interval bound [R, K - 1]: min over lambda in {lam_k, lam_{k+1}} of the larger end value."""
    u0, u1 = U[:, :-1], U[:, 1:]
    best = u1.clone()  # lambda = 0
    for lk in (lam[:, :-1], lam[:, 1:]):
        t = torch.maximum(_e(p, a, b, Btot, u0, lk), _e(p, a, b, Btot, u1, lk))
        best = torch.minimum(best, t)
    return best


def box_bounds(p, lo, hi, rounds=ROUNDS):
    """(lower, upper) [R] fp64 with lower <= F* <= upper (upper: in exact arithmetic).

    p: [R, n] rows of a distribution (>= 0, each summing to 1); lo <= hi: [R, n] the intervals of
    eps_j. fp64, no outward rounding: the measurement core.
    """
    p, lo, hi = (t.to(torch.float64) for t in (p, lo, hi))
    shift = ((lo + hi) * 0.5 * p).sum(-1, keepdim=True)  # the bound is unchanged by a common shift
    a = p * torch.exp(hi - shift)
    b = p * torch.exp(lo - shift)
    Btot = b.sum(-1)
    R = p.shape[0]
    U = torch.linspace(0, 1, GRID0, dtype=p.dtype, device=p.device).expand(R, -1).contiguous()
    lam, f = _greedy(p, a, b, Btot, U)
    lower = f.amax(-1)
    frac = torch.arange(1, SPLIT, dtype=p.dtype, device=p.device) / SPLIT
    for _ in range(rounds):
        k = _terms(p, a, b, Btot, U, lam).argmax(-1, keepdim=True)
        u0, u1 = U.gather(1, k), U.gather(1, k + 1)
        new = u0 + (u1 - u0) * frac  # [R, SPLIT - 1]
        ln, fn = _greedy(p, a, b, Btot, new)
        lower = torch.maximum(lower, fn.amax(-1))
        U, idx = torch.cat([U, new], 1).sort(-1)
        lam = torch.cat([lam, ln], 1).gather(1, idx)
    upper = _terms(p, a, b, Btot, U, lam).amax(-1)
    return lower.clamp(min=0), upper
