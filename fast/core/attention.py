"""One decode step of attention over a (quantized) KV cache, with its certificate.

decode_attention returns the output and, from the same logits, the certificate: the
forms of math.md T2 built from three running sums over the cache,
    Z = sum_j e^{x_j - m},  A' = sum_j e^{x_j - m + c_j},  B' = sum_j e^{x_j - m - c_j},
so A = A'/Z, B = B'/Z and B/A = B'/A' (the Triton kernel carries them online, with the
running max m, next to the softmax). The torch twin sums instead, without cancellation,
    Z,  P = A' - Z = sum_j e^{x_j - m} expm1(c_j),  M = Z - B' = sum_j e^{x_j - m} (1 - e^{-c_j}),
reusing the softmax's own fp32 weights e^{x_j - m} (fast.core.certify.forms_from_pmz).

What the certificate bounds (math.md T8). x^ are the kernel's fp32 logits; x~ = s<q, k~>
exactly; x = s<q, k> over the exact keys. fp32 rounding gives |x^_j - x~_j| <= e (one
bound per row, below), and the witness gives |x_j - x~_j| <= c_j. With
c_eff = c + 2 e, the reported forms of (softmax(x^), c_eff) are
- >= the exact formula on the same inputs, forms(softmax(x~), c). Write p~ = softmax(x~),
  p^ = softmax(x^), d_j = x~_j - x^_j (|d_j| <= e), so p~_j = p^_j e^{d_j} / sum_i p^_i e^{d_i}:
    A(p~, c) = sum p^ e^{d + c} / sum p^ e^{d} <= e^{e} A(p^, c) / e^{-e} = A(p^, c + 2e),
    B(p~, c) / A(p~, c) = sum p^ e^{d - c} / sum p^ e^{d + c} >= B(p^, c + e) / A(p^, c + e)
  and every form is nondecreasing in c, so forms(p~, c) <= forms(p^, c + 2e) (tanh: max c grows);
- >= TV(softmax(x), softmax(x^)) directly by T2, since |x_j - x^_j| <= c_j + e;
and every TV form then adds r_w (fast.core.certify.weight_rounding, T5c): >= TV(softmax(x), w / sum w)
for the fp32 weights w the output is made of (the attention the server actually computed).
The sums and their margins: fast.core.certify.forms_from_pmz (fp32 terms, fp64 sums, any order:
proofs/Float.v), and attention_torch for when the fp64 terms are used instead.

e: the D-term fp32 dot product is within gamma_D sum_i |q_i| |k~_ji| (Higham 3.5, any
order, FMA or not), the fp32 scale and the product with it add 2 u: e = s (D + 4) u (1.01)
sum_i |q_i| kmax_i, in fp64, with kmax_i >= |k~_ji| for every token (one bound per channel). This needs fp32 matmuls at full precision
(torch.get_float32_matmul_precision() == "highest", no TF32): checked at call time.

Inputs: NaN/Inf anywhere (q, keys, values, witness; padding slots included: store zeros
there) -> ValueError. Checks on keys and values are made on the logits and the output
([B, H, N] and [B, H, D]), so a cache is never re-read just to validate it.
"""

import math

import numpy as np
import torch

from fast.core import _checks
from fast.core.certify import CMAX32, EXP32_EPS, SATURATE_C, U32, _up, band_norms_up, forms_from_pmz, forms_from_sums, forms_with_margin, gamma, logit_rounding, logit_rounding_np, up32, up64
from fast.core.quant import QMAX, STEP_MARGIN, QTensor, dequantize, max_abs
from fast.core.witness import IN_DTYPES, _check_scale, logit_error_bound64, unpack_witness, witness_from_scales, witness_from_step


F32_MIN_N = 256  # from this many tokens on, the certificate reuses the fp32 softmax weights (see attention_torch)


def _cache_shape(name, t):
    if isinstance(t, QTensor):
        return tuple(t.shape)
    _checks.tensor(name, t, ndim=4, dtypes=IN_DTYPES)
    return tuple(t.shape)


def _check_inputs(q, k, v, rho, scale, bands, valid, exact):
    """Validate and normalise; returns (s, bands, rho [B,Hkv,N,NB] fp32/fp16, valid, exact)."""
    _checks.tensor("q", q, ndim=3, dtypes=IN_DTYPES)
    s = _check_scale(scale)
    B, H, D = q.shape
    kshape, vshape = _cache_shape("k", k), _cache_shape("v", v)
    if kshape[0] != B or kshape[3] != D or vshape[:3] != kshape[:3]:
        raise ValueError(f"shapes do not line up: q {tuple(q.shape)}, k {kshape}, v {vshape}")
    if vshape[3] != D:
        raise ValueError(f"v: head size {vshape[3]} != the query and key head size {D}")
    Hkv, N = kshape[1], kshape[2]
    _checks.gqa(H, Hkv)
    if N == 0:
        raise ValueError("k: empty cache (N = 0)")
    bands = _checks.bands_tensor(bands, D).to(q.device)
    if rho is None:
        if not isinstance(k, QTensor):
            raise ValueError("rho: a witness is required for a float key cache")
    else:
        if isinstance(rho, torch.Tensor) and rho.dtype == torch.uint8:
            rho = unpack_witness(rho)
        _checks.tensor("rho", rho, ndim=4, dtypes=(torch.float32, torch.float16))
        if tuple(rho.shape) != (B, Hkv, N, bands.shape[0]):
            raise ValueError(f"rho: shape {tuple(rho.shape)}, expected {(B, Hkv, N, bands.shape[0])}")
        _checks.nonneg_finite("rho", rho)
    _checks.finite("q", q)
    if valid is not None:
        _checks.tensor("valid", valid, dtypes=(torch.bool,))
        if tuple(valid.shape) != (B, N):
            raise ValueError(f"valid: shape {tuple(valid.shape)}, expected {(B, N)}")
        if not bool(valid.any(-1).all()):
            raise ValueError("valid: a sequence has no valid token")
    if exact is not None:
        _checks.tensor("exact", exact, dtypes=(torch.bool,))
        if tuple(exact.shape) != (B, Hkv, N):
            raise ValueError(f"exact: shape {tuple(exact.shape)}, expected {(B, Hkv, N)}")
    if torch.get_float32_matmul_precision() != "highest":
        raise ValueError("decode_attention: needs torch.set_float32_matmul_precision('highest') (the logit error bound assumes full fp32 products)")
    if q.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        raise ValueError("decode_attention: TF32 matmuls are on; the logit error bound assumes full fp32 products")
    return s, bands, rho, valid, exact


def _token_scaled(t):
    """(codes as fp32 [B,Hkv,N,D], scale [B,Hkv,1,N] fp32) for an int8 cache with one scale per
    token and head, whose dequantization m * scale is exact (11-bit scale x 8-bit code); else None."""
    if isinstance(t, QTensor) and t.scheme == "int8" and t.scales.shape[-1] == 1:
        return t.codes.to(torch.float32), t.scales.to(torch.float32).transpose(-1, -2)
    return None


def token_kappa64(q64, bands, s):
    """kappa [B, H] (numpy fp64) >= s sum_b ||q_b|| sqrt(n_b) (n_b coordinates in band b), so that
    the zero-memory witness of an integer cache with one scale per token and head gives
    c_j = kappa h_j (rho_{j,b} = h_j sqrt(n_b), h_j = scale_j (1 + 2^-10) / 2, delta constant on
    the token): O(N) per head, no [N, NB] witness. In numpy ([B, H] is small: fewer op costs).
    ||q_b||: as fast.core.witness.band_norms_up (squares exact in fp64, W-term sum, sqrt: 2 gamma_{W+4})
    rounded up; sqrt(n_b) correctly rounded (IEEE), rounded up; the NB-term sum gamma_NB, the
    product with s one rounding, one more for a later product with h_j: margin 2 gamma_{NB+3}."""
    NB, W = bands.shape
    qb = q64[..., bands.cpu().numpy()]  # [B, H, NB, W]
    norms = _up(np.sqrt((qb * qb).sum(-1)) * (1 + 2 * gamma(W + 4)))
    kappa = norms.sum(-1) * _up(math.sqrt(W)) * s
    return _up(kappa * (1 + 2 * gamma(NB + 3)))


def token_scale_h(k, valid, exact):
    """h_j = scale_j (1 + 2^-10) / 2, fp32 [B, Hkv, N], exact (an 11-bit fp16 scale times the
    11-bit constant 2^-1 + 2^-11, no underflow), set to 0 at exact and at padding tokens."""
    h = k.scales[..., 0].to(torch.float32) * (STEP_MARGIN * 0.5)
    if exact is not None:
        h = h.masked_fill(exact, 0.0)
    if valid is not None:
        h = h.masked_fill(~valid.unsqueeze(1), 0.0)
    return h


def witness_bounds(q, q64, k, rho, bands, s, valid, exact, dtype):
    """(c [B, H, N], cmax [B, H]) in dtype (fp32 or fp64): c_j + 2^-150 >= the exact witness
    bound s sum_b ||q_b|| rho_{j,b} of every valid, non-exact token; c = 0 at exact and at padding
    tokens; cmax = max_j c_j. valid: [B, N] (every row reads the same tokens) or [B, H, N] (one
    mask per query row, attention_rows). fp32 from an fp64 value y >= c_exact: fl32(y (1 + 2^-22)) >=
    y (1 + 2^-22)(1 - u64)(1 - u32) - 2^-150 >= y - 2^-150 (rounding to nearest: relative u32
    above the least normal 2^-126, absolute 2^-150 below it; Float.v rn_ge_sub_of_nonneg).
    fp32 products fl32(kappa32 h_j) with kappa32 >= kappa (1 + 2^-22): the same argument, and
    max_j fl32(kappa32 h_j) = fl32(kappa32 max_j h_j) (rounding is monotone)."""
    B, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    rows = valid is not None and valid.dim() == 3  # a mask per query row
    if rho is None:  # integer cache, one scale per token and head: c_j = kappa h_j
        kappa = token_kappa64(q64, bands, s)
        h = token_scale_h(k, None if rows else valid, exact)
        if dtype == torch.float64:
            c = up64(torch.from_numpy(kappa).to(q.device).view(B, Hkv, G, 1) * h.to(torch.float64).unsqueeze(2)).view(B, H, N)
            if rows:
                c = c.masked_fill(~valid, 0.0)
            return c, c.amax(-1)
        k1 = _up(kappa * (1 + 2.0 ** -22))
        k32 = k1.astype(np.float32)
        k32 = torch.from_numpy(np.where(k32 < k1, np.nextafter(k32, np.float32(np.inf)), k32)).to(q.device).view(B, Hkv, G, 1)
        c = (k32 * h.unsqueeze(2)).view(B, H, N)
        if rows:
            c = c.masked_fill(~valid, 0.0)
            return c, c.amax(-1)
        return c, (k32 * h.amax(-1).view(B, Hkv, 1, 1)).view(B, H)
    c = logit_error_bound64(q, rho, bands, s)
    if exact is not None:
        c = c.masked_fill(exact.repeat_interleave(G, dim=1), 0.0)
    if valid is not None:
        c = c.masked_fill(~(valid if rows else valid.unsqueeze(1)), 0.0)
    if dtype == torch.float32:
        c = c.mul_(1 + 2.0 ** -22).to(torch.float32)
    return c, c.amax(-1)


def weighted_sums(w, c):
    """fp64 [3, B, H]: Z = sum w, P = sum w expm1(c), M = sum w (1 - e^-c) = sum w expm1(c) / (1 + expm1(c)),
    for w, c [B, H, N] of one dtype (terms formed in that dtype, summed in fp64). No cancellation."""
    t = torch.empty((2,) + tuple(w.shape), dtype=w.dtype, device=w.device)
    torch.expm1(c, out=t[0])
    torch.add(t[0], 1, out=t[1])
    torch.div(t[0], t[1], out=t[1])
    t.mul_(w)
    return torch.cat([w.sum(-1, dtype=torch.float64).unsqueeze(0), t.sum(-1, dtype=torch.float64)])


def _dense(t):
    """What the torch twin multiplies with: (codes fp32 [B,Hkv,N,D], scale [B,Hkv,1,N]) for an int8
    cache with one scale per token and head, else the dequantized fp32 tensor [B, Hkv, N, D]."""
    ts = _token_scaled(t)
    if ts is not None:
        return ts
    return dequantize(t) if isinstance(t, QTensor) else t.to(torch.float32)


def _gamma32(n):
    """gamma_n for fp32 (u = 2^-24), inf once n u >= 1/2 (no margin left to state)."""
    nu = n * U32
    return nu / (1 - nu) if nu < 0.5 else math.inf


def value_info(v, v_err):
    """What the output bound (math.md T5) needs from the value cache, once per call:
    err [B, Hkv, N] fp64 (v_err, >= ||v_j - v~_j||, 0 at exact tokens), rad [B, Hkv, N] fp64
    >= ||v~_j - centre|| (centre: the fp32 mean of v~ over the tokens; any centre gives
    diam{v~} <= 2 max_j ||v~_j - centre||), vnorm [B, Hkv] fp64 >= ||vmax|| with vmax_i >=
    max_j |v~_ji| (for the output's fp32 rounding). Norms: fast.core.certify.band_norms_up with
    one band of all D coordinates (v~ - centre: a difference of two fp32 values)."""
    _checks.tensor("v_err", v_err, ndim=3, dtypes=(torch.float32, torch.float16))
    vshape = _cache_shape("v", v)
    if tuple(v_err.shape) != vshape[:3]:
        raise ValueError(f"v_err: shape {tuple(v_err.shape)}, expected {vshape[:3]}")
    _checks.nonneg_finite("v_err", v_err)
    D = vshape[3]
    vd = dequantize(v) if isinstance(v, QTensor) else v.to(torch.float32)
    centre = vd.mean(2, keepdim=True)
    one_band = torch.arange(D, device=vd.device).unsqueeze(0)
    rad = band_norms_up(vd.to(torch.float64) - centre.to(torch.float64), one_band)[..., 0]
    return {"err": v_err.to(torch.float64), "rad": rad, "vnorm": value_norm_up(max_abs(v))}


def value_norm_up(vmax):
    """[...] fp64 >= ||vmax|| over the last axis (D channels): fp64 squares, band_norms_up's margin, one ulp up."""
    v = vmax.to(torch.float64)
    return up64(torch.sqrt((v * v).sum(-1)) * (1 + 2 * gamma(v.shape[-1] + 4)))


def output_error_bound(w, valid, vinfo, tv, N, D, scaled=False):
    """out_err [B, H] fp32 >= ||o - out||: o = sum_j p_j v_j the exact attention output (exact
    keys and values), out the fp32 output served from the weights w [B, H, N] (fp32, 0 at masked
    tokens) over v~. With p_w = w / sum w (the distribution the output is made of):
      ||o - out|| <= ||o - sum p_w v~|| + ||sum p_w v~ - out||
      ||o - sum p_w v~|| <= TV(p, p_w) diam{v} + sum_j p_w,j ||e_j||            (math.md T5a)
      diam{v} <= diam{v~} + 2 max ||e_j|| <= 2 max ||v~_j - centre|| + 2 max ||e_j||  (T5b)
    and tv >= TV(p, p_w) (the certificate's min: it includes the weights' rounding r_w,
    fast.core.certify.weight_rounding). The output's fp32 arithmetic, per coordinate i: S_i =
    sum_j w_j v~_ji is a SIGNED N-term fp32 dot product (a matmul, any order, FMA or not; for a
    token-scaled int8 cache the leaves are fl(w_j sc_j) times the codes |m| <= 127, one more
    rounding each): by T8d (proofs/FloatDot.v abs_fdot_sub_le_f32)
      |S^_i - S_i| <= (gamma_N (1 + u) + u) sum_j w_j |v~_ji| + a_N,
      a_N = (2N - 1) 2^-150 / (1 - N u)  [+ 128 N 2^-150 (1 + gamma_N) token-scaled],
    the fp32 sum W^ of w within g W, g = gamma_N / (1 - gamma_N) (T8a, T8f), the division one
    rounding (relative u, absolute 2^-150): by T5d (proofs/Served.v out_quotient_le_f32), with
    c = gamma_N (1 + u) + u, |out_i - S_i / W| <= ((1 + u)(c + g)/(1 - g) + u) vmax_i
    + (1 + u) a_N / ((1 - g) W) + 2^-150 (W = sum w >= Z (1 - 2 gamma_N(u64)), Z its fp64 sum).
    In norm: that coefficient times ||vmax|| plus sqrt(D) times the absolute part (values near the
    fp32 subnormal range: products and sums below 2^-126).
    Maxima over the row's visible tokens only (valid: [B, N] or [B, H, N]). Terms nonnegative,
    fp64, a dozen roundings: the final factor 1 + 2^-40, then rounded up to fp32."""
    B, H, _ = w.shape
    Hkv = vinfo["err"].shape[1]
    G = H // Hkv
    w64 = w.to(torch.float64).view(B, Hkv, G, N)
    err = vinfo["err"]
    S = torch.matmul(w64, err.unsqueeze(-1)).view(B, H)  # N products and an N-term sum in fp64
    Z = w64.sum(-1).view(B, H)
    if valid is None:
        vis = torch.ones(B, 1, 1, N, dtype=torch.bool, device=w.device)
    else:
        vis = valid.view(B, 1, 1, N) if valid.dim() == 2 else valid.view(B, Hkv, G, N)
    rmax = torch.where(vis, vinfo["rad"].unsqueeze(2), 0.0).amax(-1).expand(B, Hkv, G).reshape(B, H)
    emax = torch.where(vis, err.unsqueeze(2), 0.0).amax(-1).expand(B, Hkv, G).reshape(B, H)
    return output_error_from_sums(S, Z, rmax, emax, vinfo["vnorm"].repeat_interleave(G, dim=1), tv, N, D, scaled)


def output_error_from_kernel(Z, vstats, vmax, tv, N, D):
    """out_err [B, T, H] of a fused C++ read (fast.core.cpu_fused._run(value=...)): Z [B, T, H] its stats' weight sums,
    vstats [B, T, H, 3] (sum w e, max e, max radius), vmax [B, Hkv, D], tv [B, T, H] its certificate."""
    G = tv.shape[-1] // vmax.shape[1]
    vnorm = value_norm_up(vmax).repeat_interleave(G, dim=1)[:, None, :]  # [B, 1, H]
    return output_error_from_sums(vstats[..., 0], Z, vstats[..., 2], vstats[..., 1], vnorm, tv, N, D)


def output_error_from_sums(S, Z, rmax, emax, vnorm, tv, N, D, scaled=False):
    """output_error_bound from its sums, [B, H] (or any shape) fp64 each: S = sum_j w_j e_j (fp64 products of fp32
    values, an N-term fp64 sum), Z = sum_j w_j (fp64), rmax >= max ||v~_j - centre|| and emax = max e_j over the row's
    tokens, vnorm >= ||vmax|| (vmax_i >= max_j |v~_ji|); tv >= TV(p, p_w). Shared by the torch twin and the fused C++
    read (fast.core.cpu_fused, _run(value=...): its output is an N-term fp32 dot product in a fixed tree, divided by
    fl32(Z), which is within g W of W = sum w as the fp32 sum the argument above takes)."""
    z_lo = Z * (1 - 2 * gamma(N))
    spread = S * (1 + 2 * gamma(N + 2)) / z_lo
    tv_w = torch.clamp(tv.to(torch.float64), max=1.0)
    g32 = _gamma32(N)
    g = g32 / (1 - g32) if g32 < 0.5 else math.inf  # |W^ - W| <= g W (T8a: W (1 - g32) <= W^; T8f: W^ (1 - g32) <= W)
    c = g32 * (1 + U32) + U32  # the dot product's relative part, with the token-scaled leaves' extra rounding
    eta = 2.0 ** -150
    a_n = (2 * N - 1) * eta / (1 - N * U32) if N * U32 < 0.5 else math.inf
    if scaled:
        a_n += 128 * N * eta * (1 + g32)
    # T5d (proofs/Served.v out_quotient_le_f32) with E = c W vmax_i + a_n, V = vmax_i: per coordinate
    # ((1 + u)(c + g)/(1 - g) + u) vmax_i + (1 + u) a_n / ((1 - g) W) + eta; in norm, ||vmax|| and sqrt(D)
    rel = ((1 + U32) * (c + g) / (1 - g) + U32) * (1 + 1e-9) if g < 1 else math.inf
    arith = rel * vnorm
    subnormal = math.sqrt(D) * (1 + 1e-9) * ((1 + U32) * a_n / ((1 - g) * z_lo) + eta)
    bound = (tv_w * (2 * rmax + 2 * emax) + spread + arith + subnormal) * (1 + 2.0 ** -40)
    return up32(bound)


def served_distance(a, b):
    """[...] fp32 >= ||a - b|| over the last axis, for a, b fp32 (or bf16 / fp16) tensors of one shape:
    the difference of two fp32 values is exact in fp64, the norm as fast.core.certify.band_norms_up
    (one band of all coordinates), rounded up. ||o - b|| <= ||o - a|| + ||a - b||: what an output bound
    of a gains when b is served instead (the Triton kernel's output against its torch twin's, the cast of
    the fp32 output to a bf16 / fp16 model's dtype)."""
    d = a.to(torch.float64) - b.to(torch.float64)
    one_band = torch.arange(d.shape[-1], device=d.device).unsqueeze(0)
    return up32(band_norms_up(d, one_band)[..., 0])


def attention_torch(q, k, v, rho, s, bands, valid, exact, certify=True, dense=None, kmax=None, vinfo=None, box_form=False,
                    subspace=None):
    """Torch twin. Returns out [B, H, D] fp32 and the fp32 certificate dict (or None).

    valid: [B, N] (every row reads the same tokens), [B, H, N] (one mask per query row:
    attention_rows flattens its rows into the head axis) or None. dense: (_dense(k), _dense(v))
    when the caller already has them; kmax: max_abs(k); vinfo: value_info(v, v_err), which adds
    the output bound "out_err" (math.md T5) to the certificate. box_form=True (opt-in, O(K N log N)
    per row) adds the box form "box" (spec T9, fast.core.box.box_form_of_read) into "min".
    subspace: (U, a, tau, sigma), the query-subspace witness of the cache's keys (fast.core.subspace,
    spec T4e; the rows of one KV head contiguous, as decode and attention_rows lay them out): every token's shift gets the signed interval
    [lo, hi] = [max(lo_sub, -c), min(hi_sub, c)] (both enclosures hold, so their intersection does;
    [0, 0] where c = 0: exact and padding tokens), certified in fp64 (subspace_forms).

    Logits x^ = fl(fl(q . k~) s32); for an int8 cache with one scale per token the scale is
    applied to the dot product instead (fl(fl(fl(q . m) scale) s32), k~ = m scale exactly):
    one more rounding, inside the (D + 4) u of logit_rounding, and no [N, D] multiply.
    The certificate reuses the softmax's own fp32 weights w and fp32 witness bounds c when
    N >= F32_MIN_N and every row has max c_eff <= CMAX32 (margins in
    fast.core.certify.forms_from_pmz: a relative few 1e-6, fine for the 1e-4 tolerance of the
    conformance suite); otherwise (rows with large c, or few tokens, where the fp64
    margins keep the twin within 1e-6 of the Triton kernel) it recomputes w and c in fp64.
    """
    B, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    q32 = q.to(torch.float32).view(B, Hkv, G, D)
    s32 = torch.tensor(s, dtype=torch.float32)
    kx, vx = dense if dense is not None else (_dense(k), _dense(v))
    if isinstance(kx, tuple):
        x = torch.matmul(q32, kx[0].transpose(-1, -2)) * kx[1] * s32
    else:
        x = torch.matmul(q32, kx.transpose(-1, -2)) * s32
    x = x.view(B, H, N)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("k or q: non-finite logits (NaN/Inf in the key cache, or logits overflow fp32)")
    vmask = None if valid is None else (valid.view(B, 1, N) if valid.dim() == 2 else valid)
    xm = x if vmask is None else x.masked_fill(~vmask, -torch.inf)
    w = torch.exp(xm - xm.amax(-1, keepdim=True))
    if isinstance(vx, tuple):
        out = torch.matmul(w.view(B, Hkv, G, N) * vx[1], vx[0])
    else:
        out = torch.matmul(w.view(B, Hkv, G, N), vx)
    out = out.view(B, H, D) / w.sum(-1, keepdim=True)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("v: NaN/Inf in the value cache")
    if not certify:
        return out, None
    q64 = q.to(torch.float64).cpu().numpy()  # [B, H]-sized work runs in numpy
    e = logit_rounding_np(q64, (max_abs(k) if kmax is None else kmax).cpu().numpy(), s)
    if isinstance(kx, tuple):  # fl(fl(fl(q . m) sc) s32): the absolute part grows with the scale
        sc_max = float(kx[1].max()) if kx[1].numel() else 0.0  # (FloatDot.v logit_rounding_le_code_f32_scaled)
        e = _up(e + (2.03 * D * s * sc_max + 1.02 * s) * 2.0 ** -150)
    cert = None
    if subspace is not None:
        c, _ = witness_bounds(q, q64, k, rho, bands, s, valid, exact, torch.float64)
        x64 = xm.to(torch.float64)
        w64 = torch.exp(x64 - x64.amax(-1, keepdim=True))
        cert, lo, hi = subspace_forms(q, c, w64, subspace, bands, s, e, N, D)
        if box_form:
            from fast.core.box import box_form_of_read
            cert = box_form_of_read(cert, w, None, e, vmask, D, lo=lo, hi=hi)
        box_form = False
    elif N >= F32_MIN_N:
        c, cmax = witness_bounds(q, q64, k, rho, bands, s, valid, exact, torch.float32)
        if float(cmax.max()) + 2 * float(e.max()) < CMAX32:  # else forms_from_pmz would refuse the row
            cert = forms_from_pmz(weighted_sums(w, c), cmax, e, N, D, torch.float32)
    if cert is None and subspace is None:
        c, cmax = witness_bounds(q, q64, k, rho, bands, s, valid, exact, torch.float64)
        x64 = xm.to(torch.float64)
        w64 = torch.exp(x64 - x64.amax(-1, keepdim=True))
        cert = forms_from_pmz(weighted_sums(w64, c.clamp(max=SATURATE_C)), cmax, e, N, D, torch.float64)
    if box_form:
        from fast.core.box import box_form_of_read
        cert = box_form_of_read(cert, w, c, e, vmask, D)
    if vinfo is not None:
        cert["out_err"] = output_error_bound(w, valid, vinfo, cert["min"], N, D, scaled=isinstance(vx, tuple))
    return out, cert


def subspace_forms(q, c, w64, subspace, bands, s, e, N, D):
    """(cert, lo, hi): the decode certificate from the query-subspace witness (fast.core.subspace, spec T4e)
    intersected with the band witness. c: [B, H, N] fp64 witness bounds (0 at exact and padding tokens),
    w64: fp64 softmax weights of the fp32 logits (0 at padding); lo, hi: [B, H, N] fp64 enclosures of the
    exact shift x_j - x~_j. The closed forms are shift-invariant (softmax(x - t) = softmax(x)): with
    |x_j - t - x~_j| <= c_t = max(hi_j - t, t - lo_j), the forms of forms_from_pmz at c_t bound the TV for
    any t; t = 0 (c_0 <= c: never looser than the band witness) and t = the w-weighted mean of the
    interval midpoints, the smaller certificate per row."""
    from fast.core.subspace import shift_bounds
    lo_s, hi_s = shift_bounds(q, *subspace, bands, s)
    zero = c == 0
    lo = torch.maximum(lo_s, -c).masked_fill(zero, 0.0)
    hi = torch.minimum(hi_s, c).masked_fill(zero, 0.0)
    if bool((lo > hi).any()):  # two enclosures of one number cannot be disjoint: a stored witness is wrong
        raise RuntimeError("subspace witness: an interval disjoint from the band witness's (a stale or corrupt store)")
    W = w64.sum(-1, keepdim=True)
    t = ((w64 * (0.5 * lo + 0.5 * hi)).sum(-1, keepdim=True) / W).nan_to_num(0.0)
    best = None
    for tt in (torch.zeros_like(t), t):
        ct = torch.maximum(up64(hi - tt), up64(tt - lo))
        cert = forms_from_pmz(weighted_sums(w64, ct.clamp(max=SATURATE_C)), ct.amax(-1), e, N, D, torch.float64)
        if best is None:
            best = cert
        else:
            take = cert["min"] < best["min"]
            best = {key: torch.where(take, cert[key], best[key]) for key in best}
    return best, lo, hi


def _check_rows(q, q_pos, k_pos, valid, N):
    """[B, T, N] bool: row t reads token j iff valid[b, j] and k_pos[b, j] <= q_pos[b, t]."""
    B, T = q.shape[:2]
    _checks.tensor("q_pos", q_pos, ndim=2, dtypes=(torch.int64, torch.int32))
    if tuple(q_pos.shape) != (B, T):
        raise ValueError(f"q_pos: shape {tuple(q_pos.shape)}, expected {(B, T)}")
    if k_pos is None:
        k_pos = torch.arange(N, device=q.device).expand(B, N)
    else:
        _checks.tensor("k_pos", k_pos, ndim=2, dtypes=(torch.int64, torch.int32))
        if tuple(k_pos.shape) != (B, N):
            raise ValueError(f"k_pos: shape {tuple(k_pos.shape)}, expected {(B, N)}")
    rows = k_pos.to(q.device).unsqueeze(1) <= q_pos.to(q.device).unsqueeze(2)  # [B, T, N]
    if valid is not None:
        rows &= valid.unsqueeze(1)
    if not bool(rows.any(-1).all()):
        b, t = (~rows.any(-1)).nonzero()[0].tolist()
        raise ValueError(f"q_pos: row {t} of sequence {b} reads no valid key (every key is later or padding)")
    return rows


ROW_ELEMS = 1 << 22  # rows are processed in chunks of about this many [H, T, N] logits (memory O(T N) per head)


def attention_rows(q, k, v, rho, scale, *, bands, q_pos, k_pos=None, valid=None, exact=None, certify=True,
                   v_err=None, backend="auto", subspace=None, box_form=False):
    """Certified attention of T query rows per sequence over one cache (math.md T2, T4, T5, T8):
    prefill chunks, a second turn, speculative verification; decode_attention is T = 1.

    q: [B, T, H, D] post-RoPE rows; k, v: [B, Hkv, N, D] float or QTensor; rho, bands, exact: as
    decode_attention; q_pos: [B, T] int absolute positions of the rows; k_pos: [B, N] positions
    of the keys (default arange(N)); valid: bool [B, N]. Row t reads key j iff valid[b, j] and
    k_pos[b, j] <= q_pos[b, t] (causal); every row must read at least one key.
    v_err: optional [B, Hkv, N] fp32 upper bounds of ||v_j - v~_j|| (0 at exact tokens): adds
    "out_err" >= ||o - out|| (math.md T5, output_error_bound). subspace, box_form: as decode_attention (torch
    backend; the box over each row's visible tokens).
    Returns out [B, T, H, D] fp32 and a dict of [B, T, H] fp32 tensors (the keys of
    decode_attention's certificate), or None when certify=False.

    One certificate per (sequence, row, query head), exactly the decode certificate of that
    row on its visible tokens: the rows are flattened into the GQA group axis (query head h,
    row t -> h T + t), with a [B, H T, N] mask. Rows run in chunks of about ROW_ELEMS logits
    per batch; keys and values are dequantized once. backend "triton" (or "auto" on CUDA)
    runs one decode kernel per row (the kernel takes one mask per sequence).
    """
    _checks.tensor("q", q, ndim=4, dtypes=IN_DTYPES)
    B, T, H, D = q.shape
    if T == 0:
        raise ValueError("q: no query rows (T = 0)")
    q_flat = q.permute(0, 2, 1, 3).reshape(B, H * T, D)  # row (h, t) -> h T + t
    s, bands, rho, valid, exact = _check_inputs(q_flat, k, v, rho, scale, bands, valid, exact)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    N = k.shape[2]
    rows = _check_rows(q, q_pos, k_pos, valid, N)
    vinfo = value_info(v, v_err) if (certify and v_err is not None) else None
    rho = _derive_rho(k, rho, bands, certify, backend, q)
    if (subspace is not None or box_form) and (backend == "triton" or (backend == "auto" and q.is_cuda)):
        raise ValueError("box_form / subspace: torch backend only")
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from fast.core import triton_kernels
        outs, certs = [], []
        for t in range(T):
            o, c = triton_kernels.decode_attention(q[:, t], k, v, rho, s, bands, rows[:, t], exact, certify)
            outs.append(o)
            certs.append(c)
            if vinfo is not None:  # the kernel keeps its weights: the twin's out_err plus ||out_twin - o||
                c["out_err"] = _served_out_err(o, attention_torch(q[:, t], k, v, rho, s, bands, rows[:, t], exact, True, vinfo=vinfo))
        out = torch.stack(outs, 1)
        return out, (None if not certify else {key: torch.stack([c[key] for c in certs], 1) for key in certs[0]})
    dense, kmax = (_dense(k), _dense(v)), (max_abs(k) if certify else None)
    step = max(1, ROW_ELEMS // max(1, B * H * N))
    outs, certs = [], []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        Tc = t1 - t0
        qc = q[:, t0:t1].permute(0, 2, 1, 3).reshape(B, H * Tc, D)
        mask = rows[:, t0:t1].unsqueeze(1).expand(B, H, Tc, N).reshape(B, H * Tc, N)
        o, c = attention_torch(qc, k, v, rho, s, bands, mask, exact, certify, dense=dense, kmax=kmax, vinfo=vinfo,
                               subspace=subspace if certify else None,  # rows h Tc + t: KV head (h Tc + t) // (G Tc)
                               box_form=box_form and certify)
        outs.append(o.view(B, H, Tc, D).permute(0, 2, 1, 3))
        if certify:
            certs.append({key: val.view(B, H, Tc).permute(0, 2, 1) for key, val in c.items()})
    out = torch.cat(outs, 1).contiguous()
    if not certify:
        return out, None
    return out, {key: torch.cat([c[key] for c in certs], 1).contiguous() for key in certs[0]}


def _served_out_err(out, twin):
    """out_err of the output `out` the Triton kernel served, from its torch twin (out_twin, cert):
    ||o - out|| <= ||o - out_twin|| + ||out_twin - out|| <= out_err_twin + served_distance, rounded up."""
    o_twin, cert = twin
    return up32(cert["out_err"].to(torch.float64) + served_distance(o_twin, out).to(torch.float64))


def _derive_rho(k, rho, bands, certify, backend, q):
    """The zero-memory witness (T4) from the scales when none is given: O(N NB). For an int8/int4
    cache with one scale per token and head on the torch path rho stays None: attention_torch
    uses token_kappa64 (the same witness, O(N))."""
    if certify and rho is None:
        one_scale = k.scheme in QMAX and k.scales.shape[-1] == 1
        if not one_scale or backend == "triton" or (backend == "auto" and q.is_cuda):
            rho = witness_from_scales(k, bands) if k.scheme in QMAX else witness_from_step(k.step(), bands)
    return rho


def decode_attention(q, k, v, rho, scale, *, bands, valid=None, exact=None, backend="auto", certify=True, v_err=None,
                     box_form=False, subspace=None):
    """Attention of one decode step and its certificate (math.md T2, T4, T8): attention_rows with
    T = 1 (one row per sequence, reading every valid token).

    q: [B, H, D] (post-RoPE); k, v: [B, Hkv, N, D] float or QTensor (dequantized inside);
    rho: [B, Hkv, N, NB] witness (fp32/fp16, or uint8 log codes), or None for the derived
    witness of a quantized k; scale: softmax scale; bands: [NB, D/NB] (rope_bands);
    valid: bool [B, N] (False = padding); exact: bool [B, Hkv, N] (c = 0: tokens held exactly).
    Returns out [B, H, D] fp32 and a dict of [B, H] fp32: A (up), B (down), max_c and
    tanh, one_minus_b_over_a, e_form, min (each >= the exact form; min capped at 1); with
    v_err ([B, Hkv, N] >= ||v_j - v~_j||) also out_err >= ||o - out|| (math.md T5).
    backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton".
    certify=False skips the certificate (the baseline of the meter-overhead benchmark).
    box_form=True (torch backend only, opt-in: a few ms per call) adds the box form (spec T9).
    subspace=(U, a, tau, sigma) (torch backend only): the query-subspace witness of the keys
    (fast.core.subspace, spec T4e), intersected with the band witness (attention_torch).
    """
    s, bands, rho, valid, exact = _check_inputs(q, k, v, rho, scale, bands, valid, exact)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if (box_form or subspace is not None) and (backend == "triton" or (backend == "auto" and q.is_cuda)):
        raise ValueError("box_form / subspace: torch backend only")
    vinfo = value_info(v, v_err) if (certify and v_err is not None) else None
    rho = _derive_rho(k, rho, bands, certify, backend, q)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from fast.core import triton_kernels
        out, cert = triton_kernels.decode_attention(q, k, v, rho, s, bands, valid, exact, certify)
        if vinfo is not None:
            cert["out_err"] = _served_out_err(out, attention_torch(q, k, v, rho, s, bands, valid, exact, True, vinfo=vinfo))
        return out, cert
    return attention_torch(q, k, v, rho, s, bands, valid, exact, certify, vinfo=vinfo, box_form=box_form,
                           subspace=subspace if certify else None)
