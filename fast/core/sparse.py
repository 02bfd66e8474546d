"""Certified sparse read of a long cache (issue 22 item 4): read pages by their box bound, stop
once the unread pages cannot carry more than tau of the attention (math.md T7i-T7k).

The full cache stays in memory. At prefill (`build_sparse_index`) the keys of each KV head are
cut into pages of `page_size` consecutive tokens and each full page keeps the elementwise box
of its keys (fast.core.pagebox; fp32 keys give exact fp32 boxes); `extend_sparse_index` adds
the pages filled since. On a decode read (`sparse_read`) with query q:

    U_p = s sum_c max(q_c lo_c, q_c hi_c) >= every logit of page p          (T7i, T7m; page_upper)
    the last partial page and a recent window of >= `window` tokens are always read exactly;
    the other pages are read in chunks (doubling) in decreasing order of U_p (per KV head: the
    max over its query heads), keeping the logits of what was read, until
        X / (Z_K + X) <= tau for every (b, h),  X = sum_{unread p} n_p exp(U_p) >= Z_E  (T7j)
    or everything was read. One page count m is shared by all (b, KV head); each KV head reads
    its own top-m pages (the query heads of a KV head share its read set).

A sparse read is eviction of the unread pages for this one read, so the certificate is the
page box certificate of eviction (T7k): TV(p, p^K) = p(E) <= X / (L + X), with p the exact
attention distribution over the whole cache and p^K the exact distribution over the read
tokens K. L <= Z_K comes from the fp32 logits the read served, x^_j >= x_j - e with e of
fast.core.certify.logit_rounding (T8e), as Z_K >= sum_K e^{x^_j - e} (T7f); every fp64 step
carries the REL margin of fast.core.evict (A9). The stopping rule only steers which pages are
read; the certificate is recomputed, rounded up, for the set actually read.

Also reported (T5a with exact values, e_j = 0): ||o - o^K|| <= TV(p, p^K) diam{v_j} <=
TV 2 max_j ||v_j|| for the exact-arithmetic outputs o (whole cache) and o^K (read set); the fp32
rounding of the served output over the read set is not in it, nor in the TV certificate.

Precondition: the indexed pages' keys do not change after indexing (an append-only cache);
they are checked finite when indexed, the window's keys on every read.
"""

import math
from dataclasses import dataclass

import torch

from fast.core.certify import logit_rounding
from fast.core.evict import REL, _check_finite, log_sum_exp_lower, tv_from_log_odds
from fast.core.pagebox import PageBoxWitness, box_upper, build_page_box_witness, log_odds_of, log_sum_upper

DENSE_FRACTION = 8  # past 1/8 of the pages a read scores every page in place instead of copying pages


@dataclass
class SparseIndex:
    """Page boxes of the first P full pages of one layer's cache.

    boxes: PageBoxWitness, counts [B, Hkv, P] (all page_size), lo / hi [B, Hkv, P, D] fp32;
    kmax [B, Hkv, D] fp64 >= |k_jc| over the indexed tokens; vmax [B, Hkv] fp64 >= ||v_j||
    over the indexed tokens."""
    boxes: PageBoxWitness
    kmax: torch.Tensor
    vmax: torch.Tensor
    page_size: int

    @property
    def pages(self):
        return self.boxes.lo.shape[2]

    @property
    def nbytes(self):
        return self.boxes.nbytes + self.kmax.numel() * 8 + self.vmax.numel() * 8


@dataclass
class SparseRead:
    """out [B, H, D] fp32: softmax attention over the read tokens; tv [B, H] fp64 >= TV(p, p^K);
    out_err [B, H] fp64 >= ||o - o^K|| (T5a); tokens [B, Hkv, R] the read tokens;
    pages_read / pages: candidate pages read / candidate pages (outside the exact window)."""
    out: torch.Tensor
    tv: torch.Tensor
    out_err: torch.Tensor
    tokens: torch.Tensor
    pages_read: int
    pages: int


def _check_cache(keys, values):
    for name, t in (("keys", keys), ("values", values)):
        if not torch.is_tensor(t) or t.dim() != 4 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor [B, Hkv, N, D]")
    if values.shape != keys.shape:
        raise ValueError(f"values {tuple(values.shape)} must have the keys' shape {tuple(keys.shape)}")
    return keys.shape


def _norm_up(v):
    """fp64 >= max_j ||v_j|| over axis -2 of v [..., N, D] (an N-term fp64 sum: REL covers it)."""
    if v.shape[-2] == 0:
        return torch.zeros(v.shape[:-2], dtype=torch.float64, device=v.device)
    return v.double().pow(2).sum(-1).sqrt().amax(-1) * (1 + REL)


def _pages_of(keys, values, start, stop, page_size):
    """(boxes, kmax, vmax) of the full pages [start, stop) of keys / values [B, Hkv, N, D]."""
    B, Hkv, N, D = keys.shape
    k = keys[:, :, start * page_size:stop * page_size]
    v = values[:, :, start * page_size:stop * page_size]
    _check_finite("keys", k)
    _check_finite("values", v)
    n = (stop - start) * page_size
    if n == 0:
        empty = torch.zeros(B, Hkv, 0, D, dtype=torch.float32, device=keys.device)
        return (PageBoxWitness(torch.zeros(B, Hkv, 0, dtype=torch.int32, device=keys.device), empty, empty.clone()),
                torch.zeros(B, Hkv, D, dtype=torch.float64, device=keys.device), _norm_up(v))
    idx = torch.arange(n, device=keys.device).expand(B, Hkv, n).contiguous()
    boxes = build_page_box_witness(k, idx, page_size=page_size, fmt="fp32")   # fp32 keys: exact boxes
    return boxes, k.abs().amax(2).double(), _norm_up(v)


def build_sparse_index(keys, values, *, page_size=16):
    """The SparseIndex of every full page of keys / values [B, Hkv, N, D] fp32 (post-RoPE, as cached)."""
    B, Hkv, N, D = _check_cache(keys, values)
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    boxes, kmax, vmax = _pages_of(keys, values, 0, N // page_size, page_size)
    return SparseIndex(boxes, kmax, vmax, page_size)


def extend_sparse_index(index, keys, values):
    """The index with the pages of keys / values [B, Hkv, N, D] filled since it was built."""
    B, Hkv, N, D = _check_cache(keys, values)
    ps, P = index.page_size, index.pages
    if index.boxes.lo.shape[:2] != (B, Hkv) or index.kmax.shape != (B, Hkv, D) or N < P * ps:
        raise ValueError(f"the cache {tuple(keys.shape)} does not extend the index ({P} pages of {ps})")
    if N // ps == P:
        return index
    boxes, kmax, vmax = _pages_of(keys, values, P, N // ps, ps)
    return SparseIndex(index.boxes.cat(boxes), torch.maximum(index.kmax, kmax), torch.maximum(index.vmax, vmax), ps)


def _check_read(q, keys, values, index, scale, window):
    _check_finite("q", q)
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be a float32 tensor [B, H, D], got {tuple(q.shape)} {q.dtype}")
    B, Hkv, N, D = _check_cache(keys, values)
    H = q.shape[1]
    if q.shape[0] != B or q.shape[2] != D or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(keys.shape)} (H a multiple of Hkv)")
    if N == 0:
        raise ValueError("empty cache (N = 0)")
    if index.boxes.lo.shape[:2] != (B, Hkv) or index.boxes.lo.shape[3] != D or index.pages * index.page_size > N:
        raise ValueError(f"the index ({index.pages} pages of {index.page_size}) does not fit the cache {tuple(keys.shape)}")
    s = float(scale)
    if not (s > 0 and s < float("inf")) or abs(s) < 2.0 ** -126:
        raise ValueError(f"scale must be a positive finite normal number, got {scale}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if torch.get_float32_matmul_precision() != "highest" or (q.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        raise ValueError("sparse_read needs full fp32 matmuls (the logit error bound assumes them)")
    cand = min(index.pages, max(0, N - max(window, 1)) // index.page_size)  # by box order; >= 1 token exact
    return B, H, Hkv, N, D, s, cand


def _pages(t, sel, ps):
    """t [B, Hkv, N, D], sel [B, Hkv, c] page numbers -> the pages' rows [B, Hkv, c ps, D] (row copies)."""
    B, Hkv, N, D = t.shape
    c = sel.shape[2]
    flat = t[:, :, :N // ps * ps].reshape(B * Hkv, N // ps, ps * D)       # a view for a contiguous cache
    rows = torch.arange(B * Hkv, device=t.device)[:, None]
    return flat[rows, sel.reshape(B * Hkv, c)].view(B, Hkv, c * ps, D)


def sparse_read(q, keys, values, index, scale, tau, *, window=64, first_chunk=8):
    """Certified sparse decode read (module doc). q: [B, H, D] fp32 post-RoPE; keys / values:
    [B, Hkv, N, D] fp32, the full cache; index: SparseIndex of it; scale s > 0; tau in (0, 1]:
    stop once every head's certificate is <= tau (tau = 1: read only the window)."""
    B, H, Hkv, N, D, s, cand = _check_read(q, keys, values, index, scale, window)
    if not (0 < float(tau) <= 1):
        raise ValueError(f"tau must lie in (0, 1], got {tau}")
    if not isinstance(first_chunk, int) or first_chunk < 1:
        raise ValueError(f"first_chunk must be an int >= 1, got {first_chunk!r}")
    ps, rep = index.page_size, H // Hkv
    s32 = torch.tensor(s, dtype=torch.float32)
    qg = q.view(B, Hkv, rep, D)                                             # the query heads of each KV head
    kw, vw = keys[:, :, cand * ps:], values[:, :, cand * ps:]               # the exact window
    _check_finite("keys", kw)
    _check_finite("values", vw)
    xs = [torch.matmul(qg, kw.transpose(-1, -2)) * s32]                     # [B, Hkv, rep, Nw] fp32: T8e's x^
    sels = []
    kmax = torch.maximum(index.kmax, kw.abs().amax(2).double())             # >= |k| over every readable token
    e = logit_rounding(q, kmax, s)                                          # [B, H] fp64: |x^ - x| <= e
    boxes = PageBoxWitness(index.boxes.counts[:, :, :cand], index.boxes.lo[:, :, :cand], index.boxes.hi[:, :, :cand])
    m, parts, dense = 0, [(xs[0], vw)], None                                # parts: (logits, values) read
    if cand:
        a = box_upper(q, boxes, s).view(B, Hkv, rep, cand)                  # fp64 >= U_p (checked when indexed)
        order = (a.amax(2)).argsort(-1, descending=True)                    # [B, Hkv, P]: by U_p per KV head
        a_sorted = a.gather(-1, order[:, :, None].expand(-1, -1, rep, -1))
        # steering only: log X of the unread after reading the first m pages (m = 0..P), and log Z_K
        t = a_sorted + math.log(ps)
        tail = torch.cat([t.flip(-1).logcumsumexp(-1).flip(-1), torch.full_like(t[..., :1], -math.inf)], -1)
        lz = xs[0].double().logsumexp(-1) if xs[0].shape[-1] else torch.full_like(t[..., 0], -math.inf)
        thr = math.log(tau) - math.log1p(-tau) if tau < 1 else math.inf
        slack = 2 * e.view(B, Hkv, rep) + 1e-6                              # keeps the rigorous value <= tau

        def first_done(lz, plse, m):
            """pages read (from m) at which every head stops, given the next pages' logsumexps plse."""
            cum = torch.logaddexp(lz[..., None], plse.logcumsumexp(-1))      # log Z_K after pages m+1, m+2, ...
            ok = (tail[..., m + 1:m + 1 + plse.shape[-1]] - cum + slack[..., None] <= thr).flatten(0, 2).all(0)
            return (int(ok.nonzero()[0]) + 1 if bool(ok.any()) else plse.shape[-1]), cum

        c = first_chunk
        while m < cand and not bool((tail[..., m] - lz + slack <= thr).all()):
            if m + c > cand // DENSE_FRACTION:
                # past 1/DENSE_FRACTION of the pages: score all of them in place (a matmul over the cache, no
                # copy) and mask the unread ones, rather than copy pages
                kc = keys[:, :, :cand * ps]
                xc = torch.matmul(qg, kc.transpose(-1, -2)) * s32           # [B, Hkv, rep, cand ps]
                plse = xc.double().view(B, Hkv, rep, cand, ps).logsumexp(-1).gather(-1, order[:, :, None].expand(-1, -1, rep, -1))
                j, _ = first_done(lz, plse[..., m:], m)
                m += j
                read = torch.zeros(B, Hkv, cand, dtype=torch.bool, device=q.device)
                read.scatter_(2, order[..., :m], True)
                dense = read
                xc = xc.masked_fill(~read.repeat_interleave(ps, -1)[:, :, None], -math.inf)
                parts = [parts[0], (xc, values[:, :, :cand * ps])]            # the chunks are inside xc
                break
            c = min(c, cand - m)
            sel = order[..., m:m + c]                                       # [B, Hkv, c] pages
            x = torch.matmul(qg, _pages(keys, sel, ps).transpose(-1, -2)) * s32     # [B, Hkv, rep, c ps]
            j, cum = first_done(lz, x.double().view(B, Hkv, rep, c, ps).logsumexp(-1), m)
            parts.append((x[..., :j * ps], sel[..., :j]))                  # values fetched once, at the end
            lz = cum[..., j - 1]
            m += j
            c *= 2
    if dense is None:
        sel = torch.cat([p[1] for p in parts[1:]], -1) if m else torch.zeros(B, Hkv, 0, dtype=torch.long, device=q.device)
        parts = [parts[0]] + ([(torch.cat([p[0] for p in parts[1:]], -1), _pages(values, sel, ps))] if m else [])
    else:
        sel = order[..., :m]
    tok = torch.cat([torch.arange(cand * ps, N, device=q.device).expand(B, Hkv, -1),
                     (sel[..., None] * ps + torch.arange(ps, device=q.device)).reshape(B, Hkv, -1)], -1)   # [B, Hkv, R]
    # out = sum over parts of e^{x - M} v / sum e^{x - M}: softmax over the read tokens, values in place
    mx = torch.stack([p[0].amax(-1) for p in parts if p[0].shape[-1]], -1).amax(-1, keepdim=True)
    w = [(p[0] - mx).exp() for p in parts]
    num = sum(torch.matmul(wi, p[1]) for wi, p in zip(w, parts))
    out = (num / sum(wi.sum(-1, keepdim=True) for wi in w)).view(B, H, D)
    x = torch.cat([p[0] for p in parts], -1)                                # [B, Hkv, rep, R] (-inf: not read)
    if bool(torch.isnan(x).any() or torch.isposinf(x).any()):
        raise ValueError("sparse_read: the fp32 logits overflow (query or keys too large)")
    # the certificate of the set actually read
    lzk = log_sum_exp_lower(x.double().view(B, H, -1) - e[..., None] * (1 + REL))   # <= log Z_K (T7f, T8e)
    if m < cand:
        unread = a_sorted[..., m:].reshape(B, H, cand - m)
        log_x = log_sum_upper(torch.full_like(unread, float(ps)), unread)   # >= log Z_E (T7j)
    else:
        log_x = torch.full((B, H), -math.inf, dtype=torch.float64, device=q.device)
    tv = tv_from_log_odds(log_odds_of(log_x, lzk)).double()                 # >= TV(p, p^K) (T7k)
    vmax = torch.maximum(index.vmax, _norm_up(vw)).repeat_interleave(rep, 1)
    out_err = tv * (2 * vmax) * (1 + REL)                                   # T5a: diam{v_j} <= 2 max ||v_j||
    return SparseRead(out, tv, out_err, tok, m, cand)


def topk_page_read(q, keys, values, index, scale, k, *, window=64):
    """Quest-style baseline, no certificate: the exact window plus, per KV head, the k pages of
    largest fp32 U_p (max over its query heads); softmax attention over them, out [B, H, D] fp32."""
    B, H, Hkv, N, D, s, cand = _check_read(q, keys, values, index, scale, window)
    ps, rep = index.page_size, H // Hkv
    s32 = torch.tensor(s, dtype=torch.float32)
    qg = q.view(B, Hkv, rep, D)
    kw, vw = keys[:, :, cand * ps:], values[:, :, cand * ps:]
    k = max(0, min(int(k), cand))
    if k:
        lo, hi = index.boxes.lo[:, :, :cand], index.boxes.hi[:, :, :cand]
        u = torch.matmul(qg.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(qg.clamp(max=0), lo.transpose(-1, -2))
        sel = u.amax(2).topk(k, -1).indices                                 # [B, Hkv, k]
        kw, vw = torch.cat([kw, _pages(keys, sel, ps)], 2), torch.cat([vw, _pages(values, sel, ps)], 2)
    x = torch.matmul(qg, kw.transpose(-1, -2)) * s32
    return torch.matmul(torch.softmax(x, -1), vw).view(B, H, D)
