"""The C++ twin of the dither (fast.core.native.dither_noise, which quant.dither_noise serves CPU
calls with) gives the torch reference's bits (quant.dither_noise_torch) for every counter range,
including seeds and layers at 2^64 - 1 and 2^32 - 1, tokens up to 2^63 - 1 and head dims that are not
a multiple of 8 (D >= 64: the AVX2 Philox, 8 blocks of channels at a time, and the scalar tail); and agrees with the element-by-element definition (quant.dither_hash)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.core import native
from fast.core.quant import TOKEN_COUNT, dither_hash, dither_noise, dither_noise_torch


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2 ** 64 - 1), st.integers(0, 2 ** 32 - 1), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 24), st.integers(1, 140), st.sampled_from([0, 1]), st.booleans())
def test_cpp_dither_is_the_torch_dither_bit_for_bit(seed, layer, rows, Hkv, N, D, stream, high_tokens):
    start = TOKEN_COUNT - 1 - N if high_tokens else seed % 2 ** 40
    a = native.dither_noise(seed, layer, Hkv, start, N, D, rows=rows, stream=stream)
    b = dither_noise_torch(seed, layer, Hkv, start, N, D, rows=rows, stream=stream)
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == (rows, Hkv, N, D)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_served_dither_is_the_definition():
    """dither_noise (the C++ path on CPU) against dither_hash coordinate by coordinate, u = (2 i + 1 - 2^16) / 2^17."""
    assert native.available()
    seed, layer, start = 2 ** 63 + 12345, 7, 2 ** 33 - 5
    u = dither_noise(seed, layer, 2, start, 11, 19, rows=2, stream=1)
    r, h, n, c = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(11), torch.arange(19), indexing="ij")
    i = dither_hash(seed, 1, layer, r, h, start + n, c)
    assert torch.equal(u, (2 * i + 1 - 65536).to(torch.float32) * 2.0 ** -17)
