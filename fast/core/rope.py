"""RoPE-aware bands (math.md T3): each band is a union of whole RoPE pairs.

Band b holds the consecutive frequencies [b P, (b+1) P), P = D / (2 NB):
- rotate_half (HF): pair i is (i, i + D/2), so band b = [bP, (b+1)P) + D/2 + [bP, (b+1)P);
- interleaved: pair i is (2i, 2i+1), so band b = [2bP, 2(b+1)P).
Contiguous chunks of coordinates are NOT bands under rotate_half (math.md, Bands).
"""

import torch

from fast.core import _checks

LAYOUTS = ("rotate_half", "interleaved")


def rope_bands(D, NB, layout="rotate_half"):
    """LongTensor [NB, D // NB]: the sorted coordinate indices of each band (spec T3b)."""
    _checks.positive_int("D", D)
    _checks.positive_int("NB", NB)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if D % (2 * NB):
        raise ValueError(f"D = {D} must be a multiple of 2 * NB = {2 * NB} (each band holds whole RoPE pairs)")
    P = D // (2 * NB)
    rows = []
    for b in range(NB):
        freqs = torch.arange(b * P, (b + 1) * P)
        if layout == "rotate_half":
            rows.append(torch.cat([freqs, freqs + D // 2]))
        else:
            rows.append(torch.stack([2 * freqs, 2 * freqs + 1], dim=1).reshape(-1))
    return torch.stack(rows)
