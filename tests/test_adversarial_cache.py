"""The standing adversarial suite (issue 8): a stateful Hypothesis machine drives CertifiedCache
and the meter (fast.integrations.hf_meter.read, the function the "kvcert" attention calls: the
fused C++ read where it applies, the torch twin elsewhere; both backends drawn) through random interleavings of prefill chunks, decode reads, multi-token reads,
eviction and re-eviction (keep_tokens), certified gates with repairs (both offload tiers), batch
rows of different lengths (left padding), every built-in scheme and registered schemes that
misbehave (write into their input or its buffer, edit their output later).

Invariant, against an independent truth: the test keeps its own exact copy of every key it wrote
(never read back from the cache) and, for every certified read, TV(softmax over the exact keys,
softmax over the keys the cache served) <= the certified bound (fp64 softmaxes, the same visible
tokens); every read of the cache produces a certificate. The dither tier (an estimate in decoding,
spec A2) is not asserted here (tests/test_cache.py and benchmarks/soundness.py measure it).
Bounded: small shapes, max_examples and step counts sized for < 2 min on 2 shared cores.
"""

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import LlamaConfig

import fast.integrations.hf_meter as meter
from fast.core.schemes import CODECS, SchemeError, register_scheme, scheme_names
from fast.integrations.hf_cache import CertifiedCache

H, HKV, D = 4, 2, 32
SCALE = 1 / math.sqrt(D)
CONFIG = LlamaConfig(vocab_size=16, hidden_size=H * D, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=H, num_key_value_heads=HKV, head_dim=D)
CONFIG._attn_implementation = "kvcert"  # the test calls the meter's read functions itself, as that function does


def _coarse(x):
    return (x.float() * 4).round() / 4


def _writes_input(x):
    out = _coarse(x)
    x.copy_(out)  # the witness would be measured against the quantized key
    return out


def _writes_buffer(x):
    out = _coarse(x)
    whole = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())  # the exact tail, if x were a view of it
    whole.mul_(0.5)
    return out


_OUTS = []


def _edits_output(x):
    if len(_OUTS) >= 3:
        _OUTS[-3].mul_(-1.0)  # after the determinism check and the witness
    out = _coarse(x).half()
    _OUTS.append(out)
    del _OUTS[:-4]
    return out


BAD = {"adv_writes_input": _writes_input, "adv_writes_buffer": _writes_buffer, "adv_edits_output": _edits_output}
for _name, _fn in BAD.items():
    if _name not in scheme_names():  # registered once per process (the probe must pass: they misbehave only later)
        register_scheme(_name, _fn)
SCHEMES = CODECS + ("kivi2", "kivi2_dither") + tuple(BAD)
NO_EVICTION = ("kivi2", "int8_dither", "int4_dither", "kivi2_dither")  # blocks of 32 tokens / dither counters that follow contiguous tokens


class CacheMachine(RuleBasedStateMachine):
    @initialize(scheme=st.sampled_from(SCHEMES), B=st.integers(1, 2), sinks=st.integers(0, 3), window=st.integers(0, 6),
                gate=st.sampled_from(["none", "certified:0.05", "certified:0.5"]), offload=st.sampled_from(["full", "residual"]),
                seed=st.integers(0, 2 ** 31 - 1), mag=st.sampled_from([0.3, 1.0, 4.0]),
                backend=st.sampled_from(["auto", "torch"]))
    def start(self, scheme, B, sinks, window, gate, offload, seed, mag, backend):
        meter.set_current(None)
        self.cache = CertifiedCache(CONFIG, scheme, sinks=sinks, window=window, gate=gate, offload=offload, backend=backend)
        self.scheme, self.B, self.mag = scheme, B, mag
        self.g = torch.Generator().manual_seed(seed)
        self.exact = None  # [B, Hkv, N, D] fp64: the test's own copy of every key it wrote
        self.valid = None  # [B, Hkv, N] bool: the test's own padding mask
        self.reads = 0

    @property
    def layer(self):
        return self.cache.layers[0]

    def _kv(self, n):
        k = torch.randn(self.B, HKV, n, D, generator=self.g) * self.mag
        k[..., 0] += 3 * self.mag * torch.rand(self.B, HKV, n, generator=self.g)  # an outlier channel
        v = torch.randn(self.B, HKV, n, D, generator=self.g)
        return k, v

    def _write(self, n):
        k, v = self._kv(n)
        new = self.exact is None
        self.exact = k.double() if new else torch.cat([self.exact, k.double()], 2)
        ones = torch.ones(self.B, HKV, n, dtype=torch.bool)
        self.valid = ones if new else torch.cat([self.valid, ones], 2)
        served = self.cache.update(k.clone(), v.clone(), 0)
        return served

    def _truth(self, q, served_k, visible):
        """TV [B, H] between softmaxes over the exact and the served keys (q [B, H, D], visible [B, Hkv, N])."""
        G = H // HKV
        qg = q.double().view(self.B, HKV, G, D)
        mask = visible[:, :, None, :]
        p = torch.softmax((torch.matmul(qg, self.exact.transpose(-1, -2)) * SCALE).masked_fill(~mask, -math.inf), -1)
        pt = torch.softmax((torch.matmul(qg, served_k.double().transpose(-1, -2)) * SCALE).masked_fill(~mask, -math.inf), -1)
        return (0.5 * (p - pt).abs().sum(-1)).reshape(self.B, H)

    def _query(self, T=None):
        shape = (self.B, H, D) if T is None else (self.B, H, T, D)
        return torch.randn(*shape, generator=self.g) * self.mag

    @precondition(lambda self: self.exact is None)
    @rule(n=st.integers(1, 40), pad=st.integers(0, 8))
    def prefill(self, n, pad):
        """The first chunk (read exact by every quantized cache, as sdpa); row 1 may start with padding."""
        self._write(n)
        if self.B > 1 and 0 < pad < n:
            self.layer.valid[1, :, :pad] = False
            self.valid[1, :, :pad] = False

    @precondition(lambda self: self.exact is not None and self.exact.shape[2] < 120)
    @rule(n=st.integers(1, 33))
    def prefill_chunk(self, n):
        """A later chunk written without a read (chunked prefill through another path)."""
        self._write(n)

    @precondition(lambda self: self.exact is not None and self.exact.shape[2] < 140)
    @rule()
    def decode(self):
        served_k, served_v = self._write(1)
        before = len(self.cache.records)
        q = self._query()
        meter.read(self.layer, q[:, :, None], served_k, served_v, SCALE)
        assert len(self.cache.records) == before + 1, "a read without a certificate"
        rec = self.cache.records[-1]
        true = self._truth(q, self.layer.served()[0], self.valid)  # every key as served (after a repair too)
        bound = rec["min"].double()
        assert bool(torch.isfinite(bound).all()) and bool((bound <= 1).all())
        assert bool((true <= bound).all()), f"{self.scheme}: true TV {true.tolist()} > bound {bound.tolist()}"
        self.reads += 1

    @precondition(lambda self: self.exact is not None and self.exact.shape[2] < 140)
    @rule(T=st.integers(2, 5))
    def multi_row_read(self, T):
        """T new tokens read by T query rows at once (second turn, chunked prefill), causal."""
        served_k, served_v = self._write(T)
        before = len(self.cache.row_records)
        q = self._query(T)
        meter.read(self.layer, q, served_k, served_v, SCALE)
        assert len(self.cache.row_records) == before + 1, "a multi-row read without a certificate"
        rec = self.cache.row_records[-1]
        N = self.exact.shape[2]
        for t in range(T):
            visible = self.valid & (torch.arange(N) <= N - T + t)
            true = self._truth(q[:, :, t], self.layer.served()[0], visible)
            bound = rec["min"][:, t].double()
            assert bool((true <= bound).all()), f"{self.scheme} row {t}: true TV {true.tolist()} > bound {bound.tolist()}"
        self.reads += 1

    @precondition(lambda self: self.exact is not None and self.exact.shape[2] >= 8)
    @rule(frac=st.floats(0.3, 0.9))
    def evict(self, frac):
        """keep_tokens with a different random subset per (row, KV head); refused schemes say so."""
        N = self.exact.shape[2]
        K = max(1, int(N * frac))
        idx = torch.stack([torch.stack([torch.randperm(N, generator=self.g)[:K].sort().values for _ in range(HKV)])
                           for _ in range(self.B)])  # [B, Hkv, K]
        if self.scheme in NO_EVICTION:
            try:
                self.cache.keep_tokens(0, idx)
            except (SchemeError, ValueError):
                return
            raise AssertionError(f"{self.scheme}: eviction accepted")
        kept_valid = self.valid.gather(2, idx)
        if not bool(kept_valid.any(-1).all()):
            return  # a row would keep only padding: nothing to read
        self.cache.keep_tokens(0, idx)
        self.exact = self.exact.gather(2, idx[..., None].expand(-1, -1, -1, D))
        self.valid = kept_valid
        assert torch.equal(self.layer.valid, self.valid)

    @invariant()
    def storage_lines_up(self):
        if self.exact is not None:
            assert self.layer.n == self.exact.shape[2]


CacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=12, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_cache_machine = CacheMachine.TestCase
