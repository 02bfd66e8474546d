"""Compression schemes for the certified cache: "any scheme as one tensor function".

    register_scheme("mine", fn)        # fn(x) -> x_hat, a quantize-dequantize round trip
    get_scheme("int8")                 # a Scheme; .roundtrip(x) is its fn

A scheme turns a block of keys or values x: [B, Hkv, n, D] into a `Stored` payload (real
bytes: .nbytes) that decodes back to x_hat. The certificate never trusts the scheme: the
cache measures k - k_hat at write time (band witness, math.md T4), so a registered function
is a black box. Built-ins: the fast-path codecs (int8, int8_dither, int4, fp8_e4m3,
fp8_e5m2, and vLLM's round-toward-zero fp8 casts fp8_e4m3_rtz / fp8_e5m2_rtz, scale 1) and KIVI-style 2-bit (keys per channel over blocks of 32 tokens, values per token
in groups of 32 channels), plain (kivi2) or subtractively dithered (kivi2_dither). The dithered
schemes (int8_dither, int4_dither, kivi2_dither) add the dither tier (math.md T6, an estimate in decoding).
"""

import copy
from dataclasses import dataclass, field, replace

import torch

CODECS = ("int8", "int8_dither", "int4", "int4_dither", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_e5m2_rtz")
UNIFORM = ("int8", "int8_dither", "int4", "int4_dither")  # |x - x_hat| <= step/2 elementwise: zero-memory witness
DITHER = ("int8_dither", "int4_dither", "kivi2_dither")  # the dither tier applies
KIVI = ("kivi2", "kivi2_dither")
KIVI_GROUP = 32


class SchemeError(ValueError):
    """A scheme misbehaved (shape change, NaN, non-determinism) or does not exist."""


# ---- stored payloads: real bytes, token axis = 2 ----

class Grow:
    """An append-only tensor along dim 2 with amortised O(1) appends (capacity doubles);
    .t is the filled part (a view: the bytes counted are those of .t)."""

    def __init__(self, t):
        self.buf, self.n = t.contiguous(), t.shape[2]

    @property
    def t(self):
        return self.buf[:, :, :self.n]

    def append(self, x):
        m = x.shape[2]
        if self.n + m > self.buf.shape[2]:
            cap = max(2 * self.buf.shape[2], self.n + m, 64)
            new = self.buf.new_empty(*self.buf.shape[:2], cap, *self.buf.shape[3:])
            new[:, :, :self.n] = self.buf[:, :, :self.n]
            self.buf = new
        self.buf[:, :, self.n:self.n + m] = x
        self.n += m
        return self


class Store:
    """Named tensors sharing a token (or token-block) axis at dim 2, appended in place."""

    def __init__(self, **fields):
        self.f = {k: Grow(v) for k, v in fields.items() if v is not None}

    def get(self, name):
        return self.f[name].t if name in self.f else None

    @property
    def nbytes(self):
        return sum(g.t.nbytes for g in self.f.values())

    def cat(self, other):
        for k, g in self.f.items():
            g.append(other.f[k].t)
        return self

    def _taken(self, index):
        new = copy.copy(self)
        new.f = {k: Grow(_take(g.t, index)) for k, g in self.f.items()}
        return new

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def _take(t, index):
    """Gather t [B, Hkv, N, ...] along the token axis with index [B, Hkv, K] -> [B, Hkv, K, ...].
    Float8 codes are gathered as their bytes (torch has no Float8 gather on CPU): bit-identical."""
    idx = index.reshape(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])
    if t.dtype in FLOAT8:
        return torch.gather(t.view(torch.uint8), 2, idx).view(t.dtype)
    return torch.gather(t, 2, idx)


class Fp16Stored(Store):
    """A black-box scheme's output, stored in fp16 (the witness is measured against this)."""

    def __init__(self, x):
        super().__init__(x=x)  # x: [B, Hkv, N, D] fp16

    def decode(self):
        return self.get("x").float()

    def take(self, index):
        return self._taken(index)

    def step(self):
        return None


def _pack2(codes):
    """uint8 codes in [0, 3], last dim D -> [.., D // 4] bytes, 4 codes a byte."""
    c = codes.reshape(*codes.shape[:-1], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def _unpack2(packed):
    parts = [(packed >> s) & 3 for s in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)


def _asym2(x, dim):
    """2-bit asymmetric min/max quantization of x (fp32) reducing over `dim` -> (codes, scale16, zero16)."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / 3).to(torch.float16)
    zero = lo.to(torch.float16)
    s = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((x - zero.float()) / s).clamp_(0, 3).to(torch.uint8)
    return codes, scale, zero


class KiviKeys(Store):
    """Keys quantized per channel over blocks of G tokens: codes [B, Hkv, N, D/4] uint8,
    scale/zero [B, Hkv, N/G, D] fp16."""

    @staticmethod
    def encode(x):
        B, Hkv, n, D = x.shape
        if n % KIVI_GROUP:
            raise SchemeError(f"kivi2 keys are quantized in blocks of {KIVI_GROUP} tokens, got {n}")
        xb = x.float().reshape(B, Hkv, n // KIVI_GROUP, KIVI_GROUP, D)
        codes, scale, zero = _asym2(xb, dim=3)  # scale/zero: [B, Hkv, N/G, 1, D]
        return KiviKeys(codes=_pack2(codes.reshape(B, Hkv, n, D)), scale=scale.squeeze(3), zero=zero.squeeze(3))

    def decode(self):
        codes, scale, zero = self.get("codes"), self.get("scale"), self.get("zero")
        B, Hkv, n, _ = codes.shape
        c = _unpack2(codes).float().reshape(B, Hkv, n // KIVI_GROUP, KIVI_GROUP, -1)
        x = c * scale.float()[:, :, :, None] + zero.float()[:, :, :, None]
        return x.reshape(B, Hkv, n, -1)

    def take(self, index):
        raise SchemeError("kivi2 keys share a scale across blocks of 32 tokens: per-token eviction is not supported")

    def step(self):
        return None


class KiviValues(Store):
    """Values quantized per token in groups of G channels: codes [B, Hkv, N, D/4] uint8,
    scale/zero [B, Hkv, N, D/G] fp16."""

    @staticmethod
    def encode(x):
        B, Hkv, n, D = x.shape
        g = min(KIVI_GROUP, D)
        if D % g:
            raise SchemeError(f"kivi2 values are quantized in groups of {KIVI_GROUP} channels: head size {D} is not a multiple")
        codes, scale, zero = _asym2(x.float().reshape(B, Hkv, n, D // g, g), dim=4)
        return KiviValues(codes=_pack2(codes.reshape(B, Hkv, n, D)), scale=scale[..., 0], zero=zero[..., 0])

    def decode(self):
        codes, scale, zero = self.get("codes"), self.get("scale"), self.get("zero")
        B, Hkv, n, _ = codes.shape
        G = scale.shape[-1]
        c = _unpack2(codes).float().reshape(B, Hkv, n, G, -1)
        return (c * scale.float()[..., None] + zero.float()[..., None]).reshape(B, Hkv, n, -1)

    def take(self, index):
        return self._taken(index)

    def step(self):
        return None


class KiviDither(Store):
    """kivi2_dither: KIVI's layout with 2-bit subtractively dithered codes (fast.core.quant.kivi_dither_quantize):
    keys (kind "k") per channel over blocks of 32 tokens, values ("v") per token in groups of 32 channels;
    codes [B, Hkv, N, D/4] uint8 (4 a byte), scale/zero fp16 [B, Hkv, N/32, D] (keys) or [B, Hkv, N, D/32]."""

    def __init__(self, kind, codes, scale, zero, seed, layer, token_start):
        super().__init__(codes=codes, scale=scale, zero=zero)
        self.kind, self.seed, self.layer, self.token_start = kind, seed, layer, token_start

    @staticmethod
    def encode(x, kind, layer, token_start, seed):
        from fast.core.quant import kivi_dither_quantize
        if x.shape[-1] % 4:
            raise SchemeError(f"kivi2_dither packs 4 codes a byte: D = {x.shape[-1]} is not a multiple of 4")
        try:
            codes, scale, zero, seed = kivi_dither_quantize(x, kind, seed=seed, layer=layer, token_start=token_start)
        except ValueError as e:
            raise SchemeError(str(e)) from None
        return KiviDither(kind, _pack2(codes), scale, zero, seed, layer, token_start)

    def _codes(self):
        return _unpack2(self.get("codes"))  # [B, Hkv, N, D]

    def decode(self):
        from fast.core.quant import kivi_dither_dequantize
        return kivi_dither_dequantize(self._codes(), self.get("scale"), self.get("zero"), self.kind,
                                      self.seed, self.layer, self.token_start)

    def step(self):
        from fast.core.quant import kivi_dither_step
        B, Hkv, N, W = self.get("codes").shape
        return kivi_dither_step(self.get("scale"), self.get("zero"), self.kind, (B, Hkv, N, 4 * W))

    def cat(self, other):
        n = self.f["codes"].n
        if (other.kind, other.seed, other.layer, other.token_start) != (self.kind, self.seed, self.layer, self.token_start + n):
            raise SchemeError("KiviDither.cat: kind, seed, layer or token counters do not line up")
        return super().cat(other)

    def take(self, index):
        raise SchemeError("kivi2_dither: the dither counters follow contiguous tokens (and keys share a scale across "
                          "blocks of 32 tokens): eviction needs another scheme")


class CodecStored(Store):
    """A fast.core.quant QTensor (packed codes + scales), grown in place."""

    def __init__(self, qt):
        super().__init__(codes=qt.codes, scales=qt.scales)
        self.template = replace(qt, codes=qt.codes[:, :, :0], scales=None)

    @property
    def qt(self):
        return replace(self.template, codes=self.get("codes"), scales=self.get("scales"))

    def decode(self):
        from fast.core.quant import dequantize
        return dequantize(self.qt)

    def cat(self, other):
        t = self.template
        if other.template.token_start != t.token_start + self.f["codes"].n or other.template.scheme != t.scheme:
            raise SchemeError("CodecStored.cat: scheme or token counters do not line up")
        return super().cat(other)

    def take(self, index):
        """Gather tokens per KV head (codes and scales carry the token axis at dim 2)."""
        if self.template.scheme in DITHER:
            raise SchemeError(f"{self.template.scheme}: the dither counters follow contiguous tokens; eviction needs another scheme")
        return self._taken(index)

    def step(self):
        return self.qt.step() if self.template.scheme in UNIFORM else None


# ---- schemes ----

@dataclass
class Scheme:
    """How one cache layer stores keys and values.

    block_k: keys are encoded in blocks of this many tokens (1 = per token; kivi2: 32);
    derived_witness: the stored payload has a uniform step with |error| <= step/2;
    dither: the probabilistic tier (math.md T6) applies;
    layout: the stored layout when it is one the fused CPU read takes in place (fast.integrations.hf_fused
    FUSED_LAYOUTS: "int8", "int4", "int8_dither", "int4_dither", "fp8", "kivi2", "kivi2_dither", "prerope", and "fp16" for
    register_scheme's fp16 outputs), set by the built-in constructors and register_scheme only ("" otherwise: a Scheme
    built by hand is read by the torch twin, whatever its name).
    """
    name: str
    encode_k: object  # (x [B,Hkv,n,D], layer, token_start, seed) -> Stored
    encode_v: object
    block_k: int = 1
    derived_witness: bool = False
    dither: bool = False
    deterministic: bool = True
    fn: object = None  # the user's round trip, for black-box schemes
    checked: dict = field(default_factory=dict)
    layout: str = ""

    def roundtrip(self, x, layer=0, token_start=0, seed=0):
        """x_hat = decode(encode(x)) for keys: the scheme as one tensor function."""
        return self.encode_k(x, layer, token_start, seed).decode()


def _codec_scheme(name):
    def encoder(stream):  # keys and values draw the dither from separate streams (0 and 1)
        def encode(x, layer, token_start, seed):
            from fast.core.quant import quantize
            qt = quantize(x, name, seed=seed, layer=layer, token_start=token_start, stream=stream)
            if qt.token_start != token_start:  # fp8 QTensors do not record the counters; cat checks them
                qt = replace(qt, token_start=token_start)
            return CodecStored(qt)
        return encode
    return Scheme(name, encoder(0), encoder(1), derived_witness=name in UNIFORM, dither=name in DITHER,
                  layout=name if name in ("int8", "int4", "int8_dither", "int4_dither") else "fp8" if name.startswith("fp8") else "")


def _kivi_scheme():
    return Scheme("kivi2", lambda x, *a: KiviKeys.encode(x), lambda x, *a: KiviValues.encode(x), block_k=KIVI_GROUP,
                  layout="kivi2")


def _kivi_dither_scheme():
    """kivi2_dither: |x - x_hat| <= step/2 elementwise (zero-memory witness) and the dither tier."""
    return Scheme("kivi2_dither", lambda x, L, t, seed: KiviDither.encode(x, "k", L, t, seed),
                  lambda x, L, t, seed: KiviDither.encode(x, "v", L, t, seed),
                  block_k=KIVI_GROUP, derived_witness=True, dither=True, layout="kivi2_dither")


def _owned_output(name, x, x_hat):
    """The cache's own fp16 copy of a scheme's output, checked. The copy is taken first and the
    checks run on it, so nothing the function does later can change what is stored."""
    if not isinstance(x_hat, torch.Tensor):
        raise SchemeError(f"scheme {name!r}: returned {type(x_hat).__name__}, expected a tensor")
    if x_hat.shape != x.shape:
        raise SchemeError(f"scheme {name!r}: changed the shape {tuple(x.shape)} -> {tuple(x_hat.shape)}")
    if not x_hat.is_floating_point():
        raise SchemeError(f"scheme {name!r}: returned dtype {x_hat.dtype}, expected a floating-point tensor")
    mine = x_hat.detach().to(device=x.device, copy=True)  # never an alias of the function's tensor
    if not bool(torch.isfinite(mine).all()):
        raise SchemeError(f"scheme {name!r}: returned NaN or Inf")
    x16 = mine.to(torch.float16).contiguous()
    if not bool(torch.isfinite(x16).all()):
        raise SchemeError(f"scheme {name!r}: output overflows fp16 storage")
    return x16


def _private(x):
    """A fresh contiguous copy of x for a black-box function: it never sees a tensor (or a view
    of a buffer) that the cache keeps."""
    return x.detach().clone(memory_format=torch.contiguous_format)


def _blackbox_scheme(name, fn, deterministic):
    scheme = Scheme(name, None, None, deterministic=deterministic, fn=fn, layout="fp16")  # the kernel reads Fp16Stored rows

    def encode(x, layer, token_start, seed):
        x16 = _owned_output(name, x, fn(_private(x)))
        if deterministic and not scheme.checked.get("determinism"):
            again = _owned_output(name, x, fn(_private(x)))
            if not torch.equal(x16, again):
                raise SchemeError(f"scheme {name!r}: claims to be deterministic but two calls on the same input differ")
            scheme.checked["determinism"] = True
        return Fp16Stored(x16)

    scheme.encode_k = scheme.encode_v = encode
    return scheme


_REGISTRY = {}


def register_scheme(name, fn, *, deterministic=True):
    """Register fn(x) -> x_hat (x: [B, Hkv, n, D] float) under `name`.

    Ownership contract (README "Registered schemes"): fn receives a private contiguous copy of
    the tokens being written (never a view of anything the cache keeps, exact tail included), so
    what it does to its input is lost; the cache copies x_hat into its own fp16 storage before
    measuring the witness against that copy, so what fn does to x_hat later is lost too.
    Probed at once on a random tensor: a shape change, NaN/Inf, or (when deterministic) two
    different answers on the same input raise SchemeError. Every later call is checked too.
    """
    if not isinstance(name, str) or not name:
        raise SchemeError("scheme name must be a non-empty string")
    if name in CODECS or name in KIVI:
        raise SchemeError(f"scheme {name!r} is built in")
    if not callable(fn):
        raise SchemeError(f"scheme {name!r}: fn is not callable")
    scheme = _blackbox_scheme(name, fn, deterministic)
    probe = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(0))
    scheme.encode_k(probe, 0, 0, 0)
    scheme.checked.clear()  # check determinism again on the first real batch
    _REGISTRY[name] = scheme
    return scheme


def unregister_scheme(name):
    _REGISTRY.pop(name, None)


def scheme_names():
    return list(CODECS) + list(KIVI) + sorted(_REGISTRY)


def get_scheme(name):
    if isinstance(name, Scheme):
        return name
    if name in CODECS:
        return _codec_scheme(name)
    if name == "kivi2":
        return _kivi_scheme()
    if name == "kivi2_dither":
        return _kivi_dither_scheme()
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise SchemeError(f"unknown scheme {name!r}: choose one of {', '.join(scheme_names())}")
