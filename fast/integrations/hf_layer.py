"""CertifiedLayer: one layer of a CertifiedCache (fast.integrations.hf_cache), the storage and the
reads of one layer's compressed keys and values with the band witness of every key (math.md T4).
The layout is in hf_cache's opening comment; fast.integrations.hf_fused.FusedLayer reads it in place."""


import torch
from transformers.cache_utils import CacheLayerMixin

from fast.core import cpu_fused
from fast.core._checks import version
from fast.core.quant import dequantize, quantize
from fast.core.schemes import CodecStored, Grow, get_scheme
from fast.core.witness import pack_witness, unpack_witness, witness, witness_from_step
from fast.core.certify import band_norms_up, up32

NB = 8  # RoPE bands per head (fast.rope_bands(D, NB, "rotate_half"))

# gate ladder:TAU: the rungs above each built-in scheme, lowest first; exact keys are the rung above the last.
# Each rung refines what the ones below left (a residual codec), so a same-width rung is not a repeat:
# int4 + int4 residual is about int8's precision at int4's bytes. Measured on SmolLM2 (README "ladder").
# A registered or pre-RoPE scheme goes straight to exact unless CertifiedCache(rungs=...) names rungs.
LADDERS = {"kivi2": ("int4", "int4", "int8"), "int4": ("int4", "int8"), "int8": ("int4",),
           "fp8_e4m3": ("int4", "int8"), "fp8_e5m2": ("int4", "int8"),
           "fp8_e4m3_rtz": ("int4", "int8"), "fp8_e5m2_rtz": ("int4", "int8")}
RUNG_CODECS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_e5m2_rtz")  # per token, no dither


def _take(t, index):
    """t [B, Hkv, N, ...] gathered along the token axis with index [B, Hkv, K]."""
    idx = index.reshape(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])
    return torch.gather(t, 2, idx)


def _up_bytes(st):
    """Bytes of one promoted head's rungs: residual codes and scales, witness (and value witness)."""
    return (sum(x.nbytes for x in st["k"] + st["v"]) + (0 if st["rho"] is None else st["rho"].nbytes)
            + (0 if st["v_err"] is None else st["v_err"].nbytes))


def value_error_norms(v, v_hat):
    """[B, Hkv, n] fp32 >= ||v_j - v~_j|| (fp64 differences of two floats, band_norms_up with one band of all
    D coordinates, rounded up to fp32): the value witness of math.md T5."""
    D = v.shape[-1]
    return up32(band_norms_up(v.to(torch.float64) - v_hat.to(torch.float64), torch.arange(D, device=v.device)[None])[..., 0])


class CertifiedLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0          # positions written so far (RoPE position of the next token)
        self.nq = 0            # tokens in the quantized part
        self.kq = self.vq = None
        self.rho_codes = None  # [B, Hkv, nq, NB] uint8 (stored witness), None when derived from the scales
        self.k_tail = self.v_tail = None  # [B, Hkv, R, D] exact
        self.ex_idx = None     # [B, Hkv, E] storage index of exact-overlay tokens
        self.ex_on = None      # [B, Hkv, E] bool (False = padding entry, a no-op)
        self.ex_k = self.ex_v = None
        self.valid = None      # [B, Hkv, N] bool: False = padding token
        self.valid_epoch = 0   # changes of `valid` not made by update's appends (in place, or replaced): _append_valid
        self._valid_mark = None
        self.exact_k = self.exact_v = None  # full exact copy (shadow and/or full offload)
        self.res_k = self.res_v = None      # residual offload tier (Stored) and its witness
        self.res_rho = None
        self.v_err = self.res_v_err = None  # [B, Hkv, nq] fp32 >= ||v - v~|| (value_bound=True; res_: after a residual repair)
        self.repaired = None   # [Hkv] bool: served exact (the top rung)
        self.rung = None       # [Hkv] long: 0 = the cache's scheme, r = cache.rungs[r - 1], len(rungs) + 1 = exact
        self.up = {}           # KV head -> {"k", "v": [Stored of rungs 1..r], "rho": witness codes of the sum
                               #   (None: written over the head's slice of rho_codes, see _rung_rho), "v_err"}
        self.risk = None       # [Hkv] risk score from the last prefill query (risk gate)
        self.steps = 0         # decode reads certified so far
        self.served_k = self.served_v = None
        self.traffic = 0       # repair traffic bytes (offload -> device)
        self._grow = {}        # preallocated growth for the append-only tensors below
        # query-subspace witness (cache.subspace = m > 0; fast.core.subspace, spec T4e): the basis U, fixed at the
        # layer's first read from its query rows, and per quantized token a (fp16 [.., m]), tau and sigma (log codes)
        self.sub_U = None      # [B, Hkv, m, D] fp32
        self.sub_a = self.sub_scale = None  # a = codes [B, Hkv, nq, m] int8 x scale [B, Hkv, nq] fp16
        self.sub_tau = self.sub_sigma = None  # [B, Hkv, nq] u8, [B, Hkv, nq, NB] u8 log codes
        self.sub_pending = []  # (k, k_hat) of tokens quantized before U was fixed (the first prefill's)

    def _append(self, name, x):
        """self.<name> = cat(self.<name>, x) along the token axis, amortised O(len(x))."""
        if name not in self._grow:
            cur = getattr(self, name)
            self._grow[name] = Grow(cur if cur is not None else x[:, :, :0])
        setattr(self, name, self._grow[name].append(x).t)

    def _set(self, name, t):
        """Replace self.<name> (after a gather)."""
        self._grow[name] = Grow(t)
        setattr(self, name, self._grow[name].t)

    @property
    def derived(self):
        """Zero-memory witness from the scales: uniform codecs served in fp32 (no rounding on the way out)."""
        return self.cache.scheme.derived_witness and self.cache.derived and self.dtype == torch.float32

    # ---- transformers CacheLayerMixin ----
    def lazy_initialization(self, key_states, value_states):
        B, Hkv, _, D = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.B, self.Hkv, self.D = B, Hkv, D
        empty = key_states[:, :, :0]
        self.k_tail, self.v_tail = empty.clone(), value_states[:, :, :0].clone()
        self.valid = torch.ones(B, Hkv, 0, dtype=torch.bool, device=self.device)
        self.ex_idx = torch.zeros(B, Hkv, 0, dtype=torch.long, device=self.device)
        self.ex_on = torch.zeros(B, Hkv, 0, dtype=torch.bool, device=self.device)
        self.ex_k, self.ex_v = empty.clone(), value_states[:, :, :0].clone()
        self.repaired = torch.zeros(Hkv, dtype=torch.bool)
        self.rung = torch.zeros(Hkv, dtype=torch.long)
        if self.cache.keep_exact:
            self.exact_k, self.exact_v = empty.clone(), value_states[:, :, :0].clone()
        if self.cache.subspace and self.cache.basis is not None:  # a static basis: the same for every request
            self.sub_U = self.cache.basis[self.layer_idx].to(self.device).expand(B, -1, -1, -1).contiguous()
        self.keys = self.k_tail  # for code that inspects .keys
        self.is_initialized = True

    def get_seq_length(self):
        return self.seen

    def get_mask_sizes(self, query_length):
        return self.n + query_length, 0

    def get_max_length(self):
        return -1

    @property
    def n(self):
        return 0 if not self.is_initialized else self.nq + self.k_tail.shape[2]

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("CertifiedCache does not support beam search")

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [B, Hkv, n_new, D] (post-RoPE keys)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.n == 0
        start = self.n
        n_new = key_states.shape[2]
        self.seen += n_new
        self._append_tail(key_states, value_states)
        self._append_valid(n_new)
        if self.exact_k is not None:
            self._append("exact_k", key_states)
            self._append("exact_v", value_states)
        self._add_sinks(key_states, value_states, start)
        self._flush()
        if first:
            # prefill reads the fresh exact states (as every quantized cache does); decode reads the cache
            self.served_k, self.served_v = key_states, value_states
        else:
            self.served_k, self.served_v = self.served(scratch=True)
        return self.served_k, self.served_v

    def _append_tail(self, key_states, value_states):
        """The new tokens' exact rows after the tail's (hf_fused.FusedLayer writes them into its read's buffers)."""
        self.k_tail = torch.cat([self.k_tail, key_states], dim=2)
        self.v_tail = torch.cat([self.v_tail, value_states], dim=2)

    def _append_valid(self, n):
        """n readable flags appended to `valid`. valid_epoch counts every other change of the flags (an in-place write
        such as a padding mask's, or a new tensor): its buffer and version are compared with what the last append left
        (the buffer object is kept, so its id and version cannot pass to another tensor). A reader that keeps a copy
        of the flags (hf_fused's segments) compares the epoch instead of the flags."""
        if not self.valid_unchanged():
            self.valid_epoch += 1
        ones = self.__dict__.get("_ones")
        if ones is None or ones.shape[2] != n:  # the appended flags: never written, so one tensor serves every step
            ones = self._ones = torch.ones(self.B, self.Hkv, n, dtype=torch.bool, device=self.device)
        self._append("valid", ones)
        g = self._grow["valid"]
        self._valid_mark = (g.buf, version(g.buf))

    def valid_unchanged(self):
        """True when `valid` changed only by appends since _append_valid last ran (valid_epoch is current)."""
        g, mark = self._grow.get("valid"), self._valid_mark
        return (mark is not None and g is not None and g.buf is mark[0] and mark[1] is not None
                and version(g.buf) == mark[1])  # an inference tensor (version None) counts as changed

    # ---- writing ----
    def _add_sinks(self, key_states, value_states, start):
        """New tokens at positions < `sinks` join the exact overlay (attention sinks, c = 0)."""
        S = min(self.cache.sinks, start + key_states.shape[2])
        if S <= start or self.cache.evicted:
            return
        m = S - start
        idx = torch.arange(start, S, device=self.device).expand(self.B, self.Hkv, m)
        self.ex_idx = torch.cat([self.ex_idx, idx], dim=2)
        self.ex_on = torch.cat([self.ex_on, torch.ones_like(idx, dtype=torch.bool)], dim=2)
        self.ex_k = torch.cat([self.ex_k, key_states[:, :, :m]], dim=2)
        self.ex_v = torch.cat([self.ex_v, value_states[:, :, :m]], dim=2)

    def _flush(self, everything=False):
        """Quantize the tail tokens that left the exact window (each token exactly once)."""
        scheme = self.cache.scheme
        R = self.k_tail.shape[2]
        m = R if everything else max(R - self.cache.window, 0)
        m -= m % scheme.block_k
        if m <= 0:
            return
        k, v = self.k_tail[:, :, :m], self.v_tail[:, :, :m]
        self.k_tail, self.v_tail = self.k_tail[:, :, m:], self.v_tail[:, :, m:]
        seed, L = self.cache.seed, self.layer_idx
        kq = scheme.encode_k(k, L, self.nq, seed)
        vq = scheme.encode_v(v, L, self.nq, seed)
        k_hat = kq.decode().to(self.dtype)  # exactly what served() will return
        bands = self.cache.bands
        if self.cache.subspace:
            self._sub_write(k, k_hat)
        if not self.derived:
            if hasattr(kq, "witness_t3"):  # pre-RoPE scheme: witness from the pre-RoPE error (T3), fast.core.prerope
                rho = kq.witness_t3(k, bands, self.dtype)
                codes = pack_witness(rho)
            else:
                codes = cpu_fused.witness_codes(k, k_hat, bands)
            self._append("rho_codes", codes)
        if self.cache.offload == "residual":
            rk = quantize((k.float() - k_hat.float()).contiguous(), "int8", layer=L, token_start=self.nq)
            rv = quantize((v.float() - vq.decode()).contiguous(), "int8", layer=L, token_start=self.nq)
            # witness of what remains after a repair: k - (k_hat + r_hat), as served()
            repaired_k = k_hat + dequantize(rk).to(self.dtype)
            rcodes = pack_witness(witness(k.float(), repaired_k.float(), bands))
            rk, rv = CodecStored(rk), CodecStored(rv)
            self.res_k = rk if self.res_k is None else self.res_k.cat(rk)
            self.res_v = rv if self.res_v is None else self.res_v.cat(rv)
            self._append("res_rho", rcodes)
            if self.cache.value_bound:
                self._append("res_v_err", value_error_norms(v, vq.decode().to(self.dtype) + dequantize(rv.qt).to(self.dtype)))
            per_head = (rk.nbytes + rv.nbytes + rcodes.nbytes) / self.Hkv
        else:
            per_head = 2 * k.nbytes / self.Hkv
        self.traffic += int(per_head * int(self.repaired.sum()))  # new tokens of repaired heads move too
        if self.cache.value_bound:  # the value witness of T5: ||v - v~|| as served, measured once, rounded up
            self._append("v_err", value_error_norms(v, vq.decode().to(self.dtype)))
        self.kq = kq if self.kq is None else self.kq.cat(kq)
        self.vq = vq if self.vq is None else self.vq.cat(vq)
        if self.up:
            v_hat = vq.decode().to(self.dtype)
        for h, st in self.up.items():  # promoted heads: their new tokens refined through their rungs too
            sl = slice(h, h + 1)
            new = self._refine(h, self.nq, self.nq + m, k_hat[:, sl], v_hat[:, sl], int(self.rung[h]))
            self.traffic += _up_bytes(new)
            rho = self._rung_rho(h, self.nq, self.nq + m, new["rho"])
            self.up[h] = {"k": [a.cat(b) for a, b in zip(st["k"], new["k"])],
                          "v": [a.cat(b) for a, b in zip(st["v"], new["v"])],
                          "rho": None if rho is None else torch.cat([st["rho"], rho], dim=2),
                          "v_err": None if new["v_err"] is None else torch.cat([st["v_err"], new["v_err"]], dim=2)}
        self.nq += m

    def _refine(self, h, lo, hi, k_hat, v_hat, rungs, first=0):
        """KV head h's quantized-part tokens [lo, hi) through rungs first+1 .. `rungs`: rung i stores the
        codes of k - (what is served before it) at its codec, from the exact copy (the offload tier);
        served = k_hat + r_1 + ... in the model's dtype, in this order (as served() adds them). Returns the
        rung stores and the witness (T4) and, with value_bound, the value witness of the final sum."""
        k, v = self.exact_k[:, h:h + 1, lo:hi], self.exact_v[:, h:h + 1, lo:hi]  # [B, 1, n, D]
        ks, vs = [], []
        for i in range(first, rungs):
            scheme = self.cache.rung_schemes[i]
            rk = scheme.encode_k((k.float() - k_hat.float()).contiguous(), self.layer_idx, lo, self.cache.seed)
            k_hat = k_hat + rk.decode().to(self.dtype)
            ks.append(rk)
            if self.cache.ladder_values:  # else the values stay at the cache's scheme (ladder_values=False)
                rv = scheme.encode_v((v.float() - v_hat.float()).contiguous(), self.layer_idx, lo, self.cache.seed)
                v_hat = v_hat + rv.decode().to(self.dtype)
                vs.append(rv)
        rho = pack_witness(witness(k.float(), k_hat.float(), self.cache.bands))
        v_err = value_error_norms(v, v_hat) if self.cache.value_bound else None
        return {"k": ks, "v": vs, "rho": rho, "v_err": v_err}

    def _rung_rho(self, h, lo, hi, codes):
        """Where a promoted head's witness codes of tokens [lo, hi) live: written over the head's slice
        of the stored witness (its own codes are never read again: the head serves the refined keys
        until it moves up, when the witness is measured again from the exact copy), so a rung costs no
        second witness; returned (kept in self.up) when the witness is derived from the scales."""
        if self.rho_codes is None:
            return codes
        self.rho_codes[:, h:h + 1, lo:hi] = codes
        return None

    # ---- the query-subspace witness (cache.subspace = m) ----
    def _sub_write(self, k, k_hat):
        """Store the subspace witness of newly quantized keys k (exact) served as k_hat, or keep them until
        the basis is fixed (set_basis)."""
        if self.sub_U is None:
            self.sub_pending.append((k.float().clone(), k_hat.float().clone()))
            return
        from fast.core.subspace import encode
        codes, scale, tau, sigma = encode(k.float(), k_hat.float(), self.sub_U, self.cache.bands)
        self._append("sub_a", codes)
        self._append("sub_scale", scale)
        self._append("sub_tau", pack_witness(tau))
        self._append("sub_sigma", pack_witness(sigma))

    def set_basis(self, query):
        """Fix the layer's basis from its first read's query rows (query [B, H, T, D] post-RoPE, before any
        decode query of the request's own reads beyond them) and write the witness of the tokens quantized
        before it. Later calls do nothing: U is never changed once a token's witness depends on it."""
        if not self.cache.subspace or self.sub_U is not None:
            return
        from fast.core.subspace import query_basis
        self.sub_U = query_basis(query.float(), self.Hkv, min(self.cache.subspace, self.D))
        pending, self.sub_pending = self.sub_pending, []
        for k, k_hat in pending:
            self._sub_write(k, k_hat)

    def subspace_view(self):
        """(U, a [B, Hkv, N, m] fp32, tau [B, Hkv, N] fp32, sigma [B, Hkv, N, NB] fp32) for the read, or None
        (no subspace witness, or no basis yet: the band witness alone certifies the read). Tail tokens get 0
        (exact: the read masks them anyway); KV heads off the cache's scheme (a rung up, repaired) serve other
        keys than the witness is about: tau and sigma there are the largest fp32 ("unknown": a vacuous
        interval, the band witness of their rung decides)."""
        if not self.cache.subspace or self.sub_U is None or self.sub_pending:
            return None
        m, nb = self.sub_U.shape[2], self.cache.bands.shape[0]
        a = torch.zeros(self.B, self.Hkv, self.n, m, device=self.device)
        tau = torch.zeros(self.B, self.Hkv, self.n, device=self.device)
        sigma = torch.zeros(self.B, self.Hkv, self.n, nb, device=self.device)
        if self.nq:
            from fast.core.subspace import coefficients
            a[:, :, :self.nq] = coefficients(self.sub_a, self.sub_scale)
            tau[:, :, :self.nq] = unpack_witness(self.sub_tau)
            sigma[:, :, :self.nq] = unpack_witness(self.sub_sigma)
        off = self.off_base()
        if bool(off.any()):
            big = torch.finfo(torch.float32).max
            tau[:, off], sigma[:, off] = big, big
        return self.sub_U, a, tau, sigma

    def subspace_bytes(self):
        return sum(t.nbytes for t in (self.sub_U, self.sub_a, self.sub_scale, self.sub_tau, self.sub_sigma) if t is not None)

    # ---- reading ----
    def _decode_into(self, stored, out):
        """out[:] = stored.decode() in self.dtype, without temporaries for int8 (code x fp16 scale
        is exact in fp32, so this equals fast.core.quant.dequantize bit for bit)."""
        qt = getattr(stored, "qt", None)
        if qt is not None and qt.scheme == "int8" and out.dtype == torch.float32:
            ng = qt.scales.shape[-1]
            B, Hkv, N, D = out.shape
            torch.mul(qt.codes.view(B, Hkv, N, ng, D // ng), qt.scales.to(torch.float32).unsqueeze(-1),
                      out=out.view(B, Hkv, N, ng, D // ng))
        else:
            out.copy_(stored.decode())

    def served(self, scratch=False):
        """(k, v) [B, Hkv, N, D] as the attention reads them: decoded codes (+ residual on repaired
        heads), exact tail, exact overlay, or the exact copy on repaired heads.
        scratch=True: written into the cache's decode workspace (one layer's worth, shared by all
        layers and reused every step: valid until the next layer's read), no per-step allocation."""
        rep = self.repaired.nonzero().flatten().tolist()
        if scratch:
            k, v = self.cache.workspace(self.B, self.Hkv, self.n, self.D, self.dtype, self.device)
        else:
            shape = (self.B, self.Hkv, self.n, self.D)
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
        nq = self.nq
        if nq:
            self._decode_into(self.kq, k[:, :, :nq])
            self._decode_into(self.vq, v[:, :, :nq])
            if rep and self.cache.offload == "residual":
                k[:, rep, :nq] += self.res_k.decode()[:, rep].to(self.dtype)
                v[:, rep, :nq] += self.res_v.decode()[:, rep].to(self.dtype)
            for h, st in self.up.items():  # promoted heads: the scheme's codes plus their rungs' refinements
                for rk in st["k"]:
                    k[:, h:h + 1, :nq] += rk.decode().to(self.dtype)
                for rv in st["v"]:  # [] with ladder_values=False
                    v[:, h:h + 1, :nq] += rv.decode().to(self.dtype)
        k[:, :, nq:] = self.k_tail
        v[:, :, nq:] = self.v_tail
        if self.ex_idx.shape[2]:
            idx = self.ex_idx[..., None].expand(*self.ex_idx.shape, self.D)
            on = self.ex_on[..., None]
            k.scatter_(2, idx, torch.where(on, self.ex_k, k.gather(2, idx)))
            v.scatter_(2, idx, torch.where(on, self.ex_v, v.gather(2, idx)))
        if rep and self.cache.offload == "full":
            k[:, rep], v[:, rep] = self.exact_k[:, rep], self.exact_v[:, rep]
        return k, v

    def exact_mask(self):
        """[B, Hkv, N] bool: True where the served key is exact (c = 0)."""
        ex = torch.zeros(self.B, self.Hkv, self.n, dtype=torch.bool, device=self.device)
        ex[:, :, self.nq:] = True
        if self.ex_idx.shape[2]:
            ex.scatter_(2, self.ex_idx, self.ex_on | ex.gather(2, self.ex_idx))
        if self.cache.offload != "residual" and bool(self.repaired.any()):
            ex[:, self.repaired] = True
        return ex

    def witness_view(self):
        """(rho [B, Hkv, N, NB] fp32 upper bounds of the band norms of k - k_served, exact [B, Hkv, N])."""
        rho, exact = self.witness_codes()
        if rho.dtype == torch.uint8:
            rho = unpack_witness(rho)
        return rho.masked_fill(exact[..., None], 0.0), exact

    def witness_codes(self):
        """Like witness_view, but the stored witness stays in its uint8 log codes (0 = exactly 0)
        for decode_attention to unpack; rho is not zeroed at exact tokens (`exact` does that)."""
        nb = self.cache.bands.shape[0]
        R = self.n - self.nq
        if self.derived:
            rho = torch.zeros(self.B, self.Hkv, self.n, nb, device=self.device)
            if self.nq:
                rho[:, :, :self.nq] = witness_from_step(self.kq.step(), self.cache.bands)
        else:
            tail = torch.zeros(self.B, self.Hkv, R, nb, dtype=torch.uint8, device=self.device)
            rho = tail if self.rho_codes is None else torch.cat([self.rho_codes, tail], dim=2)
        rep = self.repaired.nonzero().flatten().tolist()
        if rep and self.nq and self.cache.offload == "residual":
            if rho.dtype == torch.uint8:
                rho[:, rep, :self.nq] = self.res_rho[:, rep]
            else:
                rho[:, rep, :self.nq] = unpack_witness(self.res_rho[:, rep])
        for h, st in self.up.items():  # promoted heads: the witness of their refined keys (in rho_codes if None)
            if st["rho"] is not None:
                rho[:, h:h + 1, :self.nq] = st["rho"] if rho.dtype == torch.uint8 else unpack_witness(st["rho"])
        return rho, self.exact_mask()

    def value_err_view(self):
        """[B, Hkv, N] fp32 >= ||v_j - v~_j|| of the served values (0 where the served value is exact):
        the value witness of math.md T5 (value_bound=True), or None."""
        if not self.cache.value_bound:
            return None
        ve = torch.zeros(self.B, self.Hkv, self.n, device=self.device)
        if self.nq:
            ve[:, :, :self.nq] = self.v_err
            rep = self.repaired.nonzero().flatten().tolist()
            if rep and self.cache.offload == "residual":
                ve[:, rep, :self.nq] = self.res_v_err[:, rep]
            for h, st in self.up.items():
                ve[:, h:h + 1, :self.nq] = st["v_err"]
        return ve.masked_fill(self.exact_mask(), 0.0)

    def step_view(self):
        """delta [B, Hkv, N, D]: the dither step of each served element (0 where exact): the dithered schemes
        (int8_dither, int4_dither, kivi2_dither) only."""
        delta = torch.zeros(self.B, self.Hkv, self.n, self.D, device=self.device)
        if self.nq:
            delta[:, :, :self.nq] = self.kq.step()
        return delta.masked_fill(self.exact_mask()[..., None], 0.0)

    # ---- gating ----
    def head_bytes(self, h):
        """Offload bytes of KV head h: what a repair moves to the device."""
        if self.cache.offload == "residual":
            rv = self.res_v_err.nbytes if self.res_v_err is not None else 0  # value witness after a repair (value_bound)
            return (self.res_k.nbytes + self.res_v.nbytes + self.res_rho.nbytes + rv) // self.Hkv if self.nq else 0
        return (self.exact_k[:, h, :self.nq].nbytes + self.exact_v[:, h, :self.nq].nbytes)

    def repair(self, heads):
        """Serve KV heads `heads` from the offload tier (exact) from now on: the top rung."""
        for h in heads:
            if not self.repaired[h]:
                self.repaired[h] = True
                self.rung[h] = len(self.cache.rungs) + 1
                self.up.pop(h, None)  # a rung below exact is no longer read: freed
                self.traffic += self.head_bytes(h)
        self.served_k, self.served_v = self.served(scratch=True)

    def promote(self, heads):
        """The gate's repair of KV heads `heads`: ladder:TAU moves each one rung up (the next rung's
        refinement of its tokens from the exact copy, the witness measured again), the top rung and
        certified:TAU serve exact keys."""
        heads = sorted({int(h) for h in heads})  # one rung per head and call
        top = [h for h in heads if self.cache.gate.kind != "ladder" or int(self.rung[h]) >= len(self.cache.rungs)]
        for h in heads:
            if h not in top and not self.repaired[h]:
                r = int(self.rung[h])
                k, v = self.served()  # what head h serves now: the scheme's codes + its rungs so far
                sl = slice(h, h + 1)
                new = self._refine(h, 0, self.nq, k[:, sl, :self.nq], v[:, sl, :self.nq], r + 1, first=r)
                st = self.up.get(h, {"k": [], "v": []})
                self.up[h] = {"k": st["k"] + new["k"], "v": st["v"] + new["v"],
                              "rho": self._rung_rho(h, 0, self.nq, new["rho"]), "v_err": new["v_err"]}
                self.rung[h] = r + 1
                self.traffic += sum(x.nbytes for x in new["k"] + new["v"]) + new["rho"].nbytes
        self.repair(top)  # also refreshes served_k / served_v

    def fused_ok(self):
        """Whether reads of this layer go through the fused C++ kernel (hf_fused.FusedLayer); here never."""
        return False

    def off_base(self):
        """[Hkv] bool: KV heads not served from the cache's own scheme (a higher rung or exact)."""
        return self.rung > 0

    # ---- eviction hook ----
    def keep_tokens(self, index):
        """Keep only the tokens at storage positions `index` [B, Hkv, K] (per KV head) and free
        the rest: codes, scales, witness, exact overlay, validity, offload and shadow copies."""
        if index.dim() != 3 or index.shape[:2] != (self.B, self.Hkv):
            raise ValueError(f"index: expected [B={self.B}, Hkv={self.Hkv}, K], got {tuple(index.shape)}")
        index = index.to(self.device, torch.long)
        if bool((index < 0).any()) or bool((index >= self.n).any()):
            raise ValueError(f"index: positions must lie in [0, {self.n})")
        index, _ = index.sort(dim=2)
        if self.k_tail.shape[2]:
            # tail tokens are exact: move them into the overlay, then quantize them (once) with the rest
            R = self.k_tail.shape[2]
            idx = torch.arange(self.nq, self.nq + R, device=self.device).expand(self.B, self.Hkv, R)
            self.ex_idx = torch.cat([self.ex_idx, idx], dim=2)
            self.ex_on = torch.cat([self.ex_on, torch.ones_like(idx, dtype=torch.bool)], dim=2)
            self.ex_k = torch.cat([self.ex_k, self.k_tail], dim=2)
            self.ex_v = torch.cat([self.ex_v, self.v_tail], dim=2)
            self._flush(everything=True)
            if self.k_tail.shape[2]:
                raise ValueError(f"scheme {self.cache.scheme.name}: quantizes in blocks; eviction needs a per-token scheme")
        self.kq, self.vq = self.kq.take(index), self.vq.take(index)
        if self.rho_codes is not None:
            self._set("rho_codes", _take(self.rho_codes, index))
        if self.sub_pending:
            raise ValueError("subspace witness: evict after the first read (the basis is fixed by the prefill's queries)")
        for name in ("sub_a", "sub_scale", "sub_tau", "sub_sigma"):
            if getattr(self, name) is not None:
                self._set(name, _take(getattr(self, name), index))
        if self.res_k is not None:
            self.res_k, self.res_v = self.res_k.take(index), self.res_v.take(index)
            self._set("res_rho", _take(self.res_rho, index))
            if self.res_v_err is not None:
                self._set("res_v_err", _take(self.res_v_err, index))
        if self.v_err is not None:
            self._set("v_err", _take(self.v_err, index))
        for h, st in self.up.items():
            ih = index[:, h:h + 1]
            self.up[h] = {"k": [x.take(ih) for x in st["k"]], "v": [x.take(ih) for x in st["v"]],
                          "rho": None if st["rho"] is None else _take(st["rho"], ih),
                          "v_err": None if st["v_err"] is None else _take(st["v_err"], ih)}
        if self.exact_k is not None:
            self._set("exact_k", _take(self.exact_k, index))
            self._set("exact_v", _take(self.exact_v, index))
        self._set("valid", _take(self.valid, index))
        self._remap_overlay(index)
        self.nq = index.shape[2]
        self.cache.evicted = True

    def _remap_overlay(self, index):
        """Exact-overlay entries follow their tokens to the new storage positions; dropped ones go.
        Heads keep different counts: padding entries duplicate the head's first kept entry (same
        index, same value), or, in a head with none, point at token 0 switched off (a no-op)."""
        if self.ex_idx.shape[2] == 0:
            return
        hit = (self.ex_idx[..., :, None] == index[..., None, :]) & self.ex_on[..., None]  # [B, Hkv, E, K]
        kept = hit.any(dim=3)
        new_pos = hit.to(torch.uint8).argmax(dim=3)
        E2 = max(int(kept.sum(dim=2).max()), 1)
        order = torch.argsort((~kept).to(torch.int8), dim=2, stable=True)[..., :E2]  # kept entries first
        on, pos = kept.gather(2, order), new_pos.gather(2, order)
        order4 = order[..., None].expand(-1, -1, -1, self.D)
        ek, ev = self.ex_k.gather(2, order4), self.ex_v.gather(2, order4)
        has = on[..., :1]
        self.ex_idx = torch.where(on, pos, torch.where(has, pos[..., :1], torch.zeros_like(pos)))
        self.ex_k = torch.where(on[..., None], ek, ek[:, :, :1])
        self.ex_v = torch.where(on[..., None], ev, ev[:, :, :1])
        self.ex_on = on | has

    # ---- accounting ----
    def device_bytes(self, exact_itemsize=None):
        """Bytes held for serving: codes, scales, witnesses, rungs, exact tail / overlay / repaired heads.
        exact_itemsize=2 counts the exact values at 2 bytes each (what a bf16 / fp16 model holds), so
        rows of models of different dtypes compare; None: as stored."""
        def ex(t):
            return 0 if t is None else (t.numel() * exact_itemsize if exact_itemsize else t.nbytes)
        n = 0
        for s in (self.kq, self.vq):
            n += s.nbytes if s is not None else 0
        for t in (self.rho_codes, self.v_err):
            n += t.nbytes if t is not None else 0
        n += self.subspace_bytes()
        n += sum(ex(t) for t in (self.k_tail, self.v_tail, self.ex_k, self.ex_v))
        n += sum(_up_bytes(st) for st in self.up.values())
        for h in range(self.Hkv):
            if self.repaired[h]:
                n += self.head_bytes(h) if self.cache.offload == "residual" else \
                    ex(self.exact_k[:, h, :self.nq]) + ex(self.exact_v[:, h, :self.nq])
        return n

    def offload_bytes(self):
        if self.cache.gate.kind == "none":
            return 0
        if self.cache.offload == "residual":
            return sum(t.nbytes for t in (self.res_k, self.res_v, self.res_rho, self.res_v_err) if t is not None)
        return self.exact_k[:, :, :self.nq].nbytes + self.exact_v[:, :, :self.nq].nbytes


