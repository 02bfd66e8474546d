"""Pre-RoPE key quantization (KVQuant-style) with a witness from the pre-RoPE error (math.md T3).

    scheme = prerope_scheme(model.config, bits=4)      # keys int4 per channel before RoPE, values int8 per token
    cache = CertifiedCache(model.config, scheme)

transformers hands the cache post-RoPE keys k = R_m k_pre. The scheme undoes the rotation at the
token's position m (k0 = R'_m^T k in fp32, R'_m the rotation built from the fp32 cos/sin tables),
quantizes k0 per channel over blocks of BLOCK tokens (asymmetric, fp16 scale and zero: channel
outliers are stable before RoPE, which is why KVQuant quantizes there), and serves
k~ = fl(R'_m dq) with dq = dequant(codes) at every read. Values: int8 per token (fast.core.quant).

The witness (rho_b >= ||(k - k~)_b|| for every band b, a union of RoPE pairs), per token:
    k - k~ = (k - R'_m k0) + R'_m (k0 - dq) + (R'_m dq - fl(R'_m dq))
- pre-RoPE part: ||(R'_m r)_b|| <= (1 + eta) ||r_b|| for r = k0 - dq (T3, band unitarity: a
  rotation by an exact angle preserves band norms; the fp32 table pair (c', s') of frequency i
  scales the pair by sqrt(c'^2 + s'^2), and eta >= max over the table (all positions up to
  max_pos, all frequencies) of sqrt(c'^2 + s'^2) - 1, computed once in fp64 and rounded up).
  ||r_b|| is computed once, at write time, and holds at every position m <= max_pos.
- the read-time rotation's rounding (a margin argued here by hand: spec A11; not A4): each served coordinate is
  fl(fl(x c') + fl(-y s')), within gamma_2 (|x c'| + |y s'|) of x c' - y s' (Higham 3.5, with or
  without FMA); (|x c'| + |y s'|)^2 <= (x^2 + y^2)(c'^2 + s'^2) (Cauchy-Schwarz), so the pair's
  error norm is <= sqrt(2) gamma_2 (1 + eta) ||(x, y)|| and the band's <= sqrt(2) gamma_2 (1 + eta)
  ||dq_b||. Serving in a narrower dtype (bf16/fp16) adds u_dtype (1 + eta)(1 + 2 gamma_2) ||dq_b||.
- the recovery part k - R'_m k0 (k0 is the fp32 inverse rotation of k): measured at write time
  in fp64 (products of two fp32 numbers are exact in fp64; one rounding for the pair sum y^,
  |y^ - y| <= u64 |y^| (1 + u64); one for the difference, inside band_norms_up):
  ||d_b|| <= band_norms_up(k - y^)_b + 2 u64 ||y^_b||.
All norms by fast.core.certify.band_norms_up (upper bounds), summed in fp64 with a final factor
1 + 2^-40 (a handful of roundings of nonnegative terms), rounded up to fp32.
"""

import math

import torch

from fast.core import _checks
from fast.core.floats import U32, U64, band_norms_up, up32, up64
from fast.core.schemes import CodecStored, Scheme, SchemeError, Store

BLOCK = 32  # tokens per per-channel scale block (keys)
U_DTYPE = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def rope_tables(head_dim, theta, max_pos):
    """(cos, sin) fp32 [max_pos, head_dim / 2] as transformers' default Llama rotary embedding builds
    them (inv_freq = 1 / theta^(2i/D) in fp32, freqs = pos * inv_freq in fp32, then cos/sin), and
    eta >= max sqrt(c^2 + s^2) - 1 over the whole table (fp64: the squares of fp32 numbers are exact,
    the sum rounds once, sqrt once: a factor 1 + 2^-50 covers both)."""
    _checks.positive_int("head_dim", head_dim)
    _checks.positive_int("max_pos", max_pos)
    if head_dim % 2:
        raise ValueError(f"head_dim = {head_dim} must be even for RoPE")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    n = cos.double() ** 2 + sin.double() ** 2
    eta = max(float(up64(torch.sqrt(n).max() * (1 + 2.0 ** -50))) - 1.0, 0.0)
    return cos, sin, float(up64(torch.tensor(eta, dtype=torch.float64) + 2.0 ** -60))


def _rotate(x, cos, sin, sign):
    """HF rotate_half RoPE in fp32: x cos + sign * rotate_half(x) sin; x [..., n, D], cos/sin [n, D/2]."""
    h = x.shape[-1] // 2
    c = torch.cat([cos, cos], -1)
    s = torch.cat([sin, sin], -1)
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * c + rot * (s if sign > 0 else -s)


def _pack4(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack4(packed):
    return torch.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


class PreRopeKeys(Store):
    """Keys quantized per channel before RoPE, in blocks of BLOCK tokens starting at position
    token_start: codes [B, Hkv, n, D] uint8 (int8) or [B, Hkv, n, D/2] (int4, two a byte),
    scale/zero [B, Hkv, n/BLOCK, D] fp16. decode() rotates to the tokens' positions."""

    def __init__(self, rope, bits, token_start, **fields):
        super().__init__(**fields)
        self.rope, self.bits, self.token_start = rope, bits, token_start

    @staticmethod
    def encode(x, rope, bits, token_start):
        B, Hkv, n, D = x.shape
        if n % BLOCK:
            raise SchemeError(f"prerope keys are quantized in blocks of {BLOCK} tokens, got {n}")
        cos, sin, _ = rope
        if token_start + n > cos.shape[0]:
            raise SchemeError(f"prerope: position {token_start + n - 1} beyond the RoPE table ({cos.shape[0]} positions)")
        sl = slice(token_start, token_start + n)
        k0 = _rotate(x.to(torch.float32), cos[sl].to(x.device), sin[sl].to(x.device), -1)  # R'^T k
        kb = k0.view(B, Hkv, n // BLOCK, BLOCK, D)
        lo, hi = kb.amin(3, keepdim=True), kb.amax(3, keepdim=True)
        top = (1 << bits) - 1
        scale = ((hi - lo) / top).to(torch.float16)
        zero = lo.to(torch.float16)
        s = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
        codes = torch.round((kb - zero.float()) / s).clamp_(0, top).to(torch.uint8).view(B, Hkv, n, D)
        if bits == 4:
            codes = _pack4(codes)
        return PreRopeKeys(rope, bits, token_start, codes=codes, scale=scale.squeeze(3), zero=zero.squeeze(3))

    def pre(self):
        """dq [B, Hkv, n, D] fp32: the dequantized pre-RoPE keys."""
        codes, scale, zero = self.get("codes"), self.get("scale"), self.get("zero")
        if self.bits == 4:
            codes = _unpack4(codes)
        B, Hkv, n, D = codes.shape
        c = codes.float().view(B, Hkv, n // BLOCK, BLOCK, D)
        return (c * scale.float()[:, :, :, None] + zero.float()[:, :, :, None]).view(B, Hkv, n, D)

    def decode(self):
        dq = self.pre()
        n = dq.shape[2]
        cos, sin, _ = self.rope
        sl = slice(self.token_start, self.token_start + n)
        return _rotate(dq, cos[sl].to(dq.device), sin[sl].to(dq.device), +1)  # k~ = fl(R'_m dq)

    def cat(self, other):
        if other.token_start != self.token_start + self.get("codes").shape[2]:
            raise SchemeError("PreRopeKeys.cat: token positions do not line up")
        return super().cat(other)

    def take(self, index):
        raise SchemeError("prerope keys share scales across blocks of 32 tokens: per-token eviction is not supported")

    def step(self):
        return None

    def witness_t3(self, k, bands, dtype=torch.float32):
        """rho [B, Hkv, n, NB] fp32 >= ||(k - k~)_b|| for the post-RoPE keys k this payload encoded
        and k~ = decode() served in `dtype` (module doc: T3 part + rotation rounding + recovery)."""
        if dtype not in U_DTYPE:
            raise ValueError(f"prerope: serving dtype {dtype} not supported")
        cos, sin, eta = self.rope
        n = k.shape[2]
        sl = slice(self.token_start, self.token_start + n)
        c, s = cos[sl].to(k.device), sin[sl].to(k.device)
        k32 = k.to(torch.float32)
        k0 = _rotate(k32, c, s, -1)  # what encode() quantized (same fp32 operations)
        dq = self.pre()
        pre_err = band_norms_up(k0.double() - dq.double(), bands)  # ||r_b||: once, valid at every position (T3)
        dq_norm = band_norms_up(dq.double(), bands)
        rk0 = _rotate(k0.double(), c.double(), s.double(), +1)  # exact products, one rounding per sum
        rec = band_norms_up(k32.double() - rk0, bands) + 2 * U64 * band_norms_up(rk0, bands)
        g2 = 2 * U32 / (1 - 2 * U32)
        rot = math.sqrt(2) * (1 + 1e-15) * g2 + U_DTYPE[dtype] * (1 + 2 * g2)
        rho = (rec + (1 + eta) * pre_err + (1 + eta) * rot * dq_norm) * (1 + 2.0 ** -40)
        return up32(up64(rho))


def prerope_scheme(config=None, *, bits=4, head_dim=None, theta=None, max_pos=None):
    """A Scheme for CertifiedCache: keys per channel before RoPE (bits 4 or 8, blocks of 32 tokens),
    values int8 per token. RoPE parameters from a transformers Llama-style config (default rope
    type only) or given. Positions are the storage slots (no eviction)."""
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 4 or 8, got {bits!r}")
    if config is not None:
        rp = getattr(config, "rope_parameters", None) or {}
        kind = rp.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"prerope: rope_type {kind!r} not supported (default RoPE only)")
        head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta = theta or rp.get("rope_theta", getattr(config, "rope_theta", None))
        max_pos = max_pos or config.max_position_embeddings
    if head_dim is None or theta is None or max_pos is None:
        raise ValueError("prerope: give a config or head_dim, theta and max_pos")
    rope = rope_tables(int(head_dim), float(theta), int(max_pos))

    def encode_k(x, layer, token_start, seed):
        return PreRopeKeys.encode(x, rope, bits, token_start)

    def encode_v(x, layer, token_start, seed):
        from fast.core.quant import quantize
        return CodecStored(quantize(x, "int8", layer=layer, token_start=token_start))

    return Scheme(f"prerope_int{bits}", encode_k, encode_v, block_k=BLOCK, layout="prerope")
