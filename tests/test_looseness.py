"""benchmarks/looseness.py's query-subspace witness (a measured candidate, not in the library): the
interval [mu - w, mu + w] it reports contains every token's exact logit shift s q . r, for queries
inside and outside the prefill queries' span, and collapses to the shift when q lies in the span."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.looseness import QWIN, Recorder
from fast.core.rope import rope_bands

D, G, HKV, N = 16, 2, 2, 24
BANDS = rope_bands(D, 4, "rotate_half")


def draw(seed, m, in_span):
    g = torch.Generator().manual_seed(seed)
    H = G * HKV
    basis = torch.randn(HKV, 3, D, generator=g, dtype=torch.float64).repeat_interleave(G, 0)  # rank 3 per KV head
    qpre = torch.einsum("hwr,hrd->hwd", torch.randn(H, QWIN, 3, generator=g, dtype=torch.float64), basis)
    q = torch.einsum("hr,hrd->hd", torch.randn(H, 3, generator=g, dtype=torch.float64), basis)
    if not in_span:
        q = q + torch.randn(H, D, generator=g, dtype=torch.float64)
    r = torch.randn(H, N, D, generator=g, dtype=torch.float64) * 10.0 ** torch.empty(1).uniform_(-3, 1, generator=g)
    return q, r, qpre


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31), st.sampled_from([1, 2, 8]), st.booleans())
def test_interval_holds_the_exact_shift(seed, m, in_span):
    q, r, qpre = draw(seed, m, in_span)
    s = 0.125
    mu, w = Recorder.subspace_interval(q, r, qpre, m, s, BANDS, G)
    eps = s * torch.einsum("hd,hnd->hn", q, r)
    slack = 1e-12 * (1 + eps.abs() + w)
    assert bool((eps >= mu - w - slack).all() and (eps <= mu + w + slack).all())


def test_query_in_the_span_is_pinned_and_the_residual_term_is_needed():
    """m >= rank of the prefill queries and q in their span: w ~ 0, mu ~ the shift. q off the span:
    dropping w (a mutant) leaves shifts outside [mu, mu]."""
    q, r, qpre = draw(3, 3, True)
    mu, w = Recorder.subspace_interval(q, r, qpre, 3, 1.0, BANDS, G)
    eps = torch.einsum("hd,hnd->hn", q, r)
    assert float(w.max()) < 1e-9 * float(eps.abs().max()) and torch.allclose(mu, eps, atol=1e-9)
    q, r, qpre = draw(3, 3, False)
    mu, w = Recorder.subspace_interval(q, r, qpre, 3, 1.0, BANDS, G)
    eps = torch.einsum("hd,hnd->hn", q, r)
    assert float((eps - mu).abs().max()) > 1e-3 and float(w.min()) > 0


def test_run_measures_every_decode_read():
    """benchmarks.looseness.run records each (step, layer) decode read (the cache reads through the torch
    twin, whose _certify the Recorder wraps; the default fused read would record nothing), and every level
    it reports as a bound is >= the true TV from the exact keys."""
    from transformers import DynamicCache

    from benchmarks.looseness import probe_queries, run
    from fast.integrations.hf_meter import enable
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_model import tiny_ids
    torch.manual_seed(0)  # head size 64: the study's finer band partitions (32 bands) need D >= 64
    model = enable(LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)).eval())
    dyn = DynamicCache(config=model.config)
    first, qpre = probe_queries(model, tiny_ids(N=48)[0].tolist(), dyn)
    rows, _, _ = run(model, dyn, first, "int8", 2, qpre)
    assert len(rows) == 2 * 2
    for r in rows:
        assert (r["true"] > 0).all()
        for level in ("box_cs_up", "forms_wit", "reported", "box_wit_up", "reported_box", "box_wit_bin_up"):
            assert (r[level] >= r["true"] * (1 - 1e-9)).all(), level


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 1e6), st.sampled_from([4, 16]))
def test_grid_up_is_the_next_grid_value(c, steps):
    """grid_up(c) is the least (1 + i/steps) 2^e >= c (0 for 0): above c by less than a 1/steps step of c's octave."""
    from benchmarks.looseness import grid_up
    g = float(grid_up(torch.tensor([c], dtype=torch.float64), steps))
    assert g >= c and (g == 0) == (c == 0)
    if c > 0:
        m, e = torch.frexp(torch.tensor(g, dtype=torch.float64))
        assert float(m * 2 * steps) == int(m * 2 * steps)          # on the grid
        assert g - c <= 2.0 ** (int(torch.frexp(torch.tensor(c, dtype=torch.float64))[1]) - 1) / steps  # one step at most


def test_binned_box_merges_equal_c():
    """property: tokens whose c rounds to one grid value give the box of their pseudo-token (p summed): the same
    bound as the tokens with c already on the grid, and above the true TV of a sampled eps in the box."""
    from benchmarks.looseness import binned_box_up, grid_up
    from fast.core.box import box_bounds
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, 200, generator=g, dtype=torch.float64) * 3, -1)
    c = torch.rand(6, 200, generator=g, dtype=torch.float64) * 0.3
    up, bins = binned_box_up(p, c)
    assert (bins < 200).all() and (bins > 1).all()
    ref = box_bounds(p, -grid_up(c), grid_up(c))[1]
    assert torch.allclose(up, ref, rtol=1e-6)
    eps = (2 * torch.rand(6, 200, generator=g, dtype=torch.float64) - 1) * c
    q = torch.softmax(torch.log(p) + eps, -1)
    assert (0.5 * (q - p).abs().sum(-1) <= up).all()
