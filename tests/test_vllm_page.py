"""The packed int8 / int4 / fp8 page write (fast.integrations.vllm.write_page): the C++ pass (cpu_fused.page_write) writes
the same bytes as the torch code it replaces (quantize, scatter, decode, witness codes), and the page it writes decodes
to keys whose witness covers the exact keys (mpmath). No vLLM needed: the page is a plain tensor in vLLM's layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import fsum, mpf, workdps

import fast
from fast.core import cpu_fused
from fast.core.witness import max_packable, unpack_witness
from fast.integrations.vllm import packed_row_bytes, packed_views, page_decode, write_page

CODECS = ["int8", "int4_per_token_head", "fp8_per_token_head"]


def _rows(g, n, Hkv, D, spread, qmax, kinds):
    """[n, Hkv, D] fp32 rows: random with magnitudes 2^(spread N(0,1)), all zero, NaN / Inf, or exact ties of the
    code grid (x / scale = m + 1/2 with a power-of-two scale, so that rounding half to even is tested)."""
    x = torch.randn(n, Hkv, D, generator=g) * torch.exp2((torch.randn(n, Hkv, 1, generator=g) * spread).clamp(-40, 14))
    for i in range(n):
        for h in range(Hkv):
            kind = kinds[(i * Hkv + h) % len(kinds)]
            if kind == "zero":
                x[i, h] = 0.0
            elif kind == "nan":
                x[i, h, (i + h) % D] = float("nan") if (i + h) % 2 else float("inf")
            elif kind == "tie":
                e = 2.0 ** int(torch.randint(-20, 4, (1,), generator=g))
                m = torch.randint(-int(qmax), int(qmax), (D,), generator=g).float() + 0.5
                m[0] = qmax  # the row's max: scale = qmax e / qmax = e exactly
                x[i, h] = m * e
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), codec=st.sampled_from(CODECS), NB=st.sampled_from([0, 4, 8]),
       spread=st.sampled_from([0.0, 3.0, 12.0]),
       kinds=st.lists(st.sampled_from(["rand", "rand", "zero", "nan", "tie"]), min_size=1, max_size=5))
def test_page_write_is_the_torch_write(seed, n, codec, NB, spread, kinds):
    """cpu_fused.page_write (C++) and write_page's torch code (quantize, scatter, page_decode, witness_codes) leave
    byte-identical pages, every byte they do not own untouched; the keys the page decodes to are covered by its
    witness codes (mpmath, 60 digits) of the fine log table (within one step of it: 2^(1/16)), and the codes and
    scales are fast.core.quant's."""
    floor = float(unpack_witness(torch.tensor([1], dtype=torch.uint8), fine=True))
    g = torch.Generator().manual_seed(seed)
    Hkv, D, nb, bs = 2, 16, 3, 4
    qmax = {"int8": 127.0, "int4_per_token_head": 7.0, "fp8_per_token_head": 448.0}[codec]
    bands = fast.rope_bands(D, NB) if NB else None
    C = packed_row_bytes(D, NB, certify=bool(NB), codec=codec) // 4
    page = torch.randint(-2**31, 2**31 - 1, (nb, Hkv, bs, C), generator=g, dtype=torch.int32).view(torch.float32)
    k = _rows(g, n, Hkv, D, spread, qmax, kinds)
    v = _rows(g, n, Hkv, D, spread, qmax, kinds[::-1])
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1
    fused, twin = page.clone(), page.clone()
    write_page(k, v, fused, slots, codec, bands)
    write_page(k, v, twin, slots, codec, bands, fused=False)
    assert torch.equal(fused.view(torch.int32), twin.view(torch.int32))
    kc, vc, ks, vs, rc = packed_views(fused, D, NB, codec)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    free = ~written.view(nb, 1, bs).expand(nb, Hkv, bs)
    for now, before in zip((kc, vc, ks, vs, rc), packed_views(page, D, NB, codec)):  # other slots' parts untouched
        assert now is None or torch.equal(now[free].contiguous().view(torch.uint8), before[free].contiguous().view(torch.uint8))
    used = bs * (2 * kc.shape[-1] + 2 * ks.element_size() + NB)  # the slab's padding past the parts, untouched too
    assert torch.equal(fused.view(torch.uint8).view(nb, Hkv, -1)[:, :, used:], page.view(torch.uint8).view(nb, Hkv, -1)[:, :, used:])
    for i, sl in enumerate(slots.tolist()):
        if sl < 0:
            continue
        b, o = sl // bs, sl % bs
        for h in range(Hkv):
            khat = page_decode(kc[b, h, o], ks[b, h, o], codec)
            if not bool(torch.isfinite(k[i, h]).all()):
                assert bool(torch.isnan(khat).all())  # refused by every read
                if NB:
                    assert bool((rc[b, h, o] == 255).all())
                continue
            scale = float(ks[b, h, o].view(torch.float16) if ks.dtype == torch.int16 else ks[b, h, o])
            assert scale >= float(k[i, h].abs().max()) / qmax and (scale > 0)  # fp16 scale up: nothing clipped
            if NB:
                with workdps(60):
                    for j, band in enumerate(bands.tolist()):
                        exact = fsum((mpf(float(k[i, h, d])) - mpf(float(khat[d]))) ** 2 for d in band) ** 0.5
                        got = mpf(float(unpack_witness(rc[b, h, o, j], fine=True)))  # the fine table's codes
                        assert got >= exact
                        assert got <= max(exact * 2 ** (mpf(1) / 16) * (1 + mpf(2) ** -20), floor) or exact > max_packable(True)


def test_page_write_ties_round_half_to_even():
    """A row whose x / scale hits m + 1/2 exactly takes the even code (torch.round), as fast.core.quant does."""
    D = 8
    k = torch.tensor([[[127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, 126.5]]]) * 2.0 ** -3
    C = packed_row_bytes(D, 0, certify=False, codec="int8") // 4
    page = torch.zeros(1, 1, 2, C)
    cpu_fused.page_write(k, k, torch.tensor([1]), page, "int8")
    kc, _, ks, _, _ = packed_views(page, D, 0, "int8")
    assert kc[0, 0, 1].tolist() == [127, 2, -2, 4, 0, 0, 2, 126]
    assert float(ks[0, 0, 1].view(torch.float16)) == 2.0 ** -3


def test_page_write_refuses_bad_input():
    D, Hkv = 16, 2
    C = packed_row_bytes(D, 4, certify=True, codec="int8") // 4
    page, bands = torch.zeros(2, Hkv, 4, C), fast.rope_bands(D, 4)
    k = torch.randn(3, Hkv, D)
    with pytest.raises(ValueError, match="past the page"):
        cpu_fused.page_write(k, k, torch.tensor([0, 1, 8]), page, "int8", bands)
    with pytest.raises(ValueError, match="fp16 scale"):
        cpu_fused.page_write(k * 1e8, k, torch.tensor([0, 1, 2]), page, "int8", bands)
    with pytest.raises(ValueError, match="fp16 scales"):  # the torch write refuses it too
        write_page(k * 1e8, k, page, torch.tensor([0, 1, 2]), "int8", bands, fused=False)
    with pytest.raises(ValueError, match="codec"):
        cpu_fused.page_write(k, k, torch.tensor([0, 1, 2]), page, "fp8", bands)
    with pytest.raises(ValueError, match="alike"):
        cpu_fused.page_write(k, k[:2], torch.tensor([0, 1, 2]), page, "int8", bands)
    with pytest.raises(ValueError, match="needs"):
        cpu_fused.page_write(k, k, torch.tensor([0, 1, 2]), torch.zeros(2, Hkv, 4, 4), "int8", bands)
    with pytest.raises(ValueError, match="contiguous slabs"):
        cpu_fused.page_write(k, k, torch.tensor([0, 1, 2]), page.transpose(2, 3), "int8", bands)


def test_page_write_fp8_rounds_to_nearest_even():
    """fp8 e4m3 bytes: ties go to the even byte, subnormals included, the sign kept on -0 and tiny negatives, as
    fast.core.quant's cast (torch's float8_e4m3fn) gives them; every fp32 y on a fine grid of [-448, 448] alike."""
    D = 8
    row = torch.tensor([448.0, 9.5, 10.5, -9.5, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10])  # scale 448 / 448 = 1
    C = packed_row_bytes(D, 0, certify=False, codec="fp8_per_token_head") // 4
    page = torch.zeros(1, 1, 2, C)
    cpu_fused.page_write(row[None, None], row[None, None], torch.tensor([0]), page, "fp8_e4m3")
    kc, _, ks, _, _ = packed_views(page, D, 0, "fp8_per_token_head")
    assert kc[0, 0, 0].view(torch.float8_e4m3fn).float().tolist() == [448.0, 10.0, 10.0, -10.0, 16.0, 20.0, 0.0, 2.0 ** -8]
    assert float(ks[0, 0, 0]) == 1.0
    # the cast itself, against torch's, on 2^16 + 2 values of y per row (scale 1: the row's max is 448)
    y = torch.cat([torch.linspace(-448, 448, 2 ** 16), torch.tensor([-0.0, -2.0 ** -12])])
    y = torch.cat([y, torch.full((-y.numel() % 7,), 1.0)]).view(-1, 1, 7)
    rows = torch.cat([torch.full((y.shape[0], 1, 1), 448.0), y], -1)
    page = torch.zeros(rows.shape[0], 1, 1, C)
    cpu_fused.page_write(rows, rows, torch.arange(rows.shape[0]), page, "fp8_e4m3")
    kc, _, ks, _, _ = packed_views(page, D, 0, "fp8_per_token_head")
    assert bool((ks == 1.0).all())
    assert torch.equal(kc[:, 0, 0], rows[:, 0].to(torch.float8_e4m3fn).view(torch.uint8))
