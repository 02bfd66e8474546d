"""Observable TV forms (math.md T1c, T2) computed so they are never below the exact value.

Floating point (math.md T8, spec assumption A5). The sums run in fp64 and the result is
rounded UP to fp32. Why fp64: with fp32 sums the rigorous margin gamma_N (N u, u = 2^-24)
reaches ~2.4e-4 at N = 4096, far above the 1e-6 slack a useful bound may add to
1 - B/A; in fp64 (u64 = 2^-53) the same margin is ~5e-13. The cost is O(N) per row,
against the O(N D) of the attention that produced p_tilde.

Error model (fp64, round to nearest, u64 = 2^-53):
- torch.exp / torch.tanh in fp64 are within 2 ulp (Sleef u10 / glibc on CPU: 1 ulp;
  CUDA exp: 1 ulp, tanh: 2 ulp). One ulp is at most 2 u64 relative, so EXP_EPS = 8 u64
  (a factor 2 of slack on top).
- each product p_j e^{+-c_j}: one rounding, relative u64;
- an N-term sum of nonnegative terms: relative gamma_{N-1} (Higham, Thm 3.1, any order).
Hence exact A' <= computed A' (1 + EXP_EPS)(1 + u64)/(1 - gamma_N) <= computed A' * (1 + 2 (EXP_EPS + gamma_{N+1}))
(the factor 2 absorbs the second-order terms while (N + 10) u64 < 1e-3), and symmetrically
exact B' >= computed B' * (1 - 2 (EXP_EPS + gamma_{N+1})). After every further single
operation the result is moved one ulp outward (`up64` / `down64`): a correctly rounded
result is within half an ulp of the exact one, so one ulp outward is a rigorous bound.
"""

import math

import torch

from fast import _checks

U32 = 2.0 ** -24
U64 = 2.0 ** -53
EXP_EPS = 8 * U64
FORMS = ("tanh", "one_minus_b_over_a", "e_form", "min")


def gamma(n, u=U64):
    """gamma_n = n u / (1 - n u) (Higham): the relative error of an n-term sum."""
    if n * u >= 1e-3:
        raise ValueError(f"gamma_{n}: too many terms for the stated margin")
    return n * u / (1 - n * u)


def sum_margin(n):
    """Relative margin for an n-term fp64 sum of products of an exp: see module doc."""
    return 2 * (EXP_EPS + gamma(n + 1))


_INF = {}


def _inf(x, sign):
    """A cached 0-dim +-inf of x's dtype and device: nextafter broadcasts it."""
    key = (x.dtype, x.device, sign)
    if key not in _INF:
        _INF[key] = torch.tensor(sign * math.inf, dtype=x.dtype, device=x.device)
    return _INF[key]


def up64(x):
    """One ulp toward +inf (fp64): an upper bound of the exact result of the last operation."""
    return torch.nextafter(x, _inf(x, 1))


def down64(x):
    """One ulp toward -inf (fp64)."""
    return torch.nextafter(x, _inf(x, -1))


def up32(x64):
    """fp64 -> fp32, rounded UP: the smallest fp32 >= x64 (or a neighbour above it)."""
    y = x64.to(torch.float32)
    return torch.where(y.to(torch.float64) < x64, torch.nextafter(y, _inf(y, 1)), y)


def down32(x64):
    """fp64 -> fp32, rounded DOWN."""
    y = x64.to(torch.float32)
    return torch.where(y.to(torch.float64) > x64, torch.nextafter(y, _inf(y, -1)), y)


def tanh_half_up(cmax):
    """Upper bound of tanh(cmax / 2) in fp64, cmax >= 0 fp64."""
    half = cmax * 0.5
    half = torch.where(half * 2 == cmax, half, up64(half))  # only a subnormal cmax loses a bit
    t = up64(torch.tanh(half) * (1 + EXP_EPS))
    return torch.where(half == 0, torch.zeros_like(t), t)  # tanh(0) = 0 exactly


def forms_from_sums(a_up, b_down, z_down, z_up, cmax):
    """All forms from rigorous fp64 bounds on A' = sum w e^c, B' = sum w e^-c, Z = sum w.

    A = A'/Z, B = B'/Z. Every output is >= the exact form (B: <=). Returns fp64 tensors.
    """
    A = up64(a_up / z_down)
    B = down64(b_down / z_up)
    ratio = down64(b_down / a_up)  # B/A = B'/A' rounded DOWN: no cancellation in 1 - B/A
    one_minus = up64(1.0 - ratio)
    e_form = up64(up64(up64(A * A) - 1.0) * 0.5)
    tanh = torch.clamp(tanh_half_up(cmax), max=1.0)
    lowest = torch.minimum(torch.minimum(tanh, one_minus), e_form)
    return {"A": A, "B": B, "max_c": cmax, "tanh": tanh, "one_minus_b_over_a": one_minus,
            "e_form": e_form, "min": torch.clamp(lowest, min=0.0, max=1.0)}  # TV lies in [0, 1]


def to_fp32(forms):
    """Round a dict of fp64 certificate tensors outward to fp32 (B down, the rest up), in one batch."""
    names = [k for k in forms if k != "B"]
    ups = up32(torch.stack([forms[k] for k in names]))
    out = dict(zip(names, ups.unbind(0)))
    out["B"] = down32(forms["B"])
    return {k: out[k] for k in forms}


def weighted_sums(w, c):
    """Rigorous fp64 bounds (A' up, B' down, Z down, Z up) of sum w e^{+-c}, sum w. w, c: [..., N] fp64, w >= 0."""
    n = w.shape[-1]
    m = sum_margin(n)
    e_pos = torch.exp(c)
    a_terms = torch.where(w > 0, w * e_pos, torch.zeros_like(w))  # 0 * inf would be NaN
    a_up = up64(a_terms.sum(-1) * (1 + m))
    b_down = down64((w * torch.exp(-c)).sum(-1) * (1 - m))
    z = w.sum(-1)
    g = 2 * gamma(n)
    return a_up, b_down, down64(z * (1 - g)), up64(z * (1 + g))


def tv_bound_forms(p_tilde, c):
    """Twin of reference.softmax:tv_bound_forms (spec T1c, T2a-d), batched.

    p_tilde: [B, H, N] served attention (>= 0; used as given, not renormalised);
    c: [B, H, N] logit error bounds (>= 0). Returns dict of [B, H] fp32 tensors:
    tanh, one_minus_b_over_a, e_form, min (capped at 1), plus A (up), B (down), max_c.
    NaN/Inf/negative input -> ValueError.
    """
    _checks.tensor("p_tilde", p_tilde, ndim=3)
    _checks.tensor("c", c, ndim=3)
    if p_tilde.shape != c.shape:
        raise ValueError(f"p_tilde shape {tuple(p_tilde.shape)} != c shape {tuple(c.shape)}")
    _checks.nonempty("p_tilde", p_tilde, 2)
    _checks.nonneg_finite("p_tilde", p_tilde)
    _checks.nonneg_finite("c", c)
    p = p_tilde.to(torch.float64)  # exact: every input dtype embeds in fp64
    c64 = c.to(torch.float64)
    if not bool((p.sum(-1) > 0).all()):
        raise ValueError("p_tilde: a row sums to zero")
    a_up, b_down, _, _ = weighted_sums(p, c64)
    one = torch.ones_like(a_up)  # p_tilde is used as given: Z = 1 exactly
    return to_fp32(forms_from_sums(a_up, b_down, one, one, c64.amax(-1)))
