"""Observable TV forms (math.md T1c, T2) computed so they are never below the exact value.

Floating point (math.md T8, spec assumption A5). Two uses, one error model.

tv_bound_forms (and forms_from_sums): the terms and sums run in fp64 and the result is
rounded UP to fp32. Why fp64: with fp32 terms summed in fp32 the rigorous margin gamma_N
(N u, u = 2^-24) reaches ~2.4e-4 at N = 4096, far above the 1e-6 slack a useful bound may
add to 1 - B/A; in fp64 (u64 = 2^-53) the same margin is ~5e-13.

forms_from_pmz (the decode certificate of fast.core.attention): the per-token terms are fp32
(they reuse the softmax's fp32 weights), the sums fp64 (torch.sum(..., dtype=float64)
accumulates in fp64), and the quantities are chosen so that nothing cancels:
Z, P = sum w expm1(c), M = sum w (1 - e^-c), 1 - B/A = (P + M)/(Z + P). Every error is then
relative to its own term: a few u32 per term plus gamma_N(u64) per sum, ~1e-5 in all,
against the 1e-4 relative tolerance; the cancellation of 1 - B'/A' that forced fp64 terms is
gone. See its docstring for the per-term budget.

Error model (fp64, round to nearest, u64 = 2^-53; fp32 the same with u32 = 2^-24):
- torch.exp / torch.expm1 / torch.tanh are within 2 ulp (Sleef u10 / glibc on CPU: 1 ulp;
  CUDA exp: 1 ulp, tanh: 2 ulp; fp32 exp and expm1 measured <= 0.75 ulp on the ranges used).
  One ulp is at most 2 u relative, so EXP_EPS = 8 u64 and EXP32_EPS = 8 u32 (a factor 2 of slack).
- each product p_j e^{+-c_j}: one rounding, relative u64;
- an N-term sum of nonnegative terms, in any order (any summation tree): the exact sum is at
  most the computed one / (1 - gamma_N) (proofs/Float.v: exact_tree_le_computed_div_size_of_nonneg_f64
  for binary64, exact_tree_le_computed_div_of_nonneg_fmt for any format; a tree of known
  depth t gives (1 - u)^t, pow_depth_exact_le_ftree), and at least computed / (1 + u)^(N-1) (each rounded addition of
  nonnegative numbers is at most (1 + u) times the exact one; Higham, Thm 3.1).
Hence exact A' <= computed A' (1 + EXP_EPS)(1 + u64)/(1 - gamma_N) <= computed A' * (1 + 2 (EXP_EPS + gamma_{N+1}))
(the factor 2 absorbs the second-order terms while (N + 10) u64 < 1e-3), and symmetrically
exact B' >= computed B' * (1 - 2 (EXP_EPS + gamma_{N+1})). After every further single
operation the result is moved one ulp outward (`up64` / `down64`): a correctly rounded
result is within half an ulp of the exact one, so one ulp outward is a rigorous bound.
Values below the least normal number (gradual underflow, A5) carry an absolute error of at
most that number (Float.v, rn_ge_sub_of_nonneg); forms_from_pmz adds it explicitly.
"""

import math

import numpy as np
import torch

from fast.core import _checks

from fast.core.floats import U32, U64, _down, _inf, _up, band_norms_up, down32, down64, gamma, up32, up64  # noqa: F401 (re-exported)

EXP_EPS = 8 * U64
EXP32_EPS = 8 * U32  # fp32 exp / expm1 (Sleef u10: 1 ulp; measured <= 0.75 ulp): 2 ulp, twice over
FORMS = ("tanh", "one_minus_b_over_a", "e_form", "min")
CERT_KEYS = ("A", "B", "max_c", "tanh", "one_minus_b_over_a", "e_form", "min")
SATURATE_C = 600.0  # rows with a larger max c report min = 1: e^600 still fits fp64 with room for the sums
CMAX32 = 40.0  # forms_from_pmz takes fp32 terms only for rows with max c_eff <= CMAX32
TINY = {torch.float32: 2.0 ** -126, torch.float64: 2.0 ** -1022}  # least normal number
T_CUT = {torch.float32: 88.0, torch.float64: 709.0}  # e^-T_CUT < TINY
UNIT = {torch.float32: (U32, EXP32_EPS), torch.float64: (U64, EXP_EPS)}


def sum_margin(n):
    """Relative margin for an n-term fp64 sum of products of an exp: see module doc."""
    return 2 * (EXP_EPS + gamma(n + 1))


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

    p_tilde: [B, H, N] served attention weights (>= 0, a positive sum S per row); c: [B, H, N]
    logit error bounds (>= 0). Contract (shared with the reference): each row is taken as the
    distribution p~ / S, with rigorous fp64 bounds on S (a softmax rounded to fp16/bf16/fp32 sums to
    1 only approximately; taken as given, a row below 1 drove (A^2 - 1)/2 below 0). Every form is
    >= its exact value at p~ / S, hence >= TV(p, p~ / S) for p proportional to p~ e^eps, |eps| <= c.
    Returns dict of [B, H] fp32 tensors: tanh, one_minus_b_over_a, e_form, min (capped at 1),
    plus A (up), B (down), max_c. NaN/Inf/negative input or a zero row -> ValueError.
    """
    _checks.weights_and_bounds(p_tilde, c)
    p = p_tilde.to(torch.float64)  # exact: every input dtype embeds in fp64
    c64 = c.to(torch.float64)
    if not bool((p.sum(-1) > 0).all()):
        raise ValueError("p_tilde: a row sums to zero")
    a_up, b_down, s_down, s_up = weighted_sums(p, c64)  # S = sum p~ bounded both ways: A = A'/S, B = B'/S
    return to_fp32(forms_from_sums(a_up, b_down, s_down, s_up, c64.amax(-1)))


def weight_rounding(e, n, d_head, drift=0.0, rescales=0):
    """r_w [B, H] fp64 numpy >= TV(softmax(x^), w / sum w): what the rounding of the served fp32
    weights w_j = fl(exp(fl(x^_j - m))) adds to a certificate (x^ the fp32 logits, m their max over
    the row's tokens, e [B, H] the logit rounding bound). The difference rounds with relative u32 and
    |x^_j - m| <= T = min(2e / ((D + 4) u32), T_CUT) (forms_from_pmz), the fp32 exp within EXP32_EPS
    above the least normal number TINY (A5; kv_exp: checked exhaustively), absolute TINY below (and
    for |x^_j - m| > T_CUT): |w_j - a_j| <= expm1(theta) a_j + TINY, a_j = e^{x^_j - m}, theta =
    u32 T + 2 EXP32_EPS. With sum a >= 1 (the argmax term), proofs/Served.v
    tv_normalized_le_of_rel_abs: TV(a / sum a, w / sum w) <= expm1(theta) + n TINY.
    The Triton kernel (online softmax; fp32 exp: libdevice's expf on a GPU, numpy's under the
    interpreter, A5) serves w_j = p_j prod alpha, p_j at the block's running max, rescaled by
    alpha = exp(fl(m_old - m_new)) at most `rescales` times, sum |m_old - m_new| = drift:
    theta = 2 u32 (T + drift) + 2 EXP32_EPS (1 + rescales) (each exponent's rounding counted twice).
    Every operation is rounded up (nextafter); expm1 within EXP_EPS."""
    T = np.minimum(_up(2 * e / ((d_head + 4) * U32)), T_CUT[torch.float32])
    if rescales:
        theta = _up(2 * U32 * _up(T + drift) + 2 * EXP32_EPS * (1 + rescales))
    else:
        theta = _up(U32 * T + 2 * EXP32_EPS)
    return _up(_up(np.expm1(theta) * (1 + EXP_EPS)) + n * TINY[torch.float32])


def with_weight_rounding(forms, r_w):
    """forms (fp64 torch dict of forms_from_sums) + r_w ([B, H] fp64) on every TV bound (tanh,
    one_minus_b_over_a, e_form, min; capped at 1): TV(p, w_served) <= TV(p, p^) + TV(p^, w_served)
    (proofs/Served.v tv_served_le). A, B and max_c stay those of softmax(x^)."""
    out = dict(forms)
    for key in FORMS:
        out[key] = up64(forms[key] + r_w)
        if key != "e_form":
            out[key] = torch.clamp(out[key], max=1.0)
    return out


def with_other_logits(cert, e):
    """cert: the fp32 TV forms [..., H] of one fp32 evaluation x^ of a read's logits (its weights
    w^ served: each form >= TV(p, w^ / sum w^)); e: [B, H] fp64 >= |x^_j - x~_j| for x^ and for
    another evaluation x' of the same logits whose weights w' were served instead (the fused kernel's
    output, certified after the fact by the twin). Adds tanh(e) to every TV form:
    TV(p, w') <= TV(p, softmax(x^)) + TV(softmax(x^), softmax(x')) + TV(softmax(x'), w' / sum w')
    (proofs/Served.v tv_triangle), the middle term <= tanh(4e / 4) (T1: x' - x^ in [-2e, 2e]) and
    the last one the r_w the forms already carry (the same weight_rounding bound covers both
    evaluations: it depends on e, n and D only)."""
    t = tanh_half_up(2 * torch.as_tensor(e, dtype=torch.float64))  # tanh(e), rounded up
    out = dict(cert)
    for key in FORMS:
        x = cert[key].double()
        tt = t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[1]).to(x.device)
        out[key] = up32(up64(x + tt))
        if key != "e_form":
            out[key] = torch.clamp(out[key], max=1.0)
    return out


def forms_from_pmz(sums, cmax, e, n, d_head, dtype):
    """The decode certificate (fast.core.attention) from the weighted sums of one step.

    sums: fp64 [3, B, H], the computed Z = sum w_j, P = sum w_j expm1(c_j), M = sum w_j (1 - e^-c_j)
    (fast.core.attention.weighted_sums), each term formed in `dtype` (fp32 or fp64) and summed in fp64,
    w_j = fl(exp(fl(x_j - m))) the softmax weights of the fp32 logits x (0 at padding), c_j the
    witness bounds in dtype (c_j + 2^-150 >= the exact bound); cmax [B, H] >= max_j c_j; e [B, H]
    fp64 numpy, the logit rounding bound (fast.core.certify.logit_rounding); n tokens, d_head = D.
    Every TV form (tanh, one_minus_b_over_a, e_form, min) includes r_w = weight_rounding(e, n, d_head):
    it bounds TV(softmax(x), w / sum w), the fp32 weights served (w computed in fp32 whatever dtype
    the terms use here). Returns the fp32 dict (A up, B down, max_c, tanh, one_minus_b_over_a, e_form, min), or None
    when dtype is fp32 and a row has max c_eff > CMAX32 (the caller redoes it in fp64); fp64
    rows with max c_eff > SATURATE_C report the saturated certificate (A = inf, min = 1).

    Exact targets, with c_eff = c + 2e (fast.core.attention) and w_j = e^{x_j - m} exactly:
    Z, P_eff = sum w expm1(c_eff), M_eff = sum w (1 - e^-c_eff); A = 1 + P_eff/Z,
    B = 1 - M_eff/Z, 1 - B/A = (P_eff + M_eff)/(Z + P_eff), e_form = (A^2 - 1)/2 = (P/Z)(1 + P/(2Z)):
    sums of nonnegative terms, no cancellation. With d >= 2e + 2^-149 (so c_eff <= c + d),
    expm1(a + d) = e^d expm1(a) + expm1(d), 1 - e^-(a+d) = e^-d (1 - e^-a) + (1 - e^-d):
    P_eff <= e^d P + expm1(d) Z, M_eff <= e^-d M + (1 - e^-d) Z. Every form is nondecreasing in P (at the exact Z >= M), in M, and nonincreasing in Z:
    P, M bounded up, Z down.

    The sums. Per-term error, relative to the exact term, first order (u = unit roundoff of dtype):
    - w_j: the difference x_j - m rounds with relative u, i.e. the exponent moves by u |x_j - m|,
      at most u T with T = min(2e / ((D + 4) u32), T_CUT): |x_j| <= s sum |q||kmax| + e and e
      carries (D + 4) u32 1.01 times that sum, so |x_j - m| <= 2e / ((D + 4) u32) (the 1.01 pays
      for 2 u32 e and the fp64 error of e); a term with |x_j - m| > T_CUT is below TINY and goes
      to the absolute part. exp: eps (EXP_EPS / EXP32_EPS).
    - expm1(c_j): eps; for M, 1 + expm1 and the division: 2u (y/(1+y) has relative
      sensitivity <= 1 to y); the product with w_j: u.
    - the fp64 sum of n nonnegative terms (fp32 values, exact in fp64) in any order:
      gamma_n(u64) (proofs/Float.v, exact_tree_le_computed_div_size_of_nonneg_f64; the
      other side: each rounded addition of nonnegative numbers is at most (1 + u) times exact).
    r1 = u T + 2 eps + 3u + gamma_n; the products and quotients of all (1 +- delta) factors lie
    within 1 +- 2 r1 while r1 <= 1e-3 (e^x <= 1 + 2x, 1/(1 - x) <= 1 + 2x): margin = 2 r1, and the
    few roundings of r1 itself are far inside that factor 2.
    Absolute part: results below TINY (gradual underflow, spec A5) err by at most TINY each; with
    w <= 1 and expm1(c) <= e^cap: at most 8 TINY e^cap per term, alpha = n 8 TINY e^cap per sum;
    for Z, whose exact value is >= 1 (the argmax term) and computed one >= 1/2, alpha <= 2 alpha Z.

    After the sums ([B, H] fp64, numpy). d and cm are rounded up op by op (nextafter). The rest
    is +, x, / of nonnegative numbers (no cancellation; inputs bounded in the direction that
    moves each output up), each correctly rounded: an output after k roundings is within
    (1 + u64)^k / (1 - u64)^k of its exact value at the bounds, k <= 24 here (e_form, the
    longest chain), so a final factor 1 + 2^-46 (= 128 u64) and one ulp up cover it. expm1
    (torch, fp64) within EXP_EPS; e^d = 1 + expm1(d), e^-d = 1 - |expm1(-d)| are sums near 1
    (no cancellation); tanh(cm/2) = y/(y + 2) with y = expm1(cm) (increasing in y). B = 1 - M/Z: one subtraction, moved one ulp down.
    """
    u, eps = UNIT[dtype]
    cap = CMAX32 if dtype == torch.float32 else SATURATE_C
    z, p, m = sums.cpu().numpy()
    cmax = cmax.cpu().numpy().astype(np.float64)
    d = _up(2 * e + 2.0 ** -149)
    cm = _up(cmax + d)  # >= max_j c_eff_j
    margin = 2 * (u * np.minimum(2 * e / ((d_head + 4) * U32), T_CUT[dtype]) + 2 * eps + 3 * u + gamma(n))
    wild = (cm > cap) | (margin > 2e-3)
    if dtype == torch.float32 and wild.any():
        return None
    alpha = n * 8 * TINY[dtype] * math.exp(cap)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is an upper bound; NaN only in saturated rows, replaced below
        em_d, om_d, em_c = np.abs(torch.expm1(torch.from_numpy(np.stack([d, -d, np.minimum(cm, SATURATE_C)]))).numpy())
        z_up = z * (1 + margin + 2 * alpha)
        z_dn = z * (1 - margin - 2 * alpha)
        p_eff = (1 + em_d * (1 + EXP_EPS)) * (p * (1 + margin) + alpha) + em_d * (1 + EXP_EPS) * z_up
        m_eff = (1 - om_d * (1 - EXP_EPS)) * (m * (1 + margin) + alpha) + om_d * (1 + EXP_EPS) * z_up
        pz = p_eff / z_dn  # A - 1
        em_c = em_c * (1 + EXP_EPS)  # >= expm1(min(cm, 600)); tanh(cm/2) = y/(y + 2) at y = expm1(cm), increasing in y
        tanh = em_c / (em_c + 2)  # for cm > 600: y/(y + 2) rounds to 1, and tanh <= 1
        rows = np.stack([1 + pz, m_eff / z_dn, tanh, (p_eff + m_eff) / (z_dn + p_eff), pz * (1 + 0.5 * pz)])
        a, mz, tanh, one_minus, e_form = _up(rows * (1 + 2.0 ** -46))
        neg_b = np.minimum(_up(mz - 1), 0.0)  # -B rounded up; B >= 0
        r_w = weight_rounding(e, n, d_head)  # the served fp32 weights: TV(p, w) <= TV(p, p^) + r_w
        tanh, one_minus, e_form = _up(tanh + r_w), _up(one_minus + r_w), _up(e_form + r_w)
        tanh, one_minus = np.minimum(tanh, 1.0), np.minimum(one_minus, 1.0)  # TV <= 1
        if wild.any():  # saturated rows: A' = inf, B' = 0
            a, neg_b, one_minus, e_form = (np.where(wild, v, x) for v, x in ((np.inf, a), (0.0, neg_b), (1.0, one_minus), (np.inf, e_form)))
        lowest = np.clip(np.minimum(np.minimum(tanh, one_minus), e_form), 0.0, 1.0)  # TV lies in [0, 1]
        out = np.stack([a, neg_b, cm, tanh, one_minus, e_form, lowest])
        out32 = out.astype(np.float32)
    out32 = np.where(out32 < out, np.nextafter(out32, np.float32(np.inf)), out32)  # rounded up to fp32
    out32[1] = -out32[1]  # B rounded down
    return dict(zip(CERT_KEYS, torch.from_numpy(out32).to(sums.device).unbind(0)))


def logit_rounding(q, kmax, s):
    """e [B, H] fp64 >= |x^_j - s <q, k~_j>| for the fp32 logits x^ (module doc), with
    sum_i |q_i| |k~_ji| <= sum_i |q_i| kmax_i (kmax: [B, Hkv, D] per-channel bound):
    (D + 4) u32 1.01 s sum_i |q_i| kmax_i + (2.02 D s + 1) 2^-150 (spec T8e, proofs/FloatDot.v: the
    absolute part pays for products and a logit below the normal range)."""
    e = logit_rounding_np(q.to(torch.float64).cpu().numpy(), kmax.cpu().numpy(), s)
    return torch.from_numpy(e).to(q.device)


def logit_rounding_np(q64, kmax, s):
    """logit_rounding on numpy fp64 arrays q64 [B, H, D], kmax [B, Hkv, D] (small: numpy is
    cheaper per op than torch). The fp64 sum and the product with s may round down by
    O(D u64) relative: far inside the 1.01 of the formula; the last product is rounded up."""
    B, H, D = q64.shape
    Hkv = kmax.shape[1]
    qk = np.matmul(np.abs(q64).reshape(B, Hkv, H // Hkv, D), kmax[..., None])  # [B, Hkv, G, 1]
    rel = s * qk.reshape(B, H) * ((D + 4) * U32 * 1.01)
    absolute = (2.03 * D * s + 1) * 2.0 ** -150  # 2.03 > 2.02: pays for the fp64 roundings of this line
    return _up(rel + absolute)  # one ulp up covers the rounding of the sum (nonnegative terms)


def forms_with_margin(a, b, z, cmax, margin):
    """Forms from computed sums a ~ A', b ~ B', z ~ Z (fp64, [B, H]) and their relative error
    bound `margin`. A row with max c > SATURATE_C (logit errors of hundreds: tanh(c/2) = 1
    already) or a margin that is not small reports the saturated certificate:
    A' = inf, B' = 0 (so 1 - B/A = 1, e_form = inf, min = 1)."""
    wild = (margin > 1e-3) | (cmax > SATURATE_C)
    zero = torch.zeros_like(b)
    a_up = torch.where(wild, torch.full_like(a, torch.inf), up64(a * (1 + margin)))
    b_down = torch.where(wild, zero, torch.nextafter(b * (1 - margin), zero))
    z_down = torch.where(wild, torch.ones_like(z), torch.nextafter(z * (1 - margin), zero))  # Z >= 1: the argmax term
    z_up = torch.where(wild, torch.full_like(z, torch.inf), up64(z * (1 + margin)))
    return forms_from_sums(a_up, b_down, z_down, z_up, cmax)
