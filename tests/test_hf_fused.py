"""FusedCertifiedCache (fast.integrations.hf_fused) against CertifiedCache + the kvcert meter.

Differential: on the tiny Llama (GQA), the same prefill and teacher-forced decode steps through
both caches give the same logits (fp32, sums in another order) and per-(step, layer) certificates
that are >= the meter's twin certificate (within its documented margin: fast.core.cpu_fused) and
never far looser. A second turn (several tokens at once over a cache) goes through the fused
kernel with one certificate per row.
"""

import pytest
import torch

from fast.core.certify import FORMS
from fast.integrations import hf_fused, hf_meter
from fast.integrations.hf_cache import CertifiedCache, FusedCertifiedCache
from tests.tiny_model import tiny_ids, tiny_llama


def TwinCache(config, scheme, **kw):
    """The torch twin's cache (backend="torch"): the oracle the fused read is compared with."""
    return CertifiedCache(config, scheme, backend="torch", **kw)


def _run(cache_cls, attn, ids, steps, before_step=None, scheme="int8", kv_heads=2, mode=torch.no_grad, **kw):
    model = tiny_llama(attn=attn, kv_heads=kv_heads)
    cache = cache_cls(model.config, scheme, **kw)
    logits = []
    with mode():
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


@pytest.mark.parametrize("scheme,derived", [("int8", False), ("int4", False), ("int4", True), ("kivi2", False),
                                            ("prerope_int4", False), ("prerope_int8", False), ("fp8_e4m3", False),
                                            ("fp8_e5m2", False), ("fp8_e4m3_rtz", False), ("fp8_e5m2_rtz", False),
                                            ("int8_dither", False), ("int4_dither", False), ("kivi2_dither", False),
                                            ("kivi2_dither", True), ("registered", False)])
def test_decode_matches_meter(monkeypatch, scheme, derived):
    """int8 and int4 (packed codes read in place; witness stored as log codes, or derived from the scales), kivi2
    (2-bit codes, keys per channel over blocks of 32 tokens), pre-RoPE keys (rotated at read) and fp8 codes
    (round-to-nearest with per-token scales, vLLM's round-toward-zero casts), dithered int8 / int4 codes (the dither
    regenerated at read; the dither estimate from the kernel's sums with each token's radius, against the meter's fp64
    dither_forms: both above the exact formula, the kernel's e margin smaller than dither_forms' 3 e, so slightly below
    it where e matters), kivi2_dither's 2-bit dithered asymmetric codes (a dither step per channel and key block), a
    registered scheme's fp16 outputs (rounded to multiples of 1/8 here)."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)  # the meter's cache flushes every step: same contents
    ids = tiny_ids(B=2, N=70)
    dith = scheme.endswith("_dither")
    if scheme.startswith("prerope"):
        from fast.core.prerope import prerope_scheme
        scheme = prerope_scheme(tiny_llama().config, bits=int(scheme[-1]))
    if scheme == "registered":
        from fast.core.schemes import register_scheme, unregister_scheme
        scheme = register_scheme("test_eighths", lambda x: (x * 8).round() / 8)
        unregister_scheme("test_eighths")  # the Scheme object itself is passed on
    kw = dict(window=8, sinks=4, scheme=scheme, derived=derived, **(dict(seed=11) if dith else {}))
    ref_logits, ref_cache = _run(TwinCache, "kvcert", ids, 6, **kw)
    fus_logits, fus_cache = _run(FusedCertifiedCache, hf_fused.NAME, ids, 6, **kw)
    assert all(layer.fused_ok() for layer in fus_cache.layers) and not any(layer.fused_ok() for layer in ref_cache.layers)
    assert fus_cache.fused_reads == 6 * 2  # every decode read of both layers went through the kernel
    # fp32 both; the attention outputs agree to ~1e-6 relative and go through 2 layers + lm head
    torch.testing.assert_close(fus_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert len(fus_cache.records) == len(ref_cache.records) == 12
    for r, f in zip(ref_cache.records, fus_cache.records):
        assert (r["step"], r["layer"]) == (f["step"], f["layer"])
        assert bool((f["min"] < 1).any()), "a vacuous certificate compares nothing"
        for name in FORMS:
            assert bool((f[name] >= r[name] * (1 - 1e-5)).all()), name  # both >= the exact formula
            # the Taylor / chord bounds of P and M cost relative O(cm^2) (cpu_fused module doc): int4's witness
            # is ~16x int8's (cm 0.4-0.8 on the tiny model), so the room is the row's cm^2 on top of the int8 1e-2
            cm = f["max_c"].double()
            assert bool((f[name] <= r[name] * (1 + 1e-2 + cm * cm) + 1e-6).all()), name
        if dith:
            est, want = f["dither_estimate"], r["dither_estimate"]
            assert est.shape == want.shape and bool((est < f["min"]).any()), "the estimate must say something"
            # (kivi2's 2-bit radii: the epilogue's O(cm^2) room, as for the deterministic forms)
            assert bool((est >= want * (1 - 1e-2)).all()) and bool((est <= want * (1 + 1e-3 + cm * cm) + 1e-6).all())


def _second_turn(scheme, **kw):
    """A prefill of 50 tokens (batch 2), then 5 tokens at once over the cache, through the twin's cache and the fused
    read: (twin cache, fused cache), after checking that the fused one read both layers through the kernel and that
    the two gave the same logits (fp32, sums in another order)."""
    ids = tiny_ids(B=2, N=50)
    runs = []
    for cls, attn in ((TwinCache, "kvcert"), (CertifiedCache, hf_fused.NAME)):
        model = tiny_llama(attn=attn)
        cache = cls(model.config, scheme, window=4, sinks=2, **kw)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            hf_meter.set_current(None)
            out = model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits
        runs.append((out, cache))
    (ref_out, ref), (fus_out, fus) = runs
    assert fus.fused_reads == 2 and len(fus.row_records) == len(ref.row_records) == 2
    torch.testing.assert_close(fus_out, ref_out, rtol=1e-4, atol=1e-4)
    return ref, fus


def _repair_0_2(cache, t):
    if t == 2:  # non-adjacent KV heads of layer 0: the fused read takes them in two runs
        cache.layers[0].repair([0, 2])


def _climb_0_2(cache, t):
    """ladder:1 never promotes on its own: KV heads 0 and 2 of layer 0 climb kivi2's rungs by hand (0 to rung 2)."""
    if t in (2, 4):
        cache.layers[0].promote([0, 2] if t == 2 else [0])


@pytest.mark.parametrize("scheme,gate,kv_heads,hook,offload", [
    ("int4", "certified:0.4", 4, None, "full"), ("int4", "certified:0.39", 2, None, "full"), ("int4", "risk:2", 2, None, "full"),
    ("int8_dither", "certified:0.022", 2, None, "full"), ("int8", "risk:0", 4, _repair_0_2, "full"),
    ("int4", "ladder:0.39", 2, None, "full"), ("kivi2", "ladder:1", 4, _climb_0_2, "full"),
    ("int4", "certified:0.39", 2, None, "residual"), ("int8", "risk:0", 4, _repair_0_2, "residual")])
def test_gated_decode_matches_meter(monkeypatch, scheme, gate, kv_heads, hook, offload):
    """The gate on the fused read (certified:TAU, ladder:TAU, risk:K; offload "full" or "residual") against the
    meter's twin gate: the same heads promoted (rungs, repairs) at the same steps, the same logits, pre-gate and
    served certificates within the epilogue's room (a head repaired with offload "full" is read from the exact copy:
    certificate 0), the dither estimate taking the certificate on repaired heads. The runs below promote heads
    mid-generation and leave others on their codes (the ladder runs hold heads on rungs below exact); two runs
    repair two non-adjacent KV heads by hand (as risk:K does), which the fused read takes in two calls."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ids = tiny_ids(B=2, N=70)
    kw = dict(window=8, sinks=4, scheme=scheme, gate=gate, kv_heads=kv_heads, before_step=hook, seed=11, offload=offload)
    ref_logits, ref = _run(TwinCache, "kvcert", ids, 8, **kw)
    fus_logits, fus = _run(CertifiedCache, hf_fused.NAME, ids, 8, **kw)
    assert all(layer.fused_ok() for layer in fus.layers) and fus.fused_reads == 8 * 2
    torch.testing.assert_close(fus_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert len(fus.records) == len(ref.records) == 16
    for r, f in zip(ref.records, fus.records):
        assert torch.equal(r["repaired"], f["repaired"]) and r["fresh_repairs"] == f["fresh_repairs"], (r["step"], r["layer"])
        assert torch.equal(r["rung"], f["rung"]), (r["step"], r["layer"])
        rep = f["repaired"].repeat_interleave(2)  # [H] (tiny_llama: two query heads per KV head)
        if offload == "full":
            assert bool((f["min"][:, rep] < 1e-3).all())  # exact keys from the exact copy: the rounding terms alone
        for name in ("pre_min", "min"):
            # kivi2's 2-bit codes: the epilogue's O(cm^2) room (test_decode_matches_meter), cm ~0.5 before promotion
            room = 1.01 + (0.25 if scheme == "kivi2" else 0)
            assert bool((f[name] >= r[name] * (1 - 1e-5)).all()) and bool((f[name] <= r[name] * room + 1e-6).all()), name
        if "dither_estimate" in r:
            est, want = f["dither_estimate"], r["dither_estimate"]
            assert bool((est >= want * (1 - 1e-2)).all()) and bool((est <= want * (1 + 1e-3) + 1e-6).all())
    if gate.startswith(("certified", "ladder")) and scheme != "int8_dither" and hook is None:  # the runs exercise the gate
        assert any(f["fresh_repairs"] and f["step"] > 1 for f in fus.records)
        assert not all(bool(layer.repaired.all()) for layer in fus.layers)
    if gate.startswith("ladder"):  # heads served from a rung between the codes and exact
        assert any(bool(((f["rung"] > 0) & ~f["repaired"]).any()) for f in fus.records)
    if hook is _repair_0_2:
        assert fus.layers[0].repaired.tolist() == [True, False, True, False]
    if hook is _climb_0_2:
        assert fus.layers[0].rung.tolist() == [2, 0, 1, 0] and not bool(fus.layers[0].repaired.any())


@pytest.mark.parametrize("scheme,gate,offload", [("int8", "none", "full"), ("kivi2", "none", "full"),
                                                 ("int4", "ladder:0.39", "full"), ("int4", "certified:0.39", "residual")])
def test_value_bound_matches_meter(monkeypatch, scheme, gate, offload):
    """value_bound=True on the fused read (the output bound from the kernel's sums: attention.output_error_from_kernel)
    against the meter's twin: the same logits and promotions, out_err within a few percent of the twin's (the radii's centre is the
    layer's first served mean, not each read's: either is sound), and >= the true ||o - out|| of shadow mode."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ids = tiny_ids(B=2, N=70)
    kw = dict(window=8, sinks=4, scheme=scheme, gate=gate, offload=offload, value_bound=True, shadow=True)
    ref_logits, ref = _run(TwinCache, "kvcert", ids, 6, **kw)
    fus_logits, fus = _run(CertifiedCache, hf_fused.NAME, ids, 6, **kw)
    assert all(layer.fused_ok() for layer in fus.layers) and fus.fused_reads == 6 * 2
    torch.testing.assert_close(fus_logits, ref_logits, rtol=1e-4, atol=1e-4)
    for r, f in zip(ref.records, fus.records):
        assert torch.equal(r["rung"], f["rung"]) and bool((f["true_out_err"] <= f["out_err"]).all())
        ratio = f["out_err"] / r["out_err"]
        assert bool((ratio > 0.95).all() and (ratio < 1.2).all()), (f["step"], f["layer"], ratio)
    if gate != "none":
        assert any(f["fresh_repairs"] for f in fus.records)


def test_gated_second_turn_rows_match_the_meter(monkeypatch):
    """A multi-token read through the gate: the worst row of each KV head decides its repair, as in the meter."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ref, fus = _second_turn("int4", gate="certified:0.38")
    assert sum(f["fresh_repairs"] for f in fus.row_records) == 1
    for r, f in zip(ref.row_records, fus.row_records):
        assert torch.equal(r["repaired"], f["repaired"]) and r["fresh_repairs"] == f["fresh_repairs"]
        for name in ("pre_min", "min"):
            assert bool((f[name] >= r[name] * (1 - 1e-5)).all()) and bool((f[name] <= r[name] * 1.01 + 1e-6).all()), name


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_readable_flags_changed_in_place_are_read(mode):
    """Segment 0 is reused across steps (appends to the tail do not rebuild it), and segment 1's buffers too
    (update writes the new tail rows there), but a readable flag of a quantized token, a sink or a tail token changed
    in place is read at the next step: the same logits and certificates as a run that rebuilds every segment at every
    step (a stale segment would still read the masked tokens), and different from a run without the masks. Also under
    torch.inference_mode, whose tensors keep no version counter (writes to them are not counted: compared by content)."""
    ids = tiny_ids(B=2, N=60)
    nqs = set()

    def mask(cache, t, rebuild=False):
        nqs.add(cache.layers[0].nq)  # no flush during the run: segment 0 is reused unless it is rebuilt
        if t in (2, 4):
            for layer in cache.layers:
                layer.valid[1, :, 20 + t] = False  # a quantized token of row 1
                layer.valid[0, :, t // 2] = False  # a sink of row 0
        if t == 3:  # alone: segment 0 is reused, segment 1's flags must be copied again
            for layer in cache.layers:
                layer.valid[1, :, layer.nq + 1] = False  # an exact tail token of row 1
        for layer in cache.layers:
            if rebuild:
                layer._seg0 = layer._seg1 = None
    reuse, c1 = _run(FusedCertifiedCache, hf_fused.NAME, ids, 6, before_step=mask, window=8, sinks=4, mode=mode)
    fresh, c2 = _run(FusedCertifiedCache, hf_fused.NAME, ids, 6, before_step=lambda c, t: mask(c, t, True),
                     window=8, sinks=4)
    plain, _ = _run(FusedCertifiedCache, hf_fused.NAME, ids, 6, window=8, sinks=4)
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
    cache = FusedCertifiedCache(model.config, "int8", window=4, sinks=2)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        hf_meter.set_current(None)
        model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True)
    assert cache.fused_reads == 2
    assert len(cache.records) == 0 and len(cache.row_records) == 2  # one per layer, as the meter writes them
    rec = cache.row_records[-1]
    assert rec["pos"].tolist() == list(range(50, 55)) and tuple(rec["min"].shape) == (1, 5, 4)
    assert bool((rec["min"] >= 0).all()) and bool((rec["min"] <= 1).all())


def test_dither_second_turn_rows_match_the_meter(monkeypatch):
    """Dithered codes in a multi-token read (a second turn over a cache, batch 2): the kernel's rows (dither regenerated
    at read, the estimate from its sums) against the meter's twin rows (served copy, fp64 dither_forms): the same
    outputs up to fp32 order, every row's certificate and dither estimate within the room of the epilogue."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ref, fus = _second_turn("int8_dither", seed=3)
    for r, f in zip(ref.row_records, fus.row_records):
        assert f["dither_estimate"].shape == r["dither_estimate"].shape == (2, 5, 4)
        assert bool((f["min"] >= r["min"] * (1 - 1e-5)).all())
        est, want = f["dither_estimate"], r["dither_estimate"]
        assert bool((est >= want * (1 - 1e-2)).all()) and bool((est <= want * (1 + 1e-3) + 1e-6).all())


def test_block_flush_keeps_the_window_exact():
    ids = tiny_ids(B=1, N=70)
    _, cache = _run(FusedCertifiedCache, hf_fused.NAME, ids, 40, window=8, sinks=4)
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
    _, cache = _run(FusedCertifiedCache, hf_fused.NAME, tiny_ids(B=2, N=60), 3, window=8, sinks=4)
    assert len(cache.records) == len(seen) == 3 * 2
    for rec, (tmin, t) in zip(cache.records, seen):
        assert bool((t > 0).all())
        assert bool((rec["min"].double() >= torch.clamp(tmin[:, -1] + t, max=1.0)).all())


def _evict_index(B, Hkv):
    """[B, Hkv, 22] kept storage positions of a 40-token prefill (sinks 0..3, tail 32..39 in the overlay after
    keep_tokens): KV head 0 keeps the 4 sinks and the whole tail (12 overlay tokens), head 1 one sink and one
    tail token (2): the overlay of head 1 is padded with 10 entries."""
    h0 = [0, 1, 2, 3, *range(10, 20), *range(32, 40)]
    h1 = [0, *range(5, 25), 39]
    return torch.tensor([h0, h1][:Hkv]).expand(B, Hkv, 22).contiguous()


def test_eviction_reads_each_overlay_token_once(monkeypatch):
    """After keep_tokens with KV heads that keep different numbers of exact-overlay tokens, the fused read
    is the attention over the cache's tokens (each once): the same logits and certificates as the meter's
    twin on CertifiedCache, and at one read, the output is softmax over exactly the kept served keys
    and the certificate bounds TV against softmax over the exact keys of the kept tokens (from an exact
    prefill the caches never touched)."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ids = tiny_ids(B=2, N=40)

    def evict(cache, t):
        if t == 0:
            for l, layer in enumerate(cache.layers):
                cache.keep_tokens(l, _evict_index(layer.B, layer.Hkv))
    ref_logits, ref_cache = _run(TwinCache, "kvcert", ids, 4, before_step=evict, window=8, sinks=4)
    fus_logits, fus_cache = _run(FusedCertifiedCache, hf_fused.NAME, ids, 4, before_step=evict, window=8, sinks=4)
    assert fus_cache.fused_reads == 4 * 2
    ex = fus_cache.layers[0]
    assert ex.ex_idx.shape[2] == 12 and bool(ex.ex_on.all())  # head 1's overlay: 2 tokens + 10 switched-on duplicates
    assert len(set(ex.ex_idx[0, 1].tolist())) == 2
    torch.testing.assert_close(fus_logits, ref_logits, rtol=1e-4, atol=1e-4)
    for r, f in zip(ref_cache.records, fus_cache.records):
        for name in FORMS:
            assert bool((f[name] >= r[name] * (1 - 1e-5)).all()), name
            assert bool((f[name] <= r[name] * (1 + 1e-2) + 1e-6).all()), name

    # one read of layer 1 with a chosen query, against exact keys from an exact prefill
    model = tiny_llama()
    with torch.no_grad():
        exact = model(input_ids=ids, use_cache=True).past_key_values.layers[1]
    fmodel = tiny_llama(attn=hf_fused.NAME)
    cache = FusedCertifiedCache(fmodel.config, "int8", window=8, sinks=4)
    with torch.no_grad():
        fmodel(input_ids=ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    index = _evict_index(2, 2)
    cache.keep_tokens(1, index)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 32, generator=g) * 2
    scale = 32 ** -0.5
    cache.records.clear()
    out = hf_fused.fused_read(layer, q, scale)  # [B, 1, H, D]
    hf_fused.flush_certificates(cache)
    tv_bound = cache.records[-1]["pre_min"]  # [B, H]
    ks, vs = hf_fused.CertifiedLayer.served(layer)  # [B, Hkv, 22, D]: each kept token once
    take = lambda t: torch.gather(t, 2, index[..., None].expand(-1, -1, -1, 32))
    kx = take(exact.keys)
    for b in range(2):
        for h in range(4):
            kv = h // 2
            w = torch.softmax((ks[b, kv].double() @ q[b, h, 0].double()) * scale, 0)
            want = w @ vs[b, kv].double()
            torch.testing.assert_close(out[b, 0, h].double(), want, rtol=1e-5, atol=1e-6)
            p = torch.softmax((kx[b, kv].double() @ q[b, h, 0].double()) * scale, 0)
            tv = 0.5 * float((p - w).abs().sum())
            assert tv <= float(tv_bound[b, h]), (b, h, tv, float(tv_bound[b, h]))


def test_huge_key_error_mid_generation_gives_a_vacuous_record(monkeypatch):
    """Regression (issue 19 #6): a key whose witness exceeds the largest regular log code (~3.4e3) raised
    ValueError in pack_witness when it left the exact window, in the middle of generation. Now it takes the
    reserved top code (decodes to the largest fp32, >= any finite witness): every step still gets its records,
    the meter's shadow run shows them sound against the true TV (exact keys), the heads reading the key get
    the vacuous bound 1, and the fused cache's records equal the meter's there."""
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)
    ids = tiny_ids(B=1, N=20)

    def poison(cache, t):
        if t == 1:  # the newest token's key in KV head 1 of layer 0, scaled up while it is exact (tail)
            layer = cache.layers[0]
            layer.k_tail[:, 1, -1] *= 1e6
            if layer.exact_k is not None:
                layer.exact_k[:, 1, -1] *= 1e6
    steps = 14  # the token leaves the 8-token window (and is quantized, witness packed) at step 9
    ref_logits, ref_cache = _run(TwinCache, "kvcert", ids, steps, before_step=poison, window=8, sinks=4, shadow=True)
    fus_logits, fus_cache = _run(FusedCertifiedCache, hf_fused.NAME, ids, steps, before_step=poison, window=8, sinks=4)
    assert len(ref_cache.records) == len(fus_cache.records) == steps * 2
    assert int(ref_cache.layers[0].rho_codes[:, 1].max()) == 255  # the reserved top code was used
    for r in ref_cache.records:
        assert bool((r["true_tv"] <= r["pre_min"]).all()), r["step"]
        assert bool(torch.isfinite(r["pre_min"]).all())
    late = [r for r in fus_cache.records if r["layer"] == 0 and r["step"] >= 10]
    assert late and all(bool((r["pre_min"][:, 2:] == 1).all()) for r in late)  # query heads 2, 3 read KV head 1
    for r, f in zip(ref_cache.records, fus_cache.records):
        assert bool((f["pre_min"] >= r["pre_min"] * (1 - 1e-5)).all()), (f["step"], f["layer"])


def _true_tv(layer, exact_keys, q, scale):
    """[B, H] TV(softmax over the exact keys, softmax over the keys the layer serves) in fp64, query head h reading KV
    head h // (H / Hkv): the truth a read's certificate must bound."""
    ks, _ = hf_fused.CertifiedLayer.served(layer)
    rep = q.shape[1] // ks.shape[1]
    qd = q[:, :, 0].double()
    w = torch.softmax(torch.einsum("bhnd,bhd->bhn", ks.double().repeat_interleave(rep, 1), qd) * scale, -1)
    p = torch.softmax(torch.einsum("bhnd,bhd->bhn", exact_keys.double().repeat_interleave(rep, 1), qd) * scale, -1)
    return 0.5 * (p - w).abs().sum(-1)


@pytest.mark.parametrize("scheme", ["int4", "fp8_e5m2", "fp8_e4m3_rtz"])
def test_fused_certificate_bounds_true_tv(scheme):
    """Soundness against the truth (exact keys): int4 and fp8 codes through the fused cache, a read of layer 1 with a
    chosen query; the exact keys from an exact prefill the cache never touched; TV(softmax over exact keys,
    softmax over the served keys) <= the record's bound, per (sequence, query head). Shadow mode's true_tv (from the
    cache's own exact copy) is that truth, for a decode read and for the last of three rows (it sees every token)."""
    ids = tiny_ids(B=2, N=48)
    model = tiny_llama()
    with torch.no_grad():
        exact = model(input_ids=ids, use_cache=True).past_key_values.layers[1]
    fmodel = tiny_llama(attn=hf_fused.NAME)
    cache = FusedCertifiedCache(fmodel.config, scheme, window=8, sinks=4, shadow=True)
    with torch.no_grad():
        fmodel(input_ids=ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    code_dtype = {"int4": torch.uint8, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3_rtz": torch.uint8}[scheme]
    assert layer.fused_ok() and layer.nq > 0 and layer.kq.qt.codes.dtype == code_dtype
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 32, generator=g) * 3
    scale = 32 ** -0.5
    cache.records.clear()
    hf_fused.fused_read(layer, q, scale)
    hf_fused.flush_certificates(cache)
    bound = cache.records[-1]["pre_min"]  # [B, H]
    tv = _true_tv(layer, exact.keys, q, scale)
    assert bool((tv > 0).all() and (tv <= bound).all() and (bound < 1).all()), (tv, bound)
    torch.testing.assert_close(cache.records[-1]["true_tv"].double(), tv, rtol=1e-5, atol=1e-7)
    rows = torch.cat([torch.randn(2, 4, 2, 32, generator=g), q], 2)  # row 2: the decode query, at position n - 1
    hf_fused.fused_read(layer, rows, scale)
    rec = cache.row_records[-1]
    assert rec["true_tv"].shape == (2, 3, 4) and bool((rec["true_tv"] <= rec["min"]).all())
    torch.testing.assert_close(rec["true_tv"][:, 2].double(), tv, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind,offload", [("certified", "full"), ("ladder", "full"), ("certified", "residual")])
def test_gated_fused_certificate_bounds_true_tv(kind, offload):
    """Soundness of the gated fused read against the truth: int4 codes, the gate's TAU set between the two KV heads'
    worst certificates of the same read without a gate, so one head is promoted (certified: exact, from the exact copy
    or as codes plus residual; ladder: one rung up or more, int4 + int4 residual, + int8, exact) and the other served
    from its codes; TV(softmax over the exact keys of an exact prefill the cache never touched, softmax over the
    keys each head is served) <= the record's bound, per (sequence, query head)."""
    ids = tiny_ids(B=2, N=48)
    with torch.no_grad():
        exact = tiny_llama()(input_ids=ids, use_cache=True).past_key_values.layers[1]
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5)) * 3
    scale = 32 ** -0.5

    def read(gate):
        fmodel = tiny_llama(attn=hf_fused.NAME)
        cache = CertifiedCache(fmodel.config, "int4", window=8, sinks=4, gate=gate, offload=offload)
        with torch.no_grad():
            fmodel(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.records.clear()
        hf_fused.fused_read(cache.layers[1], q, scale)
        hf_fused.flush_certificates(cache)
        return cache.layers[1], cache.records[-1]

    _, plain = read("none")
    worst = hf_meter._slot(plain["min"], 2)
    tau = float(worst.min() + worst.max()) / 2
    layer, rec = read(f"{kind}:{tau}")
    assert layer.fused_ok() and (rec["rung"] > 0).tolist() == (worst > tau).tolist() and rec["fresh_repairs"] >= 1
    tv = _true_tv(layer, exact.keys, q, scale)  # the promoted head as served; the other: its int4 codes
    assert bool((tv <= rec["min"]).all() and (rec["min"] < 1).all()), (tv, rec["min"])
    exact_heads = rec["repaired"] & (offload == "full")  # served from the exact copy: no error at all
    assert (tv > 0).tolist() == [[not bool(exact_heads[h // 2]) for h in range(4)]] * 2, tv
