"""The precision ladder (gate ladder:TAU, issue 20 item 3) on the tiny GQA Llama: one rung at a
time, each rung certified on its own, its bytes, and its witness against exact keys captured from
the model before the cache saw them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.core.attention import decode_attention
from fast.core.quant import dequantize, quantize
from fast.core.witness import pack_witness, witness
from fast.integrations.hf_cache import LADDERS, CertifiedCache, Gate, parse_gate
from fast.integrations.hf_meter import enable
from tests.tiny_model import tiny_ids, tiny_llama


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


def gen(model, ids, cache, n=6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache)


def captured(cache):
    """Record, per layer, the exact keys and values the model hands to the cache (clones, before the
    cache stores or quantizes anything): the independent truth of the witness tests."""
    seen = {}
    inner = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = seen.get(layer_idx, (None, None))
        kk, vv = key_states.detach().clone(), value_states.detach().clone()
        seen[layer_idx] = (kk, vv) if k is None else (torch.cat([k, kk], 2), torch.cat([v, vv], 2))
        return inner(key_states, value_states, layer_idx, *args, **kwargs)
    cache.update = update
    return seen


def refined(k, base, rungs):
    """The ladder's served keys, computed here from the test's own exact keys: the base codec's round
    trip, then each rung's codec applied to what is left, added in order (per-token codecs)."""
    k_hat = dequantize(quantize(k.contiguous(), base))
    for r in rungs:
        k_hat = k_hat + dequantize(quantize((k - k_hat).contiguous(), r))
    return k_hat


def test_parse_ladder():
    assert parse_gate("ladder:0.2") == Gate("ladder", tau=0.2)
    assert str(parse_gate("ladder:0.2")) == "ladder:0.2"
    assert parse_gate("ladder:0.2").thresholded and parse_gate("certified:0.2").thresholded
    assert not parse_gate("risk:2").thresholded
    for bad in ("ladder", "ladder:", "ladder:2", "ladder:-0.1", "ladder:x"):
        with pytest.raises(ValueError):
            parse_gate(bad)


def test_bad_ladders_are_refused(model):
    cfg = model.config
    with pytest.raises(ValueError, match="rungs= applies"):
        CertifiedCache(cfg, "int4", gate="certified:0.2", rungs=("int8",))
    with pytest.raises(ValueError, match="a rung is one of"):
        CertifiedCache(cfg, "int4", gate="ladder:0.2", rungs=("int8_dither",))
    with pytest.raises(ValueError, match="a rung is one of"):
        CertifiedCache(cfg, "kivi2", gate="ladder:0.2", rungs=("kivi2",))
    with pytest.raises(ValueError, match="offload must be 'full'"):
        CertifiedCache(cfg, "int4", gate="ladder:0.2", offload="residual")
    assert CertifiedCache(cfg, "kivi2", gate="ladder:0.2").rungs == ("int4", "int4", "int8")
    assert CertifiedCache(cfg, "int4", gate="ladder:0.2", rungs=("int8",)).rungs == ("int8",)
    assert CertifiedCache(cfg, "int8", gate="ladder:0.2", rungs=()).rungs == ()  # straight to exact


@pytest.mark.parametrize("scheme", ["kivi2", "int4", "fp8_e5m2"])
def test_every_served_certificate_is_within_tau_or_exact(model, scheme):
    """The gate's contract: after the gate, every KV head's certificate is <= TAU or the head is exact;
    rungs only go up, by one per round, and promoted heads never exceeded TAU at their rung before."""
    top = len(LADDERS[scheme]) + 1
    free = CertifiedCache(model.config, scheme, sinks=0, window=0)
    gen(model, tiny_ids(1, 64, seed=11), free, n=4)
    worst = torch.stack([r["min"] for r in free.records]).amax()
    tau = float(worst) / 4  # every scheme trips somewhere
    cache = CertifiedCache(model.config, scheme, gate=f"ladder:{tau}", sinks=0, window=0, shadow=True)
    gen(model, tiny_ids(1, 64, seed=11), cache, n=4)
    prev = {}
    for r in cache.records:
        slot = r["min"].view(1, 2, 2).amax(dim=(0, 2))  # [Hkv]
        assert bool(((slot <= tau) | (r["rung"] == top)).all()), (r["step"], r["layer"], slot, r["rung"])
        assert torch.equal(r["repaired"], r["rung"] == top)
        assert bool((r["true_tv"] <= r["min"]).all())
        before = prev.get(r["layer"], torch.zeros(2, dtype=torch.long))
        assert bool((r["rung"] >= before).all())
        assert int((r["rung"] - before).sum()) == r["fresh_repairs"]  # each promotion is one rung
        prev[r["layer"]] = r["rung"]
    rungs = torch.stack(list(prev.values()))
    assert int(rungs.max()) >= 1 and sum(r["fresh_repairs"] for r in cache.records) > 0


def test_promoted_heads_serve_their_rung_of_the_exact_keys(model, monkeypatch):
    """A head promoted one rung serves exactly int4(k) + int4(k - int4(k)) of the captured exact keys
    (the refinement from the exact copy), its new tokens too, and its stored witness is the witness of
    that sum and bounds TV against the captured exact keys for random queries at several scales."""
    from fast.integrations import hf_fused
    monkeypatch.setattr(hf_fused, "FLUSH_BLOCK", 1)  # the fused read's window flushes every step, as the twin's
    ids = tiny_ids(2, 48, seed=12)
    cache = CertifiedCache(model.config, "int4", gate="ladder:1", sinks=0, window=0)
    seen = captured(cache)
    out = gen(model, ids, cache, n=2)
    layer = cache.layers[1]
    layer.promote([1])
    nq0 = layer.nq
    with torch.no_grad():  # one more decode step: its token of head 1 is refined too
        model(input_ids=out[:, -1:], past_key_values=cache, use_cache=True)
    k_exact, v_exact = seen[1]
    assert k_exact.shape[2] == layer.n
    k, v = layer.served()
    nq = layer.nq
    assert nq > nq0  # a token written after the promotion is in the quantized part
    assert torch.equal(k[:, 1:2, :nq], refined(k_exact[:, 1:2, :nq], "int4", ["int4"]))
    assert torch.equal(k[:, 0:1, :nq], refined(k_exact[:, 0:1, :nq], "int4", []))
    assert not torch.equal(k[:, 0, :nq], k_exact[:, 0, :nq])
    step4 = (k_exact[:, 0, :nq].abs().amax(-1, keepdim=True) / 7)
    err0, err1 = (k[:, 0, :nq] - k_exact[:, 0, :nq]).abs(), (k[:, 1, :nq] - k_exact[:, 1, :nq]).abs()
    assert float(err1.max()) < float(err0.max()) / 4 and bool((err0 <= step4).all())
    rho, exact = layer.witness_codes()
    own = pack_witness(witness(k_exact[:, 1:2, :nq].float(), k[:, 1:2, :nq].float(), cache.bands))
    assert torch.equal(rho[:, 1:2, :nq], own)  # the rung's own witness, not the int4 one
    g = torch.Generator().manual_seed(3)
    for scale in (0.3, 3.0, 30.0):
        q = torch.randn(2, 4, 32, generator=g) * scale
        _, cert = decode_attention(q, k, v, rho, 32 ** -0.5, bands=cache.bands, exact=exact, backend="torch")
        x = torch.einsum("bkgd,bknd->bkgn", q.double().view(2, 2, 2, 32), k_exact.double()) * 32 ** -0.5
        xt = torch.einsum("bkgd,bknd->bkgn", q.double().view(2, 2, 2, 32), k.double()) * 32 ** -0.5
        tv = 0.5 * (x.softmax(-1) - xt.softmax(-1)).abs().sum(-1).view(2, 4)
        assert bool((tv <= cert["min"].double()).all()), (scale, tv, cert["min"])


def test_rung_bytes_are_the_next_rungs_bytes(model):
    """Promoting a head adds that head's int8 codes and scales to the device bytes (its witness is
    written over its slice of the stored witness: no second witness), and the exact rung frees the
    rung below (counted at 2 bytes per exact value with exact_itemsize=2)."""
    cache = CertifiedCache(model.config, "int4", gate="ladder:1", sinks=0, window=0, rungs=("int8",))
    gen(model, tiny_ids(1, 40, seed=13), cache, n=1)
    layer = cache.layers[0]
    before = layer.device_bytes(exact_itemsize=2)
    layer.promote([0])
    st = layer.up[0]
    nq = layer.nq
    q8 = quantize(layer.exact_k[:, :1, :nq].contiguous(), "int8")
    assert len(st["k"]) == 1 and st["k"][0].nbytes == q8.codes.nbytes + q8.scales.nbytes
    assert st["rho"] is None and layer.device_bytes(exact_itemsize=2) - before == st["k"][0].nbytes + st["v"][0].nbytes
    layer.promote([0])  # int8 -> exact: the int8 rung is freed, the head's exact values counted
    assert 0 not in layer.up and bool(layer.repaired[0])
    assert layer.device_bytes(exact_itemsize=2) - before == 2 * 2 * nq * layer.D
    assert cache.heads_per_rung() == [3, 0, 1]


def test_keys_only_rungs_refine_the_keys_and_keep_the_values(model):
    """ladder_values=False: a promoted head serves int4(k) + int4(k - int4(k)) of the captured exact
    keys and still int4(v) of the captured exact values; the promotion adds the key rung and the
    witness only; the top rung serves exact keys and values; other gates refuse the option."""
    with pytest.raises(ValueError, match="ladder_values=False applies"):
        CertifiedCache(model.config, "int4", gate="certified:0.2", ladder_values=False)
    ids = tiny_ids(1, 48, seed=16)
    cache = CertifiedCache(model.config, "int4", gate="ladder:1", sinks=0, window=0, ladder_values=False)
    seen = captured(cache)
    out = gen(model, ids, cache, n=2)
    layer = cache.layers[1]
    before = layer.device_bytes(exact_itemsize=2)
    layer.promote([1])
    st_ = layer.up[1]
    assert st_["v"] == [] and layer.device_bytes(exact_itemsize=2) - before == st_["k"][0].nbytes
    with torch.no_grad():  # a token written after the promotion: its key is refined, its value not
        model(input_ids=out[:, -1:], past_key_values=cache, use_cache=True)
    k_exact, v_exact = seen[1]
    k, v = layer.served()
    nq = layer.nq
    assert torch.equal(k[:, 1:2, :nq], refined(k_exact[:, 1:2, :nq], "int4", ["int4"]))
    assert torch.equal(v[:, :, :nq], dequantize(quantize(v_exact[:, :, :nq].contiguous(), "int4")))
    layer.promote([1, 1])  # one rung per call: int8
    assert int(layer.rung[1]) == 2 and len(layer.up[1]["k"]) == 2 and layer.up[1]["v"] == []
    layer.promote([1])  # exact
    k, v = layer.served()
    assert bool(layer.repaired[1]) and torch.equal(k[:, 1], k_exact[:, 1]) and torch.equal(v[:, 1], v_exact[:, 1])


def test_ladder_follows_eviction(model):
    """keep_tokens after a promotion keeps the rung's codes, witness and the exact copy aligned."""
    cache = CertifiedCache(model.config, "int4", gate="ladder:1", sinks=0, window=0, rungs=("int8",))
    seen = captured(cache)
    gen(model, tiny_ids(1, 40, seed=14), cache, n=1)
    layer = cache.layers[1]
    layer.promote([0])
    n = layer.n
    index = torch.arange(0, n, 2).expand(1, 2, -1)
    cache.keep_tokens(1, index)
    k, _ = layer.served()
    k_exact = seen[1][0][:, :, :n].gather(2, index[..., None].expand(-1, -1, -1, 32))
    assert torch.equal(k[:, :1], refined(k_exact[:, :1], "int4", ["int8"]))
    assert layer.rho_codes.shape[2] == index.shape[2]
    own = pack_witness(witness(k_exact[:, :1].float(), k[:, :1].float(), cache.bands))
    assert torch.equal(layer.witness_codes()[0][:, :1, :index.shape[2]], own)  # the rung's witness, kept aligned


def test_box_form_certifies_the_reads_that_would_trip_the_gate(model):
    """box_form=True: a read whose forms exceed TAU is certified with the box form too (record "box",
    taken into min, still >= the true TV); reads already within TAU skip it."""
    ids = tiny_ids(1, 64, seed=15)
    plain = CertifiedCache(model.config, "fp8_e5m2", sinks=0, window=0, shadow=True)
    gen(model, ids, plain, n=3)
    tau = float(torch.stack([r["min"] for r in plain.records]).quantile(0.9))
    cache = CertifiedCache(model.config, "fp8_e5m2", gate=f"ladder:{tau}", sinks=0, window=0, shadow=True, box_form=True)
    gen(model, ids, cache, n=8)
    boxed = 0
    for r in cache.records:
        forms = torch.minimum(torch.minimum(r["tanh"], r["one_minus_b_over_a"]), r["e_form"])
        assert ("box" in r) == (float(forms.max()) > tau)  # the served read: box iff its forms exceed TAU
        if "box" in r:
            boxed += 1
            assert bool((r["min"] <= r["box"]).all()) and bool((r["min"] <= forms).all())
        assert bool((r["true_tv"] <= r["min"]).all())
    assert 0 < boxed < len(cache.records), boxed
    with_box = sum(r["fresh_repairs"] for r in cache.records)
    without = CertifiedCache(model.config, "fp8_e5m2", gate=f"ladder:{tau}", sinks=0, window=0)
    gen(model, ids, without, n=8)
    assert with_box <= sum(r["fresh_repairs"] for r in without.records)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), log_scale=st.floats(-3, 2), outlier=st.floats(1, 100),  # |k| < fp16 max
       scheme=st.sampled_from(["kivi2", "int4", "fp8_e4m3", "fp8_e5m2"]), steps=st.integers(1, 3),
       values=st.booleans(), derived=st.booleans())
def test_every_rung_is_sound_against_exact_keys_adversarially(seed, log_scale, outlier, scheme, steps, values, derived):
    """Property: written straight into the cache (no model), keys with outlier channels, each head
    promoted 0..top rungs: for random queries and for queries aligned with the served error of one
    token (the worst direction for that token), TV between softmax over the exact keys (the test's
    own tensors) and over the served keys is <= the certificate."""
    from transformers import LlamaConfig
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32)
    cache = CertifiedCache(cfg, scheme, gate="ladder:0.5", sinks=0, window=0, ladder_values=values,
                           derived=derived)  # derived: the rungs keep their own witness (no stored one to overwrite)
    layer = cache.layers[0]
    n = 64
    k = torch.randn(1, 2, n, 32, generator=g) * 10 ** log_scale
    k[..., 3] *= outlier
    v = torch.randn(1, 2, n, 32, generator=g)
    layer.update(k, v)
    for _ in range(steps):
        layer.promote([0])
    layer.promote([1])
    extra = torch.randn(1, 2, 32, 32, generator=g) * 10 ** log_scale  # tokens written after the promotions
    layer.update(extra, torch.randn(1, 2, 32, 32, generator=g))
    k_exact = torch.cat([k, extra], 2)
    ks, vs = layer.served()
    rho, exact = layer.witness_codes()
    err = (k_exact - ks)  # [1, 2, N, D]
    j = int(err.norm(dim=-1).sum(1).argmax())
    aligned = err[:, :, j].sign().repeat_interleave(2, dim=1)  # [1, 4, D]
    for q in (torch.randn(1, 4, 32, generator=g), aligned * 3.0, aligned * 30.0 / 10 ** log_scale):
        _, cert = decode_attention(q, ks, vs, rho, 32 ** -0.5, bands=cache.bands, exact=exact, backend="torch")
        x = torch.einsum("bkgd,bknd->bkgn", q.double().view(1, 2, 2, 32), k_exact.double()) * 32 ** -0.5
        xt = torch.einsum("bkgd,bknd->bkgn", q.double().view(1, 2, 2, 32), ks.double()) * 32 ** -0.5
        tv = (0.5 * (x.softmax(-1) - xt.softmax(-1)).abs().sum(-1)).view(1, 4)
        assert bool((tv <= cert["min"].double()).all()), (tv, cert["min"], layer.rung)
