"""The meter: an attention function ("kvcert") that serves attention from a CertifiedCache and
certifies every decode read in the same pass (fast.decode_attention).

    fast.integrations.hf_meter.enable(model)               # model.set_attn_implementation("kvcert")
    model.generate(ids, past_key_values=CertifiedCache(model.config, "int8"))

Any call that does not come from a CertifiedCache layer (a plain DynamicCache, no cache) is
plain sdpa. Prefill reads exact keys (sdpa); each decode step, per (layer, query head):
the deterministic certificate (all forms, math.md T2 + T4), the dither tier (T6) for
int8_dither, the gate, and in shadow mode the true TV, appended to cache.records.
"""

import torch
from transformers import AttentionInterface

from fast.core.attention import decode_attention
from fast.core.dither import budget_local, dither_forms
from fast.core.quant import max_abs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kvcert"
FORMS = ("tanh", "one_minus_b_over_a", "e_form", "min")
_CURRENT = [None]  # the cache layer updated last: its attention call comes next


def set_current(layer):
    _CURRENT[0] = layer


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


def _attend(q, k, v, rho, scale, bands, valid, exact):
    """decode_attention, looping over KV heads only when eviction left per-head padding."""
    same = bool((valid == valid[:, :1]).all())
    if same:
        return decode_attention(q, k, v, rho, scale, bands=bands, valid=valid[:, 0], exact=exact)
    Hkv = k.shape[1]
    G = q.shape[1] // Hkv
    outs, certs = [], []
    for h in range(Hkv):
        sl = slice(h, h + 1)
        o, c = decode_attention(q[:, h * G:(h + 1) * G], k[:, sl], v[:, sl], rho[:, sl], scale,
                                bands=bands, valid=valid[:, h], exact=exact[:, sl])
        outs.append(o)
        certs.append(c)
    cert = {key: torch.cat([c[key] for c in certs], dim=1) for key in certs[0] if certs[0][key].dim() == 2}
    return torch.cat(outs, dim=1), cert


def served_probs(q, k, scale, valid):
    """p~ [B, H, N] fp64: softmax of s <q, k_j> over valid tokens (GQA)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    x = torch.einsum("bkgd,bknd->bkgn", q.double().view(B, Hkv, H // Hkv, D), k.double()) * scale
    x = x.masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.softmax(x, dim=-1).reshape(B, H, -1)


def _certify(layer, q, k, v, scale, valid):
    rho, exact = layer.witness_codes()
    return _attend(q, k, v, rho, scale, layer.cache.bands, valid, exact)


def _slot(bound, Hkv):
    """[B, H] -> [Hkv]: the worst query head of each KV head over the batch."""
    B, H = bound.shape
    return bound.view(B, Hkv, H // Hkv).amax(dim=(0, 2))


def _plain(q, k, v, scale, valid):
    """Attention without a certificate (fp32, GQA, padding masked): the speed baseline."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    x = torch.matmul(q.view(B, Hkv, H // Hkv, D), k.float().transpose(-1, -2)) * scale  # [B, Hkv, G, N]
    x = x.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(x, dim=-1), v.float()).reshape(B, H, D)
    return out, None


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
    out, cert = _certify(layer, q, key.float(), value.float(), scale, layer.valid)
    layer.steps += 1
    t = layer.steps
    pre = cert["min"].clone()
    fresh = []
    if cache.gate.kind == "certified":
        over = (_slot(pre, Hkv) > cache.gate.tau) & ~layer.repaired
        fresh = over.nonzero().flatten().tolist()
        if fresh:  # serve this read (and every later one) of those KV heads from the offload tier
            layer.repair(fresh)
            key, value = layer.served_k, layer.served_v
            out, cert = _certify(layer, q, key.float(), value.float(), scale, layer.valid)
    rec = {"step": t, "layer": layer.layer_idx, "pre_min": pre, "repaired": layer.repaired.clone(),
           "fresh_repairs": len(fresh), "max_c": cert["max_c"].float()}
    rec.update({f: cert[f].float() for f in FORMS})
    if cache.scheme.dither or cache.shadow:
        p_tilde = served_probs(q, key, scale, layer.valid)
    if cache.scheme.dither:
        d = budget_local(cache.delta_req, cache.num_layers, cache.num_heads, t)
        # fp64 p~ as computed, with the fp32 logit rounding of the served attention (fast.core.dither.dither_forms)
        rec["dither_min"] = dither_forms(q, p_tilde, layer.step_view(), max_abs(key), scale, key.shape[2], d)["min"]
    if cache.shadow:
        p = served_probs(q, layer.exact_k, scale, layer.valid)
        rec["true_tv"] = (0.5 * (p - p_tilde).abs().sum(-1)).float()
    cache.records.append(rec)
    return out[:, None].to(query.dtype), None  # [B, 1, H, D], as sdpa returns it


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
    layer = _CURRENT[0]
    if layer is None or key is not layer.served_k or layer.layer_idx != getattr(module, "layer_idx", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    hook = layer.cache.on_layer
    if query.shape[2] > 1:
        out = prefill_step(layer, module, query, key, value, attention_mask, scale, dropout=dropout, **kwargs)
        phase = "prefill"
    else:
        out = decode_step(layer, query, key, value, scale, attention_mask)
        phase = "decode"
    if hook is not None:
        hook(phase, layer.layer_idx)
    return out


AttentionInterface.register(NAME, kvcert_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
