"""RoPE pairs, bands and rotation (math.md Bands and T3), exact at 60 digits.

Two layouts pair the D coordinates into D/2 rotation planes, one per frequency i:
- "rotate_half" (HF Llama): pair (i, i + D/2);
- "interleaved": pair (2i, 2i + 1).
Frequency i turns by the angle pos * theta^(-2i/D), as in HF Llama's inv_freq.
"""
from mpmath import cos, mpf, sin, workdps

DPS = 60
LAYOUTS = ("rotate_half", "interleaved")


def _pairs(D, layout):
    """The D/2 rotation pairs (first, second), listed by frequency i = 0 .. D/2 - 1."""
    if D <= 0 or D % 2:
        raise ValueError(f"D must be a positive even number (got {D})")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (got {layout!r})")
    half = D // 2
    if layout == "rotate_half":
        return [(i, i + half) for i in range(half)]
    return [(2 * i, 2 * i + 1) for i in range(half)]


def rope_bands(D, B, layout):
    """B bands of whole RoPE pairs; band b holds the consecutive frequencies
    b*F .. (b+1)*F - 1, F = D/(2B) (spec T3b: band norms are RoPE-invariant).

    Returns a list of B sorted index lists that partition range(D). ValueError when D is
    odd or B does not divide D/2.
    """
    pairs = _pairs(D, layout)
    if B <= 0 or (D // 2) % B:
        raise ValueError(f"B = {B} does not divide D/2 = {D // 2}")
    per_band = D // (2 * B)
    bands = []
    for b in range(B):
        band = []
        for i in range(b * per_band, (b + 1) * per_band):
            band.extend(pairs[i])
        bands.append(sorted(band))
    return bands


@workdps(DPS)
def rope_rotate(x, pos, theta, layout):
    """R_pos x: rotate each pair of frequency i by pos * theta^(-2i/D) (spec T3a, T3c).

    out[first] = x[first] cos - x[second] sin, out[second] = x[second] cos + x[first] sin,
    which is HF Llama's q * cos + rotate_half(q) * sin in the rotate_half layout.
    """
    xs = [mpf(v) for v in x]
    D = len(xs)
    pairs = _pairs(D, layout)
    out = list(xs)
    for i, (first, second) in enumerate(pairs):
        angle = mpf(pos) * mpf(theta) ** (mpf(-2 * i) / D)
        co, si = cos(angle), sin(angle)
        out[first] = xs[first] * co - xs[second] * si
        out[second] = xs[second] * co + xs[first] * si
    return out
