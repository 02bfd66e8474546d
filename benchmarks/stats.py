"""Small exact statistics for the evaluation tables (pure Python, no scipy).

    wilson(k, n)              95 % Wilson score interval of a rate k/n
    clopper_pearson(k, n)     95 % exact (Clopper-Pearson) interval
    mcnemar(a, b)             exact two-sided McNemar test of paired 0/1 outcomes (binomial on the
                              discordant pairs): (p, a_only, b_only)
    hypergeom_le(x, N, K, n)  P(X <= x), X ~ Hypergeometric(N items, K marked, n drawn): the blind gate
    auroc(pos, neg)           P(score of a positive > a negative), ties half, with a 95 % interval:
                              the wider of Hanley-McNeil and a Wilson interval on min(#pos, #neg)
                              trials (Hanley-McNeil alone collapses to a point at 0 or 1 on tiny samples)
    holm(pvals)               Holm-Bonferroni adjusted p-values (family-wise error 5 %)
"""

import math

Z95 = 1.959963984540054


def wilson(k, n, z=Z95):
    """[lo, hi] of k successes in n trials (None, None when n = 0)."""
    if n == 0:
        return [None, None]
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4)]


def _binom_cdf(k, n, p):
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def _bisect(f, lo, hi, iters=60):
    """Root of an increasing f on [lo, hi]."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k, n, alpha=0.05):
    """Exact interval: lo solves P(X >= k | lo) = alpha/2, hi solves P(X <= k | hi) = alpha/2."""
    if n == 0:
        return [None, None]
    lo = 0.0 if k == 0 else _bisect(lambda p: (1 - _binom_cdf(k - 1, n, p)) - alpha / 2, 0.0, 1.0)
    hi = 1.0 if k == n else _bisect(lambda p: alpha / 2 - _binom_cdf(k, n, p), 0.0, 1.0)
    return [round(lo, 4), round(hi, 4)]


def mcnemar(a, b):
    """Exact McNemar test of paired outcomes a, b (sequences of 0/1 of equal length).

    Returns (two-sided p, #(a=1, b=0), #(a=0, b=1)); p = 1 when there is no discordant pair."""
    if len(a) != len(b):
        raise ValueError("paired outcomes of different lengths")
    ab = sum(1 for x, y in zip(a, b) if x and not y)
    ba = sum(1 for x, y in zip(a, b) if y and not x)
    n = ab + ba
    if n == 0:
        return 1.0, ab, ba
    tail = sum(math.comb(n, i) for i in range(min(ab, ba) + 1)) / 2 ** n
    return min(1.0, 2 * tail), ab, ba


def hypergeom_le(x, N, K, n):
    """P(X <= x) for X ~ Hypergeometric(population N, K marked, n drawn without replacement)."""
    if not (0 <= K <= N and 0 <= n <= N):
        raise ValueError(f"hypergeometric: need 0 <= K, n <= N, got N={N} K={K} n={n}")
    total = math.comb(N, n)
    return sum(math.comb(K, i) * math.comb(N - K, n - i) for i in range(0, min(x, K, n) + 1)) / total


def auroc(pos, neg, z=Z95):
    """(AUROC, [lo, hi]) of scores of positives vs negatives; (None, [None, None]) if a side is empty."""
    pos = [p for p in pos if p is not None and p == p]
    neg = [q for q in neg if q is not None and q == q]
    if not pos or not neg:
        return None, [None, None]
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    a = wins / (len(pos) * len(neg))
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (len(pos) - 1) * (q1 - a * a) + (len(neg) - 1) * (q2 - a * a)) / (len(pos) * len(neg))
    se = math.sqrt(max(var, 0.0))
    m = min(len(pos), len(neg))
    w_lo, w_hi = wilson(a * m, m, z)
    return round(a, 4), [round(max(0.0, min(a - z * se, w_lo)), 4), round(min(1.0, max(a + z * se, w_hi)), 4)]


def holm(pvals):
    """Holm-Bonferroni adjusted p-values, same order as given."""
    m = len(pvals)
    order = sorted(range(m), key=lambda i: pvals[i])
    adj, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvals[i]))
        adj[i] = running
    return adj
