"""The pre-RoPE scheme (fast.core.prerope) served by CertifiedCache on the tiny GQA Llama: decode and
second-turn certificates sound against the exact shadow copy, the stored witness (T3, packed) above
the true post-RoPE error of every quantized key, bytes below int8 keys."""

import pytest
import torch

from fast.core.prerope import prerope_scheme
from fast.integrations.hf_cache import CertifiedCache
from fast.integrations.hf_meter import enable
from tests.tiny_model import tiny_ids, tiny_llama


@pytest.fixture(scope="module")
def model():
    return enable(tiny_llama())


@pytest.mark.parametrize("bits", [4, 8])
def test_prerope_cache_sound(model, bits):
    cache = CertifiedCache(model.config, prerope_scheme(model.config, bits=bits), sinks=0, window=0, shadow=True,
                           value_bound=True)
    with torch.no_grad():
        first = model.generate(tiny_ids(1, 70), max_new_tokens=5, do_sample=False, past_key_values=cache, pad_token_id=0)
        model.generate(torch.cat([first, tiny_ids(1, 30, seed=6)], 1), max_new_tokens=3, do_sample=False,
                       past_key_values=cache, pad_token_id=0)
    for recs in (cache.records, cache.row_records):
        assert recs
        for r in recs:
            assert bool((r["true_tv"] <= r["min"]).all()) and bool((r["true_out_err"] <= r["out_err"]).all())
    assert max(float(r["true_tv"].max()) for r in cache.records) > 0
    for layer in cache.layers:  # the served keys: rho (T3 witness, log codes) >= exact band norms of k - k~
        rho, _ = layer.witness_view()
        k, _ = layer.served()
        r = (layer.exact_k.double() - k.double())[..., cache.bands]
        true = torch.sqrt((r * r).sum(-1))
        assert layer.nq >= 64 and bool((rho.double() >= true).all())


def test_prerope_refuses_eviction_and_rope_scaling(model):
    cache = CertifiedCache(model.config, prerope_scheme(model.config), sinks=0, window=0)
    with torch.no_grad():
        model(tiny_ids(1, 64), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="eviction"):
        cache.keep_tokens(0, torch.zeros(1, 2, 4, dtype=torch.long))
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type"):
        prerope_scheme(cfg)
