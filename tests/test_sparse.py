"""Certified sparse read (fast.core.sparse): properties of one implementation, in fp64 shadow mode.

property: the certificate bounds the true TV (exact fp64 softmax over the whole cache) for
random, adversarial (all mass on one far page; keys at their box corners) and GQA inputs; it
is <= tau unless everything was read; tau = 1 reads only the window, a tiny tau reads every
page (certificate 0); pages read never decrease as tau decreases; the output is the softmax
attention over the read tokens; the in-place (dense) and the copying paths agree; the index
extended page by page equals the index built at once; bad input raises ValueError.
"""
import pytest
import torch

from fast.core.evict import evicted_mass
from fast.core.sparse import build_sparse_index, extend_sparse_index, sparse_read, topk_page_read

S = 0.125


def cache(seed, B=1, H=6, Hkv=3, N=300, D=16, far=False, corner=False, sink=0.0, shared=False):
    """q [B, H, D], k, v [B, Hkv, N, D]; shared: the query heads of a KV head nearly equal."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    q = torch.randn(B, H, D, generator=g) * 3
    if shared:
        q = q.view(B, Hkv, H // Hkv, D)[:, :, :1].expand(B, Hkv, H // Hkv, D).reshape(B, H, D) + 0.1 * q
    qg = q.view(B, Hkv, H // Hkv, D)[:, :, 0]                               # [B, Hkv, D]: head 0 of each KV head
    if far:                                                                 # all the mass on page 3, far from the window
        k[:, :, 48:64] = 10 * qg[:, :, None] / qg.norm(dim=-1, keepdim=True)[..., None]
    if corner:                                                              # one key per page at its box corner
        for a in range(0, N - 15, 16):
            page = k[:, :, a:a + 16]
            k[:, :, a + 15] = torch.where(qg >= 0, page.amax(2), page.amin(2))
    if sink:
        k[:, :, 0] = sink * qg / qg.norm(dim=-1, keepdim=True)
    return q, k, v


def truth(q, k, r):
    gone = torch.ones(k.shape[:3], dtype=torch.bool)
    gone.scatter_(2, r.tokens, False)
    return evicted_mass(q, k, S, gone)


def exact_out(q, k, v, r):
    B, H, D = q.shape
    Hkv = k.shape[1]
    gone = torch.ones(k.shape[:3], dtype=torch.bool)
    gone.scatter_(2, r.tokens, False)
    x = torch.einsum("bhd,bhnd->bhn", q.double(), k.double().repeat_interleave(H // Hkv, 1)) * S
    x = x.masked_fill(gone.repeat_interleave(H // Hkv, 1), -float("inf"))
    return torch.einsum("bhn,bhnd->bhd", torch.softmax(x, -1), v.double().repeat_interleave(H // Hkv, 1))


@pytest.mark.parametrize("kind", ["random", "far", "corner", "sink"])
@pytest.mark.parametrize("tau", [0.5, 0.05, 1e-3])
def test_certificate_bounds_true_tv_and_tau(kind, tau):
    """property: tv >= true TV; tv <= tau unless all pages were read (then 0); out = exact attention over the read set."""
    for seed in range(4):
        q, k, v = cache(seed, B=2, far=kind == "far", corner=kind == "corner", sink=12.0 if kind == "sink" else 0.0)
        index = build_sparse_index(k, v)
        r = sparse_read(q, k, v, index, S, tau, window=20)
        t = truth(q, k, r)
        assert bool((r.tv >= t - 1e-12).all()), (kind, seed, r.tv, t)
        if r.pages_read < r.pages:
            assert bool((r.tv <= tau).all())
        else:
            assert bool((r.tv == 0).all())
        # fp32 logits, softmax and matmul against fp64: a few ulp of values of size ~1
        torch.testing.assert_close(r.out.double(), exact_out(q, k, v, r), rtol=1e-5, atol=1e-5)
        diff = (r.out.double() - exact_out(q, k, v, r)).norm(dim=-1)
        o_full = exact_out(q, k, v, sparse_read(q, k, v, index, S, 1e-12, window=20))
        assert bool(((exact_out(q, k, v, r) - o_full).norm(dim=-1) <= r.out_err + 1e-9).all()), (kind, seed)
        assert float(diff.max()) < 1e-4


def test_sink_and_far_page_are_read_sparsely():
    """property: with a dominant sink the read stops early; all the mass on one far page is read first."""
    q, k, v = cache(0, N=1024, sink=40.0, shared=True)
    r = sparse_read(q, k, v, build_sparse_index(k, v), S, 0.05, window=16)
    assert r.pages_read < r.pages // 4, (r.pages_read, r.pages)
    q, k, v = cache(1, N=1024, far=True, shared=True)
    r = sparse_read(q, k, v, build_sparse_index(k, v), S, 0.5, window=16)
    assert bool((r.tokens[..., 16:32] // 16 == 3).all())                    # page 3 is the first page read


def test_tau_one_reads_the_minimum_and_tiny_tau_everything():
    """property: tau = 1 reads only the window (and the partial page); tau = 1e-300 reads every page, TV 0."""
    q, k, v = cache(2, N=250)
    index = build_sparse_index(k, v)
    r = sparse_read(q, k, v, index, S, 1.0, window=20)
    assert r.pages_read == 0 and r.tokens.shape[-1] == 250 - r.pages * 16
    assert r.pages == (250 - 20) // 16
    r = sparse_read(q, k, v, index, S, 1e-300, window=20)
    assert r.pages_read == r.pages and bool((r.tv == 0).all()) and bool((r.out_err == 0).all())
    assert sorted(r.tokens[0, 0].tolist()) == list(range(250))


def test_pages_read_monotone_in_tau():
    """property: a smaller tau never reads fewer pages; the read sets are nested."""
    for seed in range(3):
        q, k, v = cache(seed, N=600, sink=9.0)
        index = build_sparse_index(k, v)
        prev = None
        for tau in [1.0, 0.8, 0.5, 0.2, 0.05, 0.01, 1e-4, 1e-8]:
            r = sparse_read(q, k, v, index, S, tau, window=8)
            read = set(r.tokens[0, 1].tolist())
            if prev is not None:
                assert r.pages_read >= prev[0] and read >= prev[1], (seed, tau)
            prev = (r.pages_read, read)


def test_dense_and_copying_paths_agree():
    """property: the path that scores every page in place reads the same pages and serves the same output."""
    q, k, v = cache(3, N=800, sink=7.0)
    index = build_sparse_index(k, v)
    for tau in (0.3, 0.05):
        a = sparse_read(q, k, v, index, S, tau, window=8, first_chunk=1)     # copies pages while it can
        b = sparse_read(q, k, v, index, S, tau, window=8, first_chunk=10 ** 6)  # in place at once
        assert a.pages_read == b.pages_read
        assert [sorted(x) for x in a.tokens[0].tolist()] == [sorted(x) for x in b.tokens[0].tolist()]
        torch.testing.assert_close(a.out, b.out, rtol=1e-5, atol=1e-6)     # fp32: other summation order
        torch.testing.assert_close(a.tv, b.tv, rtol=1e-4, atol=1e-12)      # same set, other fp32 logits


def test_extend_equals_build():
    """property: an index extended as pages fill equals the index of the whole cache."""
    q, k, v = cache(4, N=200)
    index = build_sparse_index(k[:, :, :37], v[:, :, :37])
    for n in (40, 64, 65, 130, 200):
        index = extend_sparse_index(index, k[:, :, :n], v[:, :, :n])
    whole = build_sparse_index(k, v)
    for a, b in ((index.boxes.lo, whole.boxes.lo), (index.boxes.hi, whole.boxes.hi), (index.boxes.counts, whole.boxes.counts),
                 (index.kmax, whole.kmax), (index.vmax, whole.vmax)):
        assert torch.equal(a, b)


def test_topk_reads_all_pages_equals_full():
    """property: the Quest-style read with every page is the full read."""
    q, k, v = cache(5, N=160)
    index = build_sparse_index(k, v)
    full = sparse_read(q, k, v, index, S, 1e-300, window=20).out
    torch.testing.assert_close(topk_page_read(q, k, v, index, S, index.pages, window=20), full, rtol=1e-5, atol=1e-6)


def test_bad_input():
    """property: malformed input raises ValueError naming what is wrong."""
    q, k, v = cache(6, N=64)
    index = build_sparse_index(k, v)
    nan_k = k.clone()
    nan_k[0, 0, 60, 0] = float("nan")
    inf_q = q.clone()
    inf_q[0, 0, 0] = float("inf")
    bad = [(lambda: sparse_read(q, k, v, index, S, 0.0), "tau"),
           (lambda: sparse_read(q, k, v, index, S, 1.5), "tau"),
           (lambda: sparse_read(q, k, v, index, S, float("nan")), "tau"),
           (lambda: sparse_read(inf_q, k, v, index, S, 0.1), "q"),
           (lambda: sparse_read(q, nan_k, v, index, S, 0.1), "keys"),      # a NaN in the window
           (lambda: build_sparse_index(nan_k, v), "keys"),
           (lambda: sparse_read(q[:, :5], k, v, index, S, 0.1), "q"),
           (lambda: sparse_read(q.double(), k, v, index, S, 0.1), "q"),
           (lambda: sparse_read(q, k, v[..., :8], index, S, 0.1), "values"),
           (lambda: sparse_read(q, k[:, :, :32], v[:, :, :32], index, S, 0.1), "index"),
           (lambda: sparse_read(q, k, v, index, -1.0, 0.1), "scale"),
           (lambda: sparse_read(q, k, v, index, S, 0.1, window=-1), "window"),
           (lambda: build_sparse_index(k, v, page_size=0), "page_size"),
           (lambda: extend_sparse_index(index, k[:, :, :16], v[:, :, :16]), "index")]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
