"""Gating on the tiny GQA Llama: certified:TAU, risk:K, the offload tiers and their bytes."""

import pytest
import torch

from fast.integrations.hf_cache import CertifiedCache, Gate, parse_gate
from fast.integrations.hf_meter import enable
from tests.tiny_model import tiny_ids, tiny_llama


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


def gen(model, ids, cache=None, n=6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache)


def stacked(cache, key):
    return torch.stack([r[key] for r in cache.records])


def test_parse_gate():
    assert parse_gate("none") == Gate()
    assert parse_gate("certified:0.2") == Gate("certified", tau=0.2)
    assert parse_gate("risk:3") == Gate("risk", k=3)
    for bad in ("certified", "certified:x", "certified:1.5", "risk:-1", "risk:a", "always", "certified:", 0.2, 3):
        with pytest.raises(ValueError):
            parse_gate(bad)


def test_certified_zero_serves_everything_exact(model):
    """TAU = 0: every slot is repaired at the first read, so the text is the exact model's."""
    ids = tiny_ids(1, 64, seed=5)
    ref = gen(model, ids, n=8)
    cache = CertifiedCache(model.config, "int4", gate="certified:0", sinks=0, window=0)
    out = gen(model, ids, cache, n=8)
    assert out.tolist() == ref.tolist()
    slots = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert sum(r["fresh_repairs"] for r in cache.records) == slots
    assert float(stacked(cache, "pre_min")[:2].max()) > 0.1  # int4 really hurt before the repair
    assert float(stacked(cache, "min").max()) < 1e-3         # only the kernel's fp32 rounding is left
    mem = cache.memory()
    assert mem["offload_bytes"] > 0 and mem["repair_traffic_bytes"] >= mem["offload_bytes"]


def test_certified_tau_caps_every_served_bound(model):
    ids = tiny_ids(1, 64, seed=6)
    free = CertifiedCache(model.config, "fp8_e5m2", sinks=0, window=0)
    gen(model, ids, free, n=4)
    slot_max = stacked(free, "min").view(-1, 2, 1, 2, 2).amax(dim=(0, 2, 4))  # [L, Hkv] worst over steps
    tau = float(slot_max.min() + slot_max.max()) / 2  # some slots above, some below
    cache = CertifiedCache(model.config, "fp8_e5m2", gate=f"certified:{tau}", sinks=0, window=0, shadow=True)
    gen(model, ids, cache, n=4)
    bound, pre = stacked(cache, "min"), stacked(cache, "pre_min")
    assert float(bound.max()) <= tau
    assert bool((stacked(cache, "true_tv") <= bound).all())
    # a slot is repaired iff its bound exceeded tau at some read (sticky from then on)
    L = model.config.num_hidden_layers
    for l in range(L):
        recs = [r for r in cache.records if r["layer"] == l]
        over = torch.stack([r["pre_min"].view(1, 2, 2).amax(dim=(0, 2)) > tau for r in recs]).any(0)
        assert torch.equal(recs[-1]["repaired"], over)
    assert 0 < int(cache.records[-1]["repaired"].sum() + cache.records[-2]["repaired"].sum()) < 2 * L


@pytest.mark.parametrize("k", [0, 1, 3])
def test_risk_keeps_k_slots_exact(model, k):
    cache = CertifiedCache(model.config, "int4", gate=f"risk:{k}", sinks=0, window=0)
    gen(model, tiny_ids(1, 64, seed=7), cache, n=5)
    repaired = [layer.repaired for layer in cache.layers]
    assert int(sum(r.sum() for r in repaired)) == k
    scores = [(tuple(layer.risk[h].tolist()), l, h) for l, layer in enumerate(cache.layers) for h in range(2)]
    top = {(l, h) for _, l, h in sorted(scores, reverse=True)[:k]}
    assert {(l, h) for l, r in enumerate(repaired) for h in range(2) if r[h]} == top
    with pytest.raises(ValueError, match="exceeds"):
        CertifiedCache(model.config, "int4", gate="risk:5")


def test_residual_offload_beats_a_full_copy(model):
    """The residual tier (int8 codes of k - k_hat + its own witness) repairs soundly with fewer
    offload bytes than an fp16 copy of the same tokens."""
    ids = tiny_ids(1, 96, seed=8)
    full = CertifiedCache(model.config, "int4", gate="certified:0", sinks=0, window=0)
    gen(model, ids, full, n=4)
    res = CertifiedCache(model.config, "int4", gate="certified:0", sinks=0, window=0, offload="residual", shadow=True)
    gen(model, ids, res, n=4)
    bound, pre = stacked(res, "min"), stacked(res, "pre_min")
    assert bool((stacked(res, "true_tv") <= bound).all())
    assert float(bound.max()) < 0.2 * float(pre[:2].max())  # the residual tier is far tighter than int4
    m_res, m_full = res.memory(), full.memory()
    assert m_res["offload_bytes"] < 0.6 * m_full["fp16_bytes"] < m_full["offload_bytes"]


@pytest.mark.parametrize("scheme", ["int8_dither", "int4_dither", "kivi2_dither"])
def test_dither_tier_is_an_estimate_and_never_gates(model, scheme):
    """Issue 19 (A2): in decoding the dither tier is an estimate, not a certificate (the queries
    depend on the dither read before). Records and traces name it `dither_estimate`, the summary
    says so, and certified:TAU repairs exactly the slots whose DETERMINISTIC bound exceeded TAU:
    slots whose dither estimate was below TAU are repaired all the same."""
    from fast.tools import trace
    ids = tiny_ids(1, 64, seed=9)
    free = CertifiedCache(model.config, scheme, sinks=0, window=0, seed=3)
    gen(model, ids, free, n=4)
    assert all("dither_estimate" in r and "dither_min" not in r for r in free.records)
    det, est = stacked(free, "min"), stacked(free, "dither_estimate")
    tau = float(det[0].median())  # the first step (gen's tokens do not depend on the gate before it)
    cache = CertifiedCache(model.config, scheme, gate=f"certified:{tau}", sinks=0, window=0, seed=3)
    gen(model, ids, cache, n=4)
    first = [r for r in cache.records if r["step"] == 1]
    only_estimate_below = 0
    for r in first:
        pre = r["pre_min"].view(1, 2, 2).amax(dim=(0, 2))
        estimate = r["dither_estimate"].view(1, 2, 2).amax(dim=(0, 2))
        assert torch.equal(r["repaired"], pre > tau)  # the deterministic tier alone decides
        only_estimate_below += int(((estimate <= tau) & (pre > tau)).sum())
    assert only_estimate_below > 0, "no slot where the estimate alone would have kept the codes: the test is vacuous"
    s = trace.summary(trace.from_cache(cache))
    assert "dither_estimate_median" in s and not any(k.startswith("dither_") and "estimate" not in k for k in s)
    text = trace.format_summary(s).lower()
    assert "dither tier: an estimate, not a certificate" in text


@pytest.mark.parametrize("scheme", ["int8_dither", "int4_dither", "kivi2_dither"])
@pytest.mark.parametrize("offload", ["residual", "full"])
def test_repaired_heads_take_their_certificate_as_dither_estimate(model, offload, scheme):
    """Issue 19: a repaired head no longer serves dithered keys (residual: k_hat + the int8 residual;
    full: the exact copy), so the dither radius says nothing about it: its dither_estimate is its
    deterministic certificate (before, the dither radius of the codes it no longer served)."""
    cache = CertifiedCache(model.config, scheme, gate="certified:0", sinks=0, window=0, offload=offload, seed=3)
    gen(model, tiny_ids(1, 64, seed=10), cache, n=4)
    assert all(bool(r["repaired"].all()) for r in cache.records)  # TAU = 0: every head from the first read on
    for r in cache.records:
        assert torch.equal(r["dither_estimate"], r["min"]), (r["step"], r["layer"])
