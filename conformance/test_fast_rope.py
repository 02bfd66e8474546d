"""Differential: fast.rope_bands equals reference.rope.rope_bands (spec T3b), exhaustively
over the head dims and band counts the project uses, both layouts; plus the property that
fast bands are RoPE-invariant (band norms unchanged by the reference rotation)."""

import pytest
import torch
from mpmath import mpf

import fast
from reference import band as ref_band
from reference import rope as ref_rope

GRID = [(D, NB) for D in (8, 32, 64, 128) for NB in (1, 2, 4, 8) if D % (2 * NB) == 0]


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("D,NB", GRID)
def test_rope_bands_equal_reference(D, NB, layout):
    got = fast.rope_bands(D, NB, layout).tolist()
    want = ref_rope.rope_bands(D, NB, layout)
    assert got == want, f"rope_bands({D}, {NB}, {layout!r}): fast {got} != reference {want}"


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_fast_bands_are_rope_invariant(layout):
    """Property: the reference band norms of x and R_pos x agree on fast's bands (D = 32, NB = 4)."""
    bands = fast.rope_bands(32, 4, layout).tolist()
    x = torch.randn(32, generator=torch.Generator().manual_seed(1), dtype=torch.float64).tolist()
    for pos in (1, 17, 4093):
        before = ref_band.band_norms(x, bands)
        after = ref_band.band_norms(ref_rope.rope_rotate(x, pos, 10000.0, layout), bands)
        for a, b in zip(before, after):
            assert abs(a - b) <= mpf(10) ** -40 * (1 + abs(a)), (layout, pos, a, b)


def test_rope_bands_rejects_bad_shapes():
    for D, NB, layout in ((30, 4, "rotate_half"), (32, 0, "interleaved"), (32, 4, "half")):
        with pytest.raises(ValueError):
            fast.rope_bands(D, NB, layout)
