"""KV codecs: int8, int8_dither, int4 (per-group absmax, fp16 scales) and fp8 raw casts.

x: [B, Hkv, N, D] (keys or values of one layer). Every codec is a uniform or
floating-point quantizer WITHOUT clipping, and QTensor.step() returns a per-element
delta with |x - dequantize(qt)| <= delta / 2 exactly (the codec's own fp32 rounding
included): the zero-memory witness of math.md T4 is built from it.

Dither (math.md T6): u in (-1/2, 1/2) is regenerated from a counter-based hash of
(seed, stream, layer, batch row, head, token, channel) in integer arithmetic (int64 holding
uint32 words, every product < 2^63), so the Triton kernel and torch produce bit-identical
dither. Each request draws a fresh 64-bit seed from the OS unless one is given; every batch row
and the key and value streams have their own counters; counters are range-checked (seed < 2^64,
token < 2^63 enter as two words each), never reduced modulo 2^32.
u has 16 bits: u = (2 i + 1 - 2^16) / 2^17, symmetric about 0, so that m - u is exact in
fp32 (|m| <= 127 needs 7 more bits: 24 in all). Treating u as U[-1/2, 1/2) is spec
assumption A1.
"""

from dataclasses import dataclass, replace

import torch

from fast.core import _checks
from fast.core.certify import up32

SCHEMES = ("int8", "int8_dither", "int4", "fp8_e4m3", "fp8_e5m2")
# Largest code magnitude used: |x / delta| <= QMAX (dither: QMAX + 1/2 = 127 stays in range).
QMAX = {"int8": 127.0, "int8_dither": 126.5, "int4": 7.0}
CODE_MAX = {"int8": 127.0, "int8_dither": 127.5, "int4": 7.0}  # bound on |dequantized| / delta
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0, 2.0 ** -4, 2.0 ** -10),  # dtype, max, unit roundoff, half subnormal spacing
       "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2.0 ** -3, 2.0 ** -17)}
# |x - x~| <= (delta / 2)(1 + 766 u) for every integer codec (u = 2^-24, fp32). With |x/delta| <= 127:
#   y = fl(x / delta) is within 127 u of x / delta; m = round(y) (or round(fl(y + u_d))) is within
#   1/2 of y (of y + u_d, and fl(y + u_d) is within 128 u of it); int8/int4 dequantisation m delta
#   is exact (11-bit scale x 8-bit code), the dither's fl(delta (m - u_d)) within 127.5 u delta.
#   So |x - x~| / delta <= 1/2 + 127 u + 128 u + 127.5 u + (slack) <= 1/2 + 383 u.
# 1 + 2^-10 >= 1 + 766 u, and delta (11 bits) times it (11 bits) is exact in fp32.
STEP_MARGIN = 1.0 + 2.0 ** -10
MASK = 0xFFFFFFFF
M1, M2 = 0x7FEB352D, 0x2C1B3C6D  # odd multipliers < 2^31: x * M < 2^63 for x < 2^32


def _mix(x):
    """32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * M1) & MASK
    x = x ^ (x >> 15)
    x = (x * M2) & MASK
    return x ^ (x >> 16)


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


def dither_hash(seed, stream, layer, row, head, token, channel):
    """uint32 hash (as int64) of the counters, each word < 2^32 (seed < 2^64 and token < 2^63 enter
    as two words, low then high); arguments broadcast (Python ints or int64 tensors). Words are
    mixed in this order: seed lo, seed hi, stream, layer, row, head, token lo, token hi, channel."""
    seed = int(seed)
    token = torch.as_tensor(token, dtype=torch.int64)
    h = _mix(torch.as_tensor(seed & MASK, dtype=torch.int64))
    for v in (seed >> 32, stream, layer, row, head, token & MASK, token >> 32, channel):
        h = _mix(h ^ torch.as_tensor(v, dtype=torch.int64))
    return h


def dither_noise(seed, layer, Hkv, token_start, N, D, device="cpu", *, rows=1, stream=0):
    """u [rows, Hkv, N, D] fp32 in (-1/2, 1/2): the dither of batch rows 0..rows-1, heads 0..Hkv-1,
    tokens token_start.., channels 0..D-1 of one stream (0 keys, 1 values). Out-of-range counters
    raise ValueError (seed < 2^64, layer < 2^32, token_start + N < 2^63)."""
    check_dither_counters(seed, layer, stream, rows, Hkv, token_start, N, D)
    row = torch.arange(rows, device=device).view(rows, 1, 1, 1)
    head = torch.arange(Hkv, device=device).view(1, Hkv, 1, 1)
    token = torch.arange(token_start, token_start + N, device=device).view(1, 1, N, 1)
    channel = torch.arange(D, device=device).view(1, 1, 1, D)
    i = dither_hash(seed, stream, layer, row, head, token, channel) >> 16  # [0, 2^16)
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

    @property
    def shape(self):
        B, Hkv, N, W = self.codes.shape
        return (B, Hkv, N, 2 * W if self.scheme == "int4" else W)

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
        fmax = FP8[self.scheme][1]
        s = 1.0 if self.scales is None else self.scales.to(torch.float64).amax(dim=-2)  # [B, Hkv, 1]
        return torch.ones(B, Hkv, D, dtype=torch.float64, device=self.codes.device) * s * fmax * (1 + 2.0 ** -23)

    def narrow(self, start, length):
        """Tokens [start, start + length) (the dither counters follow the tokens)."""
        sc = None if self.scales is None else self.scales.narrow(2, start, length)
        return replace(self, codes=self.codes.narrow(2, start, length), scales=sc, token_start=self.token_start + start)

    def cat(self, other):
        """Append `other` after self along the token axis (append-only caches)."""
        same = (self.scheme, self.group_size, self.seed, self.layer, self.stream) == (other.scheme, other.group_size, other.seed, other.layer, other.stream)
        if not same or other.token_start != self.token_start + self.shape[2]:
            raise ValueError("QTensor.cat: schemes, seeds or token counters do not line up")
        sc = None if self.scales is None else torch.cat([self.scales, other.scales], dim=2)
        return replace(self, codes=torch.cat([self.codes, other.codes], dim=2), scales=sc)


def _fp16_scale_up(absmax, qmax):
    """fp16 scales >= absmax / qmax (so |x / scale| <= qmax: no clipping); 0 -> 2^-24."""
    s64 = absmax.to(torch.float64) / qmax
    s16 = s64.to(torch.float16)
    s16 = torch.where(s16.to(torch.float64) < s64, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    if not bool(torch.isfinite(s16).all()):
        raise ValueError(f"x: |x| > {65504 * qmax:g} does not fit fp16 scales")
    return torch.where(s16 == 0, torch.full_like(s16, 2.0 ** -24), s16)


def quantize(x, scheme, *, group_size=32, seed=None, layer=0, token_start=0, per_token_scale=True, stream=0):
    """Quantize x [B, Hkv, N, D] (fp32/fp16/bf16, finite) with one of SCHEMES.

    Integer codecs: one fp16 scale per group of `group_size` channels (D % group_size == 0).
    fp8: raw cast, with a per-token fp32 scale when per_token_scale (else |x| must fit the format).
    int8_dither: dither counters (seed, stream, layer, batch row, KV head, token = token_start + n,
    channel); seed=None draws a fresh 64-bit seed from the OS (recorded in the QTensor), a given
    seed reproduces the dither; stream 0 for keys, 1 for values. Counters out of range -> ValueError.
    """
    _checks.tensor("x", x, ndim=4, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    _checks.finite("x", x)
    B, Hkv, N, D = x.shape
    x32 = x.to(torch.float32)
    if seed is None:
        seed = draw_seed() if scheme == "int8_dither" else 0
    check_dither_counters(seed, layer, stream, B, Hkv, token_start, N, D)
    if scheme in FP8:
        return replace(_quantize_fp8(x32, scheme, per_token_scale), seed=seed, layer=layer, token_start=token_start, stream=stream)
    _checks.positive_int("group_size", group_size)
    if D % group_size or (scheme == "int4" and D % 2):
        raise ValueError(f"group_size = {group_size} must divide D = {D} (and D even for int4)")
    g = x32.view(B, Hkv, N, D // group_size, group_size)
    scales = _fp16_scale_up(g.abs().amax(-1), QMAX[scheme])  # [B, Hkv, N, D/G]
    y = g / scales.to(torch.float32).unsqueeze(-1)
    if scheme == "int8_dither":
        u = dither_noise(seed, layer, Hkv, token_start, N, D, x.device, rows=B, stream=stream).view(B, Hkv, N, D // group_size, group_size)
        y = y + u
    lim = CODE_MAX[scheme] // 1
    m = torch.clamp(torch.round(y), -lim, lim).view(B, Hkv, N, D)  # the clamp never binds: |y| <= QMAX (1 + u) (+ 1/2)
    if scheme == "int4":
        nib = (m + 8).to(torch.uint8)  # 1..15
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    else:
        codes = m.to(torch.int8)
    return QTensor(codes, scales, scheme, group_size, seed, layer, token_start, stream)


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


def dequantize(qt):
    """fp32 [B, Hkv, N, D]: the values the cache returns."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt: expected a QTensor, got {type(qt).__name__}")
    B, Hkv, N, D = qt.shape
    if qt.scheme in FP8:
        out = qt.codes.to(torch.float32)
        return out if qt.scales is None else out * qt.scales
    if qt.scheme == "int4":
        m = torch.stack([(qt.codes & 15), (qt.codes >> 4)], dim=-1).view(B, Hkv, N, D).to(torch.float32) - 8
    else:
        m = qt.codes.to(torch.float32)
    if qt.scheme == "int8_dither":
        m = m - dither_noise(qt.seed, qt.layer, Hkv, qt.token_start, N, D, qt.codes.device, rows=B, stream=qt.stream)  # exact (24 bits)
    ng = qt.scales.shape[-1]
    return (m.view(B, Hkv, N, ng, D // ng) * qt.scales.to(torch.float32).unsqueeze(-1)).view(B, Hkv, N, D)


def max_abs(k):
    """[B, Hkv, D] fp64 >= max over tokens of |k~| per channel (from the scales for a QTensor)."""
    if isinstance(k, QTensor):
        return k.max_abs()
    return k.abs().amax(dim=-2).to(torch.float64)
