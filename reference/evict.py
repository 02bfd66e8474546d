"""Eviction certificates (math.md T7), exact at 60 digits.

Kept set K, evicted set E, p = softmax of all logits, p^K = softmax over K only.
Group radii are upper bounds that must never come out low: they are computed in interval
arithmetic (mpmath.iv) and the upper end is returned.
"""
from mpmath import exp, fsum, iv, log, mpf, workdps

from reference.band import band_norms, check_partition, iv_digits, witness

DPS = 60


@workdps(DPS)
def evict_tv(x, kept):
    """TV(p, p^K) = p(E) = Z_E / (Z_K + Z_E), Z_S = sum_{j in S} e^{x_j} (spec T7a).

    x: the logits of every token (kept and evicted); kept: the indices of K (non-empty).
    """
    xs = [mpf(v) for v in x]
    keep = set(kept)
    if not keep or len(keep) != len(kept) or not keep <= set(range(len(xs))):
        raise ValueError(f"kept must be distinct indices into x, at least one (got {kept})")
    top = max(xs)
    z_kept = mpf(0)
    z_evicted = mpf(0)
    for j, v in enumerate(xs):
        if j in keep:
            z_kept += exp(v - top)
        else:
            z_evicted += exp(v - top)
    return z_evicted / (z_kept + z_evicted)


@workdps(DPS)
def group_witness(keys, bands):
    """(n_g, mu_g, radii_g) for one group of evicted keys (spec T7c).

    mu_g = the mean key (60 digits; any centre is sound as long as the radii are measured
    from it), radii_g[b] >= max_j ||(k_j - mu_g)_b||, each an interval upper end.
    """
    if not keys:
        raise ValueError("group_witness: empty group")
    D = len(keys[0])
    check_partition(bands, D)
    mu = [mpf(0)] * D
    for k in keys:
        if len(k) != D:
            raise ValueError("group_witness: keys of different lengths")
        mu = [m + mpf(v) for m, v in zip(mu, k)]
    mu = [m / len(keys) for m in mu]
    radii = [mpf(0)] * len(bands)
    for k in keys:
        radii = [max(r, w) for r, w in zip(radii, witness(k, mu, bands))]
    return len(keys), mu, radii


@workdps(DPS)
def evict_bound(q, groups, log_z_kept_lower, scale, bands):
    """U / (L + U) >= TV(p, p^K) (spec T7b, T7c), for any query q.

    groups: a list of (n_g, mu_g, radii_g) covering the evicted tokens, with
    radii_g[b] >= ||(k_j - mu_g)_b|| for every j in g. Then
    U = sum_g n_g exp(s <q, mu_g> + s sum_b ||q_b|| R_{g,b}) >= Z_E (T7c) and
    L = exp(log_z_kept_lower) must be <= Z_K (for instance the exact log Z_K, or
    log sum_{j in K} e^{x~_j - c_j} under quantization, T7d). No groups: returns 0.
    """
    s = mpf(scale)
    if not s >= 0:
        raise ValueError(f"scale must be >= 0 (got {scale})")
    q_norms = band_norms(q, bands)
    upper = mpf(0)
    for n_g, mu, radii in groups:
        if n_g < 0 or len(mu) != len(q) or len(radii) != len(bands) or min(radii) < 0:
            raise ValueError(f"evict_bound: malformed group (n={n_g}, |mu|={len(mu)}, radii={radii})")
        centre = mpf(0)
        for qi, mi in zip(q, mu):
            centre += mpf(qi) * mpf(mi)
        spread = mpf(0)
        for qb, rb in zip(q_norms, radii):
            spread += qb * mpf(rb)
        upper += n_g * exp(s * centre + s * spread)
    lower = exp(mpf(log_z_kept_lower))
    return upper / (lower + upper)


@workdps(DPS)
def group_witness_of_stored(stored_keys, rho, bands):
    """(n_g, mu_g, radii_g) for one group of evicted keys of a QUANTIZED cache (spec T7e).

    stored_keys: the keys as the cache serves them; rho: per key, its band witness
    (rho[j][b] >= ||(k_j - stored_j)_b|| for the exact key k_j). mu_g = the mean stored key;
    radii_g[b] = max_j ||(stored_j - mu_g)_b|| + rho[j][b], an interval upper end, which is
    >= ||(k_j - mu_g)_b|| for the exact keys (band triangle inequality).
    """
    if len(rho) != len(stored_keys):
        raise ValueError(f"rho has {len(rho)} rows for {len(stored_keys)} keys")
    n_g, mu, _ = group_witness(stored_keys, bands)
    radii = [mpf(0)] * len(bands)
    for k, r in zip(stored_keys, rho):
        if len(r) != len(bands) or min(mpf(v) for v in r) < 0:
            raise ValueError(f"rho: one nonnegative entry per band expected, got {r}")
        spread = witness(k, mu, bands)
        with iv_digits(DPS):
            radii = [max(R, mpf((iv.mpf(w) + iv.mpf(v)).b)) for R, w, v in zip(radii, spread, r)]
    return n_g, mu, radii


@workdps(DPS)
def log_z_kept_lower(q, stored_keys, c, scale):
    """log sum_{j in K} e^{x~_j - c_j} <= log Z_K (spec T7f), x~_j = s <q, stored_j>.

    c[j] >= |x_j - x~_j| (reference.band.logit_error_bound of the stored keys' witness).
    Exact to 60 digits (a lower bound of the exact log Z_K up to that rounding)."""
    if len(c) != len(stored_keys) or not stored_keys:
        raise ValueError(f"c has {len(c)} entries for {len(stored_keys)} kept keys (need >= 1)")
    s = mpf(scale)
    xs = []
    for k, cj in zip(stored_keys, c):
        if len(k) != len(q) or mpf(cj) < 0:
            raise ValueError("log_z_kept_lower: key length != query length, or c < 0")
        xs.append(s * fsum(mpf(a) * mpf(b) for a, b in zip(q, k)) - mpf(cj))
    top = max(xs)
    return top + log(fsum(exp(v - top) for v in xs))


@workdps(DPS)
def page_box(keys):
    """(n_p, lo, hi) of one page of evicted keys (spec T7i): lo_c = min_j k_jc, hi_c = max_j k_jc, exact."""
    if not keys:
        raise ValueError("page_box: empty page")
    D = len(keys[0])
    lo = [mpf(v) for v in keys[0]]
    hi = list(lo)
    for k in keys[1:]:
        if len(k) != D:
            raise ValueError("page_box: keys of different lengths")
        lo = [min(a, mpf(v)) for a, v in zip(lo, k)]
        hi = [max(a, mpf(v)) for a, v in zip(hi, k)]
    return len(keys), lo, hi


@workdps(DPS)
def box_max_logit(q, lo, hi, scale):
    """s sum_c max(q_c lo_c, q_c hi_c): the exact maximum of s<q, k> over lo <= k <= hi (T7i)."""
    if not (len(q) == len(lo) == len(hi)):
        raise ValueError("box_max_logit: q, lo and hi must have the same length")
    total = mpf(0)
    for qc, a, b in zip(q, lo, hi):
        if mpf(a) > mpf(b):
            raise ValueError(f"box_max_logit: lo {a} > hi {b}")
        total += max(mpf(qc) * mpf(a), mpf(qc) * mpf(b))
    return mpf(scale) * total


@workdps(DPS)
def page_box_bound(q, pages, log_z_kept_lower, scale, bands=None):
    """X / (L + X) >= TV(p, p^K) (spec T7j, T7k, T7l), for any query q.

    pages: a list of (n_p, lo_p, hi_p, widen_p) covering the evicted tokens, each token's key
    (as stored) in its page's box; widen_p None (exact keys) or, per band, an upper bound on
    ||(k_j - stored_j)_b|| over the page's tokens (then bands is required). Then
    X = sum_p n_p exp(U_p), U_p = box_max_logit + s sum_b ||q_b|| widen_{p,b} >= Z_E, and
    L = exp(log_z_kept_lower) must be <= Z_K. No pages: returns 0."""
    s = mpf(scale)
    if not s >= 0:
        raise ValueError(f"scale must be >= 0 (got {scale})")
    upper = mpf(0)
    for n_p, lo, hi, widen in pages:
        if n_p < 0:
            raise ValueError(f"page_box_bound: negative count {n_p}")
        u = box_max_logit(q, lo, hi, s)
        if widen is not None:
            if bands is None or len(widen) != len(bands) or min(mpf(v) for v in widen) < 0:
                raise ValueError("page_box_bound: widen needs bands and one nonnegative entry per band")
            u += s * fsum(qb * mpf(w) for qb, w in zip(band_norms(q, bands), widen))
        upper += n_p * exp(u)
    lower = exp(mpf(log_z_kept_lower))
    return upper / (lower + upper)


@workdps(DPS)
def sparse_read_bound(q, keys, read, page_size, scale):
    """The exact page box certificate of one sparse read (spec T7i-T7k; fast.core.sparse): X / (Z_K + X)
    with Z_K the exact kept mass of the read tokens and X = sum over the unread pages of
    n_p exp(U_p), U_p of the exact box of the page's keys. keys: every token's key (one KV head);
    read: the indices read (non-empty); the unread tokens form whole pages of page_size."""
    s = mpf(scale)
    keep = set(read)
    logits = [s * fsum(mpf(a) * mpf(b) for a, b in zip(q, k)) for k in keys]
    z_kept = fsum(exp(logits[j]) for j in keep)
    pages = []
    for a in range(0, len(keys), page_size):
        members = [j for j in range(a, min(a + page_size, len(keys))) if j not in keep]
        if members and len(members) != page_size:
            raise ValueError(f"sparse_read_bound: page at {a} is partly read")
        if members:
            n_p, lo, hi = page_box([keys[j] for j in members])
            pages.append((n_p, lo, hi, None))
    if not pages:
        return mpf(0)
    return page_box_bound(q, pages, log(z_kept), s)


@workdps(DPS)
def attention_over(q, keys, values, read, scale):
    """The exact softmax attention output over the tokens `read` (one query head)."""
    s = mpf(scale)
    logits = {j: s * fsum(mpf(a) * mpf(b) for a, b in zip(q, keys[j])) for j in read}
    top = max(logits.values())
    w = {j: exp(x - top) for j, x in logits.items()}
    z = fsum(w.values())
    return [fsum(w[j] * mpf(values[j][c]) for j in read) / z for c in range(len(values[0]))]
