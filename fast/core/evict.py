"""Eviction certificate (math.md T7): a group witness of the evicted keys, and TV <= U/(L+U).

At eviction time the evicted tokens of each KV head are cut into groups of consecutive
positions. Per group we keep the count n_g, a centre mu_g (stored in fp16) and band radii
R_{g,b} >= max_{j in g} ||(k_j - mu_g)_b|| (measured from the STORED centre, rounded up).
On every later read with query q (T7c):

    x_j <= s<q, mu_g> + s sum_b ||q_b|| R_{g,b}        for every j in g, any q,
    U    = sum_g n_g exp(that) >= Z_E,
    TV(p, p^K) = Z_E / (Z_K + Z_E) <= U / (L + U)      for any 0 < L <= Z_K     (T7a, T7b).

Floating point (math.md T8): the bound is evaluated in fp64 from fp32/fp16 inputs (the
conversion is exact), every rounded quantity gets an explicit upward margin justified next
to it, and the fp32 result is rounded up. What is returned is >= the exact real value of
U/(L+U) on the same inputs, provided the caller's `log_z_kept_lower` is a true lower bound
(use `log_z_kept_lower` below to make one).

Composition with quantization of the kept tokens (T7d): TV(p, p~^K) <= TV(p, p^K) +
TV(p^K, p~^K); `compose_tv` adds the two and rounds up. When the kept keys are quantized,
pass their logit error bounds c_j to `log_z_kept_lower` (Z_K >= sum_K e^{x~_j - c_j}) and
their band witness rho to `build_group_witness` (exact key = stored key + r, ||r_b|| <= rho_b).
"""

from dataclasses import dataclass

import torch

U64 = 2.0 ** -53  # unit roundoff of fp64
# Relative margin for the fp64 sums below. An n-term fp64 sum or dot product has error
# <= gamma_n * sum|terms|, gamma_n = n u/(1 - n u) (Higham ch. 3). We allow n <= 2^20 terms,
# so gamma_n <= 2^20 * 2^-53 / (1 - 2^-33) < 1.2e-10; REL covers it with a factor 8 spare.
REL = 1e-9
MAX_TERMS = 2 ** 20


def _check_finite(name, x):
    if not torch.is_tensor(x):
        raise ValueError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf")


def check_evicted(name, keys, evict_index):
    """keys [B, Hkv, N, D] finite, evict_index LongTensor [B, Hkv, E] of slots in range -> (B, Hkv, N, D)."""
    _check_finite(name, keys)
    if keys.dim() != 4:
        raise ValueError(f"{name} must be [B, Hkv, N, D], got {tuple(keys.shape)}")
    B, Hkv, N, D = keys.shape
    if evict_index.dim() != 3 or evict_index.shape[:2] != (B, Hkv) or evict_index.dtype != torch.long:
        raise ValueError(f"evict_index must be a LongTensor [B={B}, Hkv={Hkv}, E], got {tuple(evict_index.shape)}")
    if evict_index.numel() and (evict_index.min() < 0 or evict_index.max() >= N):
        raise ValueError("evict_index out of range")
    return B, Hkv, N, D


def _round_up_f32(x64):
    """fp64 -> fp32, never below the input (nearest rounding may go down by half an ulp)."""
    x32 = x64.float()
    low = x32.double() < x64
    return torch.where(low, torch.nextafter(x32, torch.full_like(x32, float("inf"))), x32)


def _round_up_f16(x64):
    """fp64 (>= 0) -> fp16, never below the input; values above the fp16 range become inf."""
    x16 = x64.to(torch.float16)
    low = x16.double() < x64
    # for positive finite fp16, the next larger value has the next integer bit pattern
    bumped = (x16.view(torch.int16) + 1).view(torch.float16)
    return torch.where(low, bumped, x16)


def _default_bands(D, NB):
    from fast.core.rope import rope_bands
    return rope_bands(D, NB, "rotate_half")


@dataclass
class GroupWitness:
    """Witness of the evicted keys of one layer; groups = (counts, centres, radii).

    counts [B, Hkv, G] int32 (0 marks an empty group), centres [B, Hkv, G, D] fp16,
    radii [B, Hkv, G, NB] fp16 rounded up, bands [NB, D // NB] coordinate indices."""
    counts: torch.Tensor
    centres: torch.Tensor
    radii: torch.Tensor
    bands: torch.Tensor

    @property
    def groups(self):
        return self.counts, self.centres, self.radii

    @property
    def nbytes(self):
        """Bytes of the witness as stored (counts as int32, centres and radii fp16)."""
        return sum(t.numel() * t.element_size() for t in self.groups)

    @property
    def evicted(self):
        return int(self.counts.sum())

    def cat(self, other):
        """Append the groups of a later eviction (same B, Hkv), padding G with empty groups."""
        return GroupWitness(torch.cat([self.counts, other.counts], 2), torch.cat([self.centres, other.centres], 2),
                            torch.cat([self.radii, other.radii], 2), self.bands)


def build_group_witness(keys, evict_index, bands, *, group_size=32, evict_valid=None, rho=None):
    """Group witness of the evicted keys (T7c).

    keys: [B, Hkv, N, D] the keys as cached (post-RoPE; the logits use exactly these);
    evict_index: [B, Hkv, E] positions of the evicted tokens, sorted by position;
    evict_valid: bool [B, Hkv, E] (False = padding slot, not a token), default all True;
    rho: optional [B, Hkv, N, NB] band witness of the error of the stored keys (quantized
    cache): then the exact key is k_j + r_j with ||r_{j,b}|| <= rho_{j,b} and the radius
    grows by rho (triangle inequality). Groups are runs of `group_size` consecutive
    evicted tokens of the same KV head."""
    B, Hkv, N, D = check_evicted("keys", keys, evict_index)
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if bands.dim() != 2 or bands.numel() != D:
        raise ValueError(f"bands must be [NB, D/NB] covering D={D} coordinates, got {tuple(bands.shape)}")
    NB = bands.shape[0]
    E = evict_index.shape[2]
    valid = torch.ones_like(evict_index, dtype=torch.bool) if evict_valid is None else evict_valid
    G = max(1, -(-E // group_size))
    pad = G * group_size - E
    idx = torch.nn.functional.pad(evict_index, (0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    k = keys.double().gather(2, idx[..., None].expand(-1, -1, -1, D))      # [B, Hkv, G*gs, D], exact
    k = k.view(B, Hkv, G, group_size, D)
    w = valid.view(B, Hkv, G, group_size).double()
    counts = w.sum(-1)                                                      # [B, Hkv, G]
    centre = (k * w[..., None]).sum(3) / counts.clamp_min(1)[..., None]    # any centre is valid
    centre16 = centre.to(torch.float16)
    if not torch.isfinite(centre16).all():
        raise ValueError("keys too large for an fp16 centre")
    diff = k - centre16.double()[:, :, :, None, :]                          # [B, Hkv, G, gs, D]
    bn = diff[..., bands].pow(2).sum(-1).sqrt()                            # [B, Hkv, G, gs, NB]
    if rho is not None:
        _check_finite("rho", rho)
        if rho.shape != (B, Hkv, N, NB):
            raise ValueError(f"rho must be [B, Hkv, N, NB]={(B, Hkv, N, NB)}, got {tuple(rho.shape)}")
        r = rho.double().gather(2, idx[..., None].expand(-1, -1, -1, NB)).view(B, Hkv, G, group_size, NB)
        bn = bn + r
    bn = bn * w[..., None]
    # fp64 rounding of the difference (relative u per coordinate), the squares, the
    # <= D-term sum, the sqrt and the rho sum: relative error < (D + 4) u < 1e-12 for D <= 4096.
    radius = bn.amax(3) * (1 + REL)
    return GroupWitness(counts.to(torch.int32), centre16, _round_up_f16(radius), bands)


def cluster_order(keys, evict_index, evict_valid, group_size):
    """Reorder the evicted tokens so that consecutive runs of `group_size` hold nearby keys.

    keys [B, Hkv, N, D]; evict_index, evict_valid [B, Hkv, E]. Per (row, KV head), the valid
    evicted keys are split recursively at a multiple of group_size along their principal axis
    (a PCA tree), so that the groups of build_group_witness have small radii; the number of
    groups stays ceil(E_valid / group_size). Only the partition changes: T7c holds for any
    partition of the evicted set, so the certificate stays sound. Returns (index, valid)."""
    B, Hkv, E = evict_index.shape
    out_idx, out_ok = evict_index.clone(), evict_valid.clone()
    for b in range(B):
        for h in range(Hkv):
            sel = evict_index[b, h][evict_valid[b, h]]
            if sel.numel() <= group_size:
                continue
            x = keys[b, h, sel].double()                                    # [n, D]
            order = _pca_split(x, torch.arange(sel.numel()), group_size)
            n = sel.numel()
            out_idx[b, h, :n] = sel[order]
            out_ok[b, h, :n] = True
            out_ok[b, h, n:] = False
    return out_idx, out_ok


def _pca_split(x, members, gs):
    """Order of `members` (rows of x) as leaves of a principal-axis split tree, left sizes
    multiples of gs."""
    n = members.numel()
    if n <= gs:
        return members
    pts = x[members]
    c = pts - pts.mean(0)
    axis = torch.linalg.eigh(c.T @ c).eigenvectors[:, -1]
    order = members[torch.argsort(c @ axis, stable=True)]
    left = gs * -(-(-(-n // gs)) // 2)                                      # gs * ceil(ceil(n/gs) / 2)
    return torch.cat([_pca_split(x, order[:left], gs), _pca_split(x, order[left:], gs)])


def _band_norms_up(q64, bands):
    """||q_b|| in fp64, rounded up: relative error of sqrt(sum of <= D squares) < (D/2 + 2) u."""
    return q64[..., bands].pow(2).sum(-1).sqrt() * (1 + REL)


def evict_bound(q, groups, log_z_kept_lower, scale, bands):
    """TV(p, p^K) <= U/(L+U) per query head (T7b, T7c). Returns fp32 [B, H], >= the exact value.

    q: [B, H, D] post-RoPE query; groups = (counts [B, Hkv, G], centres [B, Hkv, G, D],
    radii [B, Hkv, G, NB]); log_z_kept_lower: [B, H] with exp(.) <= Z_K (a lower bound on the
    kept partition function); scale: the softmax scale s > 0; bands: [NB, D // NB]."""
    return tv_from_log_odds(evict_log_odds(q, groups, log_z_kept_lower, scale, bands))


def tv_from_log_odds(d):
    """U/(L+U) = sigmoid(log U - log L) from an upper bound d on the log-odds, rounded up to fp32."""
    tv = torch.sigmoid(d.double()) * (1 + REL)                             # fp64 sigmoid errs by a few u
    return _round_up_f32(tv.clamp(max=1.0))


def evict_log_odds(q, groups, log_z_kept_lower, scale, bands):
    """An upper bound on log(U/L), fp64 [B, H] (-inf when nothing was evicted).

    evict_bound = sigmoid of it. Where the bound saturates at 1 in fp32 (log-odds > ~17) the
    log-odds still ranks inputs by certified risk.

    q: [B, H, D] post-RoPE query; groups = (counts [B, Hkv, G], centres [B, Hkv, G, D],
    radii [B, Hkv, G, NB]); log_z_kept_lower: [B, H] with exp(.) <= Z_K (a lower bound on the
    kept partition function); scale: the softmax scale s > 0; bands: [NB, D // NB]."""
    counts, centres, radii = groups
    for name, t in (("q", q), ("centres", centres), ("radii", radii), ("log_z_kept_lower", log_z_kept_lower)):
        _check_finite(name, t)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    if centres.dim() != 4 or centres.shape[0] != B or centres.shape[3] != D:
        raise ValueError(f"centres must be [B={B}, Hkv, G, D={D}], got {tuple(centres.shape)}")
    Hkv, G = centres.shape[1], centres.shape[2]
    if H % Hkv:
        raise ValueError(f"H={H} is not a multiple of Hkv={Hkv}")
    if counts.shape != (B, Hkv, G) or counts.is_floating_point() or (counts < 0).any():
        raise ValueError(f"counts must be nonnegative integers [B, Hkv, G]={(B, Hkv, G)}, got {tuple(counts.shape)}")
    if bands.dim() != 2 or bands.numel() != D:
        raise ValueError(f"bands must be [NB, D/NB] covering D={D}, got {tuple(bands.shape)}")
    if radii.shape != (B, Hkv, G, bands.shape[0]) or (radii < 0).any():
        raise ValueError(f"radii must be nonnegative [B, Hkv, G, NB]={(B, Hkv, G, bands.shape[0])}")
    if log_z_kept_lower.shape != (B, H):
        raise ValueError(f"log_z_kept_lower must be [B, H]={(B, H)}, got {tuple(log_z_kept_lower.shape)}")
    if not (float(scale) > 0 and float(scale) < float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if D > 4096 or G > MAX_TERMS:
        raise ValueError(f"D={D} > 4096 or G={G} > 2^20: outside the proven margins")
    s = float(scale)
    rep = H // Hkv
    q64 = q.double()                                                        # exact
    mu = centres.double().repeat_interleave(rep, 1)                         # [B, H, G, D], exact
    R = radii.double().repeat_interleave(rep, 1)                            # [B, H, G, NB], exact
    n = counts.double().repeat_interleave(rep, 1)                           # [B, H, G], exact (< 2^53)
    dot = torch.einsum("bhd,bhgd->bhg", q64, mu)
    absdot = torch.einsum("bhd,bhgd->bhg", q64.abs(), mu.abs())
    rad = torch.einsum("bhn,bhgn->bhg", _band_norms_up(q64, bands), R)
    # dot and rad are sums of <= D terms: error <= gamma_D (sum of |terms|) <= REL/8 (absdot + rad);
    # the addition and the product by s add relative u each. REL (absdot + rad) covers all of it.
    a = s * (dot + rad) + s * REL * (absdot + rad)                          # a_g >= s<q,mu_g> + s sum ||q_b|| R_gb
    logn = torch.where(n > 0, n.log(), torch.full_like(n, -float("inf")))
    t = logn + a                                                            # log of group g's term
    m = t.amax(-1, keepdim=True)                                           # [B, H, 1]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ssum = (t - m_safe).exp().sum(-1)                                      # in [1, G] when any group is nonempty
    lsum = ssum.clamp_min(1).log()
    m0 = m_safe[..., 0]
    # log n_g, t - m, exp, the G-term sum and log each err by a few u relative (exp and log
    # of libm are within 1 ulp): log U errs by < REL (1 + |m| + |log ssum|) for G <= 2^20.
    log_u = m0 + lsum + REL * (1 + m0.abs() + lsum)
    lzk = log_z_kept_lower.double()
    d = log_u - lzk + REL * (1 + log_u.abs() + lzk.abs())                  # the subtraction errs by u |.|
    empty = ~torch.isfinite(m[..., 0])                                     # nothing evicted: U = 0, TV = 0
    return torch.where(empty, torch.full_like(d, -float("inf")), d)


def log_z_kept_lower(q, keys, scale, *, valid=None, c=None):
    """A lower bound on log Z_K = log sum_{j in K} e^{x_j}, fp64 [B, H].

    q: [B, H, D]; keys: [B, Hkv, N, D] the kept keys as stored; valid: bool [B, N] or
    [B, Hkv, N] (False = padding, not in K); c: optional [B, H, N] logit error bounds of the
    stored keys (quantized cache): Z_K >= sum_K e^{x~_j - c_j} (T7d)."""
    _check_finite("q", q)
    _check_finite("keys", keys)
    B, H, D = q.shape
    if keys.dim() != 4 or keys.shape[0] != B or keys.shape[3] != D or H % keys.shape[1]:
        raise ValueError(f"keys must be [B={B}, Hkv, N, D={D}] with Hkv dividing H, got {tuple(keys.shape)}")
    Hkv, N = keys.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(H // Hkv, 1)                        # [B, H, N, D]
    q64 = q.double()
    x = float(scale) * torch.einsum("bhd,bhnd->bhn", q64, k)
    # dot of D <= 4096 terms and the product by s: error < REL * s * sum|q_i k_i|
    x = x - float(scale) * REL * torch.einsum("bhd,bhnd->bhn", q64.abs(), k.abs())
    if c is not None:
        _check_finite("c", c)
        if c.shape != (B, H, N):
            raise ValueError(f"c must be [B, H, N]={(B, H, N)}, got {tuple(c.shape)}")
        x = x - c.double() * (1 + REL)
    if valid is not None:
        v = valid if valid.dim() == 3 else valid[:, None, :].expand(B, Hkv, N)
        v = v.repeat_interleave(H // Hkv, 1)
        x = torch.where(v, x, torch.full_like(x, -float("inf")))
    return log_sum_exp_lower(x)


def log_sum_exp_lower(x):
    """A lower bound on log sum_j e^{x_j} over the last axis of fp64 logits x [..., N] (-inf = not a
    term), fp64 [...]; ValueError when a row has no finite term. Error budget of evict_bound."""
    m = x.amax(-1, keepdim=True)
    if not torch.isfinite(m).all():
        raise ValueError("every row needs at least one kept (valid) token")
    ssum = (x - m).exp().sum(-1)                                           # >= 1: the max term is exp(0)
    lse = m[..., 0] + ssum.log()
    return lse - REL * (1 + m[..., 0].abs() + ssum.log().abs())            # same error budget as evict_bound


def compose_tv(tv_evict, tv_quant):
    """T7d: TV(p, p~^K) <= TV(p, p^K) + TV(p^K, p~^K), capped at 1, rounded up to fp32."""
    _check_finite("tv_evict", tv_evict)
    _check_finite("tv_quant", tv_quant)
    return _round_up_f32((tv_evict.double() + tv_quant.double()).clamp(max=1.0))


def evicted_mass(q, keys, scale, evicted, *, valid=None):
    """Shadow mode: the exact p(E) = TV(p, p^K) (T7a) for full keys [B, Hkv, N, D], in fp64.

    evicted: bool [B, Hkv, N]; valid: bool [B, N] (False = padding). Used by tests and the
    evaluation to check the certificate against the truth; needs the evicted keys."""
    B, H, D = q.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    rep = H // Hkv
    x = float(scale) * torch.einsum("bhd,bhnd->bhn", q.double(), keys.double().repeat_interleave(rep, 1))
    if valid is not None:
        x = torch.where(valid[:, None, :], x, torch.full_like(x, -float("inf")))
    p = torch.softmax(x, -1)
    return (p * evicted.repeat_interleave(rep, 1).double()).sum(-1)


def witness_cost(witness, evicted_tokens, head_dim, kv_bytes_per_elem=2):
    """Witness bytes over the bytes it certifies away (K and V of the evicted tokens)."""
    away = evicted_tokens * 2 * head_dim * kv_bytes_per_elem
    return witness.nbytes / away if away else 0.0
