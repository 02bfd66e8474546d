"""Page box witness of the evicted keys (math.md T7i-T7l): a certificate that says something.

At eviction time the evicted tokens of each KV head are cut into pages of `page_size`
tokens (consecutive in the given order: by position, or cluster_order's grouping). Per page
we keep the count n_p and the elementwise box of its keys, lo_c <= k_jc <= hi_c, lo rounded
down and hi rounded up to fp16 (or fp32): 2 D values per page. On every later read with
query q (T7i, T7j):

    U_p = s sum_c max(q_c lo_c, q_c hi_c) = s (<q+, hi> + <q-, lo>)    (exact max of s<q, k> over the box)
    x_j = s<q, k_j> <= U_p for every j in page p,  X = sum_p n_p exp(U_p) >= Z_E,
    TV(p, p^K) <= X / (L + X) for any 0 < L <= Z_K                               (T7b, T7k).

The keys are the cached post-RoPE keys: the logits use exactly these, and an evicted key is
never rotated again, so the box needs no RoPE invariance. When the evicted keys were
quantized (the cache served k~_j, exact k_j = k~_j + r_j, ||r_{j,b}|| <= rho_{j,b}) the box is
built on the stored keys and widened per band (T7l): U_p += s sum_b ||q_b|| max_{j in p} rho_{j,b}.

Hierarchy (`super_size`, `refine`): super-pages of `super_size` consecutive pages carry the
union box (elementwise min of lo, max of hi: exact in the stored format). The read evaluates
the super-page terms first and refines into pages only the super-pages whose term is at
least `refine` times the super-page total. Every evicted token lies in exactly one box of the
chosen cover (its page's, or its super-page's, which contains the page's box), so the bound
is sound for any refinement (T7j holds for any assignment of tokens to boxes containing them).

Floating point (math.md T8, assumption A9): q is fp32 and lo/hi are fp16 or fp32, so every
product q_c lo_c is exact in fp64 (24 + 24 < 53 mantissa bits); the sum of the 2D products
and everything after it carries the REL margin of fast.core.evict. What is returned is >= the
exact real value of X/(L+X) on the same inputs.
"""

from dataclasses import dataclass

import torch

from fast.core import _checks
from fast.core.evict import MAX_TERMS, REL, _band_norms_up, _check_finite, _round_up_f16, check_evicted, tv_from_log_odds

FORMATS = {"fp16": torch.float16, "fp32": torch.float32}


def _round_out(lo64, hi64, fmt):
    """(lo rounded down, hi rounded up) in format `fmt`; ValueError if either leaves its range."""
    lo, hi = lo64.to(FORMATS[fmt]), hi64.to(FORMATS[fmt])
    lo = torch.where(lo.double() > lo64, torch.nextafter(lo, torch.full_like(lo, -float("inf"))), lo)
    hi = torch.where(hi.double() < hi64, torch.nextafter(hi, torch.full_like(hi, float("inf"))), hi)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError(f"keys too large for a {fmt} box")
    return lo, hi


@dataclass
class PageBoxWitness:
    """Box witness of the evicted keys of one layer.

    counts [B, Hkv, P] int32 (0 marks an empty page), lo / hi [B, Hkv, P, D] fp16 or fp32
    (lo rounded down, hi up), widen [B, Hkv, P, NB] fp16 rounded up (max rho of the page's
    stored keys per band) or None when the evicted keys were exact, bands [NB, D // NB]
    (only with widen)."""
    counts: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    widen: torch.Tensor = None
    bands: torch.Tensor = None

    @property
    def nbytes(self):
        """Bytes as stored (counts int32, lo/hi in their format, widen fp16)."""
        ts = [self.counts, self.lo, self.hi] + ([self.widen] if self.widen is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def evicted(self):
        return int(self.counts.sum())

    def cat(self, other):
        """Append the pages of a later eviction (same B, Hkv)."""
        if (self.widen is None) != (other.widen is None):
            raise ValueError("cannot join a widened and an unwidened witness")
        widen = None if self.widen is None else torch.cat([self.widen, other.widen], 2)
        return PageBoxWitness(torch.cat([self.counts, other.counts], 2), torch.cat([self.lo, other.lo], 2),
                              torch.cat([self.hi, other.hi], 2), widen, self.bands)

    def super_pages(self, size):
        """The witness of super-pages of `size` consecutive pages: union boxes, summed counts."""
        if size < 1:
            raise ValueError("super-page size must be >= 1")
        B, Hkv, P, D = self.lo.shape
        S = -(-P // size)
        pad = S * size - P
        cnt = torch.nn.functional.pad(self.counts, (0, pad)).view(B, Hkv, S, size)
        empty = (cnt == 0)[..., None]
        lo = torch.nn.functional.pad(self.lo, (0, 0, 0, pad)).view(B, Hkv, S, size, D)
        hi = torch.nn.functional.pad(self.hi, (0, 0, 0, pad)).view(B, Hkv, S, size, D)
        lo = lo.masked_fill(empty, float("inf")).amin(3)                    # empty pages do not widen the union
        hi = hi.masked_fill(empty, -float("inf")).amax(3)
        none = (cnt.sum(-1) == 0)[..., None]
        lo, hi = lo.masked_fill(none, 0), hi.masked_fill(none, 0)
        widen = None
        if self.widen is not None:
            NB = self.widen.shape[-1]
            widen = torch.nn.functional.pad(self.widen, (0, 0, 0, pad)).view(B, Hkv, S, size, NB).amax(3)
        return PageBoxWitness(cnt.sum(-1).to(torch.int32), lo, hi, widen, self.bands)


def build_page_box_witness(keys, evict_index, *, page_size=16, evict_valid=None, rho=None, bands=None,
                           fmt="fp16"):
    """Page box witness of the evicted keys (T7i, T7l).

    keys: [B, Hkv, N, D] the keys as cached (post-RoPE; the logits use exactly these);
    evict_index: [B, Hkv, E] the evicted tokens, in page order (pages = runs of `page_size`);
    evict_valid: bool [B, Hkv, E] (False = padding slot, not a token), default all True;
    rho: optional [B, Hkv, N, NB] band witness of the stored keys' error (quantized cache),
    with bands [NB, D // NB]: the page is widened by max_j rho_{j,b} per band (T7l);
    fmt: "fp16" or "fp32", the format of lo / hi (rounded outward)."""
    B, Hkv, N, D = check_evicted("keys", keys, evict_index)
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    E = evict_index.shape[2]
    valid = torch.ones_like(evict_index, dtype=torch.bool) if evict_valid is None else evict_valid
    if valid.shape != evict_index.shape or valid.dtype != torch.bool:
        raise ValueError(f"evict_valid must be bool {tuple(evict_index.shape)}")
    P = max(1, -(-E // page_size))
    pad = P * page_size - E
    idx = torch.nn.functional.pad(evict_index, (0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    k = keys.double().gather(2, idx[..., None].expand(-1, -1, -1, D)).view(B, Hkv, P, page_size, D)   # exact
    w = valid.view(B, Hkv, P, page_size)
    counts = w.sum(-1)
    empty = (counts == 0)[..., None]
    lo = k.masked_fill(~w[..., None], float("inf")).amin(3).masked_fill(empty, 0)    # exact min / max
    hi = k.masked_fill(~w[..., None], -float("inf")).amax(3).masked_fill(empty, 0)
    lo, hi = _round_out(lo, hi, fmt)
    widen = None
    if rho is not None:
        _check_finite("rho", rho)
        if bands is None or bands.dim() != 2 or bands.numel() != D:
            raise ValueError(f"a widened box needs bands [NB, D/NB] covering D={D}")
        NB = bands.shape[0]
        if rho.shape != (B, Hkv, N, NB) or (rho < 0).any():
            raise ValueError(f"rho must be nonnegative [B, Hkv, N, NB]={(B, Hkv, N, NB)}, got {tuple(rho.shape)}")
        r = rho.double().gather(2, idx[..., None].expand(-1, -1, -1, NB)).view(B, Hkv, P, page_size, NB)
        widen = _round_up_f16((r * w[..., None]).amax(3))                   # max of the page's rho: exact, then up
    return PageBoxWitness(counts.to(torch.int32), lo, hi, widen, bands if rho is not None else None)


def _check_witness(w, B, D):
    for name, t in (("lo", w.lo), ("hi", w.hi)):
        _check_finite(name, t)
        if t.dim() != 4 or t.shape[0] != B or t.shape[3] != D:
            raise ValueError(f"{name} must be [B={B}, Hkv, P, D={D}], got {tuple(t.shape)}")
    Hkv, P = w.lo.shape[1], w.lo.shape[2]
    if w.hi.shape != w.lo.shape or (w.lo > w.hi).any():
        raise ValueError("hi must have lo's shape and hi >= lo")
    if w.counts.shape != (B, Hkv, P) or w.counts.is_floating_point() or (w.counts < 0).any():
        raise ValueError(f"counts must be nonnegative integers [B, Hkv, P]={(B, Hkv, P)}")
    if w.widen is not None:
        _check_finite("widen", w.widen)
        if w.bands is None or w.bands.dim() != 2 or w.bands.numel() != D:
            raise ValueError(f"widen needs bands [NB, D/NB] covering D={D}")
        if w.widen.shape != (B, Hkv, P, w.bands.shape[0]) or (w.widen < 0).any():
            raise ValueError(f"widen must be nonnegative [B, Hkv, P, NB]={(B, Hkv, P, w.bands.shape[0])}")
    if D > 4096 or P > MAX_TERMS:
        raise ValueError(f"D={D} > 4096 or P={P} > 2^20: outside the proven margins")


def page_upper(q, witness, scale):
    """a_p >= U_p = s sum_c max(q_c lo_c, q_c hi_c) (+ s sum_b ||q_b|| widen_{p,b}): fp64 [B, H, P].

    max(q_c lo_c, q_c hi_c) = q+_c hi_c + q-_c lo_c with q+ = max(q, 0), q- = min(q, 0) (one of
    the two is 0), so U_p is two dot products. q: [B, H, D] post-RoPE query; scale s > 0."""
    _check_finite("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    _check_witness(witness, B, D)
    Hkv = witness.lo.shape[1]
    if H % Hkv:
        raise ValueError(f"H={H} is not a multiple of Hkv={Hkv}")
    if not (float(scale) > 0 and float(scale) < float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return box_upper(q, witness, float(scale))


def box_upper(q, witness, s):
    """page_upper without its checks, for callers whose witness was checked when built
    (fast.core.sparse): q [B, H, D] finite, s > 0 finite, H a multiple of Hkv."""
    B, H, D = q.shape
    Hkv = witness.lo.shape[1]
    q64 = q.double().view(B, Hkv, H // Hkv, D)                              # the query heads of each KV head
    qp, qm = q64.clamp(min=0), q64.clamp(max=0)
    lo, hi = witness.lo.double(), witness.hi.double()                       # exact
    dot = torch.matmul(qp, hi.transpose(-1, -2)) + torch.matmul(qm, lo.transpose(-1, -2))
    absdot = torch.matmul(qp, hi.abs().transpose(-1, -2)) - torch.matmul(qm, lo.abs().transpose(-1, -2))
    rad = torch.zeros_like(dot)
    if witness.widen is not None:
        qn = _band_norms_up(q64, witness.bands)                             # [B, Hkv, rep, NB]
        rad = torch.einsum("bkrn,bkpn->bkrp", qn, witness.widen.double())
    # every product is exact (fp32 x fp16/fp32 in fp64); dot is a sum of <= 2D <= 8192 terms, rad of
    # NB terms: error <= gamma_n (sum of |terms|) <= REL/8 (absdot + rad) in any summation order;
    # the two additions of the matmuls, the addition of rad and the product by s add relative u
    # each: REL covers all.
    a = s * (dot + rad) + s * REL * (absdot + rad)
    return a.reshape(B, H, -1)


def log_sum_upper(counts, a):
    """An upper bound on log sum_p n_p exp(a_p) over the last axis (-inf when all n_p = 0).

    counts: fp64 [..., P] (exact integers); a: fp64 [..., P]. Same error budget as
    fast.core.evict.evict_log_odds: log n, t - m, exp, the P-term sum and log err by a few u."""
    logn = torch.where(counts > 0, counts.log(), torch.full_like(counts, -float("inf")))
    t = logn + a
    m = t.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ssum = (t - m_safe).exp().sum(-1)
    lsum = ssum.clamp_min(1).log()
    m0 = m_safe[..., 0]
    out = m0 + lsum + REL * (1 + m0.abs() + lsum)
    return torch.where(torch.isfinite(m[..., 0]), out, torch.full_like(out, -float("inf")))


def pagebox_log_odds(q, witness, log_z_kept_lower, scale, *, super_size=None, refine=1 / 16, stats=None):
    """An upper bound on log(X/L), fp64 [B, H] (-inf when nothing was evicted); TV <= sigmoid of it.

    q: [B, H, D] post-RoPE query; witness: PageBoxWitness; log_z_kept_lower: [B, H] with
    exp(.) <= Z_K (fast.core.evict.log_z_kept_lower); scale s > 0.
    super_size: None = every page is read; an int = the hierarchy: super-pages of that many
    pages first, refined into pages where the super-page's term is >= refine x the super-page
    total (sound for any refine in [0, 1]). stats: optional dict, receives "boxes" (box
    evaluations per query head, mean: super-pages + super_size x refined super-pages, a partial
    last super-page counted as full) and "pages" (pages per KV head)."""
    _check_finite("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    _check_finite("log_z_kept_lower", log_z_kept_lower)
    B, H = q.shape[:2]
    if log_z_kept_lower.shape != (B, H):
        raise ValueError(f"log_z_kept_lower must be [B, H]={(B, H)}, got {tuple(log_z_kept_lower.shape)}")
    if not 0 <= refine <= 1:
        raise ValueError(f"refine must lie in [0, 1], got {refine}")
    Hkv, P = witness.lo.shape[1], witness.lo.shape[2]
    rep = H // max(1, Hkv)
    n = witness.counts.double().repeat_interleave(rep, 1)                   # [B, H, P], exact
    if super_size is None:
        log_x = log_sum_upper(n, page_upper(q, witness, scale))
        boxes = float(P)
    else:
        sup = witness.super_pages(super_size)
        S = sup.counts.shape[2]
        a_sup = page_upper(q, sup, scale)                                   # [B, H, S]
        n_sup = sup.counts.double().repeat_interleave(rep, 1)
        logn_sup = torch.where(n_sup > 0, n_sup.log(), torch.full_like(n_sup, -float("inf")))
        t_sup = logn_sup + a_sup
        total = torch.logsumexp(t_sup, -1, keepdim=True)                   # only steers the choice
        fine = t_sup >= total + (torch.log(torch.tensor(refine, dtype=torch.float64)) if refine > 0 else -float("inf"))
        fine = fine & (n_sup > 0)
        # the cover: pages of refined super-pages, whole super-pages elsewhere (each token once)
        a_page = page_upper(q, witness, scale)                              # only the refined ones are used
        fine_page = fine.repeat_interleave(super_size, -1)[..., :P]
        n_page = torch.where(fine_page, n, torch.zeros_like(n))
        n_coarse = torch.where(fine, torch.zeros_like(n_sup), n_sup)
        log_x = log_sum_upper(torch.cat([n_page, n_coarse], -1), torch.cat([a_page, a_sup], -1))
        boxes = float((S + fine.double().sum(-1) * super_size).mean())
    if stats is not None:
        stats["boxes"] = stats.get("boxes", 0.0) + boxes
        stats["pages"] = P
    return log_odds_of(log_x, log_z_kept_lower)


def log_odds_of(log_x, log_z_kept_lower):
    """An upper bound on log(X/L) from upper log_x >= log X and lower log_z_kept_lower <= log Z_K,
    fp64 (-inf where log_x = -inf: nothing unread or evicted)."""
    lzk = log_z_kept_lower.double()
    d = log_x - lzk + REL * (1 + log_x.abs() + lzk.abs())                  # the subtraction errs by u |.|
    return torch.where(torch.isfinite(log_x), d, torch.full_like(d, -float("inf")))


def pagebox_bound(q, witness, log_z_kept_lower, scale, **kw):
    """TV(p, p^K) <= X/(L+X) per query head (T7b, T7k), fp32 [B, H], >= the exact value."""
    return tv_from_log_odds(pagebox_log_odds(q, witness, log_z_kept_lower, scale, **kw))


@dataclass
class ChannelCodes:
    """int4c: 4-bit codes per channel over blocks of BLOCK consecutive evicted tokens of one (row, KV
    head), KIVI's key layout: k^_c = lo_c + code_c * step_c with lo, step fp16 per (row, KV head, block,
    channel), computed in fp32. codes: uint8 [B, Hkv, E, D/2] (low nibble = even channel); lo, step:
    fp16 [B, Hkv, ceil(E / BLOCK), D]."""
    codes: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor

    @property
    def nbytes(self):
        return self.codes.numel() + 2 * (self.lo.numel() + self.step.numel())

    def decode(self):
        c = torch.stack([self.codes & 15, self.codes >> 4], -1).flatten(-2).float()
        E = c.shape[2]
        per = lambda t: t.float().repeat_interleave(BLOCK, 2)[:, :, :E]
        return per(self.lo) + c * per(self.step)


BLOCK = 32


def channel_codes(k, valid):
    """ChannelCodes of k [B, Hkv, E, D] fp32 (min/max over the valid tokens of each block; the decoded key
    need not be close to k for soundness: the witness is measured against k itself)."""
    B, Hkv, E, D = k.shape
    nb = -(-E // BLOCK)
    pad = nb * BLOCK - E
    big = torch.finfo(torch.float32).max
    v = torch.nn.functional.pad(valid, (0, pad))[..., None].view(B, Hkv, nb, BLOCK, 1)
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, Hkv, nb, BLOCK, D)
    lo = torch.where(v, kb, torch.full_like(kb, big)).amin(3)
    hi = torch.where(v, kb, torch.full_like(kb, -big)).amax(3)
    lo = torch.where(lo <= hi, lo, torch.zeros_like(lo)).half()               # a block with no valid token: 0
    step = ((hi.clamp_min(lo.float()) - lo.float()) / 15).half()
    step = torch.where(step > 0, step, torch.ones_like(step))                 # constant channels: any step decodes lo
    per = lambda t: t.float().repeat_interleave(BLOCK, 2)[:, :, :E]
    code = ((k - per(lo)) / per(step)).round().clamp(0, 15).to(torch.uint8)
    return ChannelCodes(code[..., 0::2] | (code[..., 1::2] << 4), lo, step)


@dataclass
class KeySketch:
    """The evicted keys kept as codes (`scheme`, per token) with their band witness: a page box
    witness with one token per page (T7l with lo = hi = the decoded key k^, which lies in its own
    box, and W = the unpacked fp32 witness >= ||(k - k^)_b||, measured against the exact key: sound
    for any codec, as T4). The values of evicted tokens are not kept.
    codes: the QTensor of the evicted keys [B, Hkv, E, D] in evict order; rho: uint8 log codes
    [B, Hkv, E, NB]; valid: bool [B, Hkv, E]."""
    codes: object
    rho: torch.Tensor
    valid: torch.Tensor
    bands: torch.Tensor

    @property
    def nbytes(self):
        """Bytes as stored: codes and scales, witness codes, one validity byte per slot."""
        return self.codes.nbytes + self.rho.numel() + self.valid.numel()

    def boxes(self):
        """The PageBoxWitness this sketch stands for (pages of one token), built at read time."""
        from fast.core.witness import unpack_witness
        k_hat = _decode(self.codes)                                         # fp32: lo = hi = k^ exactly
        return PageBoxWitness(self.valid.to(torch.int32), k_hat, k_hat.clone(), unpack_witness(self.rho), self.bands)


def _decode(codes):
    from fast.core.quant import dequantize
    return codes.decode() if isinstance(codes, ChannelCodes) else dequantize(codes)


SKETCH_SCHEMES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2", "int4c")


def build_key_sketch(keys, evict_index, bands, *, scheme="int8", evict_valid=None):
    """KeySketch of the evicted keys: keys [B, Hkv, N, D] the exact keys as cached (post-RoPE),
    evict_index [B, Hkv, E] the evicted tokens, evict_valid bool [B, Hkv, E] (False = padding);
    scheme: a per-token codec of fast.core.quant (int8, int4, fp8_e4m3, fp8_e5m2), or int4c (ChannelCodes:
    4-bit per channel over the evicted tokens of each row and KV head)."""
    from fast.core.quant import quantize
    from fast.core.witness import pack_witness, witness
    B, Hkv, N, D = check_evicted("keys", keys, evict_index)
    if keys.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"keys must be fp32, fp16 or bf16 (the witness is measured against them exactly), got {keys.dtype}")
    if scheme not in SKETCH_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SKETCH_SCHEMES)}, got {scheme!r}")
    valid = torch.ones_like(evict_index, dtype=torch.bool) if evict_valid is None else evict_valid
    if valid.shape != evict_index.shape or valid.dtype != torch.bool:
        raise ValueError(f"evict_valid must be bool {tuple(evict_index.shape)}")
    bands = _checks.bands_tensor(bands, D)
    k = keys.float().gather(2, evict_index[..., None].expand(-1, -1, -1, D)).contiguous()   # exact
    if scheme == "int4c" and D % 2:
        raise ValueError(f"int4c packs two channels a byte: D must be even, got {D}")
    qt = channel_codes(k, valid) if scheme == "int4c" else quantize(k, scheme, group_size=32 if D % 32 == 0 else D)
    if scheme == "int4c" and not bool(torch.isfinite(qt.step.float()).all()):
        raise ValueError("int4c: a channel's key range exceeds fp16 (step overflows)")
    rho = pack_witness(witness(k, _decode(qt), bands))                     # >= ||(k - k^)_b||, rounded up
    return KeySketch(qt, rho, valid, bands)
