"""CertifiedCache: a transformers Cache that stores a compressed KV cache and carries the
band witness (math.md T4) of every key, so that each decode read can be certified.

Storage of one layer, token axis 2, in storage order (= position order until `keep_tokens`):

    [ quantized: kq, vq (packed, nbytes), witness codes ][ tail: exact, newest tokens ]
    + exact overlay (sinks, and tail tokens moved by keep_tokens): c = 0 there
    + offload store (gate != none): exact fp copy, or the residual k - k_hat in int8 with its own witness
    + ladder rungs (gate ladder:TAU): per promoted KV head, successive refinements: rung r stores
      the codes of what rungs < r left, k - (k_hat + r_1 + ... + r_{r-1}), at its codec (e.g. kivi2
      + int4 residual + int8 residual), from the exact copy, and the witness of the sum as served;
      the top rung is exact
    + shadow copy (shadow mode only: measurement, never counted)

Each token is quantized exactly once, when it leaves the tail (append-only). The tail keeps
the `window` newest tokens exact (and, for kivi2, the tokens of an unfinished 32-token block).
The attention function in fast/integrations/hf_meter.py reads `served()` and `witness_view()` at every
decode step.
"""

import torch
from transformers.cache_utils import Cache

from fast.core.rope import rope_bands
from fast.core.schemes import get_scheme
from fast.integrations.hf_fused import FusedLayer
from fast.integrations.hf_layer import LADDERS, NB, RUNG_CODECS, CertifiedLayer, value_error_norms  # noqa: F401 (re-exported)
from fast.integrations.hf_meter import set_current
from fast.policies.gate import Gate, parse_gate  # noqa: F401 (re-exported)

METERS = ("kvcert", "kvcert_fused")  # the attention functions that certify reads of this cache


class CertifiedCache(Cache):
    """A certified, compressed KV cache for model.generate / model(...) with attn_implementation="kvcert".

    scheme: a registered scheme name (fast.core.schemes); gate: none | certified:TAU | risk:K;
    sinks / window: exact first / newest tokens; shadow: keep the exact cache and measure true TV;
    seed, delta_req: the dither tier (int8_dither, int4_dither, kivi2_dither; records it as
    dither_estimate: an estimate in decoding, never gated, see fast.integrations.hf_meter; seed=None: a fresh 64-bit seed per cache, i.e. per
    request, drawn from the OS; each batch row and keys/values get their own counters); offload: "full" (exact copy) or "residual";
    certify=False serves the compressed cache without certificates (the meter-overhead baseline; refused with a gate,
    shadow, value_bound or box_form, which act on certificates);
    derived: use the zero-memory witness from the scales when the scheme allows it (else 1 byte
    per band and token, tighter and cheaper to read);
    rungs: gate ladder:TAU only, the schemes above `scheme`, lowest first (default LADDERS[scheme]; per
    token, no dither: RUNG_CODECS); exact keys are the top rung;
    ladder_values: gate ladder:TAU only; False: the rungs below the top refine the keys only, the
    values stay at `scheme` (the certificate bounds the attention weights, which depend on the
    keys alone; the values' error is T5's value bound, value_bound=True); the top rung serves
    exact keys and values as before;
    box_form: reads (decode and multi-row) whose certificate would trip the gate (every read without a
    threshold gate) are certified again with the box form too (spec T9, fast.core.box; torch path);
    subspace: m > 0 stores the query-subspace witness (spec T4e, fast.core.subspace: per quantized token the m
    coefficients of its key error along the top m directions of each KV head's first-read queries, as int8 codes
    and one fp16 scale, plus 1 + NB log codes: m + 3 + NB bytes a token and KV head) and certifies decode reads with the signed
    intervals it gives, intersected with the band witness, decode and multi-row reads alike (torch path);
    basis: with subspace=m, a static basis [L, Hkv, m, D] fp32 for every request (fast.calibrate_basis) in
    place of each request's own from its first read;
    backend: "auto" (default) reads through the fused C++ kernel (fast.integrations.hf_fused) wherever
    it applies (FusedLayer.fused_ok: the read falls back to the torch twin elsewhere, certified the
    same way), "torch" always through the twin (the readable reference of the same computation).
    """

    def __init__(self, config, scheme="int8", *, gate="none", sinks=4, window=32, shadow=False,
                 seed=None, delta_req=1e-3, offload="full", derived=False, nbands=NB, certify=True, value_bound=False,
                 rungs=None, ladder_values=True, box_form=False, backend="auto", subspace=0, basis=None):
        self.config = config   # the model's config: its attention implementation must be the meter (check_meter)
        self.scheme = get_scheme(scheme)
        self.gate = parse_gate(gate)
        if offload not in ("full", "residual"):
            raise ValueError(f"offload must be 'full' or 'residual', got {offload!r}")
        if not 0.0 < delta_req < 1.0:
            raise ValueError(f"delta_req must lie in (0, 1), got {delta_req}")
        if sinks < 0 or window < 0:
            raise ValueError("sinks and window must be >= 0")
        self.sinks, self.window, self.shadow = int(sinks), int(window), bool(shadow)
        self.certify = bool(certify)  # False: serve the compressed cache without certificates (speed baseline)
        if not self.certify and (self.gate.kind != "none" or self.shadow or value_bound or box_form):
            raise ValueError(f"certify=False serves reads without certificates, so gate={gate!r}, shadow, value_bound "
                             "and box_form (each acts on a certificate) would act on nothing: use certify=True")
        from fast.core.quant import SEED_COUNT, check_counter, draw_seed
        # the dither of one request is its own: a fresh 64-bit seed from the OS unless one is given (reproducibility)
        self.seed = draw_seed() if seed is None else check_counter("seed", seed, SEED_COUNT)
        self.delta_req, self.offload, self.derived = float(delta_req), offload, bool(derived)
        self.value_bound = bool(value_bound)  # store ||v - v~|| per token (4 bytes a KV head): the output bound (T5)
        if rungs is not None and self.gate.kind != "ladder":
            raise ValueError(f"rungs= applies to gate ladder:TAU, not {self.gate}")
        self.rungs = tuple(LADDERS.get(self.scheme.name, ()) if rungs is None else rungs)
        if self.gate.kind == "ladder":
            if offload != "full":
                raise ValueError("gate ladder:TAU re-encodes promoted heads from the exact copy: offload must be 'full'")
            bad = [r for r in self.rungs if r not in RUNG_CODECS]
            if bad:
                raise ValueError(f"rungs {bad}: a rung is one of {', '.join(RUNG_CODECS)} (per token, no dither)")
        self.rung_schemes = [get_scheme(r) for r in self.rungs]
        if not ladder_values and self.gate.kind != "ladder":
            raise ValueError(f"ladder_values=False applies to gate ladder:TAU, not {self.gate}")
        self.ladder_values = bool(ladder_values)
        self.box_form = bool(box_form)
        if isinstance(subspace, bool) or not isinstance(subspace, int) or not 0 <= subspace <= 64:
            raise ValueError(f"subspace: the number m of basis directions, an integer in [0, 64] (0: off), got {subspace!r}")
        self.subspace = subspace
        self.basis = None if basis is None else self._check_basis(basis, config)
        if backend not in ("auto", "torch"):
            raise ValueError(f"backend must be 'auto' (the fused C++ read where it applies) or 'torch', got {backend!r}")
        self.backend = backend
        self.keep_exact = self.shadow or (self.gate.kind != "none" and offload == "full")
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.bands = rope_bands(self.head_dim, nbands, "rotate_half")
        if self.scheme.dither:  # the local budgets of ~1e6 steps must stay normal fp64 numbers (never 0)
            from fast.core.dither import budget_local
            budget_local(self.delta_req, self.num_layers, self.num_heads, 2 ** 20)
        if self.gate.kind == "risk" and self.gate.k > self.num_layers * config.num_key_value_heads:
            raise ValueError(f"gate risk:{self.gate.k}: K exceeds the {self.num_layers * config.num_key_value_heads} (layer, KV head) slots")
        self.evicted = False
        self._work = {}        # decode workspace (see workspace())
        self.records = []      # one dict per (decode step, layer), filled by fast.integrations.hf_meter
        self.row_records = []  # one dict per (multi-row read of a non-empty cache, layer): second turns, chunked prefill
        self.risk_done = False
        self.on_layer = None   # optional callback(phase, layer_idx) after each attention call (progress bars)
        if backend == "auto":
            layers = [FusedLayer(self, i) for i in range(self.num_layers)]
        else:
            layers = [CertifiedLayer(self, i) for i in range(self.num_layers)]
        self._pending = []     # fused reads of this step awaiting the batched certificate epilogue (hf_fused)
        self.fused_reads = 0
        super().__init__(layers=layers)

    def _check_basis(self, basis, config):
        """A static basis [L, Hkv, m, D] fp32, finite, m = subspace (fast.calibrate_basis makes one)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        want = (config.num_hidden_layers, config.num_key_value_heads, self.subspace, head_dim)
        if not self.subspace:
            raise ValueError("basis= needs subspace=m > 0")
        if not isinstance(basis, torch.Tensor) or basis.dtype != torch.float32 or tuple(basis.shape) != want:
            raise ValueError(f"basis: an fp32 tensor of shape [L, Hkv, m, D] = {list(want)}, got "
                             f"{tuple(basis.shape) if isinstance(basis, torch.Tensor) else type(basis).__name__}")
        if not bool(torch.isfinite(basis).all()):
            raise ValueError("basis: contains NaN or Inf")
        return basis.contiguous()

    def workspace(self, B, Hkv, N, D, dtype, device):
        """Two [B, Hkv, N, D] views of a decode buffer shared by all layers (capacity doubles)."""
        key = (B, Hkv, D, dtype, device)
        buf = self._work.get(key)
        if buf is None or buf.shape[3] < N:
            cap = max(N, 2 * buf.shape[3] if buf is not None else 64)
            buf = self._work[key] = torch.empty(2, B, Hkv, cap, D, dtype=dtype, device=device)
        return buf[0, :, :, :N], buf[1, :, :, :N]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0 and self.gate.kind == "risk" and not self.risk_done and self.layers[0].n:
            self.apply_risk()
        layer = self.layers[layer_idx]
        if self.certify and layer.is_initialized and layer.n:
            self.check_meter()
        keys, values = layer.update(key_states, value_states)
        set_current(layer)
        return keys, values

    def check_meter(self):
        """Certify or refuse: the model reads the keys update() returns with the attention function
        its config names (the config given here: pass model.config). Unless that is the meter, those
        reads of quantized keys would go uncertified, so they are refused before they happen."""
        attn = getattr(self.config, "_attn_implementation", None)
        # a wrapper names itself "wrapper-inner" and calls inner (fast.policies.evictors.collecting)
        if str(attn).split("-")[-1] not in METERS:
            raise RuntimeError(f"CertifiedCache: the model's attention is {attn!r}, not the kvcert meter, so reads of "
                               "the compressed cache would go uncertified: call fast.enable_meter(model) first and "
                               "build the cache with model.config (certify=False serves uncertified on purpose)")

    def apply_risk(self):
        """risk:K: the K (layer, KV head) slots with the highest prefill risk are served exact."""
        self.risk_done = True
        if self.gate.k and any(layer.risk is None for layer in self.layers):
            raise ValueError("gate risk:K ranks slots during the prefill: run the prefill through the kvcert meter "
                             "(fast.integrations.hf_meter.enable(model)), not from a shared or foreign prefill")
        # rank by the bound, then by max c (which still orders slots whose bound saturates at 1)
        scores = [(tuple(r), l, h) for l, layer in enumerate(self.layers) if layer.risk is not None
                  for h, r in enumerate(layer.risk.tolist())]
        for _, l, h in sorted(scores, reverse=True)[: self.gate.k]:
            self.layers[l].repair([h])

    def fill_from(self, exact_cache, valid=None):
        """Load the keys and values of an exact prefill (a DynamicCache) as if the prefill had run
        on this cache (it reads exact keys either way): one prefill shared by several schemes.
        valid: bool [B, N] (False = left padding)."""
        for l, src in enumerate(exact_cache.layers):
            layer = self.layers[l]
            layer.update(src.keys, src.values)
            if valid is not None:
                layer.valid &= valid.to(layer.device)[:, None, :]
        return self

    def keep_tokens(self, layer_idx, index):
        self.layers[layer_idx].keep_tokens(index)

    def memory(self):
        """Bytes: device tier, offload tier, repair traffic, and an fp16 cache of the same tokens."""
        dev = sum(layer.device_bytes() for layer in self.layers if layer.is_initialized)
        off = sum(layer.offload_bytes() for layer in self.layers if layer.is_initialized)
        traffic = sum(layer.traffic for layer in self.layers if layer.is_initialized)
        dev16 = sum(layer.device_bytes(exact_itemsize=2) for layer in self.layers if layer.is_initialized)
        fp16 = sum(2 * 2 * layer.B * layer.Hkv * layer.n * layer.D for layer in self.layers if layer.is_initialized)
        tokens = max(max((layer.n for layer in self.layers if layer.is_initialized), default=0), 1)
        B = self.layers[0].B if self.layers[0].is_initialized else 1
        return {"device_bytes": dev, "device_bytes_fp16": dev16, "offload_bytes": off, "repair_traffic_bytes": traffic,
                "fp16_bytes": fp16, "tokens": tokens, "batch": B,
                "device_bytes_per_token": dev / (tokens * B), "device_bytes_fp16_per_token": dev16 / (tokens * B),
                "fp16_bytes_per_token": fp16 / (tokens * B), "offload_bytes_per_token": off / (tokens * B)}

    def heads_per_rung(self):
        """[count of (layer, KV head) slots at rung r] for r = 0 (the scheme) .. len(rungs) + 1 (exact)."""
        rungs = [int(x) for layer in self.layers if layer.is_initialized for x in layer.rung]
        return [rungs.count(r) for r in range(len(self.rungs) + 2)]


class FusedCertifiedCache(CertifiedCache):
    """CertifiedCache with backend="auto" (its reads go through fast.core.cpu_fused where the kernel applies): kept
    for older code."""

    def __init__(self, config, scheme="int8", **kwargs):
        if kwargs.get("backend", "auto") != "auto":
            raise ValueError("FusedCertifiedCache: backend is 'auto'; use CertifiedCache(..., backend='torch')")
        super().__init__(config, scheme, **kwargs)
