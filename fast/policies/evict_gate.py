"""The certified eviction gate (issue 22 item 3): evict, and serve an evicted read only where its
certificate says TV <= tau; elsewhere restore the evicted tokens from an offload tier first.

    gate = EvictionGate(0.05)                         # scope="head": per (row, layer, KV head)
    ev = evict(pre, make_evictor("snapkv:192"), gate=gate)
    out = decode(model, pre, ev, max_new_tokens=32)   # every single-token read goes through the gate
    gate.summary()                                    # reads, restores, resident bytes

At eviction time each layer's evicted tokens leave the cache. Their exact keys and values go to
the offload tier (host memory in a server, counted apart from the resident bytes). What stays
resident is an int8 key sketch of each evicted key (`fast.core.pagebox.build_key_sketch`: codes
plus the band witness measured against the exact key, no value).

On every decode read of layer l, and before it is served, the gate bounds each query head's
evicted attention mass from the resident data only:
  - L: a lower bound on log Z_K over the kept keys (`log_z_kept_lower`, exact keys);
  - X: an upper bound on Z_E over the sketch's one-token boxes (T7l, T7j);
  - TV(p, p^K) = p(E) <= X / (L + X) (T7a, T7b, T7k).
Where this bound exceeds tau for a query head, its KV head is restored: the offloaded keys and
values rejoin it, and it stays restored for the rest of the generation. scope="layer" restores
the row's whole layer, and scope="input" the row's whole cache. A restored head reads every token
the prompt and the decode wrote, so its read is the full one (TV 0). Every read served therefore
has certified TV <= tau: the bound where the head stayed evicted, 0 where it was restored.

The read itself is computed here in fp32 (softmax over the kept slots, plus the offloaded ones of
the restored heads), not by the model's attention. Reads with more than one query (a question
prefilled over the evicted cache) are not certified by this gate, so decode refuses them.
Quantized kept keys (CertifiedCache) are refused as well: this gate assumes L is computed from
exact keys.

Bytes are counted at fp16 for K+V, 4*D bytes per token and KV head, so rows compare with
evict_eval: the kept slots, the sketches of heads not restored, the offloaded K+V of restored heads.
"""

import math

import torch

from fast.core.evict import log_z_kept_lower, tv_from_log_odds
from fast.core.pagebox import build_key_sketch, pagebox_log_odds

SCOPES = ("head", "layer", "input")


class EvictionGate:
    """Per-read certified gate over an evicted cache; see the module docstring.

    tau in [0, 1]: the largest certified TV served; scope: what a breach restores (head, layer,
    input); sketch: the per-token codec of the resident key sketch (int8, int4, fp8_e4m3, fp8_e5m2);
    keep_queries: also record every read's queries (an independent truth can then be computed
    from exact keys: benchmarks.evict_gate, tests)."""

    def __init__(self, tau, *, scope="head", sketch="int8", num_bands=8, keep_queries=False):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or not 0 <= tau <= 1:
            raise ValueError(f"tau must be a number in [0, 1], got {tau!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.tau, self.scope, self.sketch_scheme, self.num_bands = float(tau), scope, sketch, num_bands
        self.keep_queries = keep_queries
        self.layers = []          # per layer: dict(index, valid, keys, values, sketch, restored)
        self.valid_now = None     # [B, Nk] the kept layout and the decode tokens (set by decode)
        self.steps = []           # per decode step: dict of [L, B, H] / [L, B, Hkv] tensors
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
        self.layers.append({"valid": ok, "keys": take(keys), "values": take(values), "sketch": sketch,
                            "restored": torch.zeros(B, Hkv, dtype=torch.bool)})

    # ------------------------------------------------------------ decode time

    def begin_step(self, valid_now):
        """decode calls this before each single-token forward with the 2D mask of the kept layout."""
        self.valid_now = valid_now
        self._step = {}

    def read(self, layer, query, key, value, scale):
        """The gated read of `layer`: query [B, H, 1, D], key/value [B, Hkv, Nk, D] the resident
        cache (kept slots and decode tokens). Returns the attention output [B, 1, H, D]."""
        if self._step is None:
            raise RuntimeError("EvictionGate.read outside a decode step (decode drives the gate)")
        st = self.layers[layer]
        q = query[:, :, 0]
        B, H, D = q.shape
        Hkv = key.shape[1]
        rep = H // Hkv
        with torch.no_grad():
            if st["sketch"] is None:                         # nothing evicted in this layer: TV = 0 (T7a)
                bound = torch.zeros(B, H, dtype=torch.float64)
            else:
                lz = log_z_kept_lower(q, key, scale, valid=self.valid_now)
                bound = tv_from_log_odds(pagebox_log_odds(q, st["sketch"].boxes(), lz, scale)).double()
            if not bool(torch.isfinite(bound).all()):
                raise ValueError(f"layer {layer}: the eviction certificate is not finite (NaN/Inf in the query or keys)")
            breach = (bound > self.tau).view(B, Hkv, rep).any(-1)           # [B, Hkv]
            self._restore(layer, breach)
            restored = st["restored"]
            served = torch.where(restored.repeat_interleave(rep, 1), torch.zeros_like(bound), bound)
            out = _read(q, key, value, self.valid_now, st, scale)
        self._step[layer] = {"bound": bound, "served": served, "restored": restored.clone(),
                             **({"query": q.detach().float().clone()} if self.keep_queries else {})}
        return out

    def _restore(self, layer, breach):
        if self.scope == "layer":
            breach = breach.any(-1, keepdim=True).expand_as(breach)
        if self.scope == "input":
            rows = breach.any(-1)
            for st in self.layers:                       # every layer of the row, from this read on
                st["restored"] |= rows[:, None]
        else:
            self.layers[layer]["restored"] |= breach

    def end_step(self):
        """decode calls this after each forward; refuses a step in which a layer was not read through the gate."""
        missing = [l for l in range(len(self.layers)) if l not in self._step]
        if missing:
            raise RuntimeError(f"layers {missing} were read without the eviction gate (an attention path that "
                               "bypasses it): refusing to serve uncertified reads")
        step = {k: torch.stack([self._step[l][k] for l in range(len(self.layers))]) for k in self._step[0]}
        step["resident_bytes"], step["full_bytes"] = self.nbytes()
        self.steps.append(step)
        self._step = None

    # ------------------------------------------------------------ accounting

    def nbytes(self):
        """(resident, full) bytes per row [B] now, K+V at fp16: the kept slots and decode tokens,
        the sketches of heads not restored, the offloaded K+V of restored heads; full = every token."""
        per_token = 4 * self.head_dim                   # fp16 K + V of one token of one KV head
        kept = self.valid_now.sum(-1).double()          # [B] real kept slots and decode tokens
        resident = torch.zeros_like(kept)
        full = torch.zeros_like(kept)
        for st in self.layers:
            n_ev = st["valid"].sum(-1).double()         # [B, Hkv] real evicted tokens
            Hkv = n_ev.shape[1]
            sk = st["sketch"]
            per_slot = sk.nbytes / sk.valid.numel() if sk is not None else 0.0
            back = st["restored"].double()
            resident += kept * Hkv * per_token + (n_ev * (back * per_token + (1 - back) * per_slot)).sum(-1)
            full += (kept * Hkv + n_ev.sum(-1)) * per_token
        return resident, full

    def summary(self):
        """Reads, breaches and bytes of the generation so far (per row lists where B > 1)."""
        if not self.steps:
            return {"tau": self.tau, "scope": self.scope, "reads": 0}
        served = torch.stack([s["served"] for s in self.steps])           # [T, L, B, H]
        bound = torch.stack([s["bound"] for s in self.steps])
        last = self.steps[-1]
        ratio = torch.stack([s["resident_bytes"] / s["full_bytes"] for s in self.steps])   # [T, B]
        return {"tau": self.tau, "scope": self.scope, "sketch": self.sketch_scheme,
                "reads": int(served[..., 0].numel()),
                "max_served_bound": float(served.max()), "max_bound_before_gate": float(bound.max()),
                "restored_heads": last["restored"].sum((0, 2)).tolist(),
                "heads": int(last["restored"][:, 0].numel()),
                "resident_over_full_mean": ratio.mean(0).tolist(), "resident_over_full_last": ratio[-1].tolist()}


def _read(q, key, value, valid_now, st, scale):
    """softmax attention over the kept slots and, for restored heads, the offloaded tokens (fp32)."""
    B, H, D = q.shape
    Hkv, Nk = key.shape[1], key.shape[2]
    rep = H // Hkv
    kk = torch.cat([key.float(), st["keys"].float()], 2).repeat_interleave(rep, 1)
    vv = torch.cat([value.float(), st["values"].float()], 2).repeat_interleave(rep, 1)
    mask = torch.cat([valid_now[:, None, :].expand(B, Hkv, Nk), st["valid"] & st["restored"][..., None]], 2)
    x = float(scale) * torch.einsum("bhd,bhnd->bhn", q.float(), kk)
    x = x.masked_fill(~mask.repeat_interleave(rep, 1), -float("inf"))
    out = torch.einsum("bhn,bhnd->bhd", torch.softmax(x, -1), vv)
    return out[:, None].to(value.dtype)
