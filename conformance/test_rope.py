"""RoPE band unitarity (spec T3): the reference rotation against the exact band norms."""
from hypothesis import given, settings
from hypothesis import strategies as st
from mpmath import cos as mp_cos, fsum, mpf, sin as mp_sin, workdps

from conformance._check import DPS, close, expect, replay
from reference.band import band_norms
from reference.rope import rope_bands, rope_rotate

layouts = st.sampled_from(["rotate_half", "interleaved"])
coord = st.floats(-10, 10)
positions = st.integers(0, 2**17) | st.floats(-1e5, 1e5)
thetas = st.sampled_from([10000.0, 100000.0, 500000.0, 1000000.0]) | st.floats(2, 1e6)


@st.composite
def shapes(draw, min_bands=1):
    """D = 2 * B * F with B bands of F frequencies each."""
    B = draw(st.sampled_from([b for b in (1, 2, 4) if b >= min_bands]))
    F = draw(st.integers(1, 3))
    return B, 2 * B * F


@st.composite
def rotations(draw):
    B, D = draw(shapes())
    return {"D": D, "B": B, "layout": draw(layouts), "theta": draw(thetas), "pos": draw(positions),
            "x": draw(st.lists(coord, min_size=D, max_size=D))}


@workdps(DPS)
def check_band_norms(case):
    """||(R_pos x)_b|| = ||x_b|| for every band of rope_bands (T3a, T3b)."""
    bands = rope_bands(case["D"], case["B"], case["layout"])
    rotated = rope_rotate(case["x"], case["pos"], case["theta"], case["layout"])
    before, after = band_norms(case["x"], bands), band_norms(rotated, bands)
    for b, (u, v) in enumerate(zip(before, after)):
        expect(close(u, v), check_band_norms, case, f"band {b} {bands[b]}: norm {u} before, {v} after rotation")


@settings(max_examples=200)
@replay("test_rotation_preserves_band_norms")
@given(case=rotations())
def test_rotation_preserves_band_norms(case):
    """property: every band (a union of RoPE pairs) keeps its norm under rotation, in both
    layouts and at any position."""
    check_band_norms(case)


def inner(a, b):
    return fsum(x * y for x, y in zip(a, b))


@workdps(DPS)
def check_offset(case):
    """<R_m q, R_n k> = <q, R_{n-m} k> = <R_{m+t} q, R_{n+t} k> (T3c)."""
    D, layout, theta, q, k = case["D"], case["layout"], case["theta"], case["q"], case["k"]
    m, n, t = case["m"], case["n"], case["t"]
    both = inner(rope_rotate(q, m, theta, layout), rope_rotate(k, n, theta, layout))
    relative = inner([mpf(v) for v in q], rope_rotate(k, n - m, theta, layout))
    shifted = inner(rope_rotate(q, m + t, theta, layout), rope_rotate(k, n + t, theta, layout))
    expect(close(both, relative) and close(both, shifted), check_offset, case,
           f"<R_m q, R_n k> = {both}, <q, R_(n-m) k> = {relative}, shifted by t: {shifted}")


@st.composite
def offsets(draw):
    _, D = draw(shapes())
    vec = st.lists(coord, min_size=D, max_size=D)
    pos = st.integers(-2**16, 2**16)
    return {"D": D, "layout": draw(layouts), "theta": draw(thetas), "q": draw(vec), "k": draw(vec),
            "m": draw(pos), "n": draw(pos), "t": draw(pos)}


@settings(max_examples=150)
@replay("test_inner_depends_on_offset")
@given(case=offsets())
def test_inner_depends_on_offset(case):
    """property: the rotated inner product depends only on the offset n - m."""
    check_offset(case)


def contiguous_chunks(D, B):
    """B contiguous coordinate chunks: the wrong "bands" of math.md under rotate_half."""
    size = D // B
    return [list(range(b * size, (b + 1) * size)) for b in range(B)]


@workdps(DPS)
def check_chunks(case):
    """Under rotate_half, contiguous chunks split pairs: the unit vector e_i (i < D/2) moves
    mass sin^2(angle) into the chunk of i + D/2, so its chunk norm changes. Under the
    interleaved layout contiguous chunks of even size are unions of pairs: rope_bands."""
    D, B, i, pos, theta = case["D"], case["B"], case["i"], case["pos"], case["theta"]
    chunks = contiguous_chunks(D, B)
    expect(rope_bands(D, B, "interleaved") == chunks, check_chunks, case, "interleaved bands are not the chunks")
    expect(rope_bands(D, B, "rotate_half") != chunks, check_chunks, case, "rotate_half bands equal the chunks")
    x = [0] * D
    x[i] = 1
    before = band_norms(x, chunks)
    after = band_norms(rope_rotate(x, pos, theta, "rotate_half"), chunks)
    moved = max(abs(u - v) for u, v in zip(before, after))
    expect(moved > mpf(10) ** -30, check_chunks, case, f"chunk norms moved by only {moved}")
    fixed = band_norms(rope_rotate(x, pos, theta, "rotate_half"), rope_bands(D, B, "rotate_half"))
    expect(all(close(u, v) for u, v in zip(band_norms(x, rope_bands(D, B, "rotate_half")), fixed)),
           check_chunks, case, "true bands moved")


@st.composite
def chunk_cases(draw):
    B, D = draw(shapes(min_bands=2))
    return {"D": D, "B": B, "i": draw(st.integers(0, D // 2 - 1)), "pos": draw(st.integers(1, 2**17)),
            "theta": draw(thetas)}


@settings(max_examples=100)
@replay("test_contiguous_chunks_not_position_invariant")
@given(case=chunk_cases())
def test_contiguous_chunks_not_position_invariant(case):
    """property: contiguous-chunk "bands" under rotate_half are NOT position-invariant (the bug
    math.md warns about), while the pair-respecting bands are."""
    check_chunks(case)


def test_rope_bands_rejects_bad_shapes():
    """property: odd D, a band count that does not divide D/2 and unknown layouts are refused."""
    for D, B, layout in ((7, 1, "rotate_half"), (12, 4, "interleaved"), (8, 0, "rotate_half"), (8, 2, "neox")):
        try:
            rope_bands(D, B, layout)
        except ValueError:
            continue
        raise AssertionError(f"rope_bands({D}, {B}, {layout!r}) did not raise ValueError")


@workdps(DPS)
def check_transformers(case):
    """reference.rope_rotate = transformers' Llama RoPE (rotate_half layout) in float64, and
    transformers' inv_freq = theta^(-2i/D) up to its float32 rounding."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    D, theta, positions, x = case["D"], case["theta"], case["positions"], case["x"]
    config = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, rope_theta=theta)
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.tolist()
    for i, f in enumerate(inv_freq):
        ours = mpf(theta) ** (mpf(-2 * i) / D)
        expect(abs(f - ours) <= 1e-6 * ours, check_transformers, case, f"inv_freq[{i}] = {f}, reference {ours}")
    # cos, sin: [1, P, D] in float64 from the reference's angles; HF layout repeats the half
    angles = [[mpf(pos) * mpf(theta) ** (mpf(-2 * i) / D) for i in range(D // 2)] * 2 for pos in positions]
    cos = torch.tensor([[[float(mp_cos(a)) for a in row] for row in angles]], dtype=torch.float64)
    sin = torch.tensor([[[float(mp_sin(a)) for a in row] for row in angles]], dtype=torch.float64)
    q = torch.tensor(x, dtype=torch.float64).expand(1, 1, len(positions), D)  # q: [1, 1, P, D]
    ours = torch.tensor([[float(v) for v in rope_rotate(x, pos, theta, "rotate_half")] for pos in positions],
                        dtype=torch.float64)
    theirs, _ = apply_rotary_pos_emb(q, q, cos, sin)
    gap = (theirs[0, 0] - ours).abs().max().item()
    expect(gap <= 1e-12, check_transformers, case, f"rope_rotate differs from transformers by {gap}")


@st.composite
def llama_cases(draw):
    D = draw(st.sampled_from([4, 8, 16, 64]))
    return {"D": D, "theta": draw(st.sampled_from([10000.0, 100000.0, 500000.0])),
            "positions": draw(st.lists(st.integers(0, 2**15), min_size=1, max_size=4)),
            "x": draw(st.lists(coord, min_size=D, max_size=D))}


@settings(max_examples=30)
@replay("test_rotate_half_matches_transformers")
@given(case=llama_cases())
def test_rotate_half_matches_transformers(case):
    """differential: the reference rotation against transformers' Llama RoPE (the layout and
    frequency convention the serving code relies on)."""
    check_transformers(case)
