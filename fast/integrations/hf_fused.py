"""CertifiedCache's fused CPU read (fast.core.cpu_fused): no fp32 copy of the history per step,
the certificate epilogue of all layers batched once per step. The default of every CertifiedCache
(backend="auto" builds FusedLayer layers; the meter, fast.integrations.hf_meter.kvcert_attention,
sends a layer's reads here whenever FusedLayer.fused_ok):

    fast.enable_meter(model)                                  # attn_implementation "kvcert"
    cache = fast.CertifiedCache(model.config, "int8")         # reads through the kernel
    model.generate(ids, past_key_values=cache)

hf_cache.FusedCertifiedCache is the same class (kept for older code), and "kvcert_fused" another name of the meter.

What changes against CertifiedCache + the "kvcert" meter (fast.integrations.hf_meter):
- update() does not rebuild the served fp32 [B, Hkv, N, D] tensors (CertifiedLayer.served): the
  attention reads the layer's parts in place: int8 or packed int4 codes + fp16 scales (dithered too: the dither
  regenerated at read, the dither estimate from the same pass: _dither_estimate), fp8 codes (+ fp32 per-token
  scales, or vLLM's round-toward-zero casts with their tensor scale), kivi2's 2-bit
  codes + fp16 scales and zeros (dithered too: kivi2_dither), pre-RoPE key codes (rotated at read) + int8 values, or a
  registered scheme's fp16 outputs (decoded exactly at read), and the uint8
  witness codes of the quantized part (segment 0; _codes), and the exact overlay (sinks) + exact tail
  (segment 1, fp32). Which schemes: Scheme.layout in FUSED_LAYOUTS (set by the built-in constructors and
  register_scheme).
- Every query row with a cache behind it goes through the kernel: decode (T = 1) and multi-token
  reads (a second turn, chunked prefill: row t at storage position n - T + t, causal).
- Window leavers are quantized in blocks of FLUSH_BLOCK (one quantize + witness call per 32 steps
  and layer, not one per step); the tail holds window .. window + 31 exact tokens.
- The certificate epilogue (fast.core.cpu_fused._certificate: C++, numpy fallback) runs once per
  step for all layers, after the last one: cache.records gets one record per (step, layer) as
  with the meter.
- Gates certified:TAU, ladder:TAU and risk:K (offload "full" or "residual"): the layer's certificate is taken at
  once (_gated), the KV heads over TAU are promoted, and the heads off the scheme's codes are read again through
  the kernel as the meter's gate serves them: repaired heads (offload "full") from the exact copy (c = 0), ladder
  rungs and residual repairs as fp32 rows decoded by the twin with their own witness (_read_heads).
- Shadow mode: the layer's certificate at once too (_gated), and the record's true_tv from the exact copy (_true_tv).
- value_bound: the kernel's output-bound sums (cpu_fused._run(value=...): sum w e, max e, max radius, max |v~|) and the
  certificate give out_err (attention.output_error_from_kernel: the twin's formula), at once (_gated).
Falls back to the torch twin (hf_meter's decode_step / rows_step, the served fp32 copy), certified
the same way, where the kernel does not apply: the box form, the subspace witness, non-fp32 models. The first
prefill reads the exact states with sdpa, as everywhere.
"""

import functools

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fast.core import cpu_fused
from fast.core._checks import version
from fast.core.attention import attention_rows as twin_rows
from fast.core.attention import output_error_from_kernel
from fast.core.certify import FORMS, logit_rounding, with_other_logits
from fast.core.dither import budget_local, radius_factor
from fast.core.prerope import BLOCK as PRE_BLOCK
from fast.core.schemes import KIVI_GROUP
from fast.core.quant import max_abs
from fast.core.witness import log_table32
from fast.integrations import hf_meter
from fast.integrations.hf_layer import CertifiedLayer

NAME = "kvcert_fused"


def enable(model):
    model.set_attn_implementation(NAME)
    return model


CERT_KEYS = ("max_c",) + FORMS  # what a record takes from a certificate dict
FLUSH_BLOCK = 32  # tail tokens quantized together once the tail exceeds window + FLUSH_BLOCK
FUSED_LAYOUTS = cpu_fused.FUSED_SCHEMES + cpu_fused.DITHER_SCHEMES + ("fp8", "kivi2", "kivi2_dither", "prerope", "fp16")  # Scheme.layout values the kernel reads in place


def _repeats(idx, on):
    """[B, Hkv, E] bool: entry e repeats an earlier switched-on entry of the same token. After keep_tokens the
    overlay of a head that keeps fewer entries is padded with switched-on duplicates (hf_cache
    _remap_overlay: served() scatters them into one slot); the kernel reads each entry as a token of its
    own, so only the first of each token stays on (the attention over the cache's tokens, each once)."""
    E = idx.shape[2]
    same = (idx[..., :, None] == idx[..., None, :]) & on[..., None, :]  # [B, Hkv, e, e']
    earlier = torch.ones(E, E, dtype=torch.bool, device=idx.device).tril(-1)  # e' < e
    return (same & earlier).any(3)


class FusedLayer(CertifiedLayer):
    def _flush(self, everything=False):
        """Quantize window leavers in blocks of FLUSH_BLOCK tokens, not one per step: the tail keeps
        between `window` and `window + FLUSH_BLOCK` exact tokens (never fewer than the meter's)."""
        if everything or not self.fused_ok() or self.k_tail.shape[2] >= self.cache.window + FLUSH_BLOCK:
            self._seg1 = None  # the tail loses its first rows: segment 1 is rebuilt
            super()._flush(everything)

    def fused_ok(self):
        """A layout the kernel reads in place (FUSED_LAYOUTS: int8, int4, fp8, kivi2, prerope, dithered int8 / int4), any
        gate and offload (_gated), shadow or not, value bound or not, no box form or subspace witness, certified or
        certify=False, fp32 on CPU, kernel built. Fixed for the layer's life: computed once (it is asked
        twice per layer and step)."""
        ok = getattr(self, "_fused_ok", None)
        if ok is None:
            if not self.is_initialized:
                return False
            c = self.cache
            ok = self._fused_ok = (c.scheme.layout in FUSED_LAYOUTS
                                   and not c.box_form and not c.subspace
                                   and self.dtype == torch.float32 and self.device.type == "cpu"
                                   and cpu_fused.available())
        return ok

    def fused_read(self, query, scale):
        return fused_read(self, query, scale)

    def served(self, scratch=False):
        if scratch and self.fused_ok():  # the kernel reads the parts: no [B, Hkv, N, D] fp32 copy
            return self.k_tail, self.v_tail
        return super().served(scratch)

    def segments(self):
        """The two kernel segments of this layer (fast.core.cpu_fused.seg)."""
        B, Hkv, nq, D = self.B, self.Hkv, self.nq, self.D
        u8 = torch.uint8
        va = self.valid.view(u8)  # [B, Hkv, N], bool as bytes (no copy)
        E = self.ex_idx.shape[2]
        # the quantized part changes only when a block is flushed (nq, the codes buffer) or when the
        # readable flags of its tokens or of the overlay change: unchanged when no write but update's appends touched
        # valid since the segment was built (valid_epoch) and ex_on is the same tensor at the same version, else
        # compared by content (every step's append to the tail bumps valid's version, which must not rebuild segment 0)
        stored = self.kq.f["codes" if "codes" in self.kq.f else "x"] if nq else None  # codes, or fp16 rows (registered)
        key0 = (nq, E, stored.buf.data_ptr() if nq else 0, self.cache.certify, self.ex_idx.data_ptr())
        old = getattr(self, "_seg0", None)
        clean = self.valid_unchanged()
        if (old is not None and old["key"] == key0 and not self.derived
                and ((clean and old["epoch"] == self.valid_epoch) or torch.equal(old["valid"], va[:, :, :nq]))
                and ((old["ex_on"] is self.ex_on and old["ex_ver"] is not None and old["ex_ver"] == version(self.ex_on))
                     or torch.equal(old["on_copy"], self.ex_on))):
            s0, ng, on_u8, ex_pos = old["seg"]
            if clean:
                old["epoch"] = self.valid_epoch
        else:
            on = self.ex_on
            if E:
                in_q = self.ex_idx < nq  # overlay tokens still in the tail are read from the tail
                on = on & in_q & self.valid.gather(2, self.ex_idx) & ~_repeats(self.ex_idx, on)
            on_u8, ex_pos = on.view(u8).contiguous(), self.ex_idx.to(torch.int32)
            if nq:
                vq0 = va[:, :, :nq]
                if E:  # overlay tokens: their exact rows (segment 1) replace the codes
                    drop = torch.zeros(B, Hkv, nq + 1, dtype=u8)
                    drop.scatter_(2, torch.where(on, self.ex_idx, nq), 1)
                    vq0 = vq0 & (1 - drop[:, :, :nq])
                rho = self.rho_codes
                if self.derived:
                    from fast.core.witness import witness_from_step
                    rho = witness_from_step(self.kq.step(), self.cache.bands)
                s0 = cpu_fused.seg(Hkv, nq, **_codes(self.cache.scheme.layout, self.kq, self.vq),
                                   rho=rho if self.cache.certify else None, valid=vq0,
                                   v_err=self.v_err if self.cache.value_bound and self.cache.certify else None)
                ng = s0["ng"]
            else:
                s0, ng = cpu_fused.seg(Hkv, 0), (1, 1)
            self._seg0 = {"key": key0, "seg": (s0, ng, on_u8, ex_pos), "valid": va[:, :, :nq].clone(),
                          "epoch": self.valid_epoch if clean else -1, "ex_on": self.ex_on,
                          "ex_ver": version(self.ex_on), "on_copy": self.ex_on.clone()}
        return [s0, self._segment1(nq, E, on_u8, ex_pos, va, clean)], ng

    def _segment1(self, nq, E, on_u8, ex_pos, va, clean):
        """Segment 1: the E exact overlay rows, then the R exact tail rows, in buffers kept across steps; the tail is a
        view of them, so a decode step's new rows are written there by update (_append_tail) and a read copies no row.
        A read copies the tail's readable flags written since the last read, or all of them when valid may have
        changed otherwise (clean False, or valid_epoch moved: flags may change in place), and sets the segment's
        length n = E + R. The buffers and the segment (checked by seg() at their whole capacity, so any n up to it is
        in bounds) are rebuilt, the tail's rows copied in, when the quantized part, the overlay or its flags change (a
        flush, an eviction: _flush / keep_tokens drop them) or the tail outgrows the capacity."""
        B, Hkv, D = self.B, self.Hkv, self.D
        R = self.k_tail.shape[2]
        key = (nq, E, self.ex_k.data_ptr(), on_u8.data_ptr())
        st = self.__dict__.get("_seg1")
        if st is None or st["key"] != key or E + R > st["cap"] or st["tail"] is not self.k_tail:
            cap = E + max(R, self.cache.window + FLUSH_BLOCK) + 8
            k1, v1 = self.k_tail.new_empty(B, Hkv, cap, D), self.v_tail.new_empty(B, Hkv, cap, D)
            pos = (torch.arange(cap, dtype=torch.int32) + (nq - E)).view(1, 1, cap).expand(B, Hkv, cap).contiguous()
            val = torch.zeros(B, Hkv, cap, dtype=torch.uint8)
            if E:
                k1[:, :, :E], v1[:, :, :E], pos[:, :, :E], val[:, :, :E] = self.ex_k, self.ex_v, ex_pos, on_u8
            k1[:, :, E:E + R], v1[:, :, E:E + R] = self.k_tail, self.v_tail
            self.k_tail, self.v_tail = k1.narrow(2, E, R), v1.narrow(2, E, R)  # the same rows, in the segment's buffers
            st = self._seg1 = {"key": key, "cap": cap, "E": E, "k": k1, "v": v1, "val": val, "flags": 0, "epoch": -1,
                               "tail": self.k_tail, "seg": cpu_fused.seg(Hkv, cap, k=k1, v=v1, valid=val, pos=pos)}
        fresh = st["flags"] if clean and st["epoch"] == self.valid_epoch else 0  # flags before it: copied and current
        if R > fresh:
            st["val"][:, :, E + fresh:E + R] = va[:, :, nq + fresh:nq + R]
        st["flags"], st["epoch"] = R, (self.valid_epoch if clean else -1)
        st["seg"]["c"].n = E + R
        return st["seg"]

    def _append_tail(self, key_states, value_states):
        """New exact rows written into segment 1's buffers, the tail a view of them (no copy at the next read), while
        the tail is still the view _segment1 left and there is room; else as CertifiedLayer (a cat: the next read
        rebuilds segment 1)."""
        st = self.__dict__.get("_seg1")
        n = key_states.shape[2]
        if (st is None or st["tail"] is not self.k_tail or st["E"] + self.k_tail.shape[2] + n > st["cap"]
                or key_states.shape != (self.B, self.Hkv, n, self.D) or value_states.shape != key_states.shape
                or key_states.dtype != st["k"].dtype or value_states.dtype != st["k"].dtype):
            return super()._append_tail(key_states, value_states)  # (a cat: it refuses what does not fit)
        E, R = st["E"], self.k_tail.shape[2]
        st["k"].narrow(2, E + R, n).copy_(key_states)
        st["v"].narrow(2, E + R, n).copy_(value_states)
        self.k_tail, self.v_tail = st["k"].narrow(2, E, R + n), st["v"].narrow(2, E, R + n)
        st["tail"] = self.k_tail
        if st["flags"] == R:  # flags copied up to the tail's end: the new rows' are update's appended ones (a write to
            st["val"].narrow(2, E + R, n).fill_(1)  # valid by anyone else moves valid_epoch: _segment1 copies them all)
            st["flags"] = R + n

    def keep_tokens(self, index):
        self._seg1 = None  # the tail and the overlay are rebuilt: so is segment 1
        return super().keep_tokens(index)


def _codes(layout, kq, vq):
    """seg()'s arguments for a layer's stored keys and values (Stored payloads of fast.core.schemes / prerope) in the
    scheme's layout: int8 / int4 QTensor codes + fp16 scales, fp8 codes (cpu_fused.fp8_parts), kivi2's 2-bit codes (keys per channel over blocks
    of 32 tokens, values per token group), prerope's pre-RoPE key codes (rotated at read) + int8 values."""
    from fast.core.prerope import PreRopeKeys
    from fast.core.schemes import Fp16Stored, KiviDither, KiviKeys, KiviValues
    if layout in cpu_fused.FUSED_SCHEMES:
        k, v = kq.qt, vq.qt
        return dict(k=k.codes, v=v.codes, k_scales=k.scales.view(torch.int16), v_scales=v.scales.view(torch.int16))
    if layout in cpu_fused.DITHER_SCHEMES:  # dithered codes: the dither regenerated at read from the QTensors' counters
        return cpu_fused.dither_parts(kq.qt, vq.qt)
    if layout == "fp8":  # fp8 codes (round-to-nearest + per-token scales, or vLLM's round-toward-zero cast)
        return cpu_fused.fp8_parts(kq.qt, vq.qt)
    if layout == "kivi2" and isinstance(kq, KiviKeys) and isinstance(vq, KiviValues):
        return dict(k_asym=cpu_fused.AsymKeys(kq.get("codes"), kq.get("scale"), kq.get("zero"), 2, KIVI_GROUP),
                    v_asym=cpu_fused.AsymValues(vq.get("codes"), vq.get("scale"), vq.get("zero"), 2))
    if layout == "kivi2_dither" and isinstance(kq, KiviDither) and isinstance(vq, KiviDither):
        if (kq.kind, vq.kind) != ("k", "v") or (kq.seed, kq.layer, kq.token_start) != (vq.seed, vq.layer, vq.token_start):
            raise RuntimeError("fused read: kivi2_dither keys and values must share seed, layer and token_start")
        return dict(k_asym=cpu_fused.AsymKeys(kq.get("codes"), kq.get("scale"), kq.get("zero"), 2, KIVI_GROUP),
                    v_asym=cpu_fused.AsymValues(vq.get("codes"), vq.get("scale"), vq.get("zero"), 2),
                    dither=cpu_fused.Dither(int(kq.seed), int(kq.layer), int(kq.token_start)))
    if layout == "prerope" and isinstance(kq, PreRopeKeys) and vq.qt.scheme == "int8":
        cos, sin, _ = kq.rope
        v = vq.qt
        return dict(k_asym=cpu_fused.AsymKeys(kq.get("codes"), kq.get("scale"), kq.get("zero"), kq.bits, PRE_BLOCK,
                                              (cos.contiguous(), sin.contiguous(), kq.token_start)),
                    v=v.codes, v_scales=v.scales.view(torch.int16))
    if layout == "fp16" and isinstance(kq, Fp16Stored) and isinstance(vq, Fp16Stored):  # a registered scheme's outputs
        return dict(k=kq.get("x"), v=vq.get("x"))
    raise RuntimeError(f"fused read: a {layout!r} layout stores {type(kq).__name__} / {type(vq).__name__}")


def fused_read(layer, query, scale):
    """query [B, H, T, D] (post-RoPE) over the layer's cache; returns [B, T, H, D] in query's dtype."""
    cache = layer.cache
    B, H, T, D = query.shape
    q = query.transpose(1, 2)
    q = (q if q.dtype == torch.float32 else q.to(torch.float32)).contiguous()  # [B, T, H, D]; NaN/Inf: the kernel's flag
    n = layer.n
    if T == 1:  # a decode read (torch.full: a quarter of arange + expand's time)
        qpos = torch.full((B, 1), n - 1, dtype=torch.int32)
    else:
        qpos = torch.arange(n - T, n, dtype=torch.int32).view(1, T).expand(B, T).contiguous()
    segs, (ngk, ngv) = layer.segments()
    lut = log_table32() if layer.rho_codes is not None and not layer.derived else None
    F = _dither_factor(layer, n, T) if cache.scheme.dither and cache.certify and layer.nq else None
    value = _centre(layer) if cache.value_bound and cache.certify else None
    out, stats, *more = cpu_fused._run(q, qpos, segs, float(scale), _bands(cache), ngk, ngv, cache.certify, lut, dither_F=F,
                                       value=value)
    vres = more.pop() if value is not None else None
    dstats = more
    cache.fused_reads += 1
    if cache.certify and (cache.gate.kind != "none" or cache.shadow or cache.value_bound):
        _gated(layer, q, qpos, float(scale), out, stats, dstats[0] if dstats else None, vres)
    elif cache.certify:
        cache._pending.append((layer, stats, n, q, dstats[0] if dstats else None))
        if layer.layer_idx == cache.num_layers - 1:
            flush_certificates(cache)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _gated(layer, q, qpos, scale, out, stats, dstats, vres=None):
    """The gate on a fused read (certified:TAU, ladder:TAU, risk:K; offload "full" or "residual"), as hf_meter._gated
    serves it: the layer's certificate at once (not in the step's batched epilogue: the gate needs it before the next
    layer reads); the KV heads off the scheme's codes (a rung up, repaired) are read again as they are served (the
    kernel read their codes too; their output and certificate are replaced: _read_heads); then (certified / ladder)
    every KV head not repaired whose worst certificate over the read's rows and batch exceeds TAU is promoted (the
    ladder: one rung up; certified: exact) and read again the same way, until none is (at most len(rungs) + 1
    rounds, as the meter's loop). A KV head's certificate depends on its own keys only, so the heads not promoted
    keep theirs. The record's pre_min is the certificate before this read's promotions, fresh_repairs their number.
    Shadow mode and the value bound come here too (no gate: no promotion); vres: the read's output-bound sums
    (cpu_fused._run(value=...)), replaced for the heads read again, make cert["out_err"] from the final certificate.
    out (the kernel's [B, T, H, D]) is overwritten in place for the heads read again."""
    cache, N, Hkv = layer.cache, layer.n, layer.Hkv
    cert = _layer_cert(layer, stats, q, N)
    if vres is not None:  # the sums the output bound takes: Z from the kernel's stats, the value witness's from vres
        cert["_vsum"] = (stats[..., 0].clone(), *[t.clone() for t in vres])
    _read_heads(layer, q, qpos, scale, out, cert, layer.off_base().nonzero().flatten().tolist())
    pre, fresh = cert["min"], 0
    while cache.gate.thresholded:  # each KV head's worst row, batch entry and query head
        worst, rep = hf_meter._slot(cert["min"].amax(1), Hkv).tolist(), layer.repaired.tolist()
        heads = [h for h in range(Hkv) if worst[h] > cache.gate.tau and not rep[h]]
        if not heads:
            break
        pre = pre.clone() if not fresh else pre
        layer.promote(heads)
        fresh += len(heads)
        _read_heads(layer, q, qpos, scale, out, cert, heads)
    if cache.scheme.dither:
        dcert = None if dstats is None else _certificate_or_none(layer, dstats, N)
        est = _dither_estimate(cert["min"], None if dcert is None else dcert["min"], dstats is not None)
        cert["dither_estimate"] = hf_meter._repaired_take_cert(est, cert["min"], layer.off_base())
    if vres is not None:
        Z, vst, vmax = cert.pop("_vsum")
        cert["out_err"] = output_error_from_kernel(Z, vst, vmax, cert["min"], N, layer.D)
    if cache.shadow:
        cert["true_tv"], o_true = _true_tv(layer, q, qpos, scale)
        if vres is not None:
            cert["true_out_err"] = (o_true - out.double()).norm(dim=-1).float()
    T = q.shape[1]
    if T == 1:  # a decode record holds [B, H] tensors
        cert, pre = {k: v[:, 0] for k, v in cert.items()}, pre[:, 0]
    _record(layer, cert, N, T, pre, fresh)


def _centre(layer):
    """[B, Hkv, D] fp32: the centre of the value witness's radii (output bound, T5b: any centre is sound): the mean of
    the values the layer served at its first value-bound read (CertifiedLayer.served), kept for the layer's life."""
    c = layer.__dict__.get("_vctr")
    if c is None or c.shape[0] != layer.B:
        c = layer._vctr = CertifiedLayer.served(layer)[1].float().mean(2).contiguous()
        if not bool(torch.isfinite(c).all()):
            c = layer._vctr = torch.zeros_like(c)
    return c


def _true_tv(layer, q, qpos, scale):
    """Shadow mode: [B, T, H] TV between the softmax over the exact copy and over the keys served (repaired heads: the
    exact copy), fp64, each row over its causal prefix, as hf_meter's shadow record (the served keys dequantized by the
    twin: CertifiedLayer.served); and [B, T, H, D] the exact output (exact keys and values), fp64."""
    B, T, H, D = q.shape
    Hkv, N = layer.Hkv, layer.n
    vis = torch.arange(N)[None, :] <= qpos[0].long()[:, None]  # [T, N]
    m = (vis[None, None, None] & layer.valid[:, :, None, None, :]).expand(B, Hkv, H // Hkv, T, N).reshape(B, Hkv, -1, N)
    qf = q.permute(0, 2, 1, 3).reshape(B, H * T, D)  # row (h, t) -> h T + t, as hf_meter.rows_step
    p_tilde = hf_meter.row_probs(qf, CertifiedLayer.served(layer)[0], scale, m)
    p = hf_meter.row_probs(qf, layer.exact_k, scale, m)
    o = hf_meter.exact_output(p, layer.exact_v, Hkv).view(B, H, T, D).transpose(1, 2)
    return (0.5 * (p - p_tilde).abs().sum(-1)).float().view(B, H, T).transpose(1, 2), o


def _certificate_or_none(layer, stats, N):
    return cpu_fused._certificate(stats, layer.cache.bands.shape[0], N, layer.cache.head_dim)


def _layer_cert(layer, stats, q, N):
    """One layer's certificate dict [B, T, H] from the kernel stats (the twin's where the epilogue refuses)."""
    c = _certificate_or_none(layer, stats, N)
    return {k: c[k] for k in CERT_KEYS} if c is not None else _twin_cert(layer, q, N)


def _read_heads(layer, q, qpos, scale, out, cert, heads):
    """Read KV heads `heads` as they are served now, through the kernel, one call per run of adjacent heads: repaired
    heads with offload "full" from the exact copy (exact fp32 rows, c = 0; strided views, kept across steps:
    _exact_seg); the others off the scheme's codes (a ladder rung: the codes plus their rungs' refinements; repaired
    with offload "residual": codes plus residual) as fp32 rows decoded by the twin (CertifiedLayer.served) with their
    own witness (witness_codes: the rung's or the residual's). Their output rows of `out` and their certificate
    entries in `cert` are replaced."""
    if not heads:
        return
    full, rep, N = layer.cache.offload == "full", layer.repaired.tolist(), layer.n
    exact = [h for h in heads if full and rep[h]]
    _read_runs(layer, q, qpos, scale, out, cert, exact, lambda h0, h1: [cpu_fused.seg(h1 - h0, 0), _exact_seg(layer, h0, h1)],
               None)
    rest = [h for h in heads if h not in exact]
    if rest:
        k, v = CertifiedLayer.served(layer)
        rho, ex = layer.witness_codes()
        ve = layer.value_err_view()  # None without value_bound; 0 at exact tokens
        u8 = torch.uint8
        lut = log_table32() if rho.dtype == u8 else None
        segs = lambda h0, h1: [cpu_fused.seg(h1 - h0, N, k=k[:, h0:h1], v=v[:, h0:h1], rho=rho[:, h0:h1],  # witness: segment 0
                                             valid=layer.valid[:, h0:h1].view(u8), exact=ex[:, h0:h1].view(u8),
                                             v_err=None if ve is None else ve[:, h0:h1].contiguous()),
                               cpu_fused.seg(h1 - h0, 0)]
        _read_runs(layer, q, qpos, scale, out, cert, rest, segs, lut)


def _read_runs(layer, q, qpos, scale, out, cert, heads, segs, lut):
    """_read_heads for one kind of read: segs(h0, h1) the kernel's two segments of KV heads h0 .. h1 - 1."""
    G = q.shape[2] // layer.Hkv
    runs = []
    for h in sorted(heads):
        if runs and runs[-1][1] == h:
            runs[-1][1] = h + 1
        else:
            runs.append([h, h + 1])
    vsum = cert.get("_vsum")
    for h0, h1 in runs:
        hs = slice(h0 * G, h1 * G)
        qs = q[:, :, hs].contiguous()
        value = None if vsum is None else _centre(layer)[:, h0:h1].contiguous()
        o, st, *vres = cpu_fused._run(qs, qpos, segs(h0, h1), scale, _bands(layer.cache), 1, 1, True, lut, value=value)
        out[:, :, hs] = o
        if vsum is not None:  # the output bound's sums of these heads as now served
            (vst, vmax), = vres
            vsum[0][:, :, hs], vsum[1][:, :, hs], vsum[2][:, h0:h1] = st[..., 0], vst, vmax
        c = _certificate_or_none(layer, st, layer.n)
        if c is None:  # the twin's certificate of the layer as now served (these heads as served)
            c = {k: v[:, :, hs] for k, v in _twin_cert(layer, q, layer.n).items()}
        for k in CERT_KEYS:
            cert[k][:, :, hs] = c[k]


def _exact_seg(layer, h0, h1):
    """The kernel segment of KV heads h0 .. h1 - 1 of the exact copy (exact_k, exact_v, valid), kept across steps as
    segment 1 is: built over the buffers' whole capacity (each append-only until it grows or an eviction replaces
    it), its length set to the layer's n at each read."""
    g = layer._grow
    if not all(name in g for name in ("exact_k", "exact_v", "valid")):  # not appended yet: views of the tensors
        return cpu_fused.seg(h1 - h0, layer.n, k=layer.exact_k[:, h0:h1], v=layer.exact_v[:, h0:h1],
                             valid=layer.valid[:, h0:h1].view(torch.uint8))
    k, v, va = g["exact_k"].buf, g["exact_v"].buf, g["valid"].buf
    key = (k.data_ptr(), v.data_ptr(), va.data_ptr(), k.shape[2], v.shape[2], va.shape[2])
    segs = layer.__dict__.setdefault("_exact_segs", {})
    st = segs.get((h0, h1))
    if st is None or st[0] != key:
        cap = min(k.shape[2], v.shape[2], va.shape[2])
        st = segs[(h0, h1)] = (key, cpu_fused.seg(h1 - h0, cap, k=k[:, h0:h1, :cap], v=v[:, h0:h1, :cap],
                                                  valid=va[:, h0:h1, :cap].view(torch.uint8)))
    st[1]["c"].n = layer.n
    return st[1]


def _dither_factor(layer, n, T):
    """sqrt(2 ln(2 n / d)) rounded up for the dither estimate of this read's rows (hf_meter's: n the tokens read, d
    the smallest local budget of the T reads, budget_local at step t0 + T)."""
    c = layer.cache
    return _factor(c.delta_req, c.num_layers, c.num_heads, layer.steps + T, n)


@functools.lru_cache(maxsize=256)
def _factor(delta_req, L, H, t, n):
    """Every layer of a step asks for the same number (budget_local's exact Fraction arithmetic: ~20 us a call)."""
    return radius_factor(n, budget_local(delta_req, L, H, t))


def _bands(cache):
    b = getattr(cache, "_bands64", None)
    if b is None:
        b = cache._bands64 = cache.bands.to(torch.int64).contiguous()
    return b


def flush_certificates(cache):
    """The certificate epilogue of every pending read in one batch (one step: same N and shapes). Each certificate
    tensor is split once into the layers' views (a decode read's row axis dropped once): no per-layer slicing."""
    pend, cache._pending = cache._pending, []
    groups = {}
    for item in pend:
        groups.setdefault((item[2], tuple(item[1].shape)), []).append(item)
    NB, D = cache.bands.shape[0], cache.head_dim
    for (N, shape), items in groups.items():
        B, T = shape[0], shape[1]
        drop = (lambda x: x[:, 0]) if T == 1 else (lambda x: x)  # a decode record holds [B, H] tensors
        cert = cpu_fused._certificate(torch.cat([it[1] for it in items]), NB, N, D)
        parts = None if cert is None else {k: drop(cert[k]).split(B) for k in CERT_KEYS}  # [layers * B, T, H] -> layers
        dith = {i: j for j, i in enumerate(i for i, it in enumerate(items) if it[4] is not None)}
        dcert = cpu_fused._certificate(torch.cat([it[4] for it in items if it[4] is not None]), NB, N, D) if dith else None
        dparts = None if dcert is None else drop(dcert["min"]).split(B)
        for i, (layer, _, _, q, ds) in enumerate(items):
            if parts is None:  # a row needs the twin's fp64 terms: each layer's certificate from the twin
                c = {k: drop(v) for k, v in _twin_cert(layer, q, N).items() if k in CERT_KEYS}
            else:
                c = {k: parts[k][i] for k in CERT_KEYS}
            if cache.scheme.dither:
                dmin = dparts[dith[i]] if dparts is not None and i in dith else None
                c["dither_estimate"] = _dither_estimate(c["min"], dmin, ds is not None)
            _record(layer, c, N, T)


def _dither_estimate(cmin, dmin, quantized):
    """The dither tier's estimate of one layer's read (hf_meter's dither_estimate): dmin, the kernel's sums with each
    token's dither radius through the same epilogue; no quantized token yet (quantized False): every radius is 0 and the
    deterministic certificate cmin is that bound; an epilogue that needs fp64 terms (a radius near the fp32 exp range,
    dmin None): 1, the trivial bound on a total variation."""
    if not quantized:
        return cmin
    return torch.ones_like(cmin) if dmin is None else dmin


def _scale(cache):
    return cache.scale if getattr(cache, "scale", None) is not None else cache.head_dim ** -0.5


def _twin_cert(layer, q, N):
    k, v = CertifiedLayer.served(layer)
    rho, exact = layer.witness_codes()
    B, T = q.shape[:2]
    qpos = torch.arange(N - T, N).view(1, T).expand(B, T)
    valid = layer.valid.all(1)
    s = _scale(layer.cache)
    _, c = twin_rows(q, k, v, rho, s, bands=layer.cache.bands, q_pos=qpos, valid=valid,
                     exact=exact, backend="torch")
    # the kernel's output was served, not the twin's: its logits differ by up to 2e (with_other_logits)
    return with_other_logits(c, logit_rounding(q.abs().amax(1), max_abs(k), s))


def _snapshot(layer):
    """Copies of the layer's repaired and rung tensors for its records, made again only when either changed (in place:
    its version counter, or replaced): every record of a run of steps without a repair shares one copy."""
    r, g = layer.repaired, layer.rung
    snap = layer.__dict__.get("_snap")
    vers = (version(r), version(g))  # None: an inference tensor, whose writes are not counted: copied every time
    if snap is None or snap[0] is not r or snap[1] is not g or snap[2] != vers or None in vers:
        snap = layer._snap = (r, g, vers, r.clone(), g.clone())
    return snap[3], snap[4]


def _f32(t):
    return t if t.dtype is torch.float32 else t.float()


def _record(layer, cert, N, T, pre=None, fresh=0):
    """One record as the meter writes it (hf_meter.decode_step / rows_step) from a certificate dict: a decode read
    (T = 1, cert of [B, H] tensors) in cache.records, a multi-row read (a second turn, chunked prefill; [B, T, H]) in
    cache.row_records with its rows' positions. pre: the certificate before the gate's promotions of this read (None:
    none, the certificate itself), fresh: their number."""
    cache = layer.cache
    pre = cert["min"] if pre is None else pre
    repaired, rung = _snapshot(layer)
    rec = {"layer": layer.layer_idx, "repaired": repaired, "rung": rung, "fresh_repairs": fresh}
    forms = {f: _f32(cert[f]) for f in (*FORMS, "dither_estimate", "true_tv", "out_err", "true_out_err") if f in cert}
    if T == 1:
        layer.steps += 1
        rec.update({"step": layer.steps, "pre_min": pre, "max_c": _f32(cert["max_c"])}, **forms)
        cache.records.append(rec)
        return
    t0 = layer.steps
    layer.steps += T  # each row is one read, as in the meter
    rec.update({"call": len(cache.row_records), "pos": torch.arange(N - T, N), "steps": (t0 + 1, t0 + T),
                "pre_min": pre, "max_c": _f32(cert["max_c"])}, **forms)
    cache.row_records.append(rec)


# another name of the meter (older code enables "kvcert_fused"): the meter itself sends fused layers here
AttentionInterface.register(NAME, hf_meter.kvcert_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
