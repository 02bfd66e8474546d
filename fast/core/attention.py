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
- >= TV(softmax(x), softmax(x^)) directly by T2, since |x_j - x^_j| <= c_j + e.
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
from fast.core.certify import CMAX32, SATURATE_C, U32, _up, forms_from_pmz, forms_from_sums, forms_with_margin, gamma, logit_rounding, logit_rounding_np, up64
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
    tokens; cmax = max_j c_j. fp32 from an fp64 value y >= c_exact: fl32(y (1 + 2^-22)) >=
    y (1 + 2^-22)(1 - u64)(1 - u32) - 2^-150 >= y - 2^-150 (rounding to nearest: relative u32
    above the least normal 2^-126, absolute 2^-150 below it; Float.v rn_ge_sub_of_nonneg).
    fp32 products fl32(kappa32 h_j) with kappa32 >= kappa (1 + 2^-22): the same argument, and
    max_j fl32(kappa32 h_j) = fl32(kappa32 max_j h_j) (rounding is monotone)."""
    B, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = H // Hkv
    if rho is None:  # integer cache, one scale per token and head: c_j = kappa h_j
        kappa = token_kappa64(q64, bands, s)
        h = token_scale_h(k, valid, exact)
        if dtype == torch.float64:
            c = up64(torch.from_numpy(kappa).to(q.device).view(B, Hkv, G, 1) * h.to(torch.float64).unsqueeze(2)).view(B, H, N)
            return c, c.amax(-1)
        k1 = _up(kappa * (1 + 2.0 ** -22))
        k32 = k1.astype(np.float32)
        k32 = torch.from_numpy(np.where(k32 < k1, np.nextafter(k32, np.float32(np.inf)), k32)).to(q.device).view(B, Hkv, G, 1)
        c = (k32 * h.unsqueeze(2)).view(B, H, N)
        return c, (k32 * h.amax(-1).view(B, Hkv, 1, 1)).view(B, H)
    c = logit_error_bound64(q, rho, bands, s)
    if exact is not None:
        c = c.masked_fill(exact.repeat_interleave(G, dim=1), 0.0)
    if valid is not None:
        c = c.masked_fill(~valid.unsqueeze(1), 0.0)
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


def attention_torch(q, k, v, rho, s, bands, valid, exact, certify=True):
    """Torch twin. Returns out [B, H, D] fp32 and the fp32 certificate dict (or None).

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
    ks = _token_scaled(k)
    if ks is None:
        kd = dequantize(k) if isinstance(k, QTensor) else k.to(torch.float32)
        x = torch.matmul(q32, kd.transpose(-1, -2)) * s32
    else:
        x = torch.matmul(q32, ks[0].transpose(-1, -2)) * ks[1] * s32
    x = x.view(B, H, N)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("k or q: non-finite logits (NaN/Inf in the key cache, or logits overflow fp32)")
    vmask = None if valid is None else valid.view(B, 1, N)
    xm = x if vmask is None else x.masked_fill(~vmask, -torch.inf)
    w = torch.exp(xm - xm.amax(-1, keepdim=True))
    vs = _token_scaled(v)
    if vs is None:
        vd = dequantize(v) if isinstance(v, QTensor) else v.to(torch.float32)
        out = torch.matmul(w.view(B, Hkv, G, N), vd)
    else:
        out = torch.matmul(w.view(B, Hkv, G, N) * vs[1], vs[0])
    out = out.view(B, H, D) / w.sum(-1, keepdim=True)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("v: NaN/Inf in the value cache")
    if not certify:
        return out, None
    q64 = q.to(torch.float64).cpu().numpy()  # [B, H]-sized work runs in numpy
    e = logit_rounding_np(q64, max_abs(k).cpu().numpy(), s)
    if N >= F32_MIN_N:
        c, cmax = witness_bounds(q, q64, k, rho, bands, s, valid, exact, torch.float32)
        if float(cmax.max()) + 2 * float(e.max()) < CMAX32:  # else forms_from_pmz would refuse the row
            cert = forms_from_pmz(weighted_sums(w, c), cmax, e, N, D, torch.float32)
            if cert is not None:
                return out, cert
    c, cmax = witness_bounds(q, q64, k, rho, bands, s, valid, exact, torch.float64)
    x64 = xm.to(torch.float64)
    w64 = torch.exp(x64 - x64.amax(-1, keepdim=True))
    return out, forms_from_pmz(weighted_sums(w64, c.clamp(max=SATURATE_C)), cmax, e, N, D, torch.float64)


def decode_attention(q, k, v, rho, scale, *, bands, valid=None, exact=None, backend="auto", certify=True):
    """Attention of one decode step and its certificate (math.md T2, T4, T8).

    q: [B, H, D] (post-RoPE); k, v: [B, Hkv, N, D] float or QTensor (dequantized inside);
    rho: [B, Hkv, N, NB] witness (fp32/fp16, or uint8 log codes), or None for the derived
    witness of a quantized k; scale: softmax scale; bands: [NB, D/NB] (rope_bands);
    valid: bool [B, N] (False = padding); exact: bool [B, Hkv, N] (c = 0: tokens held exactly).
    Returns out [B, H, D] fp32 and a dict of [B, H] fp32: A (up), B (down), max_c and
    tanh, one_minus_b_over_a, e_form, min (each >= the exact form; min capped at 1).
    backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton".
    certify=False skips the certificate (the baseline of the meter-overhead benchmark).
    """
    s, bands, rho, valid, exact = _check_inputs(q, k, v, rho, scale, bands, valid, exact)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if certify and rho is None:  # the zero-memory witness (T4), from the scales: O(N NB)
        one_scale = k.scheme in QMAX and k.scales.shape[-1] == 1
        if not one_scale or backend == "triton" or (backend == "auto" and q.is_cuda):
            rho = witness_from_scales(k, bands) if k.scheme in QMAX else witness_from_step(k.step(), bands)
        # else: rho stays None and attention_torch uses token_scale_bound64 (same witness, O(N))
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from fast.core import triton_kernels
        return triton_kernels.decode_attention(q, k, v, rho, s, bands, valid, exact, certify)
    return attention_torch(q, k, v, rho, s, bands, valid, exact, certify)
