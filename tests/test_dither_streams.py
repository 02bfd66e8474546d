"""The dither of one request is its own (issue 8): fresh per request by default, independent per
batch row, separate streams for keys and values, no silent wrap-around of the counters, and
reproducible only when a seed is given."""

import pytest
import torch

import fast
from fast.core.quant import dither_noise
from fast.core.schemes import get_scheme
from fast.integrations.hf_cache import CertifiedCache
from tests.tiny_model import tiny_llama


def noise(qt):
    """The dither u of a quantized int8_dither tensor: codes - dequantized / scale."""
    B, Hkv, N, D = qt.shape
    ng = qt.scales.shape[-1]
    x = fast.dequantize(qt).view(B, Hkv, N, ng, D // ng) / qt.scales.float().unsqueeze(-1)
    return qt.codes.float() - x.view(B, Hkv, N, D)


def corr(a, b):
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


X = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(0))


def test_default_seed_is_fresh_per_request():
    """Two caches (two requests) without a seed get different seeds, hence different dither."""
    config = tiny_llama().config
    a, b = CertifiedCache(config, "int8_dither"), CertifiedCache(config, "int8_dither")
    assert a.seed != b.seed
    assert 0 <= a.seed < 2 ** 64
    qa, qb = fast.quantize(X, "int8_dither"), fast.quantize(X, "int8_dither")  # the API draws too
    assert qa.seed != qb.seed and abs(corr(noise(qa), noise(qb))) < 0.05


def test_seed_given_is_reproducible():
    config = tiny_llama().config
    assert CertifiedCache(config, "int8_dither", seed=7).seed == 7
    a, b = fast.quantize(X, "int8_dither", seed=7), fast.quantize(X, "int8_dither", seed=7)
    assert torch.equal(a.codes, b.codes)


def test_batch_rows_get_independent_dither():
    x = X.expand(3, -1, -1, -1).contiguous()  # three identical rows
    u = noise(fast.quantize(x, "int8_dither", seed=1))
    for i in range(3):
        for j in range(i):
            assert not torch.equal(u[i], u[j])
            assert abs(corr(u[i], u[j])) < 0.05


def test_keys_and_values_use_separate_streams():
    s = get_scheme("int8_dither")
    k, v = s.encode_k(X, 0, 0, 5), s.encode_v(X, 0, 0, 5)
    uk, uv = noise(k.qt), noise(v.qt)
    assert not torch.equal(uk, uv) and abs(corr(uk, uv)) < 0.05
    assert torch.equal(fast.dequantize(k.qt), s.encode_k(X, 0, 0, 5).decode())  # each stream reproducible


@pytest.mark.parametrize("a,b", [
    (dict(seed=5), dict(seed=2 ** 32 + 5)), (dict(seed=5), dict(seed=2 ** 63 + 5)),
    (dict(token_start=5), dict(token_start=2 ** 32 + 5)), (dict(layer=5, seed=1), dict(layer=6, seed=1))])
def test_no_wrap_around(a, b):
    """Counters that differ beyond 32 bits give different dither (they used to be reduced mod 2^32)."""
    ua = dither_noise(a.get("seed", 0), a.get("layer", 0), 2, a.get("token_start", 0), 8, 32)
    ub = dither_noise(b.get("seed", 0), b.get("layer", 0), 2, b.get("token_start", 0), 8, 32)
    assert not torch.equal(ua, ub)


@pytest.mark.parametrize("kw", [dict(seed=2 ** 64), dict(seed=-1), dict(layer=2 ** 32), dict(token_start=2 ** 63 - 4),
                                dict(seed=1.5), dict(stream=2)])
def test_out_of_range_counters_are_refused(kw):
    args = dict(seed=0, layer=0, token_start=0, stream=0) | kw
    with pytest.raises(ValueError):
        dither_noise(args["seed"], args["layer"], 2, args["token_start"], 8, 32, stream=args["stream"])
    with pytest.raises(ValueError):
        fast.quantize(X, "int8_dither", **kw)


def test_cache_refuses_out_of_range_seed():
    config = tiny_llama().config
    for bad in (2 ** 64, -1, 1.5, "7"):
        with pytest.raises(ValueError):
            CertifiedCache(config, "int8_dither", seed=bad)


def test_no_token_gets_a_channel_permuted_copy_of_another():
    """Issue 19 (A1): with the former generator (one 32-bit mixer state per token, then channel
    mixed in), two tokens whose states differed in the low 6 bits got the same 64 dither values in
    permuted channels (~8 such pairs among 2^15 tokens, by the birthday bound on the other 26 bits).
    Philox4x32-10 draws every channel from a 128-bit counter under a 64-bit key: none here."""
    u = dither_noise(seed=1, layer=0, Hkv=1, token_start=0, N=2 ** 15, D=64)[0, 0]
    multisets = {tuple(row) for row in torch.sort(u, dim=-1).values.tolist()}
    assert len(multisets) == u.shape[0]


def test_philox_known_answers():
    """fast.core.quant.philox4x32_10 is Philox4x32-10: Random123's published known-answer vectors."""
    from fast.core.quant import philox4x32_10
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kat:
        got = philox4x32_10(*(torch.tensor(c, dtype=torch.int64) for c in ctr), *key)
        assert tuple(int(w) for w in got) == want, (ctr, key)


@pytest.mark.parametrize("seed,layer,start,Hkv,N,D,rows,stream", [
    (0, 0, 0, 1, 5, 32, 1, 0), (2**64 - 1, 2**32 - 1, 2**63 - 20, 2, 7, 12, 2, 1), (5, 3, 2**33, 1, 3, 9, 1, 1)])
def test_dither_noise_is_the_element_definition(seed, layer, start, Hkv, N, D, rows, stream):
    """dither_noise (8 channels per Philox call, D not a multiple of 8 included) equals dither_hash
    evaluated element by element."""
    from fast.core.quant import dither_hash
    row = torch.arange(rows).view(rows, 1, 1, 1)
    head = torch.arange(Hkv).view(1, Hkv, 1, 1)
    token = torch.arange(start, start + N).view(1, 1, N, 1)
    i = dither_hash(seed, stream, layer, row, head, token, torch.arange(D).view(1, 1, 1, D))
    want = (2 * i + 1 - 65536).to(torch.float32) * 2.0 ** -17
    assert torch.equal(dither_noise(seed, layer, Hkv, start, N, D, rows=rows, stream=stream), want)
