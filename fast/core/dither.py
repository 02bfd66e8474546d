"""Probabilistic tier for the dithered int8 cache (math.md T6), batched twins of reference.dither.

Caveat (spec A2): the radius holds for queries that do not depend on the dither
(non-adaptive); the deterministic witness tier (T4) has no such caveat.
Floating point: fp64, inputs fp32/fp16/bf16 (squares exact, no underflow), margins as in
fast.core.witness; results rounded UP to fp32 (radii) or DOWN (budgets).
"""

import math
from fractions import Fraction

import torch

from fast.core import _checks
from fast.core.certify import gamma, up32, up64
from fast.core.witness import IN_DTYPES, _check_scale


def _sigma64(q, delta, s):
    """[B, H, N] fp64 upper bounds of s sqrt(sum_i q_i^2 delta_{j,i}^2 / 12)."""
    B, H, D = q.shape
    Hkv, N = delta.shape[1:3]
    q2 = q.to(torch.float64).square().view(B, Hkv, H // Hkv, D)  # exact
    d2 = delta.to(torch.float64).square()  # exact
    var = torch.matmul(q2, d2.transpose(-1, -2)) / 12.0  # D products + D-term sum + the division
    sigma = torch.sqrt(var) * s  # sqrt halves the relative error, + 2 roundings
    return up64(sigma * (1 + 2 * gamma(D + 6))).reshape(B, H, N)


def _check(q, delta, scale):
    _checks.tensor("q", q, ndim=3, dtypes=IN_DTYPES)
    _checks.tensor("delta", delta, ndim=4, dtypes=IN_DTYPES)
    s = _check_scale(scale)
    B, H, D = q.shape
    _checks.same("q batch", B, "delta batch", delta.shape[0])
    _checks.same("q head dim", D, "delta head dim", delta.shape[3])
    _checks.gqa(H, delta.shape[1])
    _checks.finite("q", q)
    _checks.nonneg_finite("delta", delta)
    return s


def dither_sigma(q, delta, scale):
    """sigma [B, H, N] fp32 >= scale * sqrt(sum_i q_i^2 delta_{j,i}^2 / 12) (T6b).

    q: [B, H, D]; delta: [B, Hkv, N, D] quantization steps (QTensor.step()).
    """
    s = _check(q, delta, scale)
    return up32(_sigma64(q, delta, s))


def radius_factor(n, d):
    """Upper bound of sqrt(2 ln(2n/d)) (fp64: ~4 correctly rounded operations, log/sqrt
    within 1 ulp, and 2n/d >= 2 keeps ln well conditioned; 1e-14 covers it all)."""
    _checks.positive_int("n", n)
    _checks.probability("d", d)
    return math.sqrt(2.0 * math.log(2.0 * n / d)) * (1 + 1e-14)


def dither_radius(q, delta, scale, n, d):
    """c [B, H, N] fp32 >= sigma_j sqrt(2 ln(2n/d)) (T6c): with probability >= 1 - d all n
    tokens of one read satisfy |eps_j| <= c_j (non-adaptive queries, A1-A2)."""
    s = _check(q, delta, scale)
    f = radius_factor(n, d)
    return up32(up64(_sigma64(q, delta, s) * f))


def budget_local(delta_req, L, H, t):
    """delta_req / (L H t (t+1)) rounded DOWN (T6e): local budgets summing to <= delta_req
    over every step t = 1, 2, ... of a request (L layers, H heads checked per step)."""
    delta_req = _checks.probability("delta_req", delta_req)
    for name, v in (("L", L), ("H", H), ("t", t)):
        _checks.positive_int(name, v)
    exact = Fraction(delta_req) / (L * H * t * (t + 1))
    x = float(exact)
    return math.nextafter(x, 0.0) if Fraction(x) > exact else x

