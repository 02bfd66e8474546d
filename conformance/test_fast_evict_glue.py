"""Eviction on a quantized cache, fast vs reference and truth (spec T7e, T7f).

differential: fast.build_group_witness(served, rho=...) radii bound the exact keys' offsets from
the stored fp16 centre (T7e); fast.log_z_kept_lower(served, c=...) is <= the reference's
log sum_K e^{x~_j - c_j}, which is <= the exact log Z_K (T7f).
"""
import torch
from mpmath import exp, fsum, log, mpf, workdps

from conformance._check import DPS, le
from reference.band import witness
from reference.evict import log_z_kept_lower


def inner(a, b):
    return fsum(mpf(x) * mpf(y) for x, y in zip(a, b))


@workdps(DPS)
def check_fast_stored(seed):
    """differential: fast radii from served keys + rho bound the exact keys' offsets from the
    stored fp16 centre (T7e); fast log_z_kept_lower(c) <= reference and exact log Z_K (T7f)."""
    from fast.core.evict import build_group_witness
    from fast.core.evict import log_z_kept_lower as fast_lz
    from fast.core.rope import rope_bands as fast_bands
    from fast.core.witness import logit_error_bound as fast_c
    from fast.core.witness import witness as fast_witness
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, N, D, n_keep, gs = 1, 2, 1, 14, 8, 4, 3
    bands = fast_bands(D, 2, "rotate_half")
    keys = torch.randn(B, Hkv, N, D, generator=g) * (1 + seed % 3)
    step = 2.0 ** -(2 + seed % 4)
    served = (keys / step).round() * step
    rho = fast_witness(keys, served, bands)                                 # [B, Hkv, N, NB]
    ev_idx = torch.arange(n_keep, N)[None, None]
    w = build_group_witness(served, ev_idx, bands, group_size=gs, rho=rho)
    blist = bands.tolist()
    for gi in range(w.counts.shape[2]):
        mu = [mpf(v) for v in w.centres[0, 0, gi].double().tolist()]
        radii = [mpf(v) for v in w.radii[0, 0, gi].double().tolist()]
        for j in ev_idx[0, 0, gi * gs:(gi + 1) * gs].tolist():
            exact = witness(keys[0, 0, j].tolist(), mu, blist)
            assert all(le(e, r) for e, r in zip(exact, radii)), \
                f"seed {seed} group {gi} key {j}: exact offsets {exact} > radii {radii}"
    q = torch.randn(B, H, D, generator=g)
    s = 0.5
    c = fast_c(q, rho[:, :, :n_keep], bands, s)                             # [B, H, n_keep]
    lz = fast_lz(q, served[:, :, :n_keep], s, c=c)                          # [B, H]
    for h in range(H):
        qh = q[0, h].tolist()
        ref = log_z_kept_lower(qh, served[0, 0, :n_keep].tolist(), [mpf(v) for v in c[0, h].double().tolist()], s)
        log_zk = log(fsum(exp(mpf(s) * inner(qh, k)) for k in keys[0, 0, :n_keep].tolist()))
        assert le(mpf(lz[0, h].item()), ref) and ref <= log_zk, \
            f"seed {seed} head {h}: fast {lz[0, h].item()}, reference {ref}, exact log Z_K {log_zk}"


def test_fast_stored_witness_bounds_exact_keys():
    """differential: fast.build_group_witness(rho=) and fast.log_z_kept_lower(c=) against the truth."""
    for seed in range(12):
        check_fast_stored(seed)
