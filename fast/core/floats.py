"""Floating-point helpers of the whole core (the first stage: codecs, witnesses, reads and forms all use them):
unit roundoffs, gamma_n, one-ulp outward steps and upper bounds of band norms. The error model is the one of
fast.core.certify's module doc (math.md T8, spec A5)."""

import math

import numpy as np
import torch

U32 = 2.0 ** -24
U64 = 2.0 ** -53


def gamma(n, u=U64):
    """gamma_n = n u / (1 - n u) (Higham): the relative error of an n-term sum."""
    if n * u >= 1e-3:
        raise ValueError(f"gamma_{n}: too many terms for the stated margin")
    return n * u / (1 - n * u)


_INF = {}


def _inf(x, sign):
    """A cached 0-dim +-inf of x's dtype and device: nextafter broadcasts it."""
    key = (x.dtype, x.device, sign)
    if key not in _INF:
        _INF[key] = torch.tensor(sign * math.inf, dtype=x.dtype, device=x.device)
    return _INF[key]


def up64(x):
    """One ulp toward +inf (fp64): an upper bound of the exact result of the last operation."""
    return torch.nextafter(x, _inf(x, 1))


def down64(x):
    """One ulp toward -inf (fp64)."""
    return torch.nextafter(x, _inf(x, -1))


def up32(x64):
    """fp64 -> fp32, rounded UP: the smallest fp32 >= x64 (or a neighbour above it)."""
    y = x64.to(torch.float32)
    return torch.where(y.to(torch.float64) < x64, torch.nextafter(y, _inf(y, 1)), y)


def down32(x64):
    """fp64 -> fp32, rounded DOWN."""
    y = x64.to(torch.float32)
    return torch.where(y.to(torch.float64) > x64, torch.nextafter(y, _inf(y, -1)), y)


def _up(x):
    """numpy fp64: one ulp toward +inf."""
    return np.nextafter(x, np.inf)


def _down(x):
    return np.nextafter(x, -np.inf)


def band_norms_up(x64, bands):
    """Upper bounds of ||x_b|| for x64: [..., D] fp64 holding values that were fp32 (or
    differences of two fp32 values). Returns [..., NB] fp64.

    Error: x itself may carry one rounding (a difference, relative u64), its square one
    more and 2 u64 from the inexact x, the W-term sum gamma_{W-1}, sqrt halves the relative
    error and adds u64: in all <= gamma_{W+4}; the margin 2 gamma_{W+4} covers second-order terms.
    """
    xb = x64[..., bands]  # [..., NB, W]
    W = bands.shape[1]
    norms = torch.sqrt((xb * xb).sum(-1))
    return up64(norms * (1 + 2 * gamma(W + 4)))
