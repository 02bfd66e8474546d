"""Triton kernels of the fast path; their plain-torch twins live next to the public functions.

Each kernel `_x_kernel` has a launcher `x(...)` that checks shapes, dtypes and contiguity,
allocates the outputs and launches. The launchers are called by the public functions of
fast.core.witness and fast.core.attention after those validated the inputs (backend="triton", or
"auto" on CUDA). Rounding follows the twins exactly (fp64 for every bound, module docs
of fast.core.certify / fast.core.witness / fast.core.attention); the final one-ulp-outward moves and the
casts to fp32 run in torch on the kernel's fp64 outputs.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/test_triton.py). The interpreter has
no libdevice, so fp64 exp goes through tl.exp there; on a GPU the constexpr LIBDEVICE
selects libdevice's exp (__nv_exp, within 1 ulp, inside the 2 ulp of EXP_EPS): Triton's
own tl.exp is an approximation (ex2.approx) whose error is not bounded by EXP_EPS; the fp32 weights
the attention kernel serves use libdevice's expf on a GPU for the same reason (fast.core.certify.weight_rounding).
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fast.core.certify import EXP_EPS, SATURATE_C, U64, band_norms_up, forms_with_margin, gamma, logit_rounding, to_fp32, up32, up64, weight_rounding, with_weight_rounding
from fast.core.quant import QTensor, check_dither_counters, dequantize, max_abs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MODES = {"float": 0, "int8": 1, "int8_dither": 2}


@triton.jit
def _exp64(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _exp32(x, LIBDEVICE: tl.constexpr):
    """The served weights' fp32 exp: libdevice's expf on a GPU (within 2 ulp, inside EXP32_EPS), not
    tl.exp's ex2.approx of x log2(e); the interpreter's tl.exp (numpy) elsewhere."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _mulhilo(a, m_hi, m_lo):
    """fast.core.quant._mulhilo: (hi, lo) words of a * m, a in [0, 2^32), m = m_hi 2^16 + m_lo;
    every product < 2^48."""
    t = a * m_lo
    u = a * m_hi
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & 0xFFFFFFFF


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """fast.core.quant.philox4x32_10 on int64 words < 2^32 (the same operations in the same order)."""
    for r in tl.static_range(10):
        if r > 0:
            k0 = (k0 + 0x9E3779B9) & 0xFFFFFFFF
            k1 = (k1 + 0xBB67AE85) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo(c0, 0xD251, 0x1F53)  # 0xD2511F53
        hi1, lo1 = _mulhilo(c2, 0xCD9E, 0x8D57)  # 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _dither(seed_lo, seed_hi, stream, layer, row, head, token, channel):
    """u in (-1/2, 1/2), bit-identical to fast.core.quant.dither_noise (fast.core.quant.dither_hash:
    Philox4x32-10 in two stages, 8 channels a call, the same words in the same order). Every word is < 2^32
    (range-checked on the host); token (int64, < 2^63) enters as two words.
    token: [BLOCK_N, 1], channel: [1, D]."""
    token = token.to(tl.int64)
    # & 0xFFFFFFFF: a word in [2^31, 2^32) may arrive as a 32-bit argument that .to(int64) sign-extends
    k0, k1, _, _ = _philox(layer.to(tl.int64) & 0xFFFFFFFF, row.to(tl.int64) & 0xFFFFFFFF,
                           head.to(tl.int64) & 0xFFFFFFFF, stream.to(tl.int64) & 0xFFFFFFFF,
                           seed_lo.to(tl.int64) & 0xFFFFFFFF, seed_hi.to(tl.int64) & 0xFFFFFFFF)
    full = (token * 0 + channel * 0).to(tl.int64)  # [BLOCK_N, D] zeros: every counter word at the block's shape
    c = channel.to(tl.int64) + full
    w0, w1, w2, w3 = _philox((token & 0xFFFFFFFF) + full, (token >> 32) + full, c >> 3, full, k0, k1)
    j = (c & 7) >> 1  # channel c: half (c & 1) of word (c & 7) >> 1 of its block of 8 channels
    w = tl.where(j == 0, w0, tl.where(j == 1, w1, tl.where(j == 2, w2, w3)))
    i = tl.where((c & 1) == 0, w >> 16, w & 0xFFFF)
    return (2 * i + 1 - 65536).to(tl.float32) * 0.00000762939453125  # 2^-17: exact


# ---------------------------------------------------------------- dither (tests only)

@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stream", "layer", "token_start"])  # a counter equal to 1 must stay a tensor
def _dither_kernel(out_ptr, seed_lo, seed_hi, stream, layer, token_start, N, Hkv, D: tl.constexpr, BLOCK_N: tl.constexpr):
    rh = tl.program_id(0)
    row = rh // Hkv
    head = rh % Hkv
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    u = _dither(seed_lo, seed_hi, stream, layer, row, head, token_start.to(tl.int64) + offs_n[:, None], offs_d[None, :])
    ptrs = out_ptr + rh * N * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(ptrs, u, mask=offs_n[:, None] < N)


def _seed_words(seed):
    return seed & 0xFFFFFFFF, seed >> 32


def dither_noise(seed, layer, Hkv, token_start, N, D, device="cpu", *, rows=1, stream=0):
    """Triton twin of fast.core.quant.dither_noise: [rows, Hkv, N, D] fp32."""
    _pow2("D", D)
    check_dither_counters(seed, layer, stream, rows, Hkv, token_start, N, D)
    out = torch.empty(rows, Hkv, N, D, dtype=torch.float32, device=device)
    BLOCK_N = 16
    _dither_kernel[(rows * Hkv, triton.cdiv(N, BLOCK_N))](out, *_seed_words(seed), stream, layer, token_start, N, Hkv,
                                                          D=D, BLOCK_N=BLOCK_N)
    return out


# ---------------------------------------------------------------- witness

@triton.jit
def _witness_kernel(k_ptr, kh_ptr, bands_ptr, margin_ptr, out_ptr, n_rows,
                    stride_k, stride_kh, NB: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[r, b] = ||(k - k_hat)[r, bands[b]]|| (1 + margin) in fp64 (the launcher rounds it up)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    offs_w = tl.arange(0, W)
    margin = tl.load(margin_ptr)
    for b in tl.static_range(NB):
        idx = tl.load(bands_ptr + b * W + offs_w)
        k = tl.load(k_ptr + rows[:, None] * stride_k + idx[None, :], mask=rmask[:, None], other=0.0)
        kh = tl.load(kh_ptr + rows[:, None] * stride_kh + idx[None, :], mask=rmask[:, None], other=0.0)
        r = k.to(tl.float64) - kh.to(tl.float64)
        norm = tl.sqrt(tl.sum(r * r, axis=1))  # fp64 sqrt lowers to sqrt.rn.f64 (correctly rounded); only fp32 tl.sqrt is approximate
        tl.store(out_ptr + rows * NB + b, norm * margin, mask=rmask)


def witness(k, k_hat, bands):
    """Triton twin of fast.core.witness.witness (inputs already validated): rho [B, Hkv, N, NB] fp32."""
    B, Hkv, N, D = k.shape
    NB, W = bands.shape
    _pow2("band width D/NB", W)
    k2 = k.reshape(-1, D).contiguous()
    kh2 = k_hat.reshape(-1, D).contiguous()
    out = torch.empty(k2.shape[0], NB, dtype=torch.float64, device=k.device)
    margin = torch.tensor([1 + 2 * gamma(W + 4)], dtype=torch.float64, device=k.device)
    BLOCK_R = 16
    _witness_kernel[(triton.cdiv(k2.shape[0], BLOCK_R),)](
        k2, kh2, bands.contiguous().to(k.device), margin, out, k2.shape[0], k2.stride(0), kh2.stride(0),
        NB=NB, W=W, BLOCK_R=BLOCK_R)
    return up32(up64(out)).view(B, Hkv, N, NB)


# ---------------------------------------------------------------- logit error bound

@triton.jit
def _logit_error_bound_kernel(qn_ptr, rho_ptr, params_ptr, out_ptr, N,
                              stride_rb, stride_rh, stride_rn, G: tl.constexpr, HQ: tl.constexpr,
                              NB: tl.constexpr, NB_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[b, h, j] = s sum_nb qn[b, h, nb] rho[b, h // G, j, nb] (1 + margin), fp64."""
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, NB_P)
    bmask = offs_b < NB
    s = tl.load(params_ptr)
    margin = tl.load(params_ptr + 1)
    qn = tl.load(qn_ptr + bh * NB + offs_b, mask=bmask, other=0.0)
    rho = tl.load(rho_ptr + b * stride_rb + (h // G) * stride_rh + offs_n[:, None] * stride_rn + offs_b[None, :],
                  mask=(offs_n[:, None] < N) & bmask[None, :], other=0.0).to(tl.float64)
    c = tl.sum(rho * qn[None, :], axis=1) * s
    tl.store(out_ptr + bh * N + offs_n, c * margin, mask=offs_n < N)


def logit_error_bound(q, rho, bands, s):
    """Triton twin of fast.core.witness.logit_error_bound (validated inputs): c [B, H, N] fp32."""
    return up32(logit_error_bound64(q, rho, bands, s))


def logit_error_bound64(q, rho, bands, s):
    B, H, D = q.shape
    Hkv, N, NB = rho.shape[1:]
    if rho.stride(-1) != 1:
        rho = rho.contiguous()
    qn = band_norms_up(q.to(torch.float64), bands).contiguous()  # [B, H, NB]: tiny, host-side
    params = torch.tensor([s, 1 + 2 * gamma(NB + 2)], dtype=torch.float64, device=q.device)
    out = torch.empty(B, H, N, dtype=torch.float64, device=q.device)
    BLOCK_N = 64
    _logit_error_bound_kernel[(B * H, triton.cdiv(N, BLOCK_N))](
        qn, rho, params, out, N, rho.stride(0), rho.stride(1), rho.stride(2),
        G=H // Hkv, HQ=H, NB=NB, NB_P=triton.next_power_of_2(NB), BLOCK_N=BLOCK_N)
    return up64(out)


# ---------------------------------------------------------------- fused decode attention + certificate

@triton.jit
def _load_cache(ptr, scale_ptr, b, kvh, offs_n, offs_d, nmask, stride_b, stride_h, stride_n,
                sstride_b, sstride_h, sstride_n, seed_lo, seed_hi, stream, layer, token_start,
                MODE: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_N, D] fp32 block of a float (MODE 0), int8 (1) or int8_dither (2) cache."""
    ptrs = ptr + b * stride_b + kvh * stride_h + offs_n[:, None] * stride_n + offs_d[None, :]
    x = tl.load(ptrs, mask=nmask[:, None], other=0).to(tl.float32)
    if MODE != 0:
        sptrs = scale_ptr + b * sstride_b + kvh * sstride_h + offs_n[:, None] * sstride_n + offs_d[None, :] // GROUP
        sc = tl.load(sptrs, mask=nmask[:, None], other=0.0).to(tl.float32)
        if MODE == 2:
            x = x - _dither(seed_lo, seed_hi, stream, layer, b, kvh, token_start.to(tl.int64) + offs_n[:, None],
                            offs_d[None, :])  # exact (24 bits)
        x = x * sc
    return x


@triton.jit(do_not_specialize=["k_seed_lo", "k_seed_hi", "k_stream", "k_layer", "k_start",
                               "v_seed_lo", "v_seed_hi", "v_stream", "v_layer", "v_start"])
def _decode_attention_kernel(
        q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, qn_ptr, rho_ptr, valid_ptr, exact_ptr, e_ptr, params_ptr,
        out_ptr, sums_ptr, N, s32,
        stride_kb, stride_kh, stride_kn, stride_ksb, stride_ksh, stride_ksn,
        stride_vb, stride_vh, stride_vn, stride_vsb, stride_vsh, stride_vsn,
        stride_rb, stride_rh, stride_rn,
        k_seed_lo, k_seed_hi, k_stream, k_layer, k_start, v_seed_lo, v_seed_hi, v_stream, v_layer, v_start,
        HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr,
        K_MODE: tl.constexpr, V_MODE: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
        HAS_VALID: tl.constexpr, HAS_EXACT: tl.constexpr, CERTIFY: tl.constexpr,
        LIBDEVICE: tl.constexpr, SAT_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch, query head): online softmax in fp32 for the output, and in
    fp64 the running sums Z, A', B' (rescaled with the running max), max c_eff, the total
    rise of the running max, and the count of non-finite logits."""
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    kvh = h // G
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, NB_P)
    q = tl.load(q_ptr + bh * D + offs_d)  # fp32
    qn = tl.load(qn_ptr + bh * NB + offs_b, mask=offs_b < NB, other=0.0)  # fp64 band norms of q, rounded up
    s64 = tl.load(params_ptr)
    cmargin = tl.load(params_ptr + 1)
    up = tl.load(params_ptr + 2)  # 1 + 2^-52 (fp64): x * up >= the next fp64 above x, for normal x > 0
    e2 = 2.0 * tl.load(e_ptr + bh)
    m_i = tl.full([1], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    z = tl.zeros([1], dtype=tl.float64)
    a = tl.zeros([1], dtype=tl.float64)
    bb = tl.zeros([1], dtype=tl.float64)
    cmax = tl.zeros([1], dtype=tl.float64)
    drift = tl.zeros([1], dtype=tl.float64)
    bad = tl.zeros([1], dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        k = _load_cache(k_ptr, ks_ptr, b, kvh, offs_n, offs_d, nmask, stride_kb, stride_kh, stride_kn,
                        stride_ksb, stride_ksh, stride_ksn, k_seed_lo, k_seed_hi, k_stream, k_layer, k_start, K_MODE, K_GROUP)
        x = tl.sum(k * q[None, :], axis=1) * s32  # fp32 logits: a D-term dot, then the fp32 scale
        bad += tl.sum((((x != x) | (tl.abs(x) == float("inf"))) & nmask).to(tl.int32), axis=0)
        live = nmask
        if HAS_VALID:
            live = live & (tl.load(valid_ptr + b * N + offs_n, mask=nmask, other=0) != 0)
        x = tl.where(live, x, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        m_safe = tl.where(m_new > -float("inf"), m_new, 0.0)  # -inf only while every token so far is padding
        alpha = _exp32(m_i - m_safe, LIBDEVICE)
        p = tl.where(live, _exp32(x - m_safe, LIBDEVICE), 0.0)
        v = _load_cache(v_ptr, vs_ptr, b, kvh, offs_n, offs_d, nmask, stride_vb, stride_vh, stride_vn,
                        stride_vsb, stride_vsh, stride_vsn, v_seed_lo, v_seed_hi, v_stream, v_layer, v_start, V_MODE, V_GROUP)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if CERTIFY:
            rho = tl.load(rho_ptr + b * stride_rb + kvh * stride_rh + offs_n[:, None] * stride_rn + offs_b[None, :],
                          mask=nmask[:, None] & (offs_b[None, :] < NB), other=0.0).to(tl.float64)
            c = tl.sum(rho * qn[None, :], axis=1) * s64 * cmargin * up  # >= up64(c (1 + margin)) of the twin
            if HAS_EXACT:
                ex = tl.load(exact_ptr + (b * (HQ // G) + kvh) * N + offs_n, mask=nmask, other=0)
                c = tl.where(ex != 0, 0.0, c)
            c = (c + e2) * up
            c = tl.where(live, c, 0.0)
            cmax = tl.maximum(cmax, tl.max(c, axis=0))
            m64_old = m_i.to(tl.float64)
            m64 = m_safe.to(tl.float64)
            rescale = tl.where(m64_old > -float("inf"), _exp64(m64_old - m64, LIBDEVICE), 0.0)
            drift += tl.where(m64_old > -float("inf"), m64 - m64_old, 0.0)
            d = tl.where(live, x.to(tl.float64) - m64, -float("inf"))
            z = z * rescale + tl.sum(_exp64(d, LIBDEVICE), axis=0)
            a = a * rescale + tl.sum(_exp64(d + tl.minimum(c, SAT_C), LIBDEVICE), axis=0)  # rows above SAT_C are saturated
            bb = bb * rescale + tl.sum(_exp64(d - c, LIBDEVICE), axis=0)
        m_i = m_new
    tl.store(out_ptr + bh * D + offs_d, acc / l_i)
    one = tl.arange(0, 1)
    tl.store(sums_ptr + bh * 8 + one, z)
    tl.store(sums_ptr + bh * 8 + 1 + one, a)
    tl.store(sums_ptr + bh * 8 + 2 + one, bb)
    tl.store(sums_ptr + bh * 8 + 3 + one, cmax)
    tl.store(sums_ptr + bh * 8 + 4 + one, drift)
    tl.store(sums_ptr + bh * 8 + 5 + one, bad.to(tl.float64))


def _pow2(name, n):
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name} = {n}: the Triton kernels need a power of two")


def _cache_args(t):
    """(tensor, scales, strides, scale strides, (seed lo, seed hi, stream, layer, start), MODE, GROUP) for the kernel."""
    if isinstance(t, QTensor) and t.scheme in MODES:
        c, sc = t.codes, t.scales
        if c.stride(-1) != 1 or sc.stride(-1) != 1:
            raise ValueError("cache codes and scales must be contiguous along the last dim")
        B, Hkv, N, D = t.shape
        check_dither_counters(t.seed, t.layer, t.stream, B, Hkv, t.token_start, N, D)
        return (c, sc, c.stride()[:3], sc.stride()[:3], (*_seed_words(t.seed), t.stream, t.layer, t.token_start),
                MODES[t.scheme], t.group_size)
    if isinstance(t, QTensor):  # int4 / fp8: dequantized on the host (a documented gap of the kernel)
        t = dequantize(t)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return (t, t, t.stride()[:3], (0, 0, 0), (0, 0, 0, 0, 0), 0, 1)


def decode_attention(q, k, v, rho, s, bands, valid, exact, certify=True):
    """Triton twin of fast.core.attention.attention_torch (inputs validated by decode_attention)."""
    B, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    NB = bands.shape[0]
    _pow2("D", D)
    kt, ks, kst, ksst, kctr, kmode, kgroup = _cache_args(k)
    vt, vs, vst, vsst, vctr, vmode, vgroup = _cache_args(v)
    q32 = q.to(torch.float32).contiguous()
    qn = band_norms_up(q.to(torch.float64), bands).contiguous()
    if rho is None:  # certify=False: the kernel never reads it
        rho = torch.zeros(1, 1, 1, NB, device=q.device)
    if rho.stride(-1) != 1:
        rho = rho.contiguous()
    e = logit_rounding(q, max_abs(k), s).contiguous()  # [B, H] fp64
    params = torch.tensor([s, 1 + 2 * gamma(NB + 2), 1 + 2.0 ** -52], dtype=torch.float64, device=q.device)
    dummy = torch.zeros(1, dtype=torch.int8, device=q.device)
    valid_t = dummy if valid is None else valid.to(torch.int8).contiguous()
    exact_t = dummy if exact is None else exact.to(torch.int8).contiguous()
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    sums = torch.zeros(B, H, 8, dtype=torch.float64, device=q.device)
    BLOCK_N = 16 if INTERPRET else 64
    _decode_attention_kernel[(B * H,)](
        q32, kt, ks, vt, vs, qn, rho, valid_t, exact_t, e, params, out, sums, N, float(s),
        *kst, *ksst, *vst, *vsst, rho.stride(0), rho.stride(1), rho.stride(2),
        *kctr, *vctr,
        HQ=H, G=H // Hkv, D=D, NB=NB, NB_P=triton.next_power_of_2(NB),
        K_MODE=kmode, V_MODE=vmode, K_GROUP=kgroup, V_GROUP=vgroup,
        HAS_VALID=valid is not None, HAS_EXACT=exact is not None, CERTIFY=certify,
        LIBDEVICE=not INTERPRET, SAT_C=SATURATE_C, BLOCK_N=BLOCK_N)
    if bool((sums[..., 5] > 0).any()):
        raise ValueError("k or q: non-finite logits (NaN/Inf in the key cache, or logits overflow fp32)")
    if not bool(torch.isfinite(out).all()):
        raise ValueError("v: NaN/Inf in the value cache")
    if not certify:
        return out, None
    # the served weights are the kernel's fp32 p_j = exp(x_j - m) times its rescales alpha (fast.core.certify.weight_rounding)
    blocks = -(-N // BLOCK_N)
    r_w = weight_rounding(e.cpu().numpy(), N, D, drift=sums[..., 4].cpu().numpy() * (1 + 2.0 ** -40), rescales=blocks)
    cert = with_weight_rounding(certificate_from_sums(sums, N, BLOCK_N), torch.from_numpy(r_w).to(q.device))
    return out, to_fp32(cert)


def certificate_from_sums(sums, N, BLOCK_N):
    """Forms from the kernel's fp64 running sums, with the twin's margins plus the rescaling:
    each rescale by exp(m_old - m_new) adds EXP_EPS + u64 (|m_new - m_old| + 1) relative
    error to the terms before it: in all n_blocks (EXP_EPS + u64) + u64 drift."""
    z, a, b, cmax, drift = (sums[..., i] for i in range(5))
    blocks = -(-N // BLOCK_N)
    margin = 2 * (EXP_EPS + U64 * (2 * cmax + 1600) + gamma(N + 1) + blocks * (EXP_EPS + U64) + U64 * drift)
    return forms_with_margin(a, b, z, cmax, margin)
