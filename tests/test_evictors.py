"""Evictors on a random tiny GQA Llama (3 layers, 4 heads, 2 KV heads, hidden 64).

property tests of the shared interface (budget, sinks, window, padding, physical shrink) and
differential tests of what each method collects against the full eager attention matrix.
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fast.policies.evictors import (EVICTORS, EpiKV, evict, generate, keep_count, make_evictor,
                           prefill, rolling_zscore, select)

VOCAB, N = 128, 160


def tiny(attn="sdpa", layers=3):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, :40] = 0                                            # row 1: left padding, 120 real tokens
    return ids, mask


def test_make_evictor_parses_specs():
    """property: name:budget specs; ints are token budgets, floats ratios in (0, 1)."""
    ev = make_evictor("snapkv:256")
    assert ev.name == "snapkv" and ev.budget == 256
    assert make_evictor("h2o:0.25").budget == 0.25
    assert {make_evictor(f"{n}:64").name for n in EVICTORS} == set(EVICTORS)
    for bad in ("nope:10", "snapkv", "snapkv:", "snapkv:0", "snapkv:1.5", "snapkv:abc", "tova:-3"):
        with pytest.raises(ValueError):
            make_evictor(bad)
    assert keep_count(0.25, 100) == 25 and keep_count(500, 100) == 100


def test_select_keeps_sinks_window_and_no_padding():
    """property: sinks and the recent window are always kept; padding only when a row is short."""
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, :20] = False                                       # row 1 has 30 real tokens
    scores = -torch.arange(50.0).expand(2, 3, 50)               # prefer early tokens
    keep, kept_valid = select(scores, valid, 40, sinks=2, window=5)
    assert keep.shape == (2, 3, 40)
    row0 = set(keep[0, 0].tolist())
    assert {0, 1, 45, 46, 47, 48, 49} <= row0
    row1 = keep[1, 0].tolist()
    assert set(range(20, 50)) <= set(row1)                      # all 30 real tokens
    assert kept_valid[0].all() and kept_valid[1].sum() == 30 and not kept_valid[1, :10].any()
    assert all(valid[1, keep[1, 0][kept_valid[1]]])


@pytest.mark.parametrize("name", sorted(EVICTORS))
def test_every_evictor_shrinks_cache_to_budget(model, name):
    """property: every evictor physically shrinks every layer to K tokens per KV head, keeps
    the sinks and the recent window of each row, never keeps padding instead of a real token."""
    ids, mask = batch()
    ev = make_evictor(f"{name}:72")
    out = generate(model, ids, mask, evictor=ev, max_new_tokens=3)
    e = out["eviction"]
    assert e.evicted and len(e.keep) == 3
    for layer, keep in zip(out["prefill"].cache.layers, e.keep):
        assert keep.shape == (2, 2, 72)
        assert layer.keys.shape[2] == 72 + 2                    # 2 decoded tokens appended
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
        k0, k1 = keep[0].tolist(), keep[1].tolist()
        for h in range(2):
            assert {0, 1, 2, 3} <= set(k0[h]) and {40, 41, 42, 43} <= set(k1[h])        # sinks
            assert set(range(N - 64, N)) <= set(k0[h]) | set() and set(range(N - 64, N)) <= set(k1[h])
            assert min(k1[h]) >= 40                                                   # no padding kept
    assert e.bytes_after == e.bytes_before * 72 // N


def test_ratio_budget(model):
    """property: a ratio budget keeps ceil(ratio N) tokens."""
    ids, _ = batch()
    out = generate(model, ids[:1], evictor=make_evictor("knorm:0.5"), max_new_tokens=1)
    assert out["prefill"].cache.layers[0].keys.shape[2] == 80


def eager_attention(model, ids):
    """Full attention matrices [L][B, H, N, N] from the eager implementation (test oracle)."""
    m = tiny("eager")
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        return m(ids, output_attentions=True).attentions


def test_collected_attention_matches_eager(model):
    """differential: SnapKV's window, H2O's accumulated and TOVA's last-query attention equal
    the rows of the eager attention matrix (GQA-averaged), computed without that matrix."""
    ids, _ = batch()
    ids = ids[:1]
    pre = prefill(model, ids, needs={"window", "accumulated", "last"})
    att = eager_attention(model, ids)
    for l, a in enumerate(att):
        g = a.view(1, 2, 2, N, N)                               # [B, Hkv, rep, q, k]
        torch.testing.assert_close(pre.layers[l].window, g[:, :, :, -64:].mean((2, 3)), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(pre.layers[l].last, g[:, :, :, -1].mean(2), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(pre.layers[l].accumulated, g.sum(3).mean(2), rtol=1e-4, atol=1e-5)


def test_epikv_reads_residual_change(model):
    """differential: the hooks' e_t^l equals ||h^{l+1} - h^l|| / ||h^l|| from output_hidden_states;
    the rolling z-score equals a naive causal loop."""
    ids, _ = batch()
    ids = ids[:1]
    pre = prefill(model, ids, needs={"change"})
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    for l in range(2):                                          # the last entry is after the final norm
        want = (hs[l + 1] - hs[l]).norm(dim=-1) / hs[l].norm(dim=-1)
        torch.testing.assert_close(pre.layers[l].change, want, rtol=1e-4, atol=1e-6)
    E = torch.randn(1, 50)
    valid = torch.ones(1, 50, dtype=torch.bool)
    z = rolling_zscore(E, valid, 8)
    for t in (0, 5, 20, 49):
        w = E[0, max(0, t - 7): t + 1].double()
        naive = (E[0, t] - w.mean()) / (w.var(unbiased=False).sqrt() + 1e-6)
        assert abs(float(z[0, t]) - float(naive)) < 1e-4


def test_padding_does_not_change_a_row(model):
    """property: a left-padded row evicts and decodes exactly like the same row alone."""
    ids, mask = batch()
    for spec in ("streaming:64", "snapkv:64"):
        both = generate(model, ids, mask, evictor=make_evictor(spec), max_new_tokens=4, certify=False)
        alone = generate(model, ids[1:, 40:], evictor=make_evictor(spec), max_new_tokens=4, certify=False)
        assert both["tokens"][1].tolist() == alone["tokens"][0].tolist()
        k_both = both["eviction"].keep[1][1] - 40
        assert k_both.tolist() == alone["eviction"].keep[1][0].tolist()


def test_context_manager_with_generate(model):
    """property: `with evictor(model): model.generate(...)` shrinks the cache after the prefill
    and decodes; a padded batch is refused (it needs fast.policies.evictors.generate)."""
    ids, mask = batch()
    ev = make_evictor("snapkv:64")
    with ev(model) as records:
        out = model.generate(ids[:1], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert len(records) == 1 and records[0].bytes_after * N == records[0].bytes_before * 64
    cache = out.get("cache") or out.get("past_key_values")
    assert cache.layers[0].keys.shape[2] == 64 + 3
    ours = generate(model, ids[:1], evictor=make_evictor("snapkv:64"), max_new_tokens=4, certify=False)
    assert out.sequences[0, N:].tolist() == ours["tokens"][0].tolist()
    with pytest.raises(ValueError):
        with ev(model):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_epikv_needs_no_attention(model):
    """property: EpiKV collects only residual changes (no attention statistics)."""
    ids, _ = batch()
    pre = prefill(model, ids[:1], needs=EpiKV(64).needs)
    assert all(s.window is None and s.accumulated is None and s.last is None for s in pre.layers.values())
    e = evict(pre, EpiKV(64))
    assert e.evicted and pre.cache.layers[0].keys.shape[2] == 64


def test_conventions_tova_heads_h2o_norm_and_no_forcing(model):
    """property: TOVA heads=all keeps one set per layer (the same in every KV head); H2O norm=mean
    divides the accumulated attention by the queries that see each token (n - pos); sinks=0,
    window=0 keeps the pure top-K of the scores."""
    import torch
    from fast.policies.evictors import evict, make_evictor, prefill, positions
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(9))
    pre = prefill(model, ids, needs={"last", "accumulated"})
    st = pre.layers[0]
    k = pre.cache.layers[0].keys
    tova_all = make_evictor("tova:40:heads=all,sinks=0,window=0")
    keep, _ = tova_all.keep_index(k, st, pre.valid)
    assert all(torch.equal(keep[:, 0], keep[:, h]) for h in range(keep.shape[1]))
    pure = st.last.mean(1).topk(40, -1).indices.sort(-1).values
    assert torch.equal(keep[:, 0], pure)
    tova_kv, _ = make_evictor("tova:40:sinks=0,window=0").keep_index(k, st, pre.valid)
    assert not torch.equal(tova_kv[:, 0], tova_kv[:, 1])              # per KV head: different sets here
    h_mean = make_evictor("h2o:40:norm=mean").scores(k, st, pre.valid)
    seen = 120 - positions(pre.valid)
    torch.testing.assert_close(h_mean, st.accumulated / seen[:, None, :])
    keep_mean, _ = make_evictor("h2o:40:norm=mean,sinks=0,window=0").keep_index(k, st, pre.valid)
    assert torch.equal(keep_mean, h_mean.topk(40, -1).indices.sort(-1).values)


def test_make_evictor_rejects_bad_options():
    """property: unknown keys, bad values and negative sizes are one clear ValueError."""
    import pytest
    from fast.policies.evictors import make_evictor
    for bad in ("tova:64:heads=some", "knorm:64:norm=mean", "snapkv:64:window=-1", "snapkv:64:window=x", "snapkv:64:w"):
        with pytest.raises(ValueError):
            make_evictor(bad)
