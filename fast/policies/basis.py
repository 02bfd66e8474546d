"""A static basis for the query-subspace witness (fast.core.subspace, spec T4e), calibrated offline.

    basis = fast.calibrate_basis(model, [ids_1, ids_2], m=8)     # [L, Hkv, m, D] fp32
    cache = fast.CertifiedCache(model.config, "fp8_e4m3", subspace=8, basis=basis)

Per (layer, KV head), the top m right singular vectors of the last QWIN query rows of each calibration
prompt, pooled. A request's own basis (CertifiedCache(subspace=m) without `basis`) is fixed from its own
prefill; a static one is the same for every request, so it also serves caches whose blocks outlive a
request (a paged engine's shared prefixes) and prompts too short to fix one. Any basis is sound (T4e
holds for every U): the calibration only decides how tight the witness is.
"""

import torch

from fast.core.subspace import QWIN, query_basis


class _Rows:
    """A collector (fast.policies.evictors.collecting) keeping each layer's last QWIN prefill query rows."""
    needs = set()
    read = None

    def __init__(self):
        self.rows = {}

    def observe(self, module, query, key, attention_mask, scale):
        if query.shape[2] > 1:
            self.rows.setdefault(module.layer_idx, []).append(query[:, :, -QWIN:].float().clone())


def calibrate_basis(model, prompts, m):
    """basis [L, Hkv, m, D] fp32 from the query rows of `prompts` (LongTensor [1, N] each, N >= 2)."""
    from fast.policies.evictors import collecting
    if not prompts:
        raise ValueError("calibrate_basis: no prompts")
    for p in prompts:
        if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[0] != 1 or p.shape[1] < 2:
            raise ValueError("calibrate_basis: each prompt is a LongTensor [1, N] with N >= 2")
    col = _Rows()
    with torch.no_grad(), collecting(model, col):
        for p in prompts:
            model(input_ids=p, use_cache=False)
    Hkv = model.config.num_key_value_heads
    layers = range(model.config.num_hidden_layers)
    if any(l not in col.rows for l in layers):
        raise ValueError("calibrate_basis: some layer's attention was not observed (an attention implementation "
                         "that bypasses transformers' AttentionInterface?)")
    return torch.cat([query_basis(torch.cat(col.rows[l], 2), Hkv, m) for l in layers])
