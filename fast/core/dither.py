"""Probabilistic tier for the dithered caches (math.md T6), batched twins of reference.dither: int8_dither,
int4_dither and kivi2_dither (b-bit codes never clamped, proofs/DitherCode.v: one radius serves all three).

Caveat (spec A2): the radius is proved for queries and keys that do not depend on the dither
(non-adaptive). In decoding they do (the tokens produced, and within a step the layers >= 1, read
earlier dithered outputs), so the integrations report this tier as an estimate (`dither_estimate`),
never a certificate, and no gate uses it; the deterministic witness tier (T4) has no such caveat.
Floating point: fp64, inputs fp32/fp16/bf16 (squares exact, no underflow), margins as in
fast.core.witness; results rounded UP to fp32 (radii) or DOWN (budgets).
"""

import math
from fractions import Fraction

import torch

from fast.core import _checks
from fast.core.certify import gamma, logit_rounding, tv_bound_forms, up32, up64
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


# Per coordinate, in units of the scale sc <= delta (QTensor.step() = sc (1 + 2^-10)):
GRID_MEAN = 2.0 ** -17 + 2.0 ** -18  # |E e| of the grid error (T6g: 1/(2N) + eta, N = 2^16, eta = 2^-18 for fl32(y + u), A6)
QUANT_RHO = 2.0 ** -17 + 2.0 ** -18  # the rho of T6i: (x~ - x) - sc e, i.e. fl32(x / sc) within 2^-18 (|x / sc| < 128)
                                     # and fl32((m - u) sc) within 127.5 u sc < 2^-17 sc (A6); tested exactly
BIAS_RHO = GRID_MEAN + QUANT_RHO     # 3 2^-17, exact


def _bias64(q, delta, s):
    """[B, H, N] fp64 upper bounds of s sum_i |q_i| delta_{j,i} (GRID_MEAN + QUANT_RHO): the grid's bias
    bound plus the rho of T6i. The D-term sum of nonnegative products (gamma_D), the products and the
    two scalings (one rounding each)."""
    B, H, D = q.shape
    Hkv, N = delta.shape[1:3]
    qa = q.to(torch.float64).abs().view(B, Hkv, H // Hkv, D)
    t = torch.matmul(qa, delta.to(torch.float64).transpose(-1, -2)) * (s * BIAS_RHO)
    return up64(t * (1 + 2 * gamma(D + 3))).reshape(B, H, N)


def dither_radius(q, delta, scale, n, d):
    """c [B, H, N] fp32 >= s sum_i |q_i| delta_{j,i} 3 2^-17 + sigma_j sqrt(2 ln(2n/d)) (T6i on the
    code's grid): with probability >= 1 - d all n tokens of one read satisfy |eps_j| <= c_j, for a
    query and keys fixed before the dither is drawn (A1, A2: in decoding, an estimate only).
    The first term is T6i's bias plus its rho: the dither is uniform on a 2^16-point grid, whose
    error is NOT centred (mean up to 2^-17 + 2^-18 steps with the fp32 add: proofs/DitherGrid.v
    token_failure_le), and the quantizer's own fp32 roundings add up to 2^-17 + 2^-18 more per
    coordinate (QUANT_RHO); the sub-Gaussian tail holds for the centred part
    (reference.dither.dither_radius_grid with eta = 2^-18 and that rho)."""
    s = _check(q, delta, scale)
    f = radius_factor(n, d)
    if n < delta.shape[2]:
        raise ValueError(f"n = {n}: the union bound must count at least the {delta.shape[2]} tokens given")
    return up32(up64(up64(_sigma64(q, delta, s) * f) + _bias64(q, delta, s)))


TINY64 = 2.0 ** -1022  # least normal fp64: a local budget below it is refused, never rounded to 0


def budget_local(delta_req, L, H, t):
    """delta_req / (L H t (t+1)) rounded DOWN (T6e): local budgets summing to <= delta_req
    over every step t = 1, 2, ... of a request (L layers, H heads checked per step)."""
    delta_req = _checks.probability("delta_req", delta_req)
    for name, v in (("L", L), ("H", H), ("t", t)):
        _checks.positive_int(name, v)
    exact = Fraction(delta_req) / (L * H * t * (t + 1))
    if exact < Fraction(TINY64):
        raise ValueError(f"budget_local: delta_req = {delta_req:g} / (L H t (t+1)) = {float(exact):.3g} at step t = {t} "
                         f"would underflow fp64 (below {TINY64:.3g}): use a larger delta_req")
    x = float(exact)
    return math.nextafter(x, 0.0) if Fraction(x) > exact else x



def dither_forms(q, p_tilde, delta, kmax, scale, n, d):
    """The dither-tier certificate of one decode read (T6c with T2, plus the fp32 rounding of T8).

    q: [B, H, D] (fixed independently of the dither, A2); p_tilde: [B, H, N] the served attention
    computed in fp64 from the served keys k~ (softmax of s <q, k~_j>, padding 0); delta: [B, Hkv, N, D]
    dither steps (0 at exact tokens); kmax: [B, Hkv, D] >= |k~_ji| per channel (fast.core.quant.max_abs);
    n >= N tokens in the union bound, d the local budget. Returns tv_bound_forms' dict ([B, H] fp32).

    With probability >= 1 - d, |x_j - x~_j| <= c_j (x exact, x~ = s <q, k~> exactly), and the
    attention's fp32 logits x^ satisfy |x^_j - x~_j| <= e (fast.core.certify.logit_rounding), so
    |x - x^| <= c + e: T2 at the observable p^ = softmax(x^) with c + e. p^ is p~ shifted by at
    most e per logit, which moves A up and B/A down by at most e^{2e}: forms(p^, c + e) <=
    forms(p~, c + 3e), and forms(p~, c) (the TV to softmax(x~)) is below that too. p_tilde itself
    is fp64 arithmetic: its logits err by < e 2^-29 (D + 2 fp64 roundings against the (D + 4) u32 of e),
    the max-subtraction by < e 2^-29, exp and the division by < 16 u64 < 2^-48 per entry, and
    entries that underflow are absorbed by the absolute term; its sum is handled by tv_bound_forms
    (the row is normalised with rigorous bounds). Each such shift counts twice, as e does:
    c_eff = c + 3 e (1 + 2^-20) + 2^-46, rounded up.
    """
    c = dither_radius(q, delta, scale, n, d)  # [B, H, N] fp32, checks q, delta, scale, n, d
    s = _check_scale(scale)
    _checks.tensor("p_tilde", p_tilde, ndim=3)
    if tuple(p_tilde.shape) != tuple(c.shape):
        raise ValueError(f"p_tilde: shape {tuple(p_tilde.shape)}, expected {tuple(c.shape)}")
    _checks.tensor("kmax", kmax, ndim=3)
    if tuple(kmax.shape) != (delta.shape[0], delta.shape[1], delta.shape[3]):
        raise ValueError(f"kmax: shape {tuple(kmax.shape)}, expected {(delta.shape[0], delta.shape[1], delta.shape[3])}")
    _checks.nonneg_finite("kmax", kmax)
    e = logit_rounding(q, kmax.to(torch.float64), s)  # [B, H] fp64
    extra = up64(up64(3.0 * e * (1 + 2.0 ** -20)) + 2.0 ** -46)
    c_eff = up64(c.to(torch.float64) + extra.unsqueeze(-1))
    return tv_bound_forms(p_tilde, c_eff)
