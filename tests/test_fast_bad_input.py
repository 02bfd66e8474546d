"""Bad input to every public fast function: a clear exception, never a small finite bound.

Policy (fast_api.md): NaN/Inf anywhere, empty caches, mismatched shapes, wrong dtypes,
negative witnesses, budgets outside (0, 1) -> ValueError (TypeError for a non-tensor).
"""

import math

import pytest
import torch

import fast

NAN, INF = float("nan"), float("inf")
BANDS = fast.rope_bands(32, 4)


def poisoned(t, value, index=(0,)):
    t = t.clone()
    t.view(-1)[index[0]] = value
    return t


def inputs(N=6):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, generator=g)
    k = torch.randn(1, 2, N, 32, generator=g)
    v = torch.randn(1, 2, N, 32, generator=g)
    rho = torch.rand(1, 2, N, 4, generator=g)
    return q, k, v, rho


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("where", ["q", "k", "v", "rho"])
def test_decode_attention_rejects_non_finite(where, bad):
    q, k, v, rho = inputs()
    args = {"q": q, "k": k, "v": v, "rho": rho}
    args[where] = poisoned(args[where], bad, (5,))
    with pytest.raises(ValueError):
        fast.decode_attention(args["q"], args["k"], args["v"], args["rho"], 0.2, bands=BANDS)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_decode_attention_rejects_non_finite_in_padding(bad):
    """Padding slots must hold finite values too (they are multiplied by a zero weight)."""
    q, k, v, rho = inputs()
    valid = torch.tensor([[False, True, True, True, True, True]])
    with pytest.raises(ValueError):
        fast.decode_attention(q, k, poisoned(v, bad), rho, 0.2, bands=BANDS, valid=valid)


def test_decode_attention_rejects_negative_witness_and_bad_shapes():
    q, k, v, rho = inputs()
    cases = [
        dict(rho=-rho),
        dict(rho=rho[..., :3]),
        dict(k=k[:, :, :5]),
        dict(q=q[:, :3]),  # 3 query heads over 2 KV heads: not a GQA ratio
        dict(q=q.to(torch.int32)),
        dict(valid=torch.zeros(1, 6, dtype=torch.bool)),  # every token padding
        dict(valid=torch.ones(1, 5, dtype=torch.bool)),
        dict(exact=torch.ones(1, 2, 6)),  # not bool
        dict(scale=-1.0), dict(scale=NAN), dict(scale=0.0),
    ]
    for override in cases:
        args = dict(q=q, k=k, v=v, rho=rho, scale=0.2, valid=None, exact=None)
        args.update(override)
        with pytest.raises(ValueError):
            fast.decode_attention(args["q"], args["k"], args["v"], args["rho"], args["scale"], bands=BANDS,
                                  valid=args["valid"], exact=args["exact"])


def test_decode_attention_rejects_empty_cache_and_missing_witness():
    q, k, v, rho = inputs()
    with pytest.raises(ValueError):
        fast.decode_attention(q, k[:, :, :0], v[:, :, :0], rho[:, :, :0], 0.2, bands=BANDS)
    with pytest.raises(ValueError):
        fast.decode_attention(q, k, v, None, 0.2, bands=BANDS)  # a float cache needs a witness
    with pytest.raises(ValueError):
        fast.decode_attention(q, k, v, rho, 0.2, bands=BANDS, backend="cuda")


def test_decode_attention_rejects_overflowing_logits():
    q, k, v, rho = inputs()
    with pytest.raises(ValueError):
        fast.decode_attention(q * 1e20, k * 1e20, v, rho, 1.0, bands=BANDS)


def test_decode_attention_refuses_reduced_precision_matmuls():
    q, k, v, rho = inputs()
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with pytest.raises(ValueError):
            fast.decode_attention(q, k, v, rho, 0.2, bands=BANDS)
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("bad", [NAN, INF, -1.0])
def test_tv_bound_forms_rejects(bad):
    p = torch.softmax(torch.randn(1, 2, 5), -1)
    c = torch.rand(1, 2, 5)
    for args in ((poisoned(p, bad), c), (p, poisoned(c, bad))):
        with pytest.raises(ValueError):
            fast.tv_bound_forms(*args)
    with pytest.raises(ValueError):
        fast.tv_bound_forms(p, c[..., :4])
    with pytest.raises(ValueError):
        fast.tv_bound_forms(p[..., :0], c[..., :0])
    with pytest.raises(ValueError):
        fast.tv_bound_forms(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3))
    with pytest.raises(TypeError):
        fast.tv_bound_forms(p.tolist(), c)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_witness_and_bound_reject_non_finite(bad):
    q, k, v, rho = inputs()
    with pytest.raises(ValueError):
        fast.witness(poisoned(k, bad), k, BANDS)
    with pytest.raises(ValueError):
        fast.witness(k, poisoned(k, bad), BANDS)
    with pytest.raises(ValueError):
        fast.logit_error_bound(poisoned(q, bad), rho, BANDS, 0.2)
    with pytest.raises(ValueError):
        fast.logit_error_bound(q, poisoned(rho, bad), BANDS, 0.2)
    with pytest.raises(ValueError):
        fast.witness_from_step(poisoned(k.abs(), bad), BANDS)
    with pytest.raises(ValueError):
        fast.pack_witness(poisoned(rho, bad))


def test_witness_rejects_bad_shapes_and_bands():
    q, k, v, rho = inputs()
    with pytest.raises(ValueError):
        fast.witness(k, k[:, :, :3], BANDS)
    with pytest.raises(ValueError):
        fast.witness(k, k, torch.arange(32).view(4, 8).flip(0)[:, :7])  # does not cover D
    with pytest.raises(ValueError):
        fast.witness(k, k, torch.zeros(4, 8, dtype=torch.long))  # not a partition
    with pytest.raises(ValueError):
        fast.logit_error_bound(q, -rho, BANDS, 0.2)
    with pytest.raises(ValueError):
        fast.logit_error_bound(q, rho, BANDS, 2.0 ** 70)
    # above the largest regular log code: the reserved top code, rounded up (vacuous, sound), never an error
    big = torch.tensor([1e6, 3.4e38])
    assert fast.pack_witness(big).tolist() == [255, 255] and bool((fast.unpack_witness(fast.pack_witness(big)) >= big).all())


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, NAN])
def test_budgets_outside_unit_interval(bad):
    q, k, v, rho = inputs()
    with pytest.raises(ValueError):
        fast.budget_local(bad, 2, 2, 1)
    with pytest.raises(ValueError):
        fast.dither_radius(q, k.abs(), 0.2, 10, bad)


def test_dither_rejects_bad_counts_and_steps():
    q, k, v, rho = inputs()
    for L, H, t in ((0, 1, 1), (1, 0, 1), (1, 1, 0), (1.5, 1, 1)):
        with pytest.raises(ValueError):
            fast.budget_local(0.1, L, H, t)
    with pytest.raises(ValueError):
        fast.dither_radius(q, k.abs(), 0.2, 0, 0.1)
    with pytest.raises(ValueError):
        fast.dither_sigma(q, -k.abs(), 0.2)
    with pytest.raises(ValueError):
        fast.dither_sigma(poisoned(q, NAN), k.abs(), 0.2)


def test_quantize_rejects():
    x = torch.randn(1, 2, 4, 32)
    for bad in (NAN, INF):
        with pytest.raises(ValueError):
            fast.quantize(poisoned(x, bad), "int8")
    with pytest.raises(ValueError):
        fast.quantize(x, "int3")
    with pytest.raises(ValueError):
        fast.quantize(x, "int8", group_size=24)  # does not divide D
    with pytest.raises(ValueError):
        fast.quantize(x * 1e7, "int4")  # beyond fp16 scales: 65504 * 7
    with pytest.raises(ValueError):
        fast.quantize(x * 1e3, "fp8_e4m3", per_token_scale=False)  # beyond 448 without a scale
    with pytest.raises(ValueError):
        fast.quantize(x, "int8_dither", seed=-1)
    with pytest.raises(ValueError):
        fast.quantize(x.to(torch.int32), "int8")
    with pytest.raises(TypeError):
        fast.dequantize(x)
    a = fast.quantize(x, "int8_dither", seed=1)
    with pytest.raises(ValueError):
        a.cat(fast.quantize(x, "int8_dither", seed=1))  # token counters do not follow: dither would repeat


def test_rope_bands_rejects():
    for D, NB, layout in ((30, 4, "rotate_half"), (32, 0, "interleaved"), (32, 4, "half"), (32.0, 4, "rotate_half")):
        with pytest.raises(ValueError):
            fast.rope_bands(D, NB, layout)
    assert math.isfinite(float(fast.rope_bands(32, 16).sum()))


def test_huge_witness_saturates_never_small():
    """A finite but absurd witness (c ~ 1e17) gives min = 1, A = inf: never a small bound."""
    q, k, v, rho = inputs()
    _, cert = fast.decode_attention(q, k, v, torch.full_like(rho, 1e17), 0.2, bands=BANDS)
    assert bool((cert["min"] == 1).all()) and bool(torch.isinf(cert["e_form"]).all())
    assert bool((cert["one_minus_b_over_a"] >= 1).all())
    got = fast.tv_bound_forms(torch.softmax(torch.randn(1, 2, 5), -1), torch.full((1, 2, 5), 1e30))
    assert bool((got["min"] == 1).all()) and bool((got["one_minus_b_over_a"] >= 1).all())


# ---- issue 8, bad input to the API ----

def test_dither_radius_refuses_fewer_tokens_than_given():
    """n is the union bound's token count: fewer than the tokens given would shrink every radius."""
    q, k, v, rho = inputs(N=6)
    fast.dither_radius(q, k.abs(), 0.2, 6, 0.1)  # exactly the tokens given: fine
    with pytest.raises(ValueError, match="tokens"):
        fast.dither_radius(q, k.abs(), 0.2, 5, 0.1)


@pytest.mark.parametrize("delta_req", [1e-320, 5e-324, 1e-305])
def test_budget_local_underflow_is_an_error_never_zero(delta_req):
    with pytest.raises(ValueError, match="underflow"):
        fast.budget_local(delta_req, 30, 9, 1000)


def test_budget_local_stays_positive_at_the_edge():
    b = fast.budget_local(1e-290, 30, 9, 1000)
    assert b > 0 and b >= 2.0 ** -1022


def test_decode_attention_rejects_wrong_value_head_size():
    q, k, v, rho = inputs()
    with pytest.raises(ValueError, match="v"):
        fast.decode_attention(q, k, v[..., :16], rho, 0.2, bands=BANDS)
    with pytest.raises(ValueError, match="v"):
        fast.decode_attention(q, k, torch.cat([v, v], -1), rho, 0.2, bands=BANDS)


@pytest.mark.parametrize("bad", [NAN, INF])
@pytest.mark.parametrize("scheme", ["int4_dither", "kivi2_dither"])
def test_b_bit_dither_codecs_reject_non_finite(scheme, bad):
    from fast.core.quant import kivi_dither_quantize
    x = poisoned(torch.randn(1, 2, 32, 32), bad, (7,))
    with pytest.raises(ValueError):
        fast.quantize(x, scheme, seed=0) if scheme == "int4_dither" else kivi_dither_quantize(x, "k", seed=0)


def test_kivi2_dither_rejects_bad_layout_and_range():
    """kivi2_dither: keys need whole 32-token blocks, a known kind, fp16-sized groups, in-range counters."""
    from fast.core.quant import kivi_dither_quantize
    from fast.core.schemes import SchemeError, get_scheme
    x = torch.randn(1, 2, 32, 32)
    for args, kw, match in [((x[:, :, :31], "k"), {}, "blocks of 32"), ((x, "q"), {}, "kind"),
                            ((x * 1e5, "v"), {}, "65504"), ((x, "k"), {"seed": 2 ** 64}, "seed"),
                            ((x, "v"), {"token_start": -1}, "token_start"), ((torch.randn(1, 2, 4, 48), "v"), {}, "multiple of")]:
        with pytest.raises(ValueError, match=match):
            kivi_dither_quantize(*args, **{"seed": 0, **kw})
    with pytest.raises(SchemeError, match="multiple of 4"):
        get_scheme("kivi2_dither").encode_v(torch.randn(1, 2, 4, 30), 0, 0, 0)
    with pytest.raises(ValueError, match="group_size"):
        fast.quantize(torch.randn(1, 2, 4, 30), "int4_dither", group_size=4, seed=0)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_sparse_read_rejects_non_finite(where, bad):
    """NaN / Inf in the query, or in the cache when indexed or read: ValueError, never a certificate."""
    q, k, v, _ = inputs(N=40)
    index = fast.build_sparse_index(k, v, page_size=4)
    args = {"q": q, "k": k, "v": v}
    args[where] = poisoned(args[where], bad, (args[where].numel() - 3,))     # in the newest token: the window
    with pytest.raises(ValueError):
        fast.sparse_read(args["q"], args["k"], args["v"], index, 0.2, 0.05)
    if where != "q":
        with pytest.raises(ValueError):
            fast.build_sparse_index(poisoned(args[where], bad, (7,)), v if where == "k" else k)


def test_sparse_read_rejects_overflowing_logits_and_bad_tau():
    q, k, v, _ = inputs(N=40)
    index = fast.build_sparse_index(k * 1e37, v, page_size=4)
    with pytest.raises(ValueError):
        fast.sparse_read(q * 1e3, k * 1e37, v, index, 0.2, 0.05)
    index = fast.build_sparse_index(k, v, page_size=4)
    for tau in (0.0, -0.1, 1.01, NAN, INF):
        with pytest.raises(ValueError):
            fast.sparse_read(q, k, v, index, 0.2, tau)
