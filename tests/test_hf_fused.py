"""FusedCertifiedCache (fast.integrations.hf_fused) against CertifiedCache + the kvcert meter.

Differential: on the tiny Llama (GQA), the same prefill and teacher-forced decode steps through
both caches give the same logits (fp32, sums in another order) and per-(step, layer) certificates
that are >= the meter's twin certificate (within its documented margin: fast.core.cpu_fused) and
never far looser. A second turn (several tokens at once over a cache) goes through the fused
kernel with one certificate per row.
"""

import torch

from fast.core.certify import FORMS
from fast.integrations import hf_fused, hf_meter
from fast.integrations.hf_cache import CertifiedCache
from tests.tiny_model import tiny_ids, tiny_llama


def _run(cache_cls, attn, ids, steps, before_step=None, **kw):
    model = tiny_llama(attn=attn)
    cache = cache_cls(model.config, "int8", **kw)
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for t in range(steps):
            if before_step:
                before_step(cache, t)
            hf_meter.set_current(None)
            nxt = ids[:, t % ids.shape[1]][:, None]
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


def test_decode_matches_meter(monkeypatch):
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)  # the meter's cache flushes every step: same contents
    ids = tiny_ids(B=2, N=60)
    ref_logits, ref_cache = _run(CertifiedCache, "kvcert", ids, 6, window=8, sinks=4)
    fus_logits, fus_cache = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, ids, 6, window=8, sinks=4)
    assert fus_cache.fused_reads == 6 * 2  # every decode read of both layers went through the kernel
    # fp32 both; the attention outputs agree to ~1e-6 relative and go through 2 layers + lm head
    torch.testing.assert_close(fus_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert len(fus_cache.records) == len(ref_cache.records) == 12
    for r, f in zip(ref_cache.records, fus_cache.records):
        assert (r["step"], r["layer"]) == (f["step"], f["layer"])
        for name in FORMS:
            assert bool((f[name] >= r[name] * (1 - 1e-5)).all()), name  # both >= the exact formula
            assert bool((f[name] <= r[name] * (1 + 1e-2) + 1e-6).all()), name


def test_readable_flags_changed_in_place_are_read():
    """Segment 0 is reused across steps (appends to the tail do not rebuild it), but a readable flag
    of a quantized token or of a sink changed in place is read at the next step: the same logits and
    certificates as a run that rebuilds every segment at every step (a stale segment would still
    read the masked tokens), and different from a run without the masks."""
    ids = tiny_ids(B=2, N=60)
    nqs = set()

    def mask(cache, t, rebuild=False):
        nqs.add(cache.layers[0].nq)  # no flush during the run: segment 0 is reused unless it is rebuilt
        if t in (2, 4):
            for layer in cache.layers:
                layer.valid[1, :, 20 + t] = False  # a quantized token of row 1
                layer.valid[0, :, t // 2] = False  # a sink of row 0
        for layer in cache.layers:
            if rebuild:
                layer._seg0 = None
    reuse, c1 = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, ids, 6, before_step=mask, window=8, sinks=4)
    fresh, c2 = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, ids, 6, before_step=lambda c, t: mask(c, t, True),
                     window=8, sinks=4)
    plain, _ = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, ids, 6, window=8, sinks=4)
    assert c1.fused_reads == c2.fused_reads == 12 and len(nqs) == 1
    assert torch.equal(reuse, fresh)
    assert (reuse[3:, 0] - plain[3:, 0]).abs().max() > 1e-3 and (reuse[3:, 1] - plain[3:, 1]).abs().max() > 1e-3
    for a, b in zip(c1.records, c2.records):
        assert torch.equal(a["min"], b["min"])


def test_second_turn_rows():
    """A multi-token read over an existing cache: one certificate per row, outputs as the meter's
    exact-prefill path would not give (it reads exact keys): compare with the twin on the served copy."""
    ids = tiny_ids(B=1, N=50)
    model = tiny_llama(attn=hf_fused.NAME)
    cache = hf_fused.FusedCertifiedCache(model.config, "int8", window=4, sinks=2)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        hf_meter.set_current(None)
        model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True)
    assert cache.fused_reads == 2
    rec = cache.records[-1]
    assert rec["rows"] == 5 and tuple(rec["rows_min"].shape) == (1, 5, 4)
    assert bool((rec["rows_min"] >= 0).all()) and bool((rec["rows_min"] <= 1).all())


def test_block_flush_keeps_the_window_exact():
    ids = tiny_ids(B=1, N=70)
    _, cache = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, ids, 40, window=8, sinks=4)
    for layer in cache.layers:
        assert 8 <= layer.k_tail.shape[2] < 8 + hf_fused.FLUSH_BLOCK
        assert layer.n == 70 + 40


def test_refused_epilogue_rows_are_certified_for_the_kernel_output(monkeypatch):
    """Rows the fp32 epilogue refuses (a large witness) get the twin's certificate, but the kernel's
    output was already served: each form is the twin's plus tanh(e) (fast.core.certify.with_other_logits,
    e the logit rounding bound), never the twin's alone."""
    from fast.core import cpu_fused
    from fast.core.certify import logit_rounding, tanh_half_up
    from fast.core.quant import max_abs
    seen = []
    twin = hf_fused.twin_rows

    def spy(q, k, *a, **kw):  # the twin's own certificate, and the e of its rows
        out, c = twin(q, k, *a, **kw)
        e = logit_rounding(q.abs().amax(1), max_abs(k), a[2])
        seen.append((c["min"].double(), tanh_half_up(2 * e)))
        return out, c
    monkeypatch.setattr(hf_fused, "twin_rows", spy)
    monkeypatch.setattr(cpu_fused, "_certificate", lambda *a, **kw: None)  # every row refused
    _, cache = _run(hf_fused.FusedCertifiedCache, hf_fused.NAME, tiny_ids(B=2, N=60), 3, window=8, sinks=4)
    assert len(cache.records) == len(seen) == 3 * 2
    for rec, (tmin, t) in zip(cache.records, seen):
        assert bool((t > 0).all())
        assert bool((rec["min"].double() >= torch.clamp(tmin[:, -1] + t, max=1.0)).all())
