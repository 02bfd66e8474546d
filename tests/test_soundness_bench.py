"""benchmarks/soundness.py's eviction row on a random tiny GQA Llama: the truth it checks the composed
certificate against is TV(p, p~^K) from the exact keys of the full cache."""

import argparse

import numpy as np
import torch
from tests.tiny_model import tiny_evict_llama

from benchmarks.soundness import EVICT_TIERS, run_evict
from fast.integrations.hf_meter import enable

ARGS = argparse.Namespace(sinks=0, window=0, delta_req=1e-3)


def prompt(B=2, N=120, seed=1):
    return torch.randint(0, 128, (B, N), generator=torch.Generator().manual_seed(seed)).tolist()


def test_evict_row_truth_sits_between_its_parts_and_under_the_bounds():
    """property (T7a, T7d): the row's true TV(p, p~^K) is >= the evicted mass p(E) (p~^K puts no mass
    on E) and <= p(E) + TV(p^K, p~^K) (the meter's shadow truth, computed by another path); every
    composed bound (group witness, page box) is >= it."""
    model = enable(tiny_evict_llama(hidden=128))
    r = run_evict(model, prompt(), "snapkv:0.5", 3, ARGS)
    true, mass, quant = r["true_tv"], r["evict_true"], r["quant_true"]
    assert true.shape == (3 * 3, 2, 4) and (mass > 0.01).any()
    assert (true >= mass - 1e-12).all()
    assert (true <= mass + quant + 1e-12).all()
    assert (quant > 0).all()                                # the kept keys are int8: p^K != p~^K
    for tier in EVICT_TIERS:
        assert (r[tier] >= true).all() and (r[tier] <= 1).all()


def test_evict_row_without_eviction_is_the_quantization_truth():
    """property: keeping every token, the row's truth over the full exact cache equals the meter's
    TV(p, p~) and the composed bound is the quantization bound alone (the witnesses are empty)."""
    model = enable(tiny_evict_llama(hidden=128))
    r = run_evict(model, prompt(seed=2), "snapkv:1000", 2, ARGS)
    assert (r["evict_true"] == 0).all()
    np.testing.assert_allclose(r["true_tv"], r["quant_true"], rtol=1e-5, atol=1e-7)
    assert (r["true_tv"] > 0).all()


def test_prerope_row_truth_reads_the_exact_post_rope_keys():
    """property: the prerope4 row's shadow copy is the exact post-RoPE keys the model wrote (bit for bit,
    not a decode of the codes), so its true TV is the meter's TV(p, p~) against those keys."""
    from transformers import DynamicCache

    from benchmarks.soundness import run_scheme, scheme_of
    from fast.integrations.hf_cache import CertifiedCache
    model = enable(tiny_evict_llama(hidden=128))
    ids = torch.tensor(prompt(N=80, seed=3))
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=dyn, use_cache=True).logits[:, -1].argmax(-1)
    scheme = scheme_of("prerope4", model.config)
    assert scheme.name != "int4" and scheme_of("int8", model.config) == "int8"
    cache = CertifiedCache(model.config, scheme, sinks=0, window=0, shadow=True).fill_from(dyn)
    for layer, src in zip(cache.layers, dyn.layers):
        assert torch.equal(layer.exact_k, src.keys) and not torch.equal(layer.served()[0], src.keys)
    r = run_scheme(model, dyn, first, "prerope4", 2, argparse.Namespace(sinks=0, window=0, dither_seed=None, delta_req=1e-3))
    assert r["true_tv"].shape == (2 * 3, 2, 4) and (r["true_tv"] > 0).all() and (r["true_tv"] <= r["min"]).all()
