"""Evictors: SnapKV, H2O, StreamingLLM, TOVA, KNorm, Random, EpiKV behind one interface.

An evictor turns per-layer scores into keep indices [B, Hkv, K] per KV head (higher score =
keep), always keeping `sinks` first tokens and a `window` of recent tokens, at a fixed token
budget (int) or a ratio of the prompt (float in (0, 1)). Padding (left padding, batch > 1)
is never kept in place of a real token. What each method needs is collected during the
prefill forward, and only that:

    snapkv     the last `obs` (64) queries' attention over the keys (an obs x N block per
               layer, never N x N), averaged over the window and the query heads of each KV
               head (GQA), then pooled with a kernel of 5
    h2o        attention accumulated over all queries, computed in chunks of queries
    tova       the last query's attention, averaged over the query heads of each KV head
    knorm      key norms (keep the low-norm keys)
    random     a seeded random score
    streaming  position (sinks + the most recent tokens)
    epikv      residual-stream change e_t^l = ||h_t^{l+1} - h_t^l|| / ||h_t^l|| read with forward
               hooks on the decoder layers, E_t = sum_l w_l e_t^l (negative w on the upper-middle
               layers), causal rolling z-score over W tokens; no attention weights at all
               (our reconstruction of the EpiKV abstract, anchors.md section 3)

Use like kvpress, on a plain transformers model and DynamicCache:

    ev = make_evictor("snapkv:256")
    with ev(model):                       # batch 1: evicts right after the prefill
        model.generate(ids, max_new_tokens=32)
    out = generate(model, ids, mask, evictor=ev, page=gate)   # any batch, left padding, certificate

or step by step: `pre = prefill(model, ids, mask, needs=...)`, `ev = evict(pre, evictor)`, then
`decode(model, pre, ev, ...)`. `generate(..., decode_every=32)` also evicts during decoding
(attention-free methods only: streaming, knorm, random, epikv), for long generations.
The cache shrinks physically (the tensors are gathered); a cache with `keep_tokens(keep)`
(kvcert's CertifiedCache) is asked to do it itself.
"""

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fast.core.evict import build_group_witness, cluster_order, evict_log_odds, evicted_mass, log_z_kept_lower, tv_from_log_odds

OBS = 64        # SnapKV observation window (queries)
KERNEL = 5      # SnapKV pooling kernel
SINKS = 4
WINDOW = 64     # recent tokens always kept
ATTN_NAME = "kvcert_collect"


# ---------------------------------------------------------------- budgets and selection

def keep_count(budget, n):
    """Tokens kept out of n: min(budget, n) for an int budget, ceil(ratio n) for a float."""
    if isinstance(budget, float):
        if not 0 < budget < 1:
            raise ValueError(f"budget ratio must lie in (0, 1), got {budget}")
        return max(1, math.ceil(budget * n))
    if int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be a positive token count or a ratio in (0, 1), got {budget}")
    return min(int(budget), n)


def positions(valid):
    """Index of each token among the real tokens of its row (left padding): [B, N], -1 on padding."""
    return torch.where(valid, valid.long().cumsum(-1) - 1, torch.full_like(valid, -1, dtype=torch.long))


def select(scores, valid, K, sinks, window):
    """Top-K per KV head with sinks and a recent window forced in.

    scores: [B, Hkv, N]; valid: bool [B, N]. Returns (keep [B, Hkv, K] sorted by position,
    kept_valid bool [B, K]). Rows with fewer than K real tokens keep all of them, preceded by
    padding slots (the left-padded layout is preserved)."""
    B, Hkv, N = scores.shape
    pos = positions(valid)                                   # [B, N]
    n = valid.sum(-1, keepdim=True)                          # [B, 1]
    sinks = min(sinks, K)
    window = min(window, K - sinks)
    forced = valid & ((pos < sinks) | (pos >= n - window))
    s = scores.float().masked_fill(forced[:, None], float("inf"))
    s = s.masked_fill(~valid[:, None], -float("inf"))        # padding sits left of every real token,
    keep = s.topk(K, -1).indices.sort(-1).values            # so after sorting it fills the first slots

    kept_valid = torch.arange(K)[None, :] >= K - n.clamp(max=K)
    return keep, kept_valid


# ---------------------------------------------------------------- what the model gives us

@dataclass
class LayerStats:
    """What the prefill collected for one layer (None where not needed)."""
    window: torch.Tensor = None        # [B, Hkv, N] obs-window attention, GQA-averaged
    window_heads: torch.Tensor = None  # [B, H, N] obs-window attention per query head (PAGE)
    accumulated: torch.Tensor = None   # [B, Hkv, N] attention summed over all queries
    last: torch.Tensor = None          # [B, Hkv, N] last query's attention
    change: torch.Tensor = None        # [B, N] residual change e^l of this layer


def _allowed(attention_mask, B, q_len, N, rows):
    """bool [B, 1, len(rows), N] from the 4D mask of the model (bool or additive), or causal."""
    if attention_mask is None:
        q_pos = torch.as_tensor(rows) + (N - q_len)
        return (torch.arange(N)[None, :] <= q_pos[:, None])[None, None].expand(B, 1, -1, -1)
    m = attention_mask[:, :, rows, :]
    return m if m.dtype == torch.bool else m == 0


def _attention_rows(query, key, attention_mask, scale, rows):
    """Softmax of the given query rows over all keys: [B, H, len(rows), N] (fp32)."""
    B, H, q_len, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    q = query[:, :, rows].float().reshape(B, Hkv, -1, D)    # the query heads of each KV head stacked:
    logits = (scale * q @ key.float().transpose(-1, -2)).view(B, H, -1, N)   # no copy of the keys per head
    allowed = _allowed(attention_mask, B, q_len, N, rows)
    logits = logits.masked_fill(~allowed, -float("inf"))
    return torch.softmax(logits, -1).nan_to_num(0.0)        # fully masked (padding) rows -> 0


def _gqa_mean(x, Hkv):
    B, H = x.shape[:2]
    return x.view(B, Hkv, H // Hkv, *x.shape[2:]).mean(2)


class Collector:
    """Active during a forward: computes, per layer, only the statistics in `needs`.

    needs: subset of {"window", "window_heads", "accumulated", "last", "change"}. `on_decode(layer, query,
    key, attention_mask, scale)` is called on every single-token step (certificates). cache: the
    forward's cache, where attention may be handed fewer keys than it holds (kvcert's fused read
    passes only its exact tail): the collector then looks at every key as the cache serves it.
    read(layer, query, key, value, scale): when given, single-token reads (and multi-row ones when read_rows is set) are served by it instead
    of the model's attention (the certified eviction gate, fast.policies.evict_gate)."""

    def __init__(self, needs=(), obs=OBS, chunk=256, on_decode=None, cache=None, read=None):
        self.needs, self.obs, self.chunk, self.on_decode = set(needs), obs, chunk, on_decode
        self.cache, self.layers, self.read = cache, {}, read

    def observe(self, module, query, key, attention_mask, scale):
        layer = module.layer_idx
        lay = self.cache.layers[layer] if self.cache is not None and layer < len(self.cache.layers) else None
        if lay is not None and getattr(lay, "n", key.shape[2]) != key.shape[2]:
            key = lay.served()[0]
        B, H, q_len, D = query.shape
        N, Hkv = key.shape[2], key.shape[1]
        if q_len == 1:
            if self.on_decode is not None:
                self.on_decode(layer, query[:, :, 0], key, attention_mask, scale)
            return
        st = self.layers.setdefault(layer, LayerStats())
        with torch.no_grad():
            if self.needs & {"window", "window_heads"}:
                w = min(self.obs, q_len)
                per_head = _attention_rows(query, key, attention_mask, scale, range(q_len - w, q_len)).mean(2)  # [B, H, N]
                if "window_heads" in self.needs:
                    st.window_heads = per_head
                st.window = _gqa_mean(per_head, Hkv)
            if "last" in self.needs:
                st.last = _gqa_mean(_attention_rows(query, key, attention_mask, scale, [q_len - 1])[:, :, 0], Hkv)
            if "accumulated" in self.needs:
                acc = torch.zeros(B, H, N)
                for a in range(0, q_len, self.chunk):   # chunk x N at a time, never N x N
                    acc += _attention_rows(query, key, attention_mask, scale, range(a, min(a + self.chunk, q_len))).sum(2)
                st.accumulated = _gqa_mean(acc, Hkv)


_LOCAL = threading.local()   # the collectors active in this thread (threads sharing one model each see their own)


_SWITCH = threading.Lock()
_USERS = {}                  # id(model.config) -> [collecting blocks open, the attention implementation before]


def _active():
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def _wrapped(inner_name):
    """An attention function that lets the active collector look, then runs `inner_name`
    (the model's own implementation: sdpa, eager, or kvcert's metered attention)."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        from transformers import AttentionInterface
        if _active():
            col, scale = _active()[-1], kwargs.get("scaling") or module.scaling
            col.observe(module, query, key, attention_mask, scale)
            if col.read is not None and (query.shape[2] == 1 or getattr(col, "read_rows", False)):
                if kwargs.get("sliding_window") or kwargs.get("softcap"):
                    raise ValueError("the eviction gate reads plain softmax attention (no sliding window, no softcap)")
                return col.read(module.layer_idx, query, key, value, scale), None
        if inner_name == "eager":
            import sys as _sys
            inner = _sys.modules[type(module).__module__].eager_attention_forward
        else:
            inner = AttentionInterface._global_mapping[inner_name]
        return inner(module, query, key, value, attention_mask, **kwargs)
    return attention


def _register(inner_name):
    """Register ATTN_NAME-inner under both interfaces (the mask of the inner implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
    name = f"{ATTN_NAME}-{inner_name}"
    if name not in AttentionInterface._global_mapping:
        masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        AttentionInterface.register(name, _wrapped(inner_name))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks.get(inner_name, eager_mask if inner_name == "eager" else sdpa_mask))
    return name


def decoder_layers(model):
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise ValueError("model has no .model.layers: not a decoder-only transformers model")
    return list(inner.layers)


@contextmanager
def collecting(model, collector):
    """Route the model's attention through the collector (the model's own attention underneath)
    and hook the decoder layers."""
    config = model.config
    with _SWITCH:                     # threads sharing the model: the first in routes it, the last out restores
        users = _USERS.get(id(config))
        if users is None:
            old = config._attn_implementation or "sdpa"
            users = _USERS[id(config)] = [0, old]
            config._attn_implementation = _register(old.split("-", 1)[1] if old.startswith(ATTN_NAME + "-") else old)
        users[0] += 1
    hooks = []
    if "change" in collector.needs:
        for i, layer in enumerate(decoder_layers(model)):
            def hook(mod, args, kwargs, out, i=i):
                if collector not in _active():                # another thread's forward
                    return
                h_in = args[0] if args else kwargs["hidden_states"]
                h_out = out[0] if isinstance(out, tuple) else out
                e = (h_out - h_in).float().norm(dim=-1) / h_in.float().norm(dim=-1).clamp_min(1e-12)
                collector.layers.setdefault(i, LayerStats()).change = e.detach()       # [B, N] (N = 1 when decoding)
            hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
    _active().append(collector)
    try:
        yield collector
    finally:
        _active().remove(collector)
        for h in hooks:
            h.remove()
        with _SWITCH:
            users[0] -= 1
            if users[0] == 0:
                config._attn_implementation = users[1]
                del _USERS[id(config)]


# ---------------------------------------------------------------- the evictors

def _option(method, key, value, allowed):
    if value not in allowed:
        raise ValueError(f"{method}: {key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


class Evictor:
    """Shared interface. Subclasses set `name`, `needs` and `scores(keys, stats, valid)`.

    sinks / window: the first `sinks` and the last `window` real tokens are always kept (forced);
    0 and 0 turn forcing off (pure scores). `options` lists a method's convention switches."""
    name = ""
    needs = ()
    options = {}

    def __init__(self, budget, *, sinks=SINKS, window=WINDOW, seed=0):
        keep_count(budget, 10 ** 9)            # validates
        for key, val in (("sinks", sinks), ("window", window)):
            if int(val) != val or val < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {val!r}")
        self.budget, self.sinks, self.window, self.seed = budget, int(sinks), int(window), seed

    def __repr__(self):
        return f"{self.name}:{self.budget}"

    def scores(self, keys, stats, valid):
        """keys: [B, Hkv, N, D]; stats: LayerStats; valid: bool [B, N] -> [B, Hkv, N]."""
        raise NotImplementedError

    def prepare(self, layers, valid):
        """Hook for scores that need every layer (EpiKV); called once before scoring."""

    def keep_index(self, keys, stats, valid):
        K = keep_count(self.budget, keys.shape[2])
        return select(self.scores(keys, stats, valid), valid, K, self.sinks, self.window)

    def __call__(self, model, page=None, **kw):
        """`with evictor(model): model.generate(...)` (batch 1 / no padding)."""
        return evicting(model, self, page=page, **kw)


class SnapKV(Evictor):
    name, needs = "snapkv", ("window",)

    def scores(self, keys, stats, valid):
        s = stats.window                                       # [B, Hkv, N]
        B, Hkv, N = s.shape
        pooled = torch.nn.functional.avg_pool1d(s.reshape(B * Hkv, 1, N), KERNEL, 1, KERNEL // 2, count_include_pad=False)
        return pooled.view(B, Hkv, N)


class H2O(Evictor):
    """norm="sum" (H2O's accumulated attention, the paper's score) or "mean" (divided by the number
    of queries that see the token, n - pos: early tokens no longer win by being seen more often)."""
    name, needs = "h2o", ("accumulated",)
    options = {"norm": ("sum", "mean")}

    def __init__(self, budget, *, norm="sum", **kw):
        super().__init__(budget, **kw)
        self.norm = _option("h2o", "norm", norm, self.options["norm"])

    def scores(self, keys, stats, valid):
        if self.norm == "sum":
            return stats.accumulated
        seen_by = (valid.sum(-1, keepdim=True) - positions(valid)).clamp_min(1)     # [B, N] queries j..n-1
        return stats.accumulated / seen_by[:, None, :]


class TOVA(Evictor):
    """heads="kv" (kvcert: one keep set per KV head, the mean over its query heads) or "all" (the
    TOVA paper: the mean over all query heads, one keep set per layer)."""
    name, needs = "tova", ("last",)
    options = {"heads": ("kv", "all")}

    def __init__(self, budget, *, heads="kv", **kw):
        super().__init__(budget, **kw)
        self.heads = _option("tova", "heads", heads, self.options["heads"])

    def scores(self, keys, stats, valid):
        if self.heads == "kv":
            return stats.last
        return stats.last.mean(1, keepdim=True).expand_as(stats.last)    # equal GQA groups: = mean over H


class KNorm(Evictor):
    name = "knorm"

    def scores(self, keys, stats, valid):
        return -keys.float().norm(dim=-1)


class Random(Evictor):
    name = "random"

    def scores(self, keys, stats, valid):
        g = torch.Generator().manual_seed(self.seed)
        return torch.rand(keys.shape[:3], generator=g)


class StreamingLLM(Evictor):
    name = "streaming"

    def scores(self, keys, stats, valid):
        return torch.arange(keys.shape[2], dtype=torch.float32).expand(keys.shape[:3])


def epikv_weights(L):
    """+1 on the lower half and the top quarter, -1 on the upper-middle quarter, / L."""
    w = torch.ones(L)
    w[L // 2: (3 * L) // 4] = -1.0
    return w / L


def rolling_zscore(E, valid, W):
    """Causal z-score of E [B, N] against the last W real tokens (itself included)."""
    x = torch.where(valid, E.double(), torch.zeros_like(E, dtype=torch.float64))
    c1 = torch.nn.functional.pad(x.cumsum(-1), (W, 0))
    c2 = torch.nn.functional.pad((x * x).cumsum(-1), (W, 0))
    cn = torch.nn.functional.pad(valid.double().cumsum(-1), (W, 0))
    N = E.shape[1]
    n = (cn[:, W:] - cn[:, :N]).clamp_min(1)
    mean = (c1[:, W:] - c1[:, :N]) / n
    var = ((c2[:, W:] - c2[:, :N]) / n - mean ** 2).clamp_min(0)
    return ((x - mean) / (var.sqrt() + 1e-6)).float()


class EpiKV(Evictor):
    name, needs = "epikv", ("change",)

    def __init__(self, budget, *, z_window=128, **kw):
        super().__init__(budget, **kw)
        self.z_window = z_window
        self._score = None

    def token_scores(self, changes, valid):
        """changes: [L, B, N] residual changes -> z-scored E [B, N]."""
        E = torch.einsum("l,lbn->bn", epikv_weights(changes.shape[0]), changes.float())
        return rolling_zscore(E, valid, self.z_window)

    def prepare(self, layers, valid):
        changes = torch.stack([layers[i].change for i in sorted(layers) if layers[i].change is not None])
        self._score = self.token_scores(changes, valid)                        # z per cache slot [B, N]
        E = torch.einsum("l,lbn->bn", epikv_weights(changes.shape[0]), changes.float())
        # the raw scores of the last W real tokens of each row (left padding: real tokens are last)
        self._hist = E[:, -self.z_window:].double()
        self._hist_valid = valid[:, -self.z_window:]

    def step(self, layers):
        """One decoded token: its z-score against the last W raw scores, appended as a new slot."""
        changes = torch.stack([layers[i].change for i in sorted(layers)])       # [L, B, 1]
        E = torch.einsum("l,lbn->bn", epikv_weights(changes.shape[0]), changes.float()).double()
        self._hist = torch.cat([self._hist, E], 1)[:, -self.z_window:]
        self._hist_valid = torch.cat([self._hist_valid, torch.ones_like(E, dtype=torch.bool)], 1)[:, -self.z_window:]
        z = rolling_zscore(self._hist, self._hist_valid, self.z_window)[:, -1:]
        self._score = torch.cat([self._score, z], 1)

    def kept(self, keep):
        """Slots kept by a decode-time eviction: keep [B, K] (the same for every KV head)."""
        self._score = self._score.gather(1, keep)

    def scores(self, keys, stats, valid):
        if self._score.shape[1] != keys.shape[2]:
            raise ValueError(f"EpiKV has scores for {self._score.shape[1]} slots, the cache holds {keys.shape[2]}")
        return self._score[:, None, :].expand(keys.shape[:3])


EVICTORS = {c.name: c for c in (SnapKV, H2O, TOVA, KNorm, Random, StreamingLLM, EpiKV)}


def make_evictor(spec, **options):
    """'snapkv:256' (tokens), 'h2o:0.25' (ratio), 'streaming:128', 'epikv:256' -> Evictor.

    Conventions after a second colon, comma-separated key=value (or as keyword arguments):
    'tova:256:heads=all,sinks=0,window=0' (the TOVA paper), 'h2o:256:norm=mean,window=128'.
    Keys: sinks, window (ints, 0 = not forced), seed, and the method's `options`."""
    name, _, rest = spec.partition(":")
    budget, _, opts = rest.partition(":")
    if name not in EVICTORS:
        raise ValueError(f"unknown evictor {name!r}; choose from {', '.join(EVICTORS)}")
    if not budget:
        raise ValueError(f"evictor spec {spec!r} lacks a budget, e.g. {name}:256 or {name}:0.25")
    try:
        b = float(budget) if "." in budget else int(budget)
    except ValueError:
        raise ValueError(f"budget {budget!r} is neither a token count nor a ratio") from None
    cls = EVICTORS[name]
    kw = {}
    for item in filter(None, opts.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"evictor option {item!r} is not key=value")
        kw[key] = val
    kw.update(options)
    for key, val in list(kw.items()):
        if key in ("sinks", "window", "seed") or (key == "z_window" and name == "epikv"):
            try:
                kw[key] = int(val)
            except (TypeError, ValueError):
                raise ValueError(f"evictor option {key}={val!r} must be an integer") from None
        elif key not in cls.options:
            raise ValueError(f"{name} has no option {key!r}; it takes sinks, window, seed"
                             + "".join(f", {k}" for k in cls.options))
    return cls(b, **kw)


# ---------------------------------------------------------------- caches

def layer_kv(layer):
    """(keys, values, rho) of one cache layer: a DynamicCache layer (rho None), or a kvcert
    CertifiedLayer (keys as served, rho [B, Hkv, N, NB] the band witness of their error)."""
    if hasattr(layer, "served"):
        k, v = layer.served()
        rho, _ = layer.witness_view()
        return k, v, rho
    return layer.keys, layer.values, None


def exact_keys(layer):
    """The exact keys of one cache layer, for the shadow truth (issue 8 item 4): a DynamicCache
    layer holds them; a kvcert CertifiedLayer serves quantized keys, so its exact copy is used
    (kept only when the cache was built with shadow=True or a full-offload gate)."""
    if hasattr(layer, "served"):
        if getattr(layer, "exact_k", None) is None:
            raise ValueError("shadow mode on a quantized cache needs its exact copy: build it with "
                             "CertifiedCache(..., shadow=True)")
        return layer.exact_k
    return layer.keys


def cache_layers_kv(cache):
    """[(keys, values)] per layer of a transformers DynamicCache or a kvcert CertifiedCache."""
    return [layer_kv(layer)[:2] for layer in cache.layers]


def shrink_cache(cache, keep):
    """Keep only `keep[l]` [B, Hkv, K] of every layer l: physically gathers the tensors
    (kvcert's CertifiedCache frees codes, scales and witness itself: keep_tokens(l, index))."""
    if hasattr(cache, "keep_tokens"):
        for l, idx in enumerate(keep):
            cache.keep_tokens(l, idx)
        return
    for layer, idx in zip(cache.layers, keep):
        D = layer.keys.shape[-1]
        layer.keys = layer.keys.gather(2, idx[..., None].expand(-1, -1, -1, D)).contiguous()
        layer.values = layer.values.gather(2, idx[..., None].expand(-1, -1, -1, layer.values.shape[-1])).contiguous()


def cache_nbytes(cache):
    if hasattr(cache, "memory"):
        return int(cache.memory()["device_bytes"])
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_layers_kv(cache))


# ---------------------------------------------------------------- prefill, evict, generate

@dataclass
class Prefill:
    logits: torch.Tensor          # [B, V] at the last position
    cache: object
    valid: torch.Tensor           # bool [B, N]
    layers: dict                  # layer -> LayerStats


def prefill(model, input_ids, attention_mask=None, *, needs=(), cache=None):
    """One forward over the prompt collecting what `needs` asks for."""
    from transformers import DynamicCache
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, N], got {tuple(input_ids.shape)}")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if valid.shape != input_ids.shape or (valid[:, -1] == 0).any():
        raise ValueError("attention_mask must be [B, N] with LEFT padding (last column all ones)")
    cache = DynamicCache(config=model.config) if cache is None else cache
    col = Collector(needs, cache=cache)
    pos = positions(valid).clamp_min(0)
    with torch.no_grad(), collecting(model, col):
        out = model(input_ids=input_ids, attention_mask=valid.long(), position_ids=pos, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)                          # only the last position's logits are used
    return Prefill(out.logits[:, -1].float(), cache, valid, col.layers)


@dataclass
class Eviction:
    """What `evict` did; everything the trace and the certificate need."""
    keep: list                    # per layer [B, Hkv, K]
    kept_valid: torch.Tensor      # bool [B, K]
    witnesses: list               # per layer GroupWitness (or None)
    bytes_before: int
    bytes_after: int
    evicted: bool                 # False when the PAGE gate kept the full cache (every row)
    page_drop: object = None      # [B] drop D, when a gate ran
    full_keys: list = field(default_factory=list)   # shadow mode only: pre-eviction EXACT keys per layer
    rows: object = None           # bool [B]: the rows that evicted (PAGE decides per row)
    variants: dict = field(default_factory=dict)    # name -> per-layer GroupWitness (witness study)
    gate: object = None           # the EvictionGate holding the offloaded tokens (evict(gate=))

    @property
    def witness_bytes(self):
        return sum(w.nbytes for w in self.witnesses if w is not None)


def _witness_of_evicted(k, rho, valid, idx, num_bands, group_size, cluster=False):
    """Group witness of the real tokens of k [B, Hkv, N, D] not in idx [B, Hkv, K] (None if none).

    cluster=False: groups of consecutive evicted positions; True: groups of nearby keys (a
    principal-axis split tree, fast.core.evict.cluster_order). T7c holds for any partition."""
    from fast.core.rope import rope_bands
    ev_idx, ev_valid = evicted_index(valid, idx, k.shape[1])
    if not bool(ev_valid.any()):
        return None
    bands = rope_bands(k.shape[-1], num_bands, "rotate_half")
    if cluster:
        ev_idx, ev_valid = cluster_order(k, ev_idx, ev_valid, group_size)
    return build_group_witness(k.float(), ev_idx, bands, group_size=group_size, evict_valid=ev_valid, rho=rho)


def evicted_index(valid, keep, Hkv):
    """(index [B, Hkv, E] of the real tokens not in keep [B, Hkv, K], by position; bool [B, Hkv, E]
    False where a row has fewer than E evicted tokens). valid: bool [B, N] the real tokens."""
    B, N = valid.shape
    gone = valid[:, None, :].expand(B, Hkv, N).clone()
    gone.scatter_(2, keep, False)                              # evicted = real and not kept
    E = max(1, int(gone.sum(-1).max()))
    order = torch.sort(gone.long(), dim=-1, descending=True, stable=True).indices
    idx = order[..., :E].sort(-1).values
    return idx, gone.gather(2, idx)


def _page_scores(pre, page, L):
    """The per-layer scores PAGE measures agreement on: query heads [B, H, N] or KV heads [B, Hkv, N]."""
    if getattr(page, "heads", "kv") == "query":
        return [pre.layers[l].window_heads for l in range(L)]
    return [pre.layers[l].window for l in range(L)]


def evict(pre, evictor, *, page=None, witness=True, group_size=32, num_bands=8, shadow=False, variants=None,
          gate=None):
    """Choose keep sets from the prefill statistics, gate with PAGE, shrink the cache.

    PAGE decides per batch row. When every row evicts, the cache shrinks to the budget; when
    none does, nothing changes; in a mixed batch the cache keeps the width of the full rows and
    the evicted rows' slots are masked out (padding slots on the left), so their attention is
    exactly the evicted one but their memory is freed only when the whole batch evicts.
    variants: {name: {"group_size": g, "cluster": bool}} extra witnesses of the same evicted
    set, certified side by side in the trace (the witness study). gate: an EvictionGate
    (fast.policies.evict_gate) that receives the evicted tokens (offload) and serves decode reads."""
    kv = [layer_kv(layer) for layer in pre.cache.layers]
    if gate is not None and (page is not None or any(rho is not None for _, _, rho in kv)):
        raise ValueError("the eviction gate works on an exact cache (DynamicCache) without PAGE")
    if gate is not None and gate.layers:
        raise ValueError("this EvictionGate already holds an eviction: make one per generation")
    before = cache_nbytes(pre.cache)
    B = pre.valid.shape[0]
    drop, rows = None, torch.ones(B, dtype=torch.bool)
    if page is not None:
        drop = page.drop(_page_scores(pre, page, len(kv)), pre.valid, evictor)
        rows = page.decide(drop)
        if not bool(rows.any()):
            return Eviction([], pre.valid, [], before, before, False, drop, rows=rows)
    evictor.prepare(pre.layers, pre.valid)
    keep, kept_valid, wits, full, extra = [], None, [], [], {v: [] for v in (variants or {})}
    for l, (k, v, rho) in enumerate(kv):
        idx, kept_valid = evictor.keep_index(k, pre.layers.get(l, LayerStats()), pre.valid)
        if not bool(rows.all()):
            idx, kept_valid = _mixed_rows(idx, kept_valid, pre.valid, rows)
        keep.append(idx)
        if witness:
            wits.append(_witness_of_evicted(k, rho, pre.valid, idx, num_bands, group_size))
            for name, opt in (variants or {}).items():
                extra[name].append(_witness_of_evicted(k, rho, pre.valid, idx, num_bands, opt.get("group_size", group_size),
                                                       cluster=opt.get("cluster", False)))
        if shadow:                                             # the truth: exact keys, never the served ones
            full.append(exact_keys(pre.cache.layers[l]).clone())
        if gate is not None:
            gate.offload(k, v, pre.valid, idx)
    shrink_cache(pre.cache, keep)
    if isinstance(evictor, EpiKV):
        evictor.kept(keep[0][:, 0])                            # head-shared scores: one keep set
    return Eviction(keep, kept_valid, wits, before, cache_nbytes(pre.cache), True, drop, full, rows=rows,
                    variants=extra, gate=gate)


def _mixed_rows(idx, kept_valid, valid, rows):
    """A batch where only `rows` evict: width N; full rows keep every slot; evicted rows put their
    K kept slots last, preceded by masked slots that repeat their first kept index (so no evicted
    token is ever mistaken for a kept one by the witness or the shadow truth)."""
    B, Hkv, K = idx.shape
    N = valid.shape[1]
    out = torch.arange(N).expand(B, Hkv, N).clone()
    ok = valid.clone()
    for b in torch.nonzero(rows).flatten().tolist():
        out[b] = torch.cat([idx[b, :, :1].expand(Hkv, N - K), idx[b]], 1)
        ok[b] = torch.cat([torch.zeros(N - K, dtype=torch.bool), kept_valid[b]])
    return out, ok


def _needs(evictor, page):
    if page is None:
        return set(evictor.needs)
    return set(evictor.needs) | ({"window_heads"} if getattr(page, "heads", "kv") == "query" else {"window"})


class Certifier:
    """Per decode step and layer: the eviction bound [B, H] (and, in shadow mode, the true p(E)
    from an exact copy of every key ever written: `orig[l]` maps cache slots to that copy)."""

    def __init__(self, ev, valid_prefill, shadow=False, cache=None):
        self.ev, self.shadow, self.cache = ev, shadow, cache
        self.valid_now = ev.kept_valid
        self.valid_full = valid_prefill                        # [B, N_all] over the exact copy
        self.full = list(ev.full_keys)                         # per layer [B, Hkv, N_all, D]
        self.orig = list(ev.keep)                              # per layer [B, Hkv, slots]
        self.step_bounds, self.step_true, self.step_log_odds, self.step_variants = {}, {}, {}, {}

    def __call__(self, layer, q, key, attention_mask, scale):
        w = self.ev.witnesses[layer] if self.ev.witnesses else None
        if self.shadow:                                        # the newest key joins the exact copy
            n_all = self.full[layer].shape[2]
            newest = key[:, :, -1:] if self.cache is None else exact_keys(self.cache.layers[layer])[:, :, -1:]
            self.full[layer] = torch.cat([self.full[layer], newest.to(self.full[layer].dtype)], 2)
            B, Hkv = key.shape[:2]
            self.orig[layer] = torch.cat([self.orig[layer], torch.full((B, Hkv, 1), n_all, dtype=torch.long)], 2)
            if layer == 0:
                self.valid_full = torch.cat([self.valid_full, torch.ones(B, 1, dtype=torch.bool)], 1)
        if not self.ev.witnesses:  # eviction without witnesses: no certificate
            return
        if w is None:  # the witness is None only when no real token was evicted: TV(p, p^K) = 0 (T7a)
            zero = torch.zeros(q.shape[:2], dtype=torch.float32)   # [B, H]
            self.step_bounds[layer], self.step_log_odds[layer] = zero, torch.full_like(zero, -torch.inf)
            for name in self.ev.variants:
                self.step_variants.setdefault(name, {})[layer] = self.step_log_odds[layer]
            if self.shadow:
                self.step_true[layer] = zero
            return
        with torch.no_grad():
            c = None
            if self.cache is not None and hasattr(self.cache.layers[layer], "witness_view"):
                from fast.core.witness import logit_error_bound
                rho, _ = self.cache.layers[layer].witness_view()      # kept keys are quantized: T7d
                c = logit_error_bound(q, rho, self.cache.bands, scale)
            lz = log_z_kept_lower(q, key, scale, valid=self.valid_now, c=c)
            d = evict_log_odds(q, w.groups, lz, scale, w.bands)
            self.step_log_odds[layer] = d
            for name, ws in self.ev.variants.items():                 # the witness study: same q, same L
                wv = ws[layer]
                self.step_variants.setdefault(name, {})[layer] = evict_log_odds(q, wv.groups, lz, scale, wv.bands)
            self.step_bounds[layer] = tv_from_log_odds(d)
            if self.shadow:
                full = self.full[layer]
                B, Hkv, N = full.shape[:3]
                gone = self.valid_full[:, None, :].expand(B, Hkv, N).clone()
                gone.scatter_(2, self.orig[layer], False)
                self.step_true[layer] = evicted_mass(q, full, scale, gone, valid=self.valid_full)

    def appended(self, n, valid):
        """n tokens were written to every layer of the cache outside a decode step (the question):
        they join the exact copy (shadow) as kept tokens; valid [B, n]."""
        if not self.shadow:
            return
        for layer in range(len(self.full)):
            n_all = self.full[layer].shape[2]
            new = exact_keys(self.cache.layers[layer])[:, :, -n:]
            self.full[layer] = torch.cat([self.full[layer], new.to(self.full[layer].dtype)], 2)
            B, Hkv = new.shape[:2]
            self.orig[layer] = torch.cat([self.orig[layer], (n_all + torch.arange(n)).expand(B, Hkv, n)], 2)
        self.valid_full = torch.cat([self.valid_full, valid.bool()], 1)

    def kept(self, layer, keep):
        """The cache of `layer` now holds only slots `keep` [B, Hkv, K] (a decode-time eviction)."""
        if self.shadow:
            self.orig[layer] = self.orig[layer].gather(2, keep)


DECODE_SCORABLE = ("streaming", "knorm", "random", "epikv")


def reevict(cache, evictor, valid_now, K, *, ev=None, cert=None, group_size=32, num_bands=8):
    """Decode-time eviction back to K slots per KV head (methods whose scores need no attention:
    streaming, knorm, random, epikv). Extends the witnesses in `ev`; returns the new valid [B, K]."""
    if evictor.name not in DECODE_SCORABLE:
        raise ValueError(f"decode-time eviction needs an attention-free score ({', '.join(DECODE_SCORABLE)}), "
                         f"not {evictor.name}")
    kept_valid = valid_now
    for l, layer in enumerate(cache.layers):
        k, _, rho = layer_kv(layer)
        idx, kept_valid = select(evictor.scores(k, LayerStats(), valid_now), valid_now, K, evictor.sinks, evictor.window)
        if ev is not None and ev.witnesses:
            w = _witness_of_evicted(k, rho, valid_now, idx, num_bands, group_size)
            if w is not None:
                ev.witnesses[l] = w if ev.witnesses[l] is None else ev.witnesses[l].cat(w)
            for name, ws in ev.variants.items():                   # the study's witnesses grow too
                wv = _witness_of_evicted(k, rho, valid_now, idx, num_bands, group_size)
                if wv is not None:
                    ws[l] = wv if ws[l] is None else ws[l].cat(wv)
        if cert is not None:
            cert.kept(l, idx)
        shrink_cache(_OneLayer(cache, l), [idx])
        if l == 0 and isinstance(evictor, EpiKV):
            keep0 = idx[:, 0]
        if ev is not None:
            ev.keep[l] = idx
    if isinstance(evictor, EpiKV):
        evictor.kept(keep0)
    return kept_valid


class _OneLayer:
    """View of one layer of a cache for shrink_cache."""

    def __init__(self, cache, l):
        self.cache, self.l = cache, l
        self.layers = [cache.layers[l]]
        if hasattr(cache, "keep_tokens"):
            self.keep_tokens = lambda l_, idx: cache.keep_tokens(self.l, idx)


def generate(model, input_ids, attention_mask=None, *, evictor=None, page=None, max_new_tokens=16,
             certify=True, shadow=False, group_size=32, eos_token_id=None, cache=None, decode_every=None, gate=None):
    """Greedy decoding with eviction after the prefill. Batch > 1 with left padding works.

    decode_every: also evict during decoding, back to the budget every that many new tokens
    (attention-free methods: streaming, knorm, random, epikv; long generations).
    Returns a dict: tokens [B, T], eviction (Eviction or None), trace (per step: log_odds and bound
    [L, B, H]; in shadow mode also the true evicted mass), prefill (the Prefill, its cache shrunk).
    gate: an EvictionGate (fast.policies.evict_gate): every decode read certified at TV <= its tau
    (its records in gate.steps, gate.summary(); the group-witness trace is then not computed)."""
    needs = _needs(evictor, page) if evictor is not None else set()
    pre = prefill(model, input_ids, attention_mask, needs=needs, cache=cache)
    ev = None
    if evictor is not None:
        ev = evict(pre, evictor, page=page, witness=certify and gate is None, group_size=group_size, shadow=shadow,
                   gate=gate)
    return decode(model, pre, ev, max_new_tokens=max_new_tokens, certify=certify, shadow=shadow,
                  eos_token_id=eos_token_id, evictor=evictor if decode_every else None,
                  decode_every=decode_every, group_size=group_size)


def decode(model, pre, ev, *, max_new_tokens=16, certify=True, shadow=False, eos_token_id=None,
           evictor=None, decode_every=None, group_size=32, cert_steps=None, question=None, question_mask=None,
           keep_logits=False):
    """Greedy decoding from a prefill (evicted by `ev`, or not when ev is None / gated off).

    New tokens take the positions that follow the prompt (RoPE), whatever was evicted; the 2D
    mask follows the kept layout (left padding preserved). question [B, Lq] (kvpress's protocol):
    the prefill held the context only; the question is prefilled on the evicted cache at the
    positions after the context (never evicted) and the answer starts from its last logits.
    question_mask [B, Lq] (bool/0-1, LEFT padding within the question) when questions differ in
    length. With `evictor` and `decode_every`, the cache is evicted back to the budget every
    `decode_every` new tokens. cert_steps: certify (and trace) only the first that many steps
    (evaluation cost); None = every step. keep_logits: also return the logits of every token chosen
    ("logits" [B, T, V]). An eviction made with evict(gate=) is read through its gate."""
    evicted = ev is not None and ev.evicted
    gate = ev.gate if evicted else None
    if gate is not None and decode_every:
        raise ValueError("the eviction gate certifies the reads of one eviction: decode_every (eviction during "
                         "decoding) is not gated")
    valid_now = ev.kept_valid if evicted else pre.valid
    next_pos = pre.valid.sum(-1)                                   # [B] RoPE position of the next token
    tok = pre.logits.argmax(-1)
    cert = Certifier(ev, pre.valid, shadow, pre.cache) if (evicted and certify and gate is None) else None
    if question is not None:
        valid_now, next_pos, first = _prefill_question(model, pre.cache, question, question_mask, valid_now, next_pos,
                                                       gate=gate)
        tok = first.argmax(-1)
        if cert is not None:
            cert.appended(question.shape[1], valid_now[:, -question.shape[1]:])
    K = valid_now.shape[1]
    tokens, trace = [tok], []
    logits = [first if question is not None else pre.logits] if keep_logits else None
    rolling = evictor is not None and decode_every and evicted
    if rolling and decode_every < 1:
        raise ValueError("decode_every must be >= 1")
    for t in range(max_new_tokens - 1):
        if eos_token_id is not None and bool((tok == eos_token_id).all()):
            break
        valid_now = torch.cat([valid_now, torch.ones(valid_now.shape[0], 1, dtype=torch.bool)], 1)
        if cert is not None and cert_steps is not None and t >= cert_steps:
            cert = None                                                # the trace stops here
        col = Collector(needs=evictor.needs if rolling else (), on_decode=cert, cache=pre.cache,
                        read=gate.read if gate is not None else None)
        if gate is not None:
            gate.begin_step(valid_now)
        if cert is not None:
            cert.valid_now = valid_now
            cert.step_bounds, cert.step_true, cert.step_log_odds, cert.step_variants = {}, {}, {}, {}
        with torch.no_grad(), collecting(model, col):
            out = model(input_ids=tok[:, None], attention_mask=valid_now.long(), position_ids=next_pos[:, None],
                        past_key_values=pre.cache, use_cache=True)
        if gate is not None:
            gate.end_step()
        next_pos = next_pos + 1
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(tok)
        if keep_logits:
            logits.append(out.logits[:, -1].float())
        if cert is not None:
            step = {"bound": torch.stack([cert.step_bounds[l] for l in sorted(cert.step_bounds)]),
                    "log_odds": torch.stack([cert.step_log_odds[l] for l in sorted(cert.step_log_odds)])}
            if shadow:
                step["true"] = torch.stack([cert.step_true[l] for l in sorted(cert.step_true)])
            if cert.step_variants:
                step["variants"] = {name: torch.stack([d[l] for l in sorted(d)]) for name, d in cert.step_variants.items()}
            trace.append(step)
        if rolling:
            if isinstance(evictor, EpiKV):
                evictor.step(col.layers)
            if valid_now.shape[1] >= K + decode_every:
                with torch.no_grad():
                    valid_now = reevict(pre.cache, evictor, valid_now, K, ev=ev, cert=cert, group_size=group_size)
                if cert is not None:
                    cert.valid_now = valid_now
    out = {"tokens": torch.stack(tokens, 1), "eviction": ev, "trace": trace, "prefill": pre}
    if keep_logits:
        out["logits"] = torch.stack(logits, 1)
    return out


def _prefill_question(model, cache, question, question_mask, valid_now, next_pos, gate=None):
    """The question after the (evicted) context: positions continue from the context's length,
    the mask is the kept layout followed by the question's. Returns (valid, next_pos, first token).
    gate: an EvictionGate whose eviction this is: every row of the question reads through it (begin_rows:
    row t sees the kept slots and the question's tokens up to t), one certified record per row."""
    B, Lq = question.shape
    if question.dim() != 2 or B != valid_now.shape[0] or Lq < 1:
        raise ValueError(f"question must be [B={valid_now.shape[0]}, Lq >= 1], got {tuple(question.shape)}")
    qv = torch.ones(B, Lq, dtype=torch.bool) if question_mask is None else question_mask.bool()
    if qv.shape != question.shape or not bool(qv[:, -1].all()):
        raise ValueError("question_mask must be [B, Lq] with LEFT padding (last column all ones)")
    pos = next_pos[:, None] + positions(qv).clamp_min(0)
    K = valid_now.shape[1]
    valid_now = torch.cat([valid_now, qv], 1)
    kw = dict(input_ids=question, attention_mask=valid_now.long(), position_ids=pos, past_key_values=cache,
              use_cache=True, logits_to_keep=1)
    with torch.no_grad():
        if gate is None:
            out = model(**kw)
        else:
            causal = torch.arange(Lq)[None, :] <= torch.arange(Lq)[:, None]          # [T, Lq]: row t reads j <= t
            rows = torch.cat([valid_now[None, :, :K].expand(Lq, B, K), qv[None] & causal[:, None, :]], 2)
            gate.begin_rows(valid_now, rows)
            col = Collector(cache=cache, read=gate.read)
            col.read_rows = True
            with collecting(model, col):
                out = model(**kw)
            gate.end_step()
    return valid_now, next_pos + qv.sum(-1), out.logits[:, -1].float()


def copy_prefill(pre, config):
    """A Prefill with its own DynamicCache (the tensors are copied), to evict it several ways."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    for l, layer in enumerate(pre.cache.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), l)
    return Prefill(pre.logits, cache, pre.valid, pre.layers)


@contextmanager
def evicting(model, evictor, *, page=None, group_size=32):
    """kvpress-style: inside the block, every prefill forward of `model` is followed by an
    eviction of its cache (PAGE-gated when `page` is given). Yields a list that receives one
    Eviction per prefill. Left-padded batches need `generate` above (the 2D mask that
    transformers' generate keeps extending cannot follow a per-row eviction)."""
    records = []
    col = Collector(_needs(evictor, page))

    def hook(mod, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape[1] == 1 or not col.layers:
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("padding inside `with evictor(model)`: use fast.policies.evictors.generate for padded batches")
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or kwargs.get("cache")
        valid = torch.ones(ids.shape, dtype=torch.bool)
        records.append(evict(Prefill(out.logits[:, -1], cache, valid, dict(col.layers)), evictor, page=page,
                             group_size=group_size))
        col.layers.clear()

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        with collecting(model, col):
            yield records
    finally:
        handle.remove()
