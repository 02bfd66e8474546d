"""PAGE: gate an evictor on the head-agreement drop (anchors.md section 2).

OUR RECONSTRUCTION: the PAGE paper has no public code; this follows the definition written
in anchors.md section 2, from the abstract. Heads: the seed speaks of attention heads, so by
default g runs over the QUERY heads (9 on SmolLM2: 36 pairs per layer, each head's own
observation-window attention); heads="kv" measures the 3 GQA-averaged KV heads instead (the
first version). Per layer l and head g take the SnapKV
observation-window scores s^{l,g} over the candidate prefix tokens (sinks and the recent
window excluded: they are kept anyway) and the kept sets T^{l,g} = TopK(s^{l,g}, k) at the
evictor's budget k (the tokens chosen by score, at least half the non-sink budget). Then

    a_l   = mean over pairs g < g' of Jaccard(T^{l,g}, T^{l,g'}),
    a~_l  = (a_l - J0) / (1 - J0),   J0 = k / (2N - k)   (chance level for N candidates),
    D     = mean(a~_l, first third of layers) - mean(a~_l, last third of layers),

and the gate evicts iff D >= tau; otherwise it keeps the full cache. tau is calibrated once
per model and budget on unlabelled prompts (`calibrate`): it is the (1 - evict_rate)
quantile of the drops, so the gate evicts on about `evict_rate` of typical prompts.
The decision needs all layers: the scores are collected during the prefill, then decided,
then evicted (fast.policies.evictors.evict).
"""

import json
import math

import torch

from fast.policies.evictors import KERNEL, SINKS, WINDOW, keep_count, positions


def _pooled(s):
    B, Hkv, N = s.shape
    return torch.nn.functional.avg_pool1d(s.reshape(B * Hkv, 1, N), KERNEL, 1, KERNEL // 2,
                                          count_include_pad=False).view(B, Hkv, N)


def layer_agreement(scores, candidates, k):
    """Chance-corrected mean pairwise Jaccard of the per-KV-head top-k sets: [B].

    scores: [B, G, N] (G query or KV heads); candidates: bool [B, N]; k: kept tokens per head
    (1 <= k < N_cand)."""
    B, Hkv, N = scores.shape
    if Hkv < 2:
        raise ValueError("head agreement needs at least 2 KV heads")
    s = scores.float().masked_fill(~candidates[:, None], -float("inf"))
    top = torch.zeros(B, Hkv, N, dtype=torch.bool)
    top.scatter_(2, s.topk(k, -1).indices, True)
    top &= candidates[:, None]
    n = candidates.sum(-1).double()                                      # [B]
    jac = []
    for g in range(Hkv):
        for h in range(g + 1, Hkv):
            inter = (top[:, g] & top[:, h]).sum(-1).double()
            union = (top[:, g] | top[:, h]).sum(-1).double()
            jac.append(inter / union.clamp_min(1))
    a = torch.stack(jac).mean(0)
    j0 = k / (2 * n - k)
    return (a - j0) / (1 - j0).clamp_min(1e-12)


def head_agreement_drop(window_scores, valid, budget, *, sinks=SINKS, window=WINDOW):
    """The drop D [B] from per-layer SnapKV window attention (list of [B, G, N], G heads).

    Returns (drop [B], per-layer agreement [L, B]). Rows where nothing would be evicted
    get drop +inf (the gate then passes the evictor through: it is a no-op)."""
    if any(s is None for s in window_scores):
        raise ValueError("PAGE needs the observation-window scores of every layer (collect 'window')")
    L = len(window_scores)
    if L < 3:
        raise ValueError("PAGE needs at least 3 layers (first and last thirds)")
    N = valid.shape[1]
    pos = positions(valid)
    n = valid.sum(-1, keepdim=True)
    K = keep_count(budget, N)
    sk = min(sinks, K)
    win = min(window, K - sk)
    cand = valid & (pos >= sk) & (pos < n - win)
    # tokens chosen by score; when the window eats most of the budget (e.g. 64 of 64) the
    # agreement is measured at half the non-sink budget instead (our choice; PAGE is silent)
    k = max(K - sk - win, (K - sk) // 2)
    n_cand = int(cand.sum(-1).min())
    if k < 1 or k >= n_cand:
        return torch.full((valid.shape[0],), math.inf, dtype=torch.float64), None
    agree = torch.stack([layer_agreement(_pooled(s), cand, k) for s in window_scores])   # [L, B]
    third = max(1, L // 3)
    return agree[:third].mean(0) - agree[-third:].mean(0), agree


HEADS = ("query", "kv")


class Page:
    """The gate: `drop(...)` then `decide(drop)`; evict iff drop >= tau, decided per batch row.

    heads: "query" (agreement over the query heads, default) or "kv" (GQA-averaged KV heads);
    tau must have been calibrated with the same choice."""

    def __init__(self, tau, heads="query"):
        if not math.isfinite(tau):
            raise ValueError(f"tau must be finite, got {tau}")
        if heads not in HEADS:
            raise ValueError(f"PAGE heads must be one of {', '.join(HEADS)}, got {heads!r}")
        self.tau, self.heads = float(tau), heads
        self.last_drop = None

    def __repr__(self):
        return f"Page(tau={self.tau:.4f}, heads={self.heads})"

    def drop(self, window_scores, valid, evictor):
        """window_scores: per layer [B, G, N] (query heads for heads="query", KV heads for "kv")."""
        d, _ = head_agreement_drop(window_scores, valid, evictor.budget, sinks=evictor.sinks, window=evictor.window)
        self.last_drop = d
        return d

    def decide(self, drop):
        return drop >= self.tau

    @classmethod
    def load(cls, path):
        data = json.loads(open(path).read())
        return cls(data["tau"], data.get("heads", "query"))


def prompt_drop(model, input_ids, budget, *, sinks=SINKS, window=WINDOW, heads="query"):
    """The drop [B] of one prompt batch (runs a prefill collecting the window scores)."""
    from fast.policies.evictors import prefill
    if heads not in HEADS:
        raise ValueError(f"PAGE heads must be one of {', '.join(HEADS)}, got {heads!r}")
    need = "window_heads" if heads == "query" else "window"
    pre = prefill(model, input_ids, needs={need})
    L = len(pre.cache.layers)
    scores = [getattr(pre.layers[l], need) for l in range(L)]
    d, _ = head_agreement_drop(scores, pre.valid, budget, sinks=sinks, window=window)
    return d


def calibrate(drops, evict_rate=0.5):
    """tau from the drops of unlabelled prompts: evict on about `evict_rate` of them."""
    if not 0 < evict_rate < 1:
        raise ValueError(f"evict_rate must lie in (0, 1), got {evict_rate}")
    d = torch.as_tensor([x for x in drops if math.isfinite(x)], dtype=torch.float64)
    if d.numel() == 0:
        raise ValueError("no finite drops to calibrate on (prompts shorter than the budget?)")
    return float(torch.quantile(d, 1 - evict_rate))


def calibrate_model(model, prompts, budget, *, evict_rate=0.5, heads="query"):
    """prompts: list of LongTensor [1, N] -> (tau, drops)."""
    drops = [float(prompt_drop(model, p, budget, heads=heads)[0]) for p in prompts]
    return calibrate(drops, evict_rate), drops
