"""CertifiedCache on a random tiny GQA Llama: storage, append-only writes, soundness in shadow
mode, generate (greedy, sampling, left-padded batches), eviction hook, scheme registry."""

import pytest
import torch

from fast.integrations.hf_cache import CertifiedCache
from fast.integrations.hf_meter import enable
from fast.core.schemes import CODECS, SchemeError, get_scheme, register_scheme, unregister_scheme
from tests.tiny_model import tiny_ids, tiny_llama

SCHEMES = CODECS + ("kivi2", "kivi2_dither")


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


def gen(model, ids, cache=None, n=6, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0, **kw)


def stacked(cache, key):
    return torch.stack([r[key] for r in cache.records])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shadow_bound_holds_every_check(model, scheme):
    """Every form of every (step, layer, head) check is >= the true TV (no sinks, no window)."""
    cache = CertifiedCache(model.config, scheme, sinks=0, window=0, shadow=True)
    gen(model, tiny_ids(1, 70), cache, n=8)
    true = stacked(cache, "true_tv")
    assert true.shape == (7 * 2, 1, 4)
    for form in ("min", "tanh", "one_minus_b_over_a", "e_form"):
        bound = stacked(cache, form)
        assert bool((true <= bound).all()), f"{scheme}/{form}: true TV {true.max()} above the bound"
    assert float(true.max()) > 0  # the check is not vacuous: the cache is really compressed
    if get_scheme(scheme).dither:  # int8_dither, int4_dither, kivi2_dither: the estimate is recorded
        assert bool((true <= stacked(cache, "dither_estimate")).all())


@pytest.mark.parametrize("scheme", ["int8", "int4", "int8_dither", "int4_dither", "kivi2_dither"])
def test_derived_witness_bound_holds_every_check(model, scheme):
    """The zero-memory witness from the codec's step (derived=True: |k - k~| <= step/2 elementwise,
    kivi2_dither's step max(scale, |zero| 2^-7)(1 + 2^-10) included) bounds the true TV at every check."""
    assert get_scheme(scheme).derived_witness
    cache = CertifiedCache(model.config, scheme, sinks=0, window=0, shadow=True, derived=True)
    gen(model, tiny_ids(1, 70), cache, n=8)
    assert all(layer.derived for layer in cache.layers)
    true, bound = stacked(cache, "true_tv"), stacked(cache, "min")
    assert bool((true <= bound).all()), f"{scheme}: true TV {float(true.max())} above the derived bound"
    assert float(true.max()) > 0
    for layer in cache.layers:  # the witness itself: rho_b >= ||(k - k~)_b|| per band (fp64), tight within 3x
        rho, exact = layer.witness_view()
        served, _ = layer.served()
        r = layer.exact_k.double() - served.double()
        norms = torch.stack([r[..., b].norm(dim=-1) for b in cache.bands], -1)  # [B, Hkv, N, NB]
        q = ~exact
        assert bool((norms[q] <= rho[q].double()).all()), scheme
        assert float((norms[q] / rho[q].double()).max()) > 1 / 3, scheme


def test_int8_cache_matches_exact_generation(model):
    ids = tiny_ids(1, 60)
    ref = gen(model, ids, n=8)
    out = gen(model, ids, CertifiedCache(model.config, "int8"), n=8)
    assert out.tolist() == ref.tolist()


def test_each_token_quantized_once(model):
    """Append-only: the scheme sees every token that left the exact window exactly once."""
    seen = []

    def fn(x):
        seen.append(x.shape[2])
        return x.half().float()

    register_scheme("count_tokens", fn, deterministic=False)  # one call per write
    try:
        seen.clear()
        cache = CertifiedCache(model.config, "count_tokens", sinks=0, window=5)
        gen(model, tiny_ids(1, 30), cache, n=6)
        L = model.config.num_hidden_layers
        n = cache.layers[0].n
        assert n == 30 + 5
        assert sum(seen) == 2 * L * cache.layers[0].nq  # keys and values, every layer, each quantized token once
    finally:
        unregister_scheme("count_tokens")


def test_packed_bytes_are_real(model):
    """Codes are stored packed: int4 < int8 < fp16, measured with tensor.nbytes."""
    ids = tiny_ids(1, 128)
    mem = {}
    for scheme in ("int8", "int4", "kivi2"):
        cache = CertifiedCache(model.config, scheme, sinks=0, window=0)
        gen(model, ids, cache, n=2)
        mem[scheme] = cache.memory()
    L, Hkv, D = 2, 2, 32
    fp16 = mem["int8"]["fp16_bytes_per_token"]
    assert fp16 == 2 * 2 * L * Hkv * D
    # int8: D code bytes + D/32 fp16 scales (k and v) + NB witness bytes (k) per head and layer
    assert mem["int8"]["device_bytes_per_token"] == pytest.approx(L * Hkv * (2 * (D + 2) + 8), rel=0.02)
    assert mem["int4"]["device_bytes_per_token"] < mem["int8"]["device_bytes_per_token"] < fp16
    assert mem["kivi2"]["device_bytes_per_token"] < mem["int4"]["device_bytes_per_token"]


def test_left_padded_batch_matches_single_rows(model):
    """Batch of two prompts with left padding: each row decodes as it does alone, and the
    padding never enters a certificate (shadow mode: still sound)."""
    a, b = tiny_ids(1, 50, seed=3), tiny_ids(1, 35, seed=4)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 15, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 50), torch.cat([torch.zeros(1, 15), torch.ones(1, 35)], 1)]).long()
    cache = CertifiedCache(model.config, "int8", shadow=True, sinks=2, window=4)
    out = gen(model, ids, cache, n=6, attention_mask=mask)
    alone_a = gen(model, a, CertifiedCache(model.config, "int8", sinks=2, window=4), n=6)
    alone_b = gen(model, b, CertifiedCache(model.config, "int8", sinks=2, window=4), n=6)
    assert out[0, 50:].tolist() == alone_a[0, 50:].tolist()
    assert out[1, 50:].tolist() == alone_b[0, 35:].tolist()
    assert not bool(cache.layers[0].valid[1, :, :15].any())
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


def test_sampling_generates_and_certifies(model):
    torch.manual_seed(0)
    cache = CertifiedCache(model.config, "fp8_e4m3", shadow=True)
    with torch.no_grad():
        out = model.generate(tiny_ids(1, 40), max_new_tokens=5, do_sample=True, temperature=1.0, past_key_values=cache)
    assert out.shape == (1, 45)
    assert len(cache.records) == 4 * 2
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


def test_sinks_and_window_are_exact(model):
    """c = 0 on sinks and the exact window: with every token exact only the kernel's own fp32
    logit rounding (math.md T8, a few 1e-5 here) is left in the bound."""
    cache = CertifiedCache(model.config, "int4", sinks=4, window=1000)
    gen(model, tiny_ids(1, 40), cache, n=4)
    assert float(stacked(cache, "min").max()) < 1e-3
    assert float(stacked(cache, "max_c").max()) < 1e-3
    cache = CertifiedCache(model.config, "int4", sinks=4, window=8)
    gen(model, tiny_ids(1, 40), cache, n=4)
    layer = cache.layers[0]
    _, exact = layer.witness_view()
    quantized = layer.n - layer.k_tail.shape[2]  # the fused read flushes in blocks: its tail may exceed the window
    assert layer.k_tail.shape[2] >= 8 and quantized > 4
    assert bool(exact[..., :4].all()) and bool(exact[..., quantized:].all()) and not bool(exact[..., 4:quantized].any())


def test_keep_tokens_shrinks_storage(model):
    """The eviction hook gathers codes, witness and exact overlay per KV head; decoding goes on soundly."""
    cache = CertifiedCache(model.config, "int8", sinks=2, window=4, shadow=True)
    with torch.no_grad():
        model(input_ids=tiny_ids(1, 48), past_key_values=cache, use_cache=True)
    before = cache.memory()["device_bytes"]
    layer = cache.layers[0]
    k_before, _ = layer.served()
    _, ex_before = layer.witness_view()
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(48, generator=g)[:20].sort().values for _ in range(2)])[None]  # [1, 2, 20]
    for l in range(model.config.num_hidden_layers):
        cache.keep_tokens(l, index)
    k_after, _ = layer.served()
    _, ex_after = layer.witness_view()
    assert k_after.shape[2] == 20 and cache.memory()["device_bytes"] < before
    torch.testing.assert_close(k_after, k_before.gather(2, index[..., None].expand(-1, -1, -1, 32)), rtol=0, atol=0)
    assert torch.equal(ex_after, ex_before.gather(2, index))
    with torch.no_grad():
        tok = torch.tensor([[5]])
        for _ in range(3):
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert len(cache.records) == 3 * 2 and layer.n == 23
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


def test_kivi2_roundtrip_and_blocks():
    x = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(0))
    s = get_scheme("kivi2")
    kq = s.encode_k(x, 0, 0, 0)
    assert kq.get("codes").dtype == torch.uint8 and kq.get("codes").shape == (1, 2, 64, 8)
    assert kq.get("scale").shape == (1, 2, 2, 32)  # per channel, per block of 32 tokens
    err = (kq.decode() - x).abs()
    span = x.reshape(1, 2, 2, 32, 32).amax(3) - x.reshape(1, 2, 2, 32, 32).amin(3)
    assert bool((err.reshape(1, 2, 2, 32, 32) <= span[:, :, :, None] / 6 * 1.01 + 1e-3).all())
    with pytest.raises(SchemeError, match="blocks of 32"):
        s.encode_k(x[:, :, :10], 0, 0, 0)


def test_registry_rejects_bad_functions():
    with pytest.raises(SchemeError, match="changed the shape"):
        register_scheme("bad_shape", lambda x: x[..., :-1])
    with pytest.raises(SchemeError, match="NaN"):
        register_scheme("bad_nan", lambda x: x * float("nan"))
    with pytest.raises(SchemeError, match="deterministic"):
        register_scheme("bad_random", lambda x: x + 1e-2 * torch.randn_like(x))
    register_scheme("ok_random", lambda x: x + 1e-2 * torch.randn_like(x), deterministic=False)
    unregister_scheme("ok_random")
    with pytest.raises(SchemeError, match="unknown scheme"):
        get_scheme("int3")
    with pytest.raises(SchemeError, match="built in"):
        register_scheme("int8", lambda x: x)


def test_registry_checks_every_call(model):
    """A function that turns bad on real data is caught at first use, not served."""
    calls = []

    def fn(x):
        calls.append(1)
        return x if len(calls) <= 2 else x * float("inf")  # the registration probe calls twice

    register_scheme("turns_bad", fn)
    try:
        with pytest.raises(SchemeError, match="NaN or Inf"):
            gen(model, tiny_ids(1, 40), CertifiedCache(model.config, "turns_bad", sinks=0, window=0), n=2)
    finally:
        unregister_scheme("turns_bad")


def test_registered_scheme_is_certified(model):
    """A black-box round trip (bf16 rounding) is measured, stored in fp16, and certified."""
    register_scheme("bf16_round", lambda x: x.bfloat16().float())
    try:
        cache = CertifiedCache(model.config, "bf16_round", sinks=0, window=0, shadow=True)
        gen(model, tiny_ids(1, 40), cache, n=4)
        assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())
        assert float(stacked(cache, "min").max()) > 0
    finally:
        unregister_scheme("bf16_round")


def test_cli_decode_with_evictor(model):
    """The integration point for fast.policies.evictors: evict after the prefill, then certified decoding."""
    from types import SimpleNamespace
    from fast.tools.cli import decode_evicting
    from fast.policies.evictors import make_evictor
    cache = CertifiedCache(model.config, "int8", sinks=4, window=8, shadow=True)
    ids = tiny_ids(1, 150, seed=5)[0].tolist()
    args = SimpleNamespace(max_new_tokens=5, evict_group_size=32, shadow=True, evict="snapkv:64", scheme="int8")
    out, info = decode_evicting(model, ids, cache, args, make_evictor("snapkv:64"), None, progress=False)
    assert info["eviction"].evicted and len(info["trace"]) == len(out) - 1
    assert cache.layers[0].n == 64 + len(out) - 1 and len(cache.records) == 2 * (len(out) - 1)
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


# ---- ownership: the cache owns what it measures (issue 8, defect 1) ----

def _coarse(x):
    return (x.float() * 4).round() / 4  # error up to 1/8 per element: a visibly compressed key


def _shadow_run(model, name, fn, window, n):
    """Register fn as `name`, decode n tokens in shadow mode (no sinks); (true TV, bound) per check."""
    register_scheme(name, fn)
    try:
        cache = CertifiedCache(model.config, name, sinks=0, window=window, shadow=True)
        gen(model, tiny_ids(1, 40), cache, n=n)
        return stacked(cache, "true_tv"), stacked(cache, "min")
    finally:
        unregister_scheme(name)


def test_scheme_writing_into_its_input_cannot_fake_the_witness(model):
    """A scheme that overwrites its input with its output (so that the exact key the witness is
    measured against would be the quantized one) gets a private copy: the bound still holds."""
    def fn(x):
        out = _coarse(x)
        x.copy_(out)  # scribble into the input
        return out

    true, bound = _shadow_run(model, "writes_input", fn, window=0, n=4)
    assert float(true.max()) > 1e-3  # really compressed
    assert bool((true <= bound).all()), f"true TV {float(true.max())} above the bound {float(bound.min())}"


def test_scheme_writing_into_the_exact_tail_cannot_reach_the_cache(model):
    """A scheme that writes into the whole buffer behind its input (where the cache keeps the
    exact window it serves with c = 0) only ever sees a private copy."""
    def fn(x):
        out = _coarse(x)
        whole = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())  # every element x's buffer holds
        whole.copy_(_coarse(whole))
        return out

    true, bound = _shadow_run(model, "writes_tail", fn, window=6, n=5)
    assert bool((true <= bound).all()), f"true TV {float(true.max())} above the bound"


def test_scheme_editing_its_output_later_cannot_change_what_is_served(model):
    """A scheme that keeps the fp16 tensor it returned and edits it on a later call: the cache
    stored its own copy, so what is served is what the witness was measured against."""
    outs = []

    def fn(x):
        if len(outs) >= 3:
            outs[-3].mul_(-1.0)  # three calls later: after the determinism check, after the witness
        out = _coarse(x).half()
        outs.append(out)
        return out

    true, bound = _shadow_run(model, "edits_output", fn, window=0, n=4)
    assert bool((true <= bound).all()), f"true TV {float(true.max())} above the bound"


def test_dither_tier_covers_the_fp32_logits(model, monkeypatch):
    """Every token exact (window covers the prompt): the dither tier must still cover the fp32
    rounding of the served logits, TV(exact p, softmax of the fp32 logits) (issue 8 defect 2)."""
    import fast.integrations.hf_meter as meter
    seen, inner = [], meter.decode_attention

    def spy(q, k, v, rho, scale, **kw):
        seen.append((q.clone(), k.clone(), scale, kw.get("valid")))
        return inner(q, k, v, rho, scale, **kw)

    monkeypatch.setattr(meter, "decode_attention", spy)
    cache = CertifiedCache(model.config, "int8_dither", sinks=0, window=1000, shadow=True, backend="torch")  # spies on the twin
    gen(model, tiny_ids(1, 40), cache, n=5)
    assert len(seen) == len(cache.records) > 0
    worst = 0.0
    for (q, k, s, valid), rec in zip(seen, cache.records):
        B, H, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        qg = q.view(B, Hkv, H // Hkv, D)
        x32 = (torch.matmul(qg, k.transpose(-1, -2)) * torch.tensor(s, dtype=torch.float32)).reshape(B, H, N)
        served = torch.softmax(x32.double(), -1)  # the fp32 logits the attention uses, softmax taken exactly
        exact = torch.softmax((torch.matmul(qg.double(), k.double().transpose(-1, -2)) * s).reshape(B, H, N), -1)
        tv = 0.5 * (served - exact).abs().sum(-1)
        worst = max(worst, float(tv.max()))
        assert bool((tv <= rec["dither_estimate"].double()).all()), (float(tv.max()), float(rec["dither_estimate"].min()))
    assert worst > 0  # the fp32 rounding is visible: the check is not vacuous


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "fp8_e5m2"])
def test_keep_tokens_on_fp8_caches(model, scheme):
    """Eviction on fp8 caches (gather is not implemented for Float8 on CPU: the cache gathers
    the bytes), then certified decoding stays sound."""
    cache = CertifiedCache(model.config, scheme, sinks=2, window=4, shadow=True)
    with torch.no_grad():
        model(input_ids=tiny_ids(1, 48), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    k_before, _ = layer.served()
    index = torch.stack([torch.randperm(48, generator=torch.Generator().manual_seed(h))[:20].sort().values for h in range(2)])[None]
    for l in range(model.config.num_hidden_layers):
        cache.keep_tokens(l, index)
    k_after, _ = layer.served()
    assert torch.equal(k_after, k_before.gather(2, index[..., None].expand(-1, -1, -1, 32)))
    with torch.no_grad():
        tok = torch.tensor([[5]])
        for _ in range(3):
            tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert len(cache.records) == 3 * 2
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


def test_tiny_delta_req_is_refused_up_front(model):
    """delta_req so small that the local budgets underflow: refused at construction, not mid-generation."""
    with pytest.raises(ValueError, match="underflow"):
        CertifiedCache(model.config, "int8_dither", delta_req=1e-320)
    CertifiedCache(model.config, "int8", delta_req=1e-320)  # no dither tier: the budget is unused


def test_cache_refuses_a_model_whose_attention_is_not_the_meter():
    """Certify or refuse: without enable_meter the model would read the quantized cache with plain
    sdpa (0 records, no warning); the cache raises at the first read of a non-empty layer instead."""
    plain = tiny_llama()  # attn "sdpa"
    cache = CertifiedCache(plain.config, "int8")
    with pytest.raises(RuntimeError, match="enable_meter"):
        gen(plain, tiny_ids(1, 40), cache, n=4)
    assert cache.records == [] and cache.row_records == []
    # certify=False is the explicit opt-out (the speed baseline): it generates
    gen(plain, tiny_ids(1, 40), CertifiedCache(plain.config, "int8", certify=False), n=4)
    # ... but never with an option that acts on a certificate: a gate would silently never fire
    for opts in ({"gate": "certified:0.2"}, {"gate": "ladder:0.5"}, {"gate": "risk:2"}, {"shadow": True},
                 {"value_bound": True}, {"box_form": True}):
        with pytest.raises(ValueError, match="certify=False"):
            CertifiedCache(plain.config, "int8", certify=False, **opts)


def test_threads_sharing_one_model_each_certify_every_read(model):
    """Several threads generating with one shared model, a cache each: every decode read of every
    thread is certified (the meter's current layer is per thread), with the single-thread results."""
    import threading
    ids = [tiny_ids(1, 50, seed=s) for s in range(8)]
    alone = [gen(model, x, CertifiedCache(model.config, "int8", seed=7), n=16).tolist() for x in ids]
    caches = [CertifiedCache(model.config, "int8", seed=7) for _ in ids]
    outs, errors = [None] * len(ids), []
    barrier = threading.Barrier(len(ids))

    def run(i):
        try:
            barrier.wait()
            outs[i] = gen(model, ids[i], caches[i], n=16).tolist()
        except Exception as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    import sys
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads between a layer's update and its attention call
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert outs == alone
    for c, x, out in zip(caches, ids, outs):
        steps = len(out[0]) - x.shape[1] - 1  # decode reads: every new token after the first (EOS may stop early)
        assert len(c.records) == steps * model.config.num_hidden_layers, "a read went uncertified"
