"""Every read of a quantized key is certified on the transformers path (issue 10): a second
`generate` on the same CertifiedCache (second turn) and chunked prefill read the quantized cache
with several query rows; each (row, layer, head) gets a certificate (cache.row_records), checked
against the true TV from the exact shadow copy, and the output bound (T5) against the exact
output. The first prefill of an empty cache reads exact keys only and makes no record."""

import pytest
import torch

from fast.integrations.hf_cache import CertifiedCache
from fast.integrations.hf_meter import enable
from tests.tiny_model import tiny_ids, tiny_llama

FORMS = ("min", "tanh", "one_minus_b_over_a", "e_form")


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


def gen(model, ids, cache, n=4, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0, **kw)


def check_sound(recs, L, T=None):
    """Every form >= true TV and out_err >= ||o - out|| on every (row, head) of every record; not vacuous."""
    assert recs and len(recs) % L == 0
    worst = 0.0
    for r in recs:
        assert r["min"].dim() == 3 and r["true_tv"].shape == r["min"].shape  # [B, T, H]
        if T is not None:
            assert r["min"].shape[1] == T and r["pos"].shape == (T,)
        for f in FORMS:
            assert bool((r["true_tv"] <= r[f]).all()), f"{f}: true TV {r['true_tv'].max()} above the bound"
        assert bool((r["true_out_err"] <= r["out_err"]).all()), "output bound violated"
        worst = max(worst, float(r["true_tv"].max()))
    assert worst > 0  # the cache is really compressed: the check is not vacuous


@pytest.mark.parametrize("scheme", ["int8", "int4", "int8_dither", "fp8_e4m3"])
def test_second_turn_certified(model, scheme):
    """A second generate on the same cache: every row of the new turn is certified and sound."""
    cache = CertifiedCache(model.config, scheme, sinks=0, window=0, shadow=True, value_bound=True)
    first = gen(model, tiny_ids(1, 40), cache)
    assert cache.row_records == []  # the first prefill read exact keys only: nothing to certify
    L = model.config.num_hidden_layers
    n_dec = len(cache.records)
    turn2 = torch.cat([first, tiny_ids(1, 10, seed=7)], 1)
    out = gen(model, turn2, cache)
    T = turn2.shape[1] - (first.shape[1] - 1)  # the last token of turn 1 was never written
    assert len(cache.row_records) == L and len(cache.records) == n_dec + 3 * L
    check_sound(cache.row_records, L, T)
    assert cache.row_records[0]["pos"].tolist() == list(range(first.shape[1] - 1, turn2.shape[1]))
    if scheme == "int8_dither":
        for r in cache.row_records:
            assert bool((r["true_tv"] <= r["dither_estimate"]).all())
    # the second turn decodes as the exact model does over the same context (int8: same tokens)
    if scheme == "int8":
        with torch.no_grad():
            ref = model.generate(turn2, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out[0, turn2.shape[1]:].tolist() == ref[0, turn2.shape[1]:].tolist()


def test_chunked_prefill_certified(model):
    """A prompt fed in three chunks: chunks 2 and 3 read the quantized chunk 1 (and each other),
    each row certified; the logits agree with the exact model's one-shot forward."""
    ids = tiny_ids(1, 60, seed=3)
    cache = CertifiedCache(model.config, "int8", sinks=0, window=0, shadow=True, value_bound=True)
    with torch.no_grad():
        logits = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in ((0, 20), (20, 45), (45, 60))]
        full = model(ids).logits
    L = model.config.num_hidden_layers
    assert len(cache.row_records) == 2 * L and cache.records == []
    assert [r["pos"].tolist() for r in cache.row_records[::L]] == [list(range(20, 45)), list(range(45, 60))]
    check_sound(cache.row_records, L)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=0, atol=0.05)  # int8 keys and values: small error


def test_chunked_prefill_gate_repairs(model):
    """certified:TAU also guards multi-row reads: a head over TAU is repaired before the rows are served."""
    ids = tiny_ids(1, 50, seed=4)
    cache = CertifiedCache(model.config, "int4", sinks=0, window=0, shadow=True, gate="certified:0.001")
    with torch.no_grad():
        model(ids[:, :30], past_key_values=cache, use_cache=True)
        model(ids[:, 30:], past_key_values=cache, use_cache=True)
    recs = cache.row_records
    assert sum(r["fresh_repairs"] for r in recs) > 0
    for r in recs:
        Hkv = r["repaired"].shape[0]
        slot = r["min"].amax(dim=(0, 1)).view(Hkv, -1).amax(1)
        assert bool((slot[~r["repaired"]] <= 0.001).all())  # every head left unrepaired is under TAU
        assert bool((r["true_tv"] <= r["min"]).all())


def test_left_padded_second_turn(model):
    """Batch with left padding in the first turn, then a second chunk for both rows: padding never
    enters a certificate, and every row is sound."""
    a, b = tiny_ids(1, 40, seed=3), tiny_ids(1, 25, seed=4)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 15, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 40), torch.cat([torch.zeros(1, 15), torch.ones(1, 25)], 1)]).long()
    cache = CertifiedCache(model.config, "int8", sinks=0, window=0, shadow=True, value_bound=True)
    more = tiny_ids(2, 6, seed=9)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        model(more, attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1), past_key_values=cache, use_cache=True)
    L = model.config.num_hidden_layers
    check_sound(cache.row_records, L, 6)
    assert not bool(cache.layers[0].valid[1, :, :15].any())


@pytest.mark.model
def test_smollm2_second_turn_certified():
    """Real model: a chat's second turn over an int4 cache, every row of it certified and sound."""
    from fast.tools.cli import load
    from fast.integrations.model import chat_ids
    model, tok = load()
    ids = torch.tensor([chat_ids(tok, "Name three colours of the rainbow.")])
    cache = CertifiedCache(model.config, "int4", sinks=0, window=0, shadow=True, value_bound=True)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=tok.pad_token_id)
        turn2 = torch.cat([first, torch.tensor([chat_ids(tok, "And two more?")])], 1)
        model.generate(turn2, max_new_tokens=3, do_sample=False, past_key_values=cache, pad_token_id=tok.pad_token_id)
    check_sound(cache.row_records, model.config.num_hidden_layers)


@pytest.mark.parametrize("scheme,gate,offload", [("int8", "none", "full"), ("int4", "none", "full"), ("fp8_e5m2", "none", "full"),
                                                 ("kivi2", "none", "full"), ("int4", "certified:0.01", "residual")])
def test_decode_output_bound(model, scheme, gate, offload):
    """T5 on every decode read: ||o - out|| (exact keys and values, fp64) <= out_err; the value
    witness costs 4 bytes per (layer, KV head, quantized token), counted in device bytes."""
    kw = dict(sinks=0, window=0, gate=gate, offload=offload)
    cache = CertifiedCache(model.config, scheme, shadow=True, value_bound=True, **kw)
    gen(model, tiny_ids(1, 70), cache, n=6)
    true = torch.stack([r["true_out_err"] for r in cache.records])
    bound = torch.stack([r["out_err"] for r in cache.records])
    assert bool((true <= bound).all()) and float(true.max()) > 0
    if gate != "none":
        assert sum(r["fresh_repairs"] for r in cache.records) > 0
        return
    plain = CertifiedCache(model.config, scheme, shadow=True, **kw)
    gen(model, tiny_ids(1, 70), plain, n=6)
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    extra = cache.memory()["device_bytes"] - plain.memory()["device_bytes"]
    assert extra == 4 * L * Hkv * cache.layers[0].nq


def test_rows_uncertified_baseline_matches(model):
    """certify=False (the speed baseline) serves the same multi-row output as the certified path."""
    ids = tiny_ids(1, 50, seed=5)
    outs = []
    for certify in (True, False):
        cache = CertifiedCache(model.config, "int8", sinks=0, window=0, certify=certify)
        with torch.no_grad():
            model(ids[:, :30], past_key_values=cache, use_cache=True)
            outs.append(model(ids[:, 30:], past_key_values=cache, use_cache=True).logits)
        assert len(cache.row_records) == (model.config.num_hidden_layers if certify else 0)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)  # fp32 both; different matmul order


def test_bf16_model_out_err_covers_the_cast():
    """A bf16 model gets out.to(bf16): out_err covers that cast (issue 19). The truth: ||o - served|| with o
    the exact output the shadow copy gives (fp64, exact keys and values) and served the attention output
    the model's o_proj actually receives (captured at its input)."""
    from fast.integrations import hf_meter
    model = enable(tiny_llama()).to(torch.bfloat16)
    exact, served = [], []
    orig = hf_meter.exact_output

    def spy(p, v, Hkv):
        exact.append(orig(p, v, Hkv))
        return exact[-1]
    hf_meter.exact_output = spy
    hooks = [l.self_attn.o_proj.register_forward_pre_hook(lambda m, a: served.append(a[0].detach().clone()))
             for l in model.model.layers]
    try:
        cache = CertifiedCache(model.config, "int8", sinks=0, window=64, shadow=True, value_bound=True)
        gen(model, tiny_ids(1, 20), cache, n=3)
    finally:
        hf_meter.exact_output = orig
        for h in hooks:
            h.remove()
    assert len(cache.records) == len(exact) > 0
    for r, o, s in zip(cache.records, exact, served[-len(exact):]):
        B, H, D = o.shape
        true = (o - s.view(B, H, D).double()).norm(dim=-1)
        assert bool((true <= r["out_err"].double()).all()), (true, r["out_err"])
        assert float(true.max()) > 1e-5  # the bf16 cast is visible: the check is not vacuous
