"""The certified eviction gate (issue 22 item 3): evict, and serve an evicted read only where its
certificate says TV <= tau; elsewhere bring evicted tokens back from an offload tier first.

    gate = EvictionGate(0.2)                          # scope="tokens": the fewest tokens back
    gate = EvictionGate(0.2, sketch="int4c", retain=False)   # fetched per read, 4-bit per-channel sketch
    ev = evict(pre, make_evictor("streaming:48"), gate=gate)
    out = decode(model, pre, ev, max_new_tokens=32)   # every read of the evicted cache goes through the gate
    gate.summary()                                    # reads, restores, resident bytes

At eviction time each layer's evicted tokens leave the cache. Their exact keys and values go to
the offload tier (host memory in a server, counted apart from the resident bytes). What stays
resident is a key sketch of each evicted key (`fast.core.pagebox.build_key_sketch`: int8 codes per
token by default, or int4c, 4-bit codes per channel over blocks of 32 evicted tokens, plus the band
witness measured against the exact key; no value).

On every decode read of layer l, and before it is served, the gate bounds each query head's
missed attention mass from resident data only:
  - L: a lower bound on log Z_K over the kept keys and the restored ones (`log_z_kept_lower`,
    exact keys);
  - X: an upper bound on Z_E over the sketch's one-token boxes of the tokens still out (T7l, T7j);
  - TV(p, p^K) = p(E) <= X / (L + X) (T7a, T7b, T7k; any partition of the tokens into read and
    not read).
Where the bound exceeds tau for a query head, tokens of its KV head come back from the offload
tier. With retain=True (the default) they stay resident for the rest of the generation; with
retain=False each read fetches what it needs into a buffer, dropped after the read. What comes back:
  - scope="tokens": those with the largest sketch upper logits, as few as bring the bound of the
    rest to <= tau;
  - "head": all of the KV head's evicted tokens;
  - "layer": the row's whole layer;
  - "input": the row's whole cache.
The bound is then recomputed for the set actually read, and that is the bound served. If
rounding at the edge leaves it above tau, the whole KV head comes back (TV 0). So every read
served has certified TV <= tau.

The read itself is computed here in fp32 (softmax over the kept slots and the restored tokens),
not by the model's attention. A multi-token read over the evicted cache (a question prefilled after
the context, kvpress's protocol: decode(question=)) is certified row by row, each row a read of the
kept slots and the question's tokens up to it (causal), the evicted tokens preceding every row; one
record per row. Quantized kept keys (CertifiedCache) are refused, because L here comes from exact keys.

Bytes are counted at fp16 for K+V, 4*D bytes per token and KV head, so rows compare with
evict_eval. Resident: the kept slots and decode tokens, the restored tokens (retain=True) or the
largest one-layer fetch buffer of the step (retain=False), and the sketches of the tokens still
out. With retain=False the step's traffic from the offload tier is counted too (fetch_bytes).
In this implementation the offloaded tensors share the process's memory (the tier is simulated,
with its bytes counted apart), and the sketch is decoded at every read.
"""

import math

import torch

from fast.core.evict import log_z_kept_lower, tv_from_log_odds
from fast.core.pagebox import SKETCH_SCHEMES, build_key_sketch, log_odds_of, log_sum_upper, page_upper

SCOPES = ("tokens", "head", "layer", "input")
MARGIN = 1e-6   # the restore choice aims this many nats below tau; the bound served is recomputed anyway


class EvictionGate:
    """Per-read certified gate over an evicted cache; see the module docstring.

    tau in [0, 1]: the largest certified TV served. scope: what a breach restores: "tokens" (the
    evicted tokens of the breaching KV head with the largest sketch upper logits, fewest first,
    until the bound of what stays out is <= tau), "head" (all of that KV head's evicted tokens),
    "layer" (the row's layer), "input" (the row's whole cache). sketch: the per-token codec of the
    resident key sketch (int8, int4, fp8_e4m3, fp8_e5m2, int4c). retain: restored tokens stay resident
    for the rest of the generation (True), or each read fetches what it needs and drops it after the read
    (False: the resident set is the kept slots and the sketches; the fetched K+V are a transient buffer
    of one layer's read, and traffic from the offload tier each step). keep_queries: also record every
    read's queries (an independent truth can then be computed from exact keys: benchmarks.evict_gate, tests)."""

    def __init__(self, tau, *, scope="tokens", sketch="int8", num_bands=8, retain=True, keep_queries=False):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or not 0 <= tau <= 1:
            raise ValueError(f"tau must be a number in [0, 1], got {tau!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        if not isinstance(retain, bool) or (not retain and scope == "input"):
            raise ValueError(f"retain must be True or False (False: each read fetches its own tokens, so scope "
                             f"'input', which restores later layers ahead of their reads, needs retain=True); got "
                             f"retain={retain!r}, scope={scope!r}")
        if sketch not in SKETCH_SCHEMES:
            raise ValueError(f"sketch must be one of {', '.join(SKETCH_SCHEMES)}, got {sketch!r}")
        self.retain = retain
        self.tau, self.scope, self.sketch_scheme, self.num_bands = float(tau), scope, sketch, num_bands
        self.keep_queries = keep_queries
        self.layers = []          # per layer: index, valid, keys, values [B, Hkv, E, .], sketch, restored [B, Hkv, E]
        self.valid_now = None     # [B, Nk] the kept layout and the decode tokens (set by decode)
        self.steps = []           # per decode step: dict of [L, B, ...] tensors
        self._step = None
        self.head_dim = None

    # ------------------------------------------------------------ eviction time

    def offload(self, keys, values, valid, keep):
        """Move one layer's evicted tokens out: keys/values [B, Hkv, N, D] exact as cached, valid
        bool [B, N] the prefill's real tokens, keep [B, Hkv, K] the kept slots. Called by evict
        before the cache shrinks, once per layer in order."""
        from fast.core.rope import rope_bands
        from fast.policies.evictors import evicted_index
        if keys.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the eviction gate needs exact fp32/fp16/bf16 keys, got {keys.dtype}")
        B, Hkv, N, D = keys.shape
        self.head_dim = D
        idx, ok = evicted_index(valid, keep, Hkv)
        take = lambda t: t.gather(2, idx[..., None].expand(-1, -1, -1, t.shape[-1])).clone()
        bands = rope_bands(D, self.num_bands, "rotate_half")
        sketch = build_key_sketch(keys, idx, bands, scheme=self.sketch_scheme, evict_valid=ok) if bool(ok.any()) else None
        self.layers.append({"index": idx, "valid": ok, "keys": take(keys), "values": take(values), "sketch": sketch,
                            "n_prefill": N, "restored": torch.zeros_like(ok)})

    # ------------------------------------------------------------ decode time

    def begin_step(self, valid_now):
        """decode calls this before each single-token forward with the 2D mask of the kept layout."""
        self.valid_now = valid_now
        self._step = {}
        self._rows = None

    def begin_rows(self, valid_now, rows_visible):
        """decode calls this before a multi-token forward over the evicted cache (a question prefilled after
        the context, kvpress's protocol): valid_now [B, Nk] the kept layout followed by the T new tokens,
        rows_visible [T, B, Nk] what row t may read (the kept slots, and the new tokens up to t: causal)."""
        self.begin_step(valid_now)
        self._rows = rows_visible

    def read(self, layer, query, key, value, scale):
        """The gated read of `layer`: query [B, H, T, D], key/value [B, Hkv, Nk, D] the resident
        cache (kept slots, decode or question tokens). Returns the attention output [B, T, H, D].
        T = 1: a decode step (begin_step); T > 1: the rows of begin_rows, each certified as a read of its
        own (its visible resident tokens; the evicted tokens precede every row), in order, so a token one
        row brings back is read by the later rows of the same call too."""
        if self._step is None:
            raise RuntimeError("EvictionGate.read outside a decode step (decode drives the gate)")
        T = query.shape[2]
        if (T > 1) != (self._rows is not None) or (self._rows is not None and self._rows.shape[0] != T):
            raise RuntimeError(f"EvictionGate.read: {T} query rows, but the step was begun for "
                               f"{1 if self._rows is None else self._rows.shape[0]} (decode drives the gate)")
        st = self.layers[layer]
        if not self.retain:                                  # nothing fetched by an earlier read stays
            st["restored"] = torch.zeros_like(st["valid"])
        outs, recs = [], []
        for t in range(T):
            vis = self.valid_now if self._rows is None else self._rows[t]
            out, rec = self._one(st, query[:, :, t], key, value, scale, vis)
            outs.append(out)
            recs.append(rec)
        self._step[layer] = recs
        return torch.cat(outs, 1)

    def _one(self, st, q, key, value, scale, vis):
        """One row's gated read: q [B, H, D], vis [B, Nk] the resident tokens it reads. (out [B, 1, H, D], record)."""
        with torch.no_grad():
            # the sketch's upper logits a_j >= s<q, k_j> (T7l), once per read: they depend on q only
            a = page_upper(q, st["sketch"].boxes(), scale) if st["sketch"] is not None else None
            bound = self._bound(q, key, st, scale, a, vis)
            served = bound
            if bool(bound.gt(self.tau).any()):
                self._restore(st, bound, a, self._log_z(q, key, st, scale, vis))
                served = self._bound(q, key, st, scale, a, vis)
                still = self._by_kv(served > self.tau)      # rounding at the edge: the whole KV head comes back
                if bool(still.any()):
                    st["restored"] |= still[..., None] & st["valid"]
                    served = self._bound(q, key, st, scale, a, vis)
            out = _read(q, key, value, vis, st, scale)
        pos = torch.zeros(st["index"].shape[:2] + (st["n_prefill"],), dtype=torch.bool)
        pos.scatter_(2, st["index"], st["restored"] & st["valid"])
        return out, {"bound": bound, "served": served, "restored": pos,
                     "fetched": (st["restored"] & st["valid"]).sum((1, 2)).double(),
                     **({"query": q.detach().float().clone()} if self.keep_queries else {})}

    def _by_kv(self, per_query_head):
        """[B, H] -> [B, Hkv]: any query head of the KV head."""
        B, H = per_query_head.shape
        Hkv = self.layers[0]["valid"].shape[1]
        return per_query_head.view(B, Hkv, H // Hkv).any(-1)

    def _log_z(self, q, key, st, scale, vis):
        """log_z_kept_lower over the visible resident slots vis [B, Nk] and the restored tokens (exact keys) [B, H]."""
        back = st["valid"] & st["restored"]
        if not bool(back.any()):                             # nothing read back: the kept slots alone
            return log_z_kept_lower(q, key, scale, valid=vis)
        B, Hkv, Nk = key.shape[0], key.shape[1], key.shape[2]
        ok = torch.cat([vis[:, None, :].expand(B, Hkv, Nk), back], 2)
        return log_z_kept_lower(q, torch.cat([key, st["keys"].to(key.dtype)], 2), scale, valid=ok)

    def _bound(self, q, key, st, scale, a, vis):
        """Certified TV [B, H] of the read over the kept slots and the restored tokens: L over their
        exact keys, X = sum of e^{a_j} over the sketch's tokens still out (T7l, T7j, T7k); a [B, H, E]
        the sketch's upper logits (None: nothing evicted in this layer, TV = 0 by T7a)."""
        if a is None:
            return torch.zeros(q.shape[:2], dtype=torch.float64)
        rep = q.shape[1] // st["valid"].shape[1]
        out = (st["valid"] & ~st["restored"]).double().repeat_interleave(rep, 1)
        d = log_odds_of(log_sum_upper(out, a), self._log_z(q, key, st, scale, vis))
        bound = tv_from_log_odds(d).double()
        if not bool(torch.isfinite(bound).all()):
            raise ValueError("the eviction certificate is not finite (NaN/Inf in the query or keys)")
        return bound

    def _restore(self, st, bound, a, lz):
        """Bring tokens back from the offload tier where the bound exceeds tau (st: the layer's state)."""
        breach = bound > self.tau                            # [B, H]
        kv = self._by_kv(breach)
        if self.scope == "tokens":
            st["restored"] |= self._fewest(st, breach, a, lz) & st["valid"]
        elif self.scope == "head":
            st["restored"] |= kv[..., None] & st["valid"]
        elif self.scope == "layer":
            st["restored"] |= kv.any(-1)[:, None, None] & st["valid"]
        else:                                                # every layer of the row, from this read on
            rows = kv.any(-1)[:, None, None]
            for other in self.layers:
                other["restored"] |= rows & other["valid"]

    def _fewest(self, st, breach, a, lz):
        """[B, Hkv, E]: per breaching query head, the tokens still out with the largest upper logits,
        as few as make sum of e^a over the rest <= tau/(1 - tau) L (L from the current resident set;
        the restored tokens only raise it); the union over the query heads of each KV head."""
        B, H, E = a.shape
        Hkv = st["valid"].shape[1]
        rep = H // Hkv
        out = (st["valid"] & ~st["restored"]).repeat_interleave(rep, 1)
        a = a.masked_fill(~out, -float("inf"))
        order = a.argsort(-1, descending=True)
        sa = a.gather(-1, order)
        tail = sa.flip(-1).logcumsumexp(-1).flip(-1)         # tail[m] = log sum_{i >= m} e^{sa_i}
        target = (math.log(self.tau / (1 - self.tau)) if 0 < self.tau < 1 else -math.inf) + lz - MARGIN
        m = (tail > target[..., None]).sum(-1)               # the tail sums decrease: the first m fail
        m = torch.where(breach, m, torch.zeros_like(m))
        pick = torch.zeros_like(out)
        pick.scatter_(-1, order, torch.arange(E).expand(B, H, E) < m[..., None])
        return pick.view(B, Hkv, rep, E).any(2)

    def end_step(self):
        """decode calls this after each forward; refuses a step in which a layer was not read through the gate.
        One record per row read (a decode step: one; begin_rows: its T rows, in order, each marked "row")."""
        missing = [l for l in range(len(self.layers)) if l not in self._step]
        if missing:
            raise RuntimeError(f"layers {missing} were read without the eviction gate (an attention path that "
                               "bypasses it): refusing to serve uncertified reads")
        L, per_token = len(self.layers), 4 * self.head_dim
        resident, full = self.nbytes()
        fetched_before = None
        for t in range(len(self._step[0])):
            step = {k: torch.stack([self._step[l][t][k] for l in range(L)]) for k in self._step[0][t]}
            step["resident_bytes"], step["full_bytes"] = resident, full
            if self.retain:
                step["fetch_bytes"] = torch.zeros_like(full)
            else:  # traffic: what this row fetched beyond the rows before it in the same call; peak: one layer's buffer
                new = step["fetched"] - (0 if fetched_before is None else fetched_before)
                step["fetch_bytes"] = new.sum(0) * per_token
                step["resident_bytes"] = resident + step["fetched"].amax(0) * per_token
                fetched_before = step["fetched"]
            if self._rows is not None:
                step["row"] = t
            self.steps.append(step)
        self._step = None
        self._rows = None

    # ------------------------------------------------------------ accounting

    def nbytes(self):
        """(resident, full) bytes per row [B] now, K+V at fp16: the kept slots and decode tokens, the
        restored tokens' K+V (retain=True), the sketches of the tokens still out; full = every token."""
        per_token = 4 * self.head_dim                   # fp16 K + V of one token of one KV head
        kept = self.valid_now.sum(-1).double()          # [B] real kept slots and decode tokens
        resident = torch.zeros_like(kept)
        full = torch.zeros_like(kept)
        for st in self.layers:
            Hkv = st["valid"].shape[1]
            sk = st["sketch"]
            per_slot = sk.nbytes / sk.valid.numel() if sk is not None else 0.0
            back = (st["valid"] & st["restored"]).sum((1, 2)).double() if self.retain else 0.0
            out = st["valid"].sum((1, 2)).double() - back
            resident += kept * Hkv * per_token + back * per_token + out * per_slot
            full += (kept * Hkv + back + out) * per_token
        return resident, full

    def summary(self):
        """Reads, restores and bytes of the generation so far (per row lists where B > 1)."""
        if not self.steps:
            return {"tau": self.tau, "scope": self.scope, "reads": 0}
        served = torch.stack([s["served"] for s in self.steps])           # [T, L, B, H]
        bound = torch.stack([s["bound"] for s in self.steps])
        back = self.steps[-1]["restored"]                                 # [L, B, Hkv, N]
        evicted = sum(st["valid"].sum((1, 2)) for st in self.layers)
        ratio = torch.stack([s["resident_bytes"] / s["full_bytes"] for s in self.steps])   # [T, B]
        fetch = torch.stack([s["fetch_bytes"] / s["full_bytes"] for s in self.steps])
        return {"tau": self.tau, "scope": self.scope, "sketch": self.sketch_scheme, "retain": self.retain,
                "fetch_over_full_per_step_mean": fetch.mean(0).tolist(),
                "reads": int(served[..., 0].numel()) * served.shape[-1],
                "max_served_bound": float(served.max()), "max_bound_before_gate": float(bound.max()),
                "restored_tokens": back.sum((0, 2, 3)).tolist(), "evicted_tokens": evicted.tolist(),
                "resident_over_full_mean": ratio.mean(0).tolist(), "resident_over_full_last": ratio[-1].tolist()}


def _read(q, key, value, valid_now, st, scale):
    """softmax attention over the kept slots and the restored tokens (fp32; the offloaded tensors are
    read only when some token came back)."""
    B, H, D = q.shape
    Hkv, Nk = key.shape[1], key.shape[2]
    rep = H // Hkv
    back = st["valid"] & st["restored"]
    mask = valid_now[:, None, :].expand(B, Hkv, Nk)
    kk, vv = key.float(), value.float()
    if bool(back.any()):
        kk = torch.cat([kk, st["keys"].float()], 2)
        vv = torch.cat([vv, st["values"].float()], 2)
        mask = torch.cat([mask, back], 2)
    kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
    x = float(scale) * torch.einsum("bhd,bhnd->bhn", q.float(), kk)
    x = x.masked_fill(~mask.repeat_interleave(rep, 1), -float("inf"))
    out = torch.einsum("bhn,bhnd->bhd", torch.softmax(x, -1), vv)
    return out[:, None].to(value.dtype)
