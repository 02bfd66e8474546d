"""The meter: an attention function ("kvcert") that serves attention from a CertifiedCache and
certifies every read of a quantized key in the same pass (fast.core.attention).

    fast.integrations.hf_meter.enable(model)               # model.set_attn_implementation("kvcert")
    model.generate(ids, past_key_values=CertifiedCache(model.config, "int8"))

Any call that does not come from a CertifiedCache layer (a plain DynamicCache, no cache) is
plain sdpa. Which reads are certified:
- the first prefill of an empty cache reads the fresh exact keys (sdpa over key_states, as every
  quantized cache does): it reads no quantized key, so it needs no certificate (TV = 0);
- a decode step (one query row) reads the cache: decode_attention, one record in cache.records;
- every other multi-row query over a non-empty cache (a second turn or a second `generate` on
  the same cache, chunked prefill, speculative verification) reads the quantized keys:
  attention_rows with causal positions, one certificate per (row, query head), one record per
  (call, layer) in cache.row_records with "pos" [T] (the rows' positions) and [B, T, H] tensors.
Per read, per (layer, query head): the deterministic certificate (all forms, math.md T2 + T4),
for the dithered schemes (int8_dither, int4_dither, kivi2_dither) the dither tier's number as
`dither_estimate`, the gate, with value_bound=True the output bound out_err (T5, covering the cast
to a bf16 / fp16 model's dtype), and in shadow mode the true TV (and true_out_err = ||o - out||
from the exact keys and values, out as the model gets it).

The dither tier is an ESTIMATE here, never a certificate (spec A2): T6i-T6j are proved for a query
and keys fixed before the dither is drawn. Within a step, the query of layer l >= 1 is computed from
the outputs of layers < l, which read dithered keys and values; from the second decode step on every
query (and the keys of generated tokens) depends on tokens produced from dithered reads; a multi-row
read's layers >= 1 likewise. Only a layer-0 read of tokens all fixed by the caller (not produced
from a dithered read) meets A2, and the cache cannot tell where its tokens came from. So the gates
(certified:TAU, risk:K) use the deterministic tier alone.
"""

import threading

import torch
from transformers import AttentionInterface

from fast.core.attention import attention_rows, decode_attention, served_distance
from fast.core.certify import up32
from fast.core.dither import budget_local, dither_forms
from fast.core.quant import max_abs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kvcert"
FORMS = ("tanh", "one_minus_b_over_a", "e_form", "min")
# The cache layer updated last IN THIS THREAD: its attention call comes next. Per thread, so that
# several threads generating with one shared model (each with its own cache) never read each
# other's layer and fall through to plain sdpa.
_LOCAL = threading.local()


def set_current(layer):
    _LOCAL.layer = layer


def current():
    return getattr(_LOCAL, "layer", None)


def enable(model):
    """Route the model's attention through the meter (sdpa whenever no CertifiedCache is in use)."""
    model.set_attn_implementation(NAME)
    return model


def _valid_row(mask, n):
    """[B, n] bool from an HF mask [B, 1, q, kv] (last query row), or None."""
    if mask is None:
        return None
    row = mask[:, 0, -1, -n:]
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


def _attend(q, k, v, rho, scale, bands, valid, exact, v_err=None, q_pos=None, box_form=False, sub=None):
    """decode_attention (q [B, H, D]) or, with q_pos [B, T], attention_rows (q [B, T, H, D]),
    looping over KV heads only when eviction left per-head padding (valid [B, Hkv, N]).
    sub: the layer's subspace_view() (or None)."""
    def one(qh, kh, vh, rh, vh_valid, eh, ve, sh):
        if q_pos is None:
            backend = "torch" if (box_form or sh is not None) else "auto"
            return decode_attention(qh, kh, vh, rh, scale, bands=bands, valid=vh_valid, exact=eh, v_err=ve,
                                    backend=backend, box_form=box_form, subspace=sh)
        return attention_rows(qh, kh, vh, rh, scale, bands=bands, q_pos=q_pos, valid=vh_valid, exact=eh, v_err=ve,
                              backend="torch" if (box_form or sh is not None) else "auto", subspace=sh, box_form=box_form)
    if bool((valid == valid[:, :1]).all()):
        return one(q, k, v, rho, valid[:, 0], exact, v_err, sub)
    Hkv = k.shape[1]
    G = q.shape[-2] // Hkv
    outs, certs = [], []
    for h in range(Hkv):
        sl = slice(h, h + 1)
        o, c = one(q[..., h * G:(h + 1) * G, :], k[:, sl], v[:, sl], rho[:, sl], valid[:, h], exact[:, sl],
                   None if v_err is None else v_err[:, sl], None if sub is None else tuple(t[:, sl] for t in sub))
        outs.append(o)
        certs.append(c)
    cert = {key: torch.cat([c[key] for c in certs], dim=-1) for key in certs[0]}
    return torch.cat(outs, dim=-2), cert


def served_probs(q, k, scale, valid):
    """p~ [B, H, N] fp64: softmax of s <q, k_j> over valid tokens (GQA)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    x = torch.einsum("bkgd,bknd->bkgn", q.double().view(B, Hkv, H // Hkv, D), k.double()) * scale
    x = x.masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.softmax(x, dim=-1).reshape(B, H, -1)


def _certify(layer, q, k, v, scale, valid, q_pos=None, box_form=False):
    rho, exact = layer.witness_codes()
    sub = layer.subspace_view()
    return _attend(q, k, v, rho, scale, layer.cache.bands, valid, exact, layer.value_err_view(), q_pos, box_form, sub)


def exact_output(p, v, Hkv):
    """o [B, H', D] fp64 = sum_j p_j v_j for p [B, H', N] (GQA: H' = Hkv G')."""
    B, H, N = p.shape
    return torch.matmul(p.view(B, Hkv, H // Hkv, N), v.double()).view(B, H, -1)


def _slot(bound, Hkv):
    """[B, H] -> [Hkv]: the worst query head of each KV head over the batch."""
    B, H = bound.shape
    return bound.view(B, Hkv, H // Hkv).amax(dim=(0, 2))


def _repaired_take_cert(estimate, cert_min, repaired):
    """[..., H] dither estimate with the deterministic certificate in place of it on the query heads of
    repaired KV heads (repaired [Hkv]): those serve the exact copy or k_hat + the int8 residual, not
    the dithered codes the dither radius is about."""
    rep = repaired.repeat_interleave(estimate.shape[-1] // repaired.shape[0])
    return torch.where(rep, cert_min, estimate)


def _plain(q, k, v, scale, valid):
    """Attention without a certificate (fp32, GQA, padding masked): the speed baseline."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    x = torch.matmul(q.view(B, Hkv, H // Hkv, D), k.float().transpose(-1, -2)) * scale  # [B, Hkv, G, N]
    x = x.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(x, dim=-1), v.float()).reshape(B, H, D)
    return out, None


def _gated(layer, q, key, value, scale, q_pos=None):
    """Certify one read and apply the gate: while some KV head's worst certificate over the read's
    rows and batch exceeds TAU, promote those heads (certified:TAU: to exact; ladder:TAU: one rung up,
    each rung certified on its own) and certify the read again, so the read served is the one the
    returned certificate covers. With cache.box_form a read that would trip the gate (every read
    without a threshold gate; decode or rows) is certified with the box form too (spec T9).
    Returns out, cert, pre (the first certificate's min), the number of promotions, key, value."""
    cache, gate = layer.cache, layer.cache.gate

    def certify(key, value):
        out, cert = _certify(layer, q, key.float(), value.float(), scale, layer.valid, q_pos)
        if cache.box_form and (not gate.thresholded or bool((cert["min"] > gate.tau).any())):
            out, cert = _certify(layer, q, key.float(), value.float(), scale, layer.valid, q_pos, box_form=True)
        return out, cert

    def over(cert):
        worst = cert["min"] if q_pos is None else cert["min"].amax(1)  # [B, H] (rows: worst row)
        return ((_slot(worst, layer.Hkv) > gate.tau) & ~layer.repaired).nonzero().flatten().tolist()
    out, cert = certify(key, value)
    pre, fresh = cert["min"].clone(), 0
    while gate.thresholded and (heads := over(cert)):  # at most len(rungs) + 1 rounds: each one promotes
        layer.promote(heads)
        fresh += len(heads)
        key, value = layer.served_k, layer.served_v
        out, cert = certify(key, value)
    return out, cert, pre, fresh, key, value


def decode_step(layer, query, key, value, scale, mask=None):
    cache = layer.cache
    row = _valid_row(mask, layer.n) if mask is not None and mask.shape[-1] == layer.n and not cache.evicted else None
    if row is not None:  # padding seen by transformers' mask (e.g. a prefill that bypassed the meter)
        layer.valid &= row[:, None, :]
    q = query[:, :, 0].float()  # q: [B, H, D] post-RoPE
    Hkv = layer.Hkv
    if not cache.certify:
        valid = layer.valid[:, 0] if bool((layer.valid == layer.valid[:, :1]).all()) else None
        if valid is None:
            raise ValueError("certify=False needs the same valid tokens in every KV head")
        out, _ = _plain(q, key, value, scale, valid)
        return out[:, None].to(query.dtype), None
    out, cert, pre, fresh, key, value = _gated(layer, q, key, value, scale)
    layer.steps += 1
    t = layer.steps
    rec = {"step": t, "layer": layer.layer_idx, "pre_min": pre, "repaired": layer.repaired.clone(),
           "rung": layer.rung.clone(), "fresh_repairs": fresh, "max_c": cert["max_c"].float()}
    rec.update({f: cert[f].float() for f in FORMS})
    if "box" in cert:  # box_form: this read was certified with the box form too (in min already)
        rec["box"] = cert["box"].float()
    served = out.to(query.dtype)  # what the model gets (bf16 / fp16 models: the cast is served)
    if "out_err" in cert:
        rec["out_err"] = served_out_err(cert["out_err"], out, served)
    if cache.scheme.dither or cache.shadow:
        p_tilde = served_probs(q, key, scale, layer.valid)
    if cache.scheme.dither:
        d = budget_local(cache.delta_req, cache.num_layers, cache.num_heads, t)
        # fp64 p~ as computed, with the fp32 logit rounding of the served attention (fast.core.dither.dither_forms);
        # an estimate: this query depends on the dither read before (A2), and the gate above never reads it
        est = dither_forms(q, p_tilde, layer.step_view(), max_abs(key), scale, key.shape[2], d)["min"]
        rec["dither_estimate"] = _repaired_take_cert(est, rec["min"], layer.off_base())
    if cache.shadow:
        p = served_probs(q, layer.exact_k, scale, layer.valid)
        rec["true_tv"] = (0.5 * (p - p_tilde).abs().sum(-1)).float()
        if "out_err" in cert:
            rec["true_out_err"] = (exact_output(p, layer.exact_v, Hkv) - served.double()).norm(dim=-1).float()
    cache.records.append(rec)
    return served[:, None], None  # [B, 1, H, D], as sdpa returns it


def served_out_err(out_err, out, served):
    """out_err of the output the model gets: the fp32 output's bound plus ||served - out|| (0 when the
    model is fp32; the bf16 / fp16 cast otherwise), rounded up (fast.core.attention.served_distance).
    out, served: [..., H, D]; out_err: [..., H]."""
    if served.dtype == out.dtype:
        return out_err
    return up32(out_err.to(torch.float64) + served_distance(out, served).to(torch.float64))


def row_probs(q, k, scale, mask):
    """p [B, H T, N] fp64: softmax of s <q, k_j> per row over its visible tokens (q [B, H T, D] with
    rows flattened as attention_rows does, h T + t; mask [B, Hkv, G T, N])."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    x = torch.matmul(q.double().view(B, Hkv, H // Hkv, D), k.double().transpose(-1, -2)) * scale
    return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1).reshape(B, H, -1)


def rows_step(layer, query, key, value, scale, mask=None):
    """T query rows over a cache that already holds quantized (or about-to-be-read) tokens: the
    newest T cached tokens are these rows' own keys, at storage slots N - T .. N - 1 (after
    eviction, storage order still puts every older token first), so row t reads every valid slot
    j <= N - T + t. One certificate per (row, query head) from attention_rows."""
    cache = layer.cache
    B, H, T, D = query.shape
    N, Hkv = layer.n, layer.Hkv
    row = _valid_row(mask, N) if mask is not None and mask.shape[-1] == N and not cache.evicted else None
    if row is not None:  # padding seen by transformers' mask
        layer.valid &= row[:, None, :]
    q = query.transpose(1, 2).float()  # q: [B, T, H, D] post-RoPE
    q_pos = torch.arange(N - T, N, device=q.device).expand(B, T)
    if not cache.certify:
        vis = (torch.arange(N, device=q.device)[None, :] <= q_pos[0][:, None])  # [T, N]
        if not bool((layer.valid == layer.valid[:, :1]).all()):
            raise ValueError("certify=False needs the same valid tokens in every KV head")
        m = vis[None, None, None] & layer.valid[:, 0, None, None, None, :]  # [B, 1, 1, T, N]
        x = torch.matmul(q.transpose(1, 2).reshape(B, Hkv, H // Hkv, T, D), key.float().transpose(-1, -2)[:, :, None]) * scale
        out = torch.matmul(torch.softmax(x.masked_fill(~m, float("-inf")), -1), value.float()[:, :, None])
        return out.reshape(B, H, T, D).transpose(1, 2).to(query.dtype), None
    out, cert, pre, fresh, key, value = _gated(layer, q, key, value, scale, q_pos)
    t0 = layer.steps
    layer.steps += T  # each row is one read (the dither budget counts reads)
    rec = {"call": len(cache.row_records), "layer": layer.layer_idx, "pos": q_pos[0].clone(),
           "steps": (t0 + 1, t0 + T), "pre_min": pre, "repaired": layer.repaired.clone(),
           "rung": layer.rung.clone(), "fresh_repairs": fresh, "max_c": cert["max_c"].float()}
    rec.update({f: cert[f].float() for f in FORMS})
    if "box" in cert:  # box_form: these rows were certified with the box form too (in min already)
        rec["box"] = cert["box"].float()
    served_out = out.to(query.dtype)  # what the model gets (bf16 / fp16 models: the cast is served)
    if "out_err" in cert:
        rec["out_err"] = served_out_err(cert["out_err"], out, served_out)
    if cache.scheme.dither or cache.shadow:
        G = H // Hkv
        vis = torch.arange(N, device=q.device)[None, :] <= q_pos[0][:, None]  # [T, N]
        m = (vis[None, None, None] & layer.valid[:, :, None, None, :]).expand(B, Hkv, G, T, N).reshape(B, Hkv, G * T, N)
        qf = q.permute(0, 2, 1, 3).reshape(B, H * T, D)  # row (h, t) -> h T + t, as attention_rows
        p_tilde = row_probs(qf, key, scale, m)
        unflat = lambda x: x.view(B, H, T).transpose(1, 2)  # [B, H T] -> [B, T, H]
    if cache.scheme.dither:
        # the smallest local budget of the T reads (t0 + T) for every row: each row spends at most its own
        d = budget_local(cache.delta_req, cache.num_layers, cache.num_heads, t0 + T)
        est = unflat(dither_forms(qf, p_tilde, layer.step_view(), max_abs(key), scale, N, d)["min"])
        rec["dither_estimate"] = _repaired_take_cert(est, rec["min"], layer.off_base())
    if cache.shadow:
        p = row_probs(qf, layer.exact_k, scale, m)
        rec["true_tv"] = unflat((0.5 * (p - p_tilde).abs().sum(-1)).float())
        if "out_err" in cert:
            o = exact_output(p, layer.exact_v, Hkv)
            served = served_out.permute(0, 2, 1, 3).reshape(B, H * T, D).double()
            rec["true_out_err"] = unflat((o - served).norm(dim=-1).float())
    cache.row_records.append(rec)
    return served_out, None  # [B, T, H, D], as sdpa returns it


def prefill_step(layer, module, query, key, value, mask, scale, **kwargs):
    out = sdpa_attention_forward(module, query, key, value, mask, scaling=scale, **kwargs)
    row = _valid_row(mask, key.shape[2])
    if row is not None:
        layer.valid[:, :, -key.shape[2]:] &= row[:, None, :]
    if layer.cache.gate.kind == "risk" and layer.nq:
        # risk of each (layer, KV head): the certificate of the last prompt query on the compressed cache
        k, v = layer.served()
        _, cert = _certify(layer, query[:, :, -1].float(), k.float(), v.float(), scale, layer.valid)
        layer.risk = torch.stack([_slot(cert["min"], layer.Hkv), _slot(cert["max_c"], layer.Hkv)], dim=-1)
    return out


def kvcert_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface function: query [B, H, q, D], key/value [B, Hkv, N, D] from the cache."""
    layer = current()
    if layer is None or key is not layer.served_k or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, phase = read(layer, query, key, value, scale, attention_mask, module=module, dropout=dropout, **kwargs)
    if layer.cache.on_layer is not None:
        layer.cache.on_layer(phase, layer.layer_idx)
    return out


def read(layer, query, key, value, scale, mask=None, module=None, **kwargs):
    """One certified read of `layer` (key, value: what its update returned) by query [B, H, q, D]
    through the path that applies: the fused C++ read (hf_fused.FusedLayer), the exact first
    prefill of an empty cache (no quantized key: no certificate), multi-row reads, decode.
    Returns (output as the attention interface returns it, phase)."""
    layer.set_basis(query)  # the subspace witness's basis, from the layer's first read (a no-op after it, or without one)
    if layer.fused_ok() and layer.n > query.shape[2]:  # certified the same way, records alike
        layer.cache.scale = scale
        return (layer.fused_read(query, scale), None), "decode" if query.shape[2] == 1 else "rows"
    if query.shape[2] > 1 and layer.n == query.shape[2]:
        return prefill_step(layer, module, query, key, value, mask, scale, **kwargs), "prefill"
    if query.shape[2] > 1:
        return rows_step(layer, query, key, value, scale, mask), "rows"
    return decode_step(layer, query, key, value, scale, mask), "decode"


AttentionInterface.register(NAME, kvcert_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
